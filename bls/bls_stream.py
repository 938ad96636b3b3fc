"""Reading a decoupled BLS child's responses from async code, with a bound on every wait.

Triton 2.51 hands a decoupled BLS child's responses out through a *blocking* iterator, and
`await request.async_exec(decoupled=True)` is `loop.run_in_executor(None, request.exec)`, where `exec`
returns only once the child's *first* response exists. So every stream waiting in a full engine's queue
held one thread of the event loop's default executor, which has min(32, cpus + 4) threads: 6 on 2
cores, shared with every other BLS call of the gateway (tokenizing included). Six queued streams
stalled every new request, its refusal included (measured: 5-7 s for what the ensemble answered in
0.1 s). `ThreadedIterator` runs `exec` and then steps the iterator in a thread of the stream's own and
hands the items to the loop, so the default executor only ever runs short calls.

The iterator of an engine whose process died never returns, not even once the launcher has reloaded
the model (measured: the new stub answers new requests, the old streams wait forever). `EngineWatch`
bounds each wait: after `check_after_s` without a response it checks that the engine process the
stream started on still runs (`identity`: the Python stub's pid, read from /proc), and otherwise asks
the engine whether it is alive (a cheap probe, e.g. a `stop` for an id nobody uses). A stream whose
engine process is gone, or an engine that answers the probe with an error, or not at all for
`dead_after_s`, ends with an `unavailable` error instead of hanging.
"""
from __future__ import annotations

import asyncio
import os
import threading
import time

from bls.errors import ServingError

END = object()  # the iterator is exhausted


class ThreadedIterator:
    """Calls `source()` (e.g. `lambda: request.exec(decoupled=True)`) and steps the iterator it returns
    in a daemon thread of its own; `await next(timeout)` gets the items, and what they raise.

    `close()` abandons it: items that still arrive are dropped, and a thread blocked in a dead
    iterator stays blocked (it holds no lock and nothing waits for it)."""

    def __init__(self, source, loop: asyncio.AbstractEventLoop | None = None, name: str = "bls-stream"):
        self._loop = loop or asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, args=(source,), name=name, daemon=True)
        self._thread.start()

    def _put(self, kind, value) -> bool:
        if self._closed:
            return False
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (kind, value))
            return True
        except RuntimeError:  # the loop is closed
            return False

    def _run(self, source) -> None:
        try:
            for item in source():
                if not self._put("item", item):
                    return
            self._put("end", None)
        except BaseException as e:  # handed to the reader
            self._put("error", e)

    async def next(self, timeout: float | None = None):
        """The next item, or END; raises what the iterator raised, TimeoutError after `timeout` s."""
        kind, value = await asyncio.wait_for(self._queue.get(), timeout)
        if kind == "error":
            raise value
        return END if kind == "end" else value

    def close(self) -> None:
        self._closed = True

    @property
    def thread_alive(self) -> bool:
        return self._thread.is_alive()


