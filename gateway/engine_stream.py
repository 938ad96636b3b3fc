"""Reading a decoupled BLS child's responses from async code, with a bound on every wait.

Triton 2.51 hands a decoupled BLS child's responses out through a *blocking* iterator, and
`await request.async_exec(decoupled=True)` is `loop.run_in_executor(None, request.exec)`, where `exec`
returns only once the child's *first* response exists. So every stream waiting in a full engine's queue
held one thread of the event loop's default executor, which has min(32, cpus + 4) threads: 6 on 2
cores, shared with every other BLS call of the gateway (tokenizing included). Six queued streams
stalled every new request, its refusal included (measured: 5-7 s for what the ensemble answered in
0.1 s). `BlockingStream` runs `exec` and each step of the iterator as one call on a pool of threads of
its own (`StreamThreads`), so the default executor only ever runs short calls.

One call at a time per stream, each asked for by the event loop, never read-ahead: a thread per
stream that stepped its iterator on its own (and kept stepping it after the stream was closed)
corrupted the stub's heap within a minute at 32 streams (`malloc(): unaligned fastbin chunk
detected`, measured 2026-11-23); stepped this way the same soak runs clean (benchmarks/results/soak.json).

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
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from contracts.errors import ServingError

END = object()  # the iterator is exhausted


_QUEUED, _RUNNING, _ABANDONED, _CANCELLED, _DONE = range(5)


class _Call:
    """One blocking call for a stream, and the event-loop future its outcome goes to."""
    __slots__ = ("loop", "future", "fn", "args", "state")

    def __init__(self, loop, fn, args):
        self.loop, self.future, self.fn, self.args, self.state = loop, loop.create_future(), fn, args, _QUEUED


class StreamThreads:
    """The threads that run blocking stream calls: up to `max_workers`, started as needed, each handing
    its call's outcome straight to the caller's event loop (one `call_soon_threadsafe`, no executor
    futures in between: this hop runs once per streamed token).

    A call still blocked when its stream is closed is *abandoned* (a dead engine's iterator never
    returns): its thread no longer counts, so dead streams can never starve live ones; a call closed
    before it started never runs."""

    def __init__(self, max_workers: int = 64, name: str = "bls-stream"):
        self.max_workers, self.name = max_workers, name
        self._lock = threading.Lock()
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = 0  # threads that serve calls (not those stuck in abandoned ones)
        self._idle = 0  # of those, the ones waiting for a call
        self.abandoned = 0  # abandoned calls still blocked

    def submit(self, loop: asyncio.AbstractEventLoop, fn, *args) -> _Call:
        call = _Call(loop, fn, args)
        with self._lock:
            if self._idle:
                self._idle -= 1
            elif self._threads < self.max_workers:
                self._threads += 1
                threading.Thread(target=self._serve, name=f"{self.name}-{self._threads}", daemon=True).start()
        self._calls.put(call)
        return call

    def abandon(self, call: _Call) -> None:
        """`call` belongs to a closed stream: never start it, or stop counting the thread it blocks."""
        with self._lock:
            if call.state == _QUEUED:
                call.state = _CANCELLED
            elif call.state == _RUNNING:
                call.state = _ABANDONED
                self.abandoned += 1
                self._threads -= 1

    def _serve(self) -> None:
        while True:
            call = self._calls.get()
            with self._lock:
                run = call.state == _QUEUED
                if run:
                    call.state = _RUNNING
            if run:
                try:
                    outcome = (call.fn(*call.args), None)
                except BaseException as e:  # handed to the caller
                    outcome = (None, e)
                try:
                    call.loop.call_soon_threadsafe(_settle, call.future, outcome)
                except RuntimeError:  # the loop is closed
                    pass
                del outcome
            with self._lock:
                if call.state == _ABANDONED:
                    self.abandoned -= 1
                    if self._threads >= self.max_workers:
                        return  # replaced meanwhile
                    self._threads += 1
                call.state = _DONE
                self._idle += 1


def _settle(future: asyncio.Future, outcome) -> None:
    if future.done():  # its stream stopped waiting (cancelled)
        return
    result, error = outcome
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


_DEFAULT_THREADS: StreamThreads | None = None


def default_threads() -> StreamThreads:
    global _DEFAULT_THREADS
    if _DEFAULT_THREADS is None:
        _DEFAULT_THREADS = StreamThreads()
    return _DEFAULT_THREADS


class BlockingStream:
    """Calls `source()` (e.g. `lambda: request.exec(decoupled=True)`) and steps the iterator it returns,
    one blocking call at a time on `threads`; `await next(timeout)` gets the items, and what they raise.
    A `next` that times out (or whose caller is cancelled) leaves its call running: the following
    `next` waits for the same call.

    `close()` abandons it: nothing more is asked of the iterator; a call still blocked stays so."""

    def __init__(self, source, threads: StreamThreads | None = None, loop: asyncio.AbstractEventLoop | None = None):
        self._loop = loop or asyncio.get_running_loop()
        self._threads = threads or default_threads()
        self._iterator = None
        self._pending: _Call | None = self._threads.submit(self._loop, source)
        self._done = False

    async def next(self, timeout: float | None = None):
        """The next item, or END; raises what the iterator raised, TimeoutError after `timeout` s."""
        while True:
            if self._done:
                return END
            if self._pending is None:
                self._pending = self._threads.submit(self._loop, next, self._iterator, END)
            future = self._pending.future
            if not future.done():
                # asyncio.wait neither cancels the call's future on a timeout nor on our cancellation
                done, _ = await asyncio.wait((future,), timeout=timeout)
                if not done:
                    raise TimeoutError(f"no response within {timeout} s")
            self._pending = None
            try:
                result = future.result()
            except BaseException:
                self._done, self._iterator = True, None  # the call itself raised: the stream is over
                raise
            if self._iterator is None:  # that was `source()`
                self._iterator = iter(result)
                continue
            if result is END:
                self._done, self._iterator = True, None
            return result

    def close(self) -> None:
        self._done, self._iterator = True, None
        pending, self._pending = self._pending, None
        if pending is not None and not pending.future.done():
            pending.future.cancel()  # an outcome that still arrives is dropped
            self._threads.abandon(pending)


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

    async def next(self, stream: BlockingStream, model: str, started_on=None):
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

    async def alive(self, model: str, started_on=None) -> None:
        """Raises `unavailable` if the engine the stream started on is gone or dead (a probe another
        stream got an answer to moments ago is good enough: for streams that only went quiet)."""
        self._check_identity(model, started_on)
        await self.check(model)
        self._check_identity(model, started_on)

    def _check_identity(self, model: str, started_on) -> None:
        """Raises `unavailable` if the engine is no longer the process(es) the stream started on."""
        if started_on is None:
            return
        now = self.identity(model)
        if now is None:
            return
        if started_on and not started_on <= now:
            raise _dead(model, f"its process (pid {', '.join(map(str, sorted(started_on - now)))}) "
                               "is gone; this request was lost with it")
        if not started_on and now:
            # no engine process when the stream started, one now: it began while the engine was dead or
            # being restarted, so it went to the dead one (whose stream never ends, or ends empty), and a
            # probe may reach the new process and answer (a C++ backend has no process here: never this)
            raise _dead(model, "it was restarting when this request started")


class StubProcesses:
    """The pids of the Triton Python stub processes that serve a model, found in /proc among the
    children of our own parent (every stub of one tritonserver is its child); cached briefly.

    A stub's command line is `triton_python_backend_stub <repository>/<model>/<version>/model.py ...`.

    A scan reads every process's stat (1.4 ms for 67 processes on 2 cores, more on a busy node), and it ran
    on the gateway's event loop in the admit of every request that came `ttl_s` after the last one: most of
    an admit at low load. Past `ttl_s` a call now reads only the stat of the model's own stubs: one gone (a
    stub died or restarted: what the identity is for) means a scan at once, else the cached pids serve and
    `background` rescans (a thread). It rescans every `ttl_s` only while a model that had stubs has none
    (its restart: the new stub is found within `ttl_s`), else every `rescan_s` (stubs started beside live
    ones, a model's first, a C++ backend's none): a rescan every `ttl_s` under load, with the scan's Python
    holding the GIL, was 9.1% of the gateway's samples at 16 streams of short requests
    (benchmarks/results/2026-11-29-short-requests-profiles.json; docs/benchmarks.md has what it cost)."""

    def __init__(self, repository: str, parent_pid: int | None = None, ttl_s: float = 0.25,
                 rescan_s: float = 5.0, proc: str = "/proc", clock=time.monotonic, background=None):
        self.repository = os.path.realpath(repository)
        self.parent_pid = parent_pid if parent_pid is not None else os.getppid()
        self.ttl_s, self.rescan_s, self.proc, self.clock = ttl_s, rescan_s, proc, clock
        # one thread kept for it: starting a thread per rescan blocked the caller until the new one ran
        # (Thread.start waits for it), 2 ms at the 90th percentile of the admits at low load here
        self.background = background or ThreadPoolExecutor(1, thread_name_prefix="stub-scan").submit
        self._cache: tuple[float, dict[str, frozenset] | None] | None = None
        self._checked = float("-inf")  # when the cached stubs were last read
        self._had_stubs: set[str] = set()
        self._rescanning = False

    def __call__(self, model: str) -> frozenset | None:
        """The model's stub pids: empty when it has none (a C++ backend, or its stub is gone), None when
        /proc cannot be read."""
        now, cache = self.clock(), self._cache
        if cache is None or cache[1] is None:
            cache = self._store(now)
        elif now - self._checked > self.ttl_s:
            self._checked = now
            pids = cache[1].get(model, ())
            if not all(self._ours(pid) for pid in pids):
                cache = self._store(now)
            elif not self._rescanning and (now - cache[0] > self.rescan_s or (not pids and model in self._had_stubs)):
                self._rescanning = True
                self.background(self._rescan)
        found = cache[1]
        return None if found is None else found.get(model, frozenset())

    def _store(self, now: float) -> tuple:
        found = self._scan()
        if found is not None:
            self._had_stubs.update(m for m, pids in found.items() if pids)
        self._cache, self._checked = (now, found), now
        return self._cache

    def _rescan(self) -> None:
        try:
            self._store(self.clock())
        finally:
            self._rescanning = False

    def _ours(self, pid: int) -> bool:
        """The process still lives as a child of our parent (pids are not reused while it does)."""
        try:
            with open(f"{self.proc}/{pid}/stat", "rb") as f:
                return _parent(f.read()) == self.parent_pid
        except (OSError, ValueError, IndexError):
            return False

    def _scan(self) -> dict[str, frozenset] | None:
        try:
            pids = [p for p in os.listdir(self.proc) if p.isdigit()]
        except OSError:
            return None
        by_model: dict[str, set] = {}
        for pid in pids:
            try:
                with open(f"{self.proc}/{pid}/stat", "rb") as f:
                    if _parent(f.read()) != self.parent_pid:
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


def _parent(stat: bytes) -> int:
    """The parent pid in a /proc/<pid>/stat line (after the command name, which may hold spaces and parens)."""
    return int(stat[stat.rindex(b")") + 2:].split()[1])


def _dead(model: str, why: str) -> ServingError:
    return ServingError("unavailable", f"engine model '{model}' is not responding: {why}", retry_after=5.0)
