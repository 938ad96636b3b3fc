"""The serving stack as one owned process tree: tritonserver (internal) + the front (public) + a supervisor.

Used by `make serve` (`python -m launcher`), the tests, the benchmarks and the load tests, so all of them
run what production runs.

- Start: tritonserver in its own process group, bound to an internal address, admin APIs behind a key
  only the launcher holds; then the front, the one public door; ready when the front says so.
- Supervise: a Python model whose stub process died (killed, OOM) is reloaded through Triton's
  repository API; Triton 2.51 itself never replaces a dead stub and keeps reporting ready.
- Stop (SIGTERM, Ctrl-C): the front stops accepting and drains in-flight requests up to the drain
  timeout, then tritonserver gets its exit timeout, then whatever is left of either process group
  (stubs included) is killed. Nothing outlives the launcher.
"""
from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from launcher.triton import ADMIN_HEADER, ROOT, die_with_parent, server_command, server_env, wait_ready

log = logging.getLogger("launcher")
STUB = "triton_python_backend_stub"


@dataclass
class StackConfig:
    repo: Path
    host: str = "127.0.0.1"  # the front's (public) address
    port: int = 9000
    triton_host: str = "127.0.0.1"  # tritonserver's (internal) address
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    front_metrics_port: int = 9002
    front: bool = True
    supervise: bool = True
    drain_timeout_s: float = 30.0  # in-flight requests get this long at the front on stop
    exit_timeout_s: int = 10  # then tritonserver gets this long
    log_verbose: int = 0
    ready_timeout_s: float = 240.0
    env: dict = field(default_factory=dict)
    front_args: tuple = ()
    log_path: Path | None = None  # both processes' output; None: inherit the launcher's
    # the usage ledger's data directory (gateway spool + SQLite; docs/usage.md); None: LLM_DATA_DIR from
    # `env` or the environment, else no ledger. ledger_url: PostgreSQL instead of SQLite.
    data_dir: Path | None = None
    ledger_url: str | None = None


