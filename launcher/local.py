"""A whole stack on free loopback ports from a freshly rendered repository, for one process's lifetime.

What the tests, the benchmarks and the load tests start: render -> `Stack` (tritonserver, optionally the
front, the stub supervisor) -> ready -> stop. It is the same `Stack` as `make serve`, so every caller runs
what production runs; only the ports (free ones) and the repository (a temporary render) differ.
"""
from __future__ import annotations

import socket
import tempfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from build.render import DEFAULT_CHECKPOINT, render
from launcher.stack import Stack, StackConfig

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class LocalStack:
    """`overrides` are render knobs (`gateway_config` names a tenants file); `start()` returns once ready."""

    overrides: dict = field(default_factory=dict)
    target: str = "cpu"
    checkpoint: Path = DEFAULT_CHECKPOINT
    models: tuple | None = None  # None: every model the renderer knows
    extra_engines: dict | None = None  # more engine models: {name: knob overrides}
    env: dict = field(default_factory=dict)
    ready_timeout: float = 240
    front: bool = False  # also start the OpenAI-compatible front (front_url)
    supervise: bool = True
    drain_timeout_s: float = 10.0
    front_workers: int = 1
    front_args: tuple = ()  # more `python -m front` flags (its client limits, say)
    engine_direct: bool = True  # False: the front streams every request through the gateway (--no-engine-direct)

    def __post_init__(self):
        self.http_port, self.grpc_port, self.metrics_port = free_port(), free_port(), free_port()
        self.front_port, self.front_metrics_port = free_port(), free_port()
        self.workdir = Path(tempfile.mkdtemp(prefix="triton-stack-"))
        self.repo = self.workdir / "model_repository"
        self.log_path = self.workdir / "server.log"
        self.stack: Stack | None = None

    @property
    def proc(self):
        return self.stack.triton if self.stack else None

    @property
    def http_url(self) -> str:
        return f"{HOST}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{HOST}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{HOST}:{self.metrics_port}/metrics"

    @property
    def front_url(self) -> str:
        return f"http://{HOST}:{self.front_port}"

    def start(self) -> "LocalStack":
        kwargs = {} if self.models is None else {"models": self.models}
        render(self.target, self.repo, self.overrides, self.checkpoint, extra_engines=self.extra_engines, **kwargs)
        self.stack = Stack(StackConfig(
            repo=self.repo, host=HOST, port=self.front_port, triton_host=HOST, http_port=self.http_port,
            grpc_port=self.grpc_port, metrics_port=self.metrics_port, front_metrics_port=self.front_metrics_port,
            front=self.front, supervise=self.supervise, drain_timeout_s=self.drain_timeout_s, exit_timeout_s=10,
            front_workers=self.front_workers, front_args=tuple(self.front_args), engine_direct=self.engine_direct,
            ready_timeout_s=self.ready_timeout, env=self.env, log_path=self.log_path))
        try:
            self.stack.start()
        except Exception as e:
            raise RuntimeError(f"the stack did not start ({type(e).__name__}: {e}); log tail:\n{self.log_tail()}") from None
        return self

    def metrics(self) -> str:
        """Triton's Prometheus text (engine, gateway and Triton families); read it with clients.prometheus."""
        with urllib.request.urlopen(self.metrics_url, timeout=5) as r:
            return r.read().decode()

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self):
        if self.stack is not None:
            self.stack.stop()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
