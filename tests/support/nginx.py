"""A real nginx load balancer on a free loopback port in front of several tritonservers' HTTP ports,
hashing on the API key so one tenant's requests stay on one replica (as deploy does: the config comes
from the shipped load balancer's template, build/nginx_lb.py), or round robin."""
from __future__ import annotations

import shutil
import tempfile
import time
import urllib.request
from pathlib import Path

from build.nginx_lb import render_lb_config
from tests.support.server import HOST, free_port
from tests.support.service import Service

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"


class Nginx(Service):
    def __init__(self, backends: list[str], balance: str = "round_robin", ready_path: str = "/v2/health/ready"):
        """`ready_path`: what answers 200 through it once a backend is up (the front's is /health/ready)."""
        if not Path(NGINX).exists():
            raise RuntimeError("nginx not found: run `bash build/system_deps.sh` (make test does)")
        self.port, self.ready_path = free_port(), ready_path
        self.dir = Path(tempfile.mkdtemp(prefix="nginx-test-"))
        # the same template as the shipped load balancer (deploy/nginx/llm-lb.conf.template)
        (self.dir / "nginx.conf").write_text(render_lb_config(
            backends, f"{HOST}:{self.port}", balance, temp_dir=str(self.dir), pid=f"{self.dir}/nginx.pid",
            error_log=f"{self.dir}/error.log", worker_processes="1"))

    @property
    def url(self) -> str:
        return f"{HOST}:{self.port}"

    def start(self) -> "Nginx":
        self.spawn([NGINX, "-c", str(self.dir / "nginx.conf"), "-g", "daemon off;"])
        for _ in range(100):
            try:
                urllib.request.urlopen(f"http://{self.url}{self.ready_path}", timeout=1)
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"nginx did not start: {(self.dir / 'error.log').read_text()}")
