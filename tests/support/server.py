"""Start a real tritonserver on a freshly rendered repository, on free loopback ports.

Used by the integration tests (and usable from benchmarks): render -> launch -> wait ready -> stop.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from build.render import DEFAULT_CHECKPOINT, render
from build.serve import die_with_parent, server_command, server_env, wait_ready

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class TritonServer:
    overrides: dict = field(default_factory=dict)
    target: str = "cpu"
    checkpoint: Path = DEFAULT_CHECKPOINT
    models: tuple | None = None  # None: every model the renderer knows
    extra_engines: dict | None = None  # more engine models: {name: knob overrides}
    env: dict = field(default_factory=dict)
    ready_timeout: float = 240

    def __post_init__(self):
        self.http_port, self.grpc_port, self.metrics_port = free_port(), free_port(), free_port()
        self.workdir = Path(tempfile.mkdtemp(prefix="triton-test-"))
        self.repo = self.workdir / "model_repository"
        self.log_path = self.workdir / "server.log"
        self.proc: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"{HOST}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{HOST}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{HOST}:{self.metrics_port}/metrics"

    def start(self) -> "TritonServer":
        kwargs = {} if self.models is None else {"models": self.models}
        render(self.target, self.repo, self.overrides, self.checkpoint, extra_engines=self.extra_engines, **kwargs)
        cmd = server_command(self.repo, HOST, self.http_port, self.grpc_port, self.metrics_port, exit_timeout=10)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, env={**server_env(), **self.env}, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent)
        try:
            wait_ready(HOST, self.http_port, self.proc, self.ready_timeout)
        except Exception:
            self.stop()
            raise RuntimeError(f"tritonserver did not start; log tail:\n{self.log_tail()}") from None
        return self

    def metrics(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=5) as r:
            return r.read().decode()

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if getattr(self, "_log", None):
            self._log.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def metric_value(text: str, name: str, **labels) -> float | None:
    """Sum of the samples of `name` whose labels include `labels` in Prometheus text."""
    total, found = 0.0, False
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, label_text = head.partition("{")
        if metric != name:
            continue
        pairs = dict(
            p.split("=", 1) for p in label_text.rstrip("}").split(",") if "=" in p
        )
        pairs = {k: v.strip('"') for k, v in pairs.items()}
        if all(pairs.get(k) == str(v) for k, v in labels.items()):
            total += float(value)
            found = True
    return total if found else None