class EngineWatch:
    """Bounded waits for engine responses, with one shared liveness probe per engine model.

    `probe(model)` is a coroutine that returns when the engine answered and raises when it answered
    with an error (for a dead Triton Python stub: "Stub process ... is not healthy")."""

    def __init__(self, probe, identity=None, check_after_s: float = 1.0, probe_timeout_s: float = 1.0,
                 dead_after_s: float = 5.0, clock=time.monotonic):
        self.probe = probe
        # identity(model) -> frozenset of the engine's process ids, or None where there is no such thing
        # (the C++ backend runs inside tritonserver: if it dies, so does the gateway)
        self.identity = identity or (lambda model: None)
        self.check_after_s = check_after_s
        self.probe_timeout_s = probe_timeout_s
        self.dead_after_s = dead_after_s
        self.clock = clock
        self._running: dict[str, asyncio.Future] = {}
        self._last_ok: dict[str, float] = {}
        self._failing_since: dict[str, float] = {}

    async def check(self, model: str, force: bool = False) -> None:
        """Returns if the engine looks alive; raises `unavailable` if it is dead. Without `force`, an
        answer another stream got in the last check_after_s / 2 seconds is good enough."""
        now = self.clock()
        if not force and now - self._last_ok.get(model, -1e18) < self.check_after_s / 2:
            return  # another stream's probe just got an answer
        if model not in self._running:  # one probe at a time per model, shared by every waiting stream
            self._running[model] = asyncio.ensure_future(self._probe(model))
        await asyncio.shield(self._running[model])

    async def _probe(self, model: str) -> None:
        try:
            try:
                await asyncio.wait_for(self.probe(model), self.probe_timeout_s)
            except (TimeoutError, asyncio.TimeoutError):
                since = self._failing_since.setdefault(model, self.clock() - self.probe_timeout_s)
                if self.clock() - since < self.dead_after_s:
                    return  # busy, or dead: tell which on a later check
                raise _dead(model, f"it has not answered for {self.clock() - since:.1f} s") from None
            except ServingError as e:
                raise _dead(model, e.message) from None
            except Exception as e:
                raise _dead(model, f"{type(e).__name__}: {e}") from None
            self._failing_since.pop(model, None)
            self._last_ok[model] = self.clock()
        finally:
            self._running.pop(model, None)

    def begin(self, model: str):
        """What the engine is when a stream starts; pass it to `next`."""
        return self.identity(model)

    async def next(self, stream: ThreadedIterator, model: str, started_on=None):
        """The stream's next item (or END), checking the engine whenever one takes long."""
        while True:
            try:
                return await stream.next(self.check_after_s)
            except (TimeoutError, asyncio.TimeoutError):
                self._check_identity(model, started_on)
                await self.check(model)

    async def verify(self, model: str, started_on=None) -> None:
        """Raises `unavailable` unless the engine the stream started on is alive and answers now. For an
        end that may not be the engine's own: when a stub dies, Triton ends some of its streams with an
        empty final response, which must not pass for a completed generation."""
        self._check_identity(model, started_on)
        await self.check(model, force=True)
        self._check_identity(model, started_on)

    def _check_identity(self, model: str, started_on) -> None:
        if not started_on:
            return
        now = self.identity(model)
        if now is not None and not started_on <= now:
            raise _dead(model, f"its process (pid {', '.join(map(str, sorted(started_on - now)))}) "
                               "is gone; this request was lost with it")


class StubProcesses:
    """The pids of the Triton Python stub processes that serve a model, found in /proc among the
    children of our own parent (every stub of one tritonserver is its child); cached briefly.

    A stub's command line is `triton_python_backend_stub <repository>/<model>/<version>/model.py ...`."""

    def __init__(self, repository: str, parent_pid: int | None = None, ttl_s: float = 0.25,
                 proc: str = "/proc", clock=time.monotonic):
        self.repository = os.path.realpath(repository)
        self.parent_pid = parent_pid if parent_pid is not None else os.getppid()
        self.ttl_s, self.proc, self.clock = ttl_s, proc, clock
        self._cache: tuple[float, dict[str, frozenset]] | None = None

    def __call__(self, model: str) -> frozenset | None:
        """The model's stub pids: empty when it has none (a C++ backend, or its stub is gone), None when
        /proc cannot be read."""
        now = self.clock()
        if self._cache is None or now - self._cache[0] > self.ttl_s:
            self._cache = (now, self._scan())
        found = self._cache[1]
        return None if found is None else found.get(model, frozenset())

    def _scan(self) -> dict[str, frozenset] | None:
        try:
            pids = [p for p in os.listdir(self.proc) if p.isdigit()]
        except OSError:
            return None
        by_model: dict[str, set] = {}
        for pid in pids:
            try:
                with open(f"{self.proc}/{pid}/stat", "rb") as f:
                    stat = f.read()
                if int(stat[stat.rindex(b")") + 2:].split()[1]) != self.parent_pid:
                    continue
                with open(f"{self.proc}/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile, or not ours to read
            if len(argv) < 2 or not argv[0].endswith(b"triton_python_backend_stub"):
                continue
            path = os.path.realpath(argv[1].decode(errors="replace"))
            rel = os.path.relpath(path, self.repository).split(os.sep)
            if len(rel) == 3 and rel[0] != ".." and rel[2] == "model.py":
                by_model.setdefault(rel[0], set()).add(int(pid))
        return {m: frozenset(p) for m, p in by_model.items()}


def _dead(model: str, why: str) -> ServingError:
    return ServingError("unavailable", f"engine model '{model}' is not responding: {why}", retry_after=5.0)
