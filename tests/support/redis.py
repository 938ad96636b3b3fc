"""A real redis-server on a free loopback port (pytest-redis style), started and stopped by tests."""
from __future__ import annotations

import shutil
import subprocess
import tempfile
import time

import redis

from tests.support.server import HOST, free_port


class RedisServer:
    def __init__(self):
        if not shutil.which("redis-server"):
            raise RuntimeError("redis-server not found: run `bash build/system_deps.sh` (make test does)")
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="redis-test-")
        self.proc = None

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def start(self) -> "RedisServer":
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", HOST, "--save", "", "--appendonly", "no",
             "--dir", self.dir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        for _ in range(100):
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