def python_stubs(server_pid: int) -> dict[str, int]:
    """model name -> pid of its Python backend stub, among tritonserver's children."""
    out = {}
    try:
        children = psutil.Process(server_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return out
    for child in children:
        try:  # a child can vanish between any two of these calls (a killed stub being reaped)
            cmd = child.cmdline()
            if len(cmd) > 1 and cmd[0].endswith(STUB) and child.status() != psutil.STATUS_ZOMBIE:
                out[Path(cmd[1]).parent.parent.name] = child.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


class Stack:
    def __init__(self, config: StackConfig):
        self.cfg = config
        self.admin_key = secrets.token_urlsafe(24)
        # the batch worker (in the front) acts for tenants with this key; only the gateway knows its digest
        self.worker_key = "bw-" + secrets.token_urlsafe(24)
        self.triton: subprocess.Popen | None = None
        self.front: subprocess.Popen | None = None
        self.stopping = threading.Event()
        self.reloads: list[str] = []  # models the supervisor reloaded, in order
        self._log = None
        self._supervisor: threading.Thread | None = None
        self.data_dir: Path | None = None
        self.env: dict = {}

    # -- addresses --------------------------------------------------------------------------------
    @property
    def front_url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.port}"

    @property
    def triton_http(self) -> str:
        return f"http://{self.cfg.triton_host}:{self.cfg.http_port}"

    @property
    def triton_grpc(self) -> str:
        return f"{self.cfg.triton_host}:{self.cfg.grpc_port}"

    # -- lifecycle --------------------------------------------------------------------------------
    def _spawn(self, cmd: list[str], env: dict) -> subprocess.Popen:
        out = self._log if self._log is not None else None
        return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT if out else None,
                                start_new_session=True, preexec_fn=die_with_parent)

    def start(self) -> "Stack":
        cfg = self.cfg
        if not (cfg.repo / "ensemble" / "config.pbtxt").is_file():
            raise FileNotFoundError(f"no rendered repository at {cfg.repo}: run `make render`")
        if cfg.log_path is not None:
            self._log = open(cfg.log_path, "ab")
        env = {**server_env(), **cfg.env}
        data_dir = cfg.data_dir or env.get("LLM_DATA_DIR")
        if data_dir:
            self.data_dir = Path(data_dir).resolve()
            (self.data_dir / "spool").mkdir(parents=True, exist_ok=True)
            env["LLM_DATA_DIR"] = str(self.data_dir)
            env["LLM_BATCH_WORKER_KEY"] = self.worker_key
        if cfg.ledger_url:
            env["LLM_LEDGER_URL"] = cfg.ledger_url
        self.env = env
        cmd = server_command(cfg.repo, cfg.triton_host, cfg.http_port, cfg.grpc_port, cfg.metrics_port,
                             cfg.log_verbose, exit_timeout=cfg.exit_timeout_s, admin_key=self.admin_key)
        try:
            self.triton = self._spawn(cmd, env)
            wait_ready(f"{self.triton_http}/v2/health/ready", self.triton, cfg.ready_timeout_s)
            if cfg.front:
                self.start_front()
        except BaseException:
            self.stop()
            raise
        if cfg.supervise:
            self._stubs_at_start = python_stubs(self.triton.pid)  # before anyone can kill one
            self._supervisor = threading.Thread(target=self._supervise, name="stack-supervisor", daemon=True)
            self._supervisor.start()
        return self

    def start_front(self) -> subprocess.Popen:
        """Spawn the front (again, after it died: a restarted front resumes its batch lines)."""
        cfg = self.cfg
        self.front = self._spawn([
            sys.executable, "-m", "front", "--host", cfg.host, "--port", str(cfg.port),
            "--triton-grpc", self.triton_grpc, "--metrics-port", str(cfg.front_metrics_port),
            "--graceful-timeout-s", str(cfg.drain_timeout_s), *cfg.front_args], self.env)
        wait_ready(f"{self.front_url}/health/ready", self.front, 60, "the front")
        return self.front

    def wait(self) -> int:
        """Block until stop() is called or a process dies; the exit code for the launcher."""
        while not self.stopping.wait(0.5):
            for name, proc in (("tritonserver", self.triton), ("front", self.front)):
                if proc is not None and proc.poll() is not None:
                    log.error("%s exited unexpectedly with code %s; stopping the stack", name, proc.returncode)
                    self.stop()
                    return proc.returncode or 1
        return 0

    def stop(self) -> None:
        """Drain the front, then stop tritonserver, then kill whatever is left of both process groups."""
        self.stopping.set()
        cfg = self.cfg
        for proc, grace in ((self.front, cfg.drain_timeout_s + 5), (self.triton, cfg.exit_timeout_s + 15)):
            if proc is None:
                continue
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    log.warning("pid %d did not stop within %.0f s: killing it", proc.pid, grace)
            _kill_group(proc)
        self._drain_ledger()
        if self._log is not None:
            self._log.close()
            self._log = None

    def _drain_ledger(self) -> None:
        """The gateway seals its last usage records when Triton unloads it, after the front has stopped:
        load them now, so a clean shutdown leaves nothing in the spool (what cannot be written now stays
        spooled and is replayed at the next start)."""
        if getattr(self, "data_dir", None) is None:
            return
        from ledger.store import Store
        from ledger.writer import LedgerWriter

        store = Store.open(self.env.get("LLM_LEDGER_URL") or self.data_dir / "ledger.sqlite3")
        writer = LedgerWriter(store, self.data_dir / "spool")
        writer.ensure_ready = store.init
        try:
            if not writer.drain():
                log.warning("usage ledger: store unreachable at shutdown; records stay in %s", self.data_dir)
        finally:
            store.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # -- supervision ------------------------------------------------------------------------------
    def reload_model(self, model: str, timeout: float = 180) -> None:
        req = urllib.request.Request(f"{self.triton_http}/v2/repository/models/{model}/load", data=b"{}",
                                     method="POST", headers={ADMIN_HEADER: self.admin_key})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()

    def _supervise(self) -> None:
        while not self.stopping.is_set():
            try:
                self._watch_stubs()
                return
            except Exception:  # the supervisor must outlive any surprise of its own
                log.exception("stub supervisor failed; restarting it")
                time.sleep(0.5)

    def _watch_stubs(self) -> None:
        """Every Python model of the repository must have a live stub, the same one as last time."""
        expected = python_models(self.cfg.repo)
        known = self._stubs_at_start
        while not self.stopping.wait(0.5):
            if self.triton.poll() is not None:
                return
            now = python_stubs(self.triton.pid)
            for model in expected:
                # gone, or replaced by the backend's own restart (which does not bring the model back)
                if model in now and now[model] == known.get(model, now[model]) or self.stopping.is_set():
                    continue
                print(f"launcher: the {model} model's stub (pid {known.get(model)}) died; reloading it",
                      file=sys.stderr, flush=True)
                try:
                    self.reload_model(model)
                    self.reloads.append(model)
                except OSError as e:
                    log.error("reloading %s failed: %s (retrying)", model, e)
            known = python_stubs(self.triton.pid)


def python_models(repo: Path) -> list[str]:
    """The repository's models served by the Python backend (each runs in a stub process)."""
    return sorted(p.parent.name for p in repo.glob("*/config.pbtxt")
                  if 'backend: "python"' in p.read_text())


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group (the stubs live in tritonserver's) and reap the leader."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
