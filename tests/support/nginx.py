"""A real nginx load balancer on a free loopback port in front of several tritonservers' HTTP ports,
hashing on the API key so one tenant's requests stay on one replica (as deploy would), or round robin."""
from __future__ import annotations

import shutil
import tempfile
import time
import urllib.request
from pathlib import Path

from tests.support.server import HOST, free_port
from tests.support.service import Service

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"


class Nginx(Service):
    def __init__(self, backends: list[str], balance: str = "round_robin"):
        if not Path(NGINX).exists():
            raise RuntimeError("nginx not found: run `bash build/system_deps.sh` (make test does)")
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="nginx-test-"))
        policy = "hash $arg_api_key consistent;" if balance == "hash" else ""
        servers = "\n".join(f"    server {b};" for b in backends)
        (self.dir / "nginx.conf").write_text(f"""
worker_processes 1;
pid {self.dir}/nginx.pid;
error_log {self.dir}/error.log;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  client_body_temp_path {self.dir}/body;
  proxy_temp_path {self.dir}/proxy;
  fastcgi_temp_path {self.dir}/fastcgi;
  uwsgi_temp_path {self.dir}/uwsgi;
  scgi_temp_path {self.dir}/scgi;
  upstream triton {{
    {policy}
{servers}
  }}
  server {{
    listen {HOST}:{self.port};
    location / {{
      proxy_pass http://triton;
      proxy_http_version 1.1;
      proxy_buffering off;
      proxy_read_timeout 300s;
    }}
  }}
}}
""")

    @property
    def url(self) -> str:
        return f"{HOST}:{self.port}"

    def start(self) -> "Nginx":
        self.spawn([NGINX, "-c", str(self.dir / "nginx.conf"), "-g", "daemon off;"])
        for _ in range(100):
            try:
                urllib.request.urlopen(f"http://{self.url}/v2/health/ready", timeout=1)
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"nginx did not start: {(self.dir / 'error.log').read_text()}")
