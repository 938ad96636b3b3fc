"""A real redis-server on a free loopback port (pytest-redis style), started and stopped by tests."""
from __future__ import annotations

import shutil
import tempfile
import time

import redis

from tests.support.server import HOST, free_port
from tests.support.service import Service


class RedisServer(Service):
    def __init__(self):
        if not shutil.which("redis-server"):
            raise RuntimeError("redis-server not found: run `bash build/system_deps.sh` (make test does)")
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="redis-test-")

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def start(self) -> "RedisServer":
        self.spawn(
            ["redis-server", "--port", str(self.port), "--bind", HOST, "--save", "", "--appendonly", "no",
             "--dir", self.dir])
        client = redis.Redis.from_url(self.url)
        for _ in range(100):
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")
