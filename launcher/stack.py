"""The serving stack as one owned process tree: tritonserver (internal) + the front (public) + a supervisor.

Used by `make serve` (`python -m launcher`), the tests, the benchmarks and the load tests, so all of them
run what production runs.

- Start: tritonserver in its own process group, bound to an internal address, admin APIs behind a key
  only the launcher holds; then the front, the one public door; ready when the front says so.
- Supervise (`StubSupervisor`): a Python model whose stub process died (killed, OOM) is unloaded and
  loaded again through Triton's repository API; Triton 2.51 itself never replaces a dead stub and keeps
  reporting the model ready. Where Triton cannot recover (a load hung by a stub killed as it started, or
  a server a stub's death aborted), tritonserver is replaced.
- Stop (SIGTERM, Ctrl-C): the front stops accepting and drains in-flight requests up to the drain
  timeout, then tritonserver gets its exit timeout, then whatever is left of either process group
  (stubs included) is killed. Nothing outlives the launcher.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from build.triton_flags import ADMIN_HEADER
from launcher.triton import ROOT, die_with_parent, server_command, server_env, wait_ready

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
    # the front streams tokens from the engine itself, the gateway admitting and settling each request
    # (front/engine_direct.py); False: every token through the gateway
    engine_direct: bool = True
    front_workers: int = 1  # processes of the front on its one port (front/__main__.py --workers)
    log_path: Path | None = None  # both processes' output; None: inherit the launcher's
    # the usage ledger's data directory (gateway spool + SQLite; docs/usage.md); None: LLM_DATA_DIR from
    # `env` or the environment, else no ledger. ledger_url: PostgreSQL instead of SQLite.
    data_dir: Path | None = None
    ledger_url: str | None = None


def stub_pids(server_pid: int) -> dict[str, frozenset]:
    """model name -> pids of its Python backend stubs (one per instance), among tritonserver's children."""
    out: dict[str, set] = {}
    try:
        children = psutil.Process(server_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    for child in children:
        try:  # a child can vanish between any two of these calls (a killed stub being reaped)
            cmd = child.cmdline()
            if len(cmd) > 1 and cmd[0].endswith(STUB) and child.status() != psutil.STATUS_ZOMBIE:
                out.setdefault(Path(cmd[1]).parent.parent.name, set()).add(child.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return {m: frozenset(p) for m, p in out.items()}


def python_stubs(server_pid: int) -> dict[str, int]:
    """model name -> pid of its Python backend stub (the lowest, where a model has several instances)."""
    return {m: min(p) for m, p in stub_pids(server_pid).items()}


class Stack:
    def __init__(self, config: StackConfig):
        self.cfg = config
        self.admin_key = secrets.token_urlsafe(24)
        # the batch worker (in the front) acts for tenants with this key; only the gateway knows its digest
        self.worker_key = "bw-" + secrets.token_urlsafe(24)
        # the front's key for the gateway's leases (it streams from the engine itself; front/engine_direct.py)
        self.front_key = "fk-" + secrets.token_urlsafe(24)
        self.triton: subprocess.Popen | None = None
        self.front: subprocess.Popen | None = None
        self.stopping = threading.Event()
        self.reloads: list[str] = []  # models the supervisor reloaded, in order
        self.triton_restarts: list[str] = []  # why the supervisor restarted tritonserver, in order
        self._triton_cmd: list[str] = []
        self._triton_lock = threading.Lock()  # held while the supervisor replaces tritonserver
        self._log = None
        self._supervisor: threading.Thread | None = None
        self.data_dir: Path | None = None
        self.env: dict = {}
        self._socket_dir: Path | None = None

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
        env["LLM_FRONT_KEY"] = self.front_key  # the gateway keeps its digest; the front uses it for leases
        if "LLM_GATEWAY_SOCKET" not in env:  # set (empty: none) by the caller, else a folder of this start's own
            # the front's lease operations on the gateway's own socket, past Triton (docs/gateway.md); the
            # folder is this user's alone (mkdtemp: 0700)
            self._socket_dir = Path(tempfile.mkdtemp(prefix="llm-lease-"))
            env["LLM_GATEWAY_SOCKET"] = str(self._socket_dir / "gateway.sock")
        self.env = env
        cmd = server_command(cfg.repo, cfg.triton_host, cfg.http_port, cfg.grpc_port, cfg.metrics_port,
                             cfg.log_verbose, exit_timeout=cfg.exit_timeout_s, admin_key=self.admin_key)
        self._triton_cmd = cmd
        try:
            self.triton = self._spawn(cmd, env)
            wait_ready(f"{self.triton_http}/v2/health/ready", self.triton, cfg.ready_timeout_s)
            if cfg.front:
                self.start_front()
        except BaseException:
            self.stop()
            raise
        if cfg.supervise:
            self._stubs_at_start = stub_pids(self.triton.pid)  # before anyone can kill one
            self._supervisor = threading.Thread(target=self._supervise, name="stack-supervisor", daemon=True)
            self._supervisor.start()
        return self

    def start_front(self) -> subprocess.Popen:
        """Spawn the front (again, after it died: a restarted front resumes its batch lines)."""
        cfg = self.cfg
        self.front = self._spawn([
            sys.executable, "-m", "front", "--host", cfg.host, "--port", str(cfg.port),
            "--triton-grpc", self.triton_grpc, "--triton-http", self.triton_http.split("://", 1)[-1], "--metrics-port", str(cfg.front_metrics_port),
            "--graceful-timeout-s", str(cfg.drain_timeout_s), *self._direct_args(), "--workers", str(cfg.front_workers), *cfg.front_args], self.env)
        wait_ready(f"{self.front_url}/health/ready", self.front, 60, "the front")
        return self.front

    def _direct_args(self) -> list[str]:
        """--tokenizer-dir for the front's direct engine streams: the rendered repository's tokenizer."""
        tokenizer = self.tokenizer_dir() if self.cfg.engine_direct else None
        return ["--tokenizer-dir", tokenizer] if tokenizer else []

    def tokenizer_dir(self) -> str | None:
        """The rendered repository's tokenizer folder (render.json), None if it names none."""
        meta = self.cfg.repo / "render.json"
        return json.loads(meta.read_text()).get("values", {}).get("tokenizer_dir") if meta.is_file() else None

    def wait(self) -> int:
        """Block until stop() is called or a process dies; the exit code for the launcher."""
        while not self.stopping.wait(0.5):
            with self._triton_lock:  # not while the supervisor replaces it
                procs = [("front", self.front)]
                if self._supervisor is None or not self._supervisor.is_alive():  # else it restarts Triton
                    procs.append(("tritonserver", self.triton))
            for name, proc in procs:
                if proc is not None and proc.poll() is not None:
                    log.error("%s exited unexpectedly with code %s; stopping the stack", name, proc.returncode)
                    self.stop()
                    return proc.returncode or 1
        return 0

    def stop(self) -> None:
        """Drain the front, then stop tritonserver, then kill whatever is left of both process groups."""
        self.stopping.set()
        with self._triton_lock:  # a restart in progress gives up at once (it watches `stopping`)
            pass
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
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
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
    def _repository(self, action: str, model: str | None = None, timeout: float = 10) -> bytes:
        path = "index" if model is None else f"models/{model}/{action}"
        req = urllib.request.Request(f"{self.triton_http}/v2/repository/{path}", data=b"{}", method="POST",
                                     headers={ADMIN_HEADER: self.admin_key})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read()

    def model_states(self) -> dict[str, str]:
        """model -> Triton's state of it (READY, LOADING, UNLOADING, UNAVAILABLE), from the repository index."""
        return {m["name"]: m.get("state", "") for m in json.loads(self._repository("index") or b"[]")}

    def reload_model(self, model: str, timeout: float = 600) -> None:
        """Unload `model`, then load it; returns once it is loaded, raises OSError if the load failed.

        Not a plain `load`: Triton 2.51 (explicit mode) reloads a model on `load` only if a file of its
        directory is newer than at its last successful load; otherwise the call reloads its dependents
        (the ensemble) and leaves the model itself as it is, dead stub included. Unloading first makes the
        load a fresh one, and the model is unavailable (not ready) in between, not served by a dead stub."""
        self._repository("unload", model)  # returns at once; the dead version is released meanwhile
        self._repository("load", model, timeout)

    RESTART_GRACE_S = 5.0

    def restart_triton(self, why: str, hung=None) -> bool:
        """Replace tritonserver (same command, ports and admin key), once: True when the new one is
        ready. False if it exited first (a stub killed during its start makes it exit), if `hung()`
        said its start cannot finish, if the stack stops, or after the ready timeout. In-flight
        requests fail (the front answers 503 meanwhile); the front stays up and reconnects.

        The old server gets SIGTERM and RESTART_GRACE_S, then SIGKILL: one with a hung load does not get
        as far as unloading its models within its exit timeout (measured), so waiting longer gains
        nothing. The gateway's usage spool is fsync'd every 0.2 s and a segment its dead owner left open
        is sealed by the front's reader (ledger/spool.py)."""
        print(f"launcher: restarting tritonserver: {why}", file=sys.stderr, flush=True)
        with self._triton_lock:
            old = self.triton
            if self.stopping.is_set() or old is None:
                return False
            self.triton_restarts.append(why)
            if old.poll() is None:
                old.send_signal(signal.SIGTERM)
                try:
                    old.wait(timeout=self.RESTART_GRACE_S)
                except subprocess.TimeoutExpired:
                    pass
            _kill_group(old)
            if self.stopping.is_set():
                return False
            self.triton = self._spawn(self._triton_cmd, self.env)
            deadline = time.monotonic() + self.cfg.ready_timeout_s
            while time.monotonic() < deadline and not self.stopping.wait(0.25):
                if self.triton.poll() is not None or (hung is not None and hung()):
                    return False
                try:
                    with urllib.request.urlopen(f"{self.triton_http}/v2/health/ready", timeout=1) as r:
                        if r.status == 200:
                            print("launcher: tritonserver is ready again", file=sys.stderr, flush=True)
                            return True
                except OSError:
                    pass
            return False

    def server_live(self, timeout: float = 5.0) -> bool:
        """tritonserver answers /v2/health/live with 200 (false while it shuts down, or hangs)."""
        try:
            with urllib.request.urlopen(f"{self.triton_http}/v2/health/live", timeout=timeout) as r:
                return r.status == 200
        except OSError:
            return False

    def _supervise(self) -> None:
        supervisor = StubSupervisor(self)
        while not self.stopping.is_set():
            try:
                supervisor.run()
                return
            except Exception:  # the supervisor must outlive any surprise of its own
                log.exception("stub supervisor failed; restarting it")
                time.sleep(0.5)


class StubSupervisor:
    """Every Python model of the repository keeps a live stub: the one it had when it was last loaded.

    Each model is up or down. Up: the stubs seen right after its last load are all alive (it may have
    more: a stub that starts is not a death). Down: one of them died (killed, OOM), or its reload
    failed: it is reloaded (unload + load, `Stack.reload_model`) until a load succeeds, one attempt at
    a time, never while Triton is still loading it, with a growing pause after each failed attempt
    (RETRY_S): a model that cannot come back costs one attempt and one log line per pause, never a
    loop. A death is logged once, however many attempts it takes.

    A load whose stub dies before it has started (its first message to the server) never ends in
    Triton 2.51: the Python backend waits for that message without a timeout, and the model stays
    LOADING, locked against any other load, for the life of the server. A load that has had no live
    stub for HUNG_AFTER_S is that case, and the only way out is a new tritonserver
    (`Stack.restart_triton`).

    The server itself is replaced when it exits, and when it has not said it is live for
    UNRESPONSIVE_AFTER_S: a tritonserver 2.51 that aborted in its gRPC code (a cancellation race under
    load) was seen to hang in its signal handler instead of exiting, serving nothing
    (docs/benchmarks.md, On 16 cores)."""

    POLL_S = 0.5
    RETRY_S = (1.0, 2.0, 5.0, 10.0, 30.0)  # pauses after the 1st, 2nd, ... failed attempt
    LIVE_EVERY_S = 2.0  # how often tritonserver's /v2/health/live is asked
    UNRESPONSIVE_AFTER_S = 20.0  # no live answer for this long: the server is replaced
    LOAD_TIMEOUT_S = 600.0
    HUNG_AFTER_S = 5.0
    START_HUNG_AFTER_S = 10.0
    SETTLE_S = 1.0  # after a reload, the stubs to keep alive are read once none came or went for this long
    SETTLE_MAX_S = 5.0

    def __init__(self, stack: Stack, clock=time.monotonic):
        self.stack, self.clock = stack, clock
        self.models = python_models(stack.cfg.repo)
        self.up: dict[str, frozenset] = {}
        self.down: dict[str, tuple[int, float]] = {}  # model -> (failed attempts, time of the next one)
        self.reset(stack._stubs_at_start)

    def reset(self, stubs: dict[str, frozenset]) -> None:
        """Start over from a freshly started server's stubs (a model without one never loaded: down)."""
        self.up = {m: p for m, p in stubs.items() if m in self.models}
        self.down = {m: (0, self.clock()) for m in self.models if m not in self.up}
        self._stubless: dict[str, float] = {}  # model -> since when its load in flight has had no stub
        self._live_asked, self._silent_since = self.clock(), None

    def run(self) -> None:
        """Until the stack stops, or tritonserver died and a new one did not get ready."""
        stack = self.stack
        while not stack.stopping.wait(self.POLL_S):
            code = stack.triton.poll()
            if code is not None:  # a stub's death can take the server with it (SIGABRT in the backend)
                if not self._restart(f"it exited with code {code}"):
                    return
                continue
            if self._unresponsive():
                if not self._restart(f"it has not answered /v2/health/live for {self.UNRESPONSIVE_AFTER_S:.0f} s"):
                    return
                continue
            self.step()

    def _unresponsive(self) -> bool:
        """True once the server has not said it is live for UNRESPONSIVE_AFTER_S (asked every LIVE_EVERY_S)."""
        now = self.clock()
        if now - self._live_asked < self.LIVE_EVERY_S:
            return False
        self._live_asked = now
        if self.stack.server_live():
            self._silent_since = None
            return False
        if self._silent_since is None:
            self._silent_since = now
        return now - self._silent_since >= self.UNRESPONSIVE_AFTER_S

    def step(self) -> None:
        stack = self.stack
        now = stub_pids(stack.triton.pid)
        for model in self.models:
            if stack.stopping.is_set():
                return
            if model in self.up:
                if self.up[model] <= now.get(model, frozenset()):
                    continue
                gone = self.up.pop(model) - now.get(model, frozenset())
                print(f"launcher: the {model} model's stub (pid {', '.join(map(str, sorted(gone)))}) died; "
                      "reloading it", file=sys.stderr, flush=True)
                self.down[model] = (0, self.clock())
            if model in self.down and self.clock() >= self.down[model][1]:
                self._attempt(model)

    def _attempt(self, model: str) -> None:
        stack = self.stack
        failures = self.down[model][0]
        try:
            if stack.model_states().get(model) == "LOADING":  # a load in flight (ours timed out): never a second
                self._watch_load(model)
                return
            self._stubless.pop(model, None)
            if not self._reload(model):
                return  # tritonserver was replaced, or the stack stops
        except OSError as e:
            pause = self.RETRY_S[min(failures, len(self.RETRY_S) - 1)]
            self.down[model] = (failures + 1, self.clock() + pause)
            log.error("reloading %s failed: %s (next attempt in %.0f s)", model, _reason(e), pause)
            return
        stack.reloads.append(model)
        # loaded: its stubs now are the ones to keep alive (read after the load returned, never during it)
        pids = self._settled(model)
        if not pids:  # and already dead again: the next step reloads it
            print(f"launcher: the {model} model was loaded but its stub is gone already; reloading it",
                  file=sys.stderr, flush=True)
            self.down[model] = (0, self.clock())
            return
        del self.down[model]
        self.up[model] = pids
        print(f"launcher: the {model} model is loaded again (stub pid {', '.join(map(str, sorted(pids)))})",
              file=sys.stderr, flush=True)

    def _settled(self, model: str) -> frozenset:
        """The model's stubs once none has come or gone for SETTLE_S (at most SETTLE_MAX_S). Right after a
        load there can be a stub on its way out (the Python backend's own restart of an unhealthy stub,
        overlapping ours): kept as one to watch, its exit reads as a death and reloads the model again, and
        again (seen on a starved 2-core host: pre- and postprocessing reloaded in a loop, the ensemble
        unavailable each time)."""
        started = changed = time.monotonic()
        pids = stub_pids(self.stack.triton.pid).get(model, frozenset())
        while time.monotonic() - changed < self.SETTLE_S and time.monotonic() - started < self.SETTLE_MAX_S:
            if self.stack.stopping.wait(min(self.POLL_S, self.SETTLE_S) / 5):
                break
            now = stub_pids(self.stack.triton.pid).get(model, frozenset())
            if now != pids:
                pids, changed = now, time.monotonic()
        return pids

    def _reload(self, model: str) -> bool:
        """`Stack.reload_model`, watched: True once loaded; raises what the load raised; False if the
        load hung (tritonserver is then replaced and every model starts over) or the stack stops."""
        stack, outcome, done = self.stack, [], threading.Event()

        def load():
            try:
                stack.reload_model(model, self.LOAD_TIMEOUT_S)
                outcome.append(None)
            except BaseException as e:  # handed to the supervisor
                outcome.append(e)
            done.set()
        threading.Thread(target=load, name=f"reload-{model}", daemon=True).start()
        while not done.wait(self.POLL_S):
            if stack.stopping.is_set() or self._watch_load(model):
                return False
        if outcome[0] is not None:
            raise outcome[0]
        return True

    def _watch_load(self, model: str) -> bool:
        """Called while `model` loads: True if the load hung and tritonserver was replaced."""
        if stub_pids(self.stack.triton.pid).get(model):
            self._stubless.pop(model, None)
            return False
        since = self._stubless.setdefault(model, self.clock())
        if self.clock() - since < self.HUNG_AFTER_S:
            return False
        try:  # double-check with the server: still loading, and still no stub
            hung = self.stack.model_states().get(model) == "LOADING" and not stub_pids(self.stack.triton.pid).get(model)
        except OSError:
            return False
        if not hung:
            self._stubless.pop(model, None)
            return False
        self._restart(f"the {model} model's load cannot finish (its stub died as it started)")
        return True

    def _restart(self, why: str) -> bool:
        """Replace tritonserver until a new one is ready, with RETRY_S pauses between attempts; after
        the last one the launcher gives up: the server is killed, and `Stack.wait` stops the stack."""
        stack = self.stack
        for failures in range(len(self.RETRY_S) + 1):
            if stack.restart_triton(why, hung=self._start_watch()):
                self.reset(stub_pids(stack.triton.pid))
                for model in sorted(self.down):  # a model the new server did not load: loaded as usual
                    print(f"launcher: the {model} model has no stub after the restart; loading it",
                          file=sys.stderr, flush=True)
                return True
            if stack.stopping.is_set():
                return False
            if failures == len(self.RETRY_S):
                break
            pause = self.RETRY_S[failures]
            log.error("the new tritonserver did not get ready (exit code %s); next attempt in %.0f s",
                      stack.triton.poll(), pause)
            why = "the previous one did not get ready"
            if stack.stopping.wait(pause):
                return False
        log.error("tritonserver did not get ready after %d restarts; giving up", len(self.RETRY_S) + 1)
        with stack._triton_lock:
            _kill_group(stack.triton)
        return False

    def _start_watch(self):
        """For a starting server: true once a Python model has had no stub for START_HUNG_AFTER_S (all of
        them load at once, each with a stub from its first moment; a stub killed as it started leaves
        its load, and so the server's start, hung for good)."""
        since: dict[str, float] = {}

        def hung() -> bool:
            now, t = stub_pids(self.stack.triton.pid), self.clock()
            for model in self.models:
                if now.get(model):
                    since.pop(model, None)
                elif t - since.setdefault(model, t) >= self.START_HUNG_AFTER_S:
                    print(f"launcher: the new tritonserver's start cannot finish: the {model} model has had no "
                          f"stub for {self.START_HUNG_AFTER_S:.0f} s", file=sys.stderr, flush=True)
                    return True
            return False
        return hung


def _reason(e: OSError) -> str:
    """An HTTP error's body (Triton's own message), else the error."""
    if isinstance(e, urllib.error.HTTPError):
        try:
            body = e.read().decode(errors="replace")
            return json.loads(body).get("error", body).strip()
        except (OSError, ValueError, AttributeError):
            pass
    return str(e)


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
