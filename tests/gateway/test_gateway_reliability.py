"""The gateway's reliability pieces without Triton (issue 18, findings 4, 5, 9, 10): engine streams that
never starve the loop's executor, bounded waits that end a dead engine's streams, limits that refuse an
impossible request before any reservation, and input parsing that names the field."""
import asyncio
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from contracts.generation import EngineStep
from gateway.engine_stream import END, BlockingStream, EngineWatch, StreamThreads, StubProcesses
from gateway.engine_limits import EngineLimits, RepositoryEngineLimits, config_parameters, limits_from_parameters
from contracts.errors import ServingError
from gateway.core import GatewayRequest
from gateway.edges import Preprocessed
from gateway.request import parse_gateway_request
from gateway.triton_backend import TritonBackend
from tests.gateway.test_gateway_lib import FakeBackend, collect, make_gateway
from tests.support.wait import wait_until


# -- a stand-in for triton_python_backend_utils with the 2.51 BLS semantics that matter here ----------

class FakeTensor:
    def __init__(self, name, array):
        self._name, self._array = name, np.asarray(array)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


class FakeError:
    def __init__(self, message):
        self._message = message

    def message(self):
        return self._message


class FakeResponse:
    def __init__(self, ids=None, error=None):
        self.ids, self._error = ids, error

    def has_error(self):
        return self._error is not None

    def error(self):
        return FakeError(self._error)

    def output_tensors(self):
        return []


class FakeEngine:
    """`script(request) -> iterable of FakeResponse`, consumed lazily like Triton's blocking iterator.
    `exec` blocks until the first response exists, as the 2.51 stub's does. `ready`: what Triton says
    of the model's readiness (false while the launcher reloads it)."""

    def __init__(self, script):
        self.script = script
        self.requests = []
        self.ready = True


def fake_pb(engine: FakeEngine):
    class InferenceRequest:
        def __init__(self, model_name, inputs, requested_output_names, request_id="", parameters=None):
            self.model_name, self.request_id = model_name, request_id
            self.inputs = {t.name(): t.as_numpy() for t in inputs}
            engine.requests.append(self)

        def exec(self, decoupled=False):
            if self.model_name == "preprocessing":
                return PREP_RESPONSE
            it = iter(engine.script(self))
            first = next(it, None)  # blocks, as Triton's exec does, until the first response

            def rest():
                if first is not None:
                    yield first
                yield from it
            return rest()

        async def async_exec(self, decoupled=False):  # what the stub does: the loop's default executor
            return await asyncio.get_running_loop().run_in_executor(None, self.exec, decoupled)

    class Pb:
        Tensor = FakeTensor

        @staticmethod
        def is_model_ready(model_name, model_version=""):
            return engine.ready

        @staticmethod
        def get_output_tensor_by_name(resp, name):
            if resp.ids is None:
                return None
            if name == "output_ids":
                return FakeTensor(name, np.array([[resp.ids]]))
            if name == "sequence_length":
                return FakeTensor(name, np.array([[len(resp.ids)]]))
            return None

    Pb.InferenceRequest = InferenceRequest
    return Pb


class _Prep:
    def has_error(self):
        return False

    def output_tensors(self):
        return [FakeTensor(k, v) for k, v in PREP_TENSORS.items()]


PREP_TENSORS = {"INPUT_ID": np.array([[1, 2, 3]], np.int32), "REQUEST_INPUT_LEN": np.array([[3]], np.int32),
        "REQUEST_OUTPUT_LEN": np.array([[4]], np.int32), "OUT_END_ID": np.array([[0]], np.int32),
        "OUT_PAD_ID": np.array([[0]], np.int32), "STOP_WORDS_IDS": np.zeros((1, 2, 0), np.int32),
        "BAD_WORDS_IDS": np.zeros((1, 2, 0), np.int32)}
PREP = Preprocessed.from_tensors(PREP_TENSORS)
PREP_RESPONSE = _Prep()


def _req(**kw):
    return GatewayRequest("k", 4, text="hi", **kw)


async def _drain(backend, model="m", req=None):
    return [step.ids async for step in backend.engine_stream(model, req or _req(), PREP, "acme")]


# -- streams in threads of their own ---------------------------------------------------------------

@pytest.mark.timeout(30)
def test_streams_queued_in_the_engine_do_not_starve_other_bls_calls():
    """40 engine streams whose first response never comes (queued behind a full KV cache) while the
    loop's default executor has the 6 threads it has in the stub on 2 cores: a tokenize call (a plain
    BLS call on that executor) still answers at once. With async_exec + run_in_executor(next) per
    stream it waited until the engine produced something (measured 5-20 s in Triton)."""
    gate = threading.Event()

    def script(request):
        gate.wait()  # the engine holds every stream in its queue
        yield FakeResponse([7])

    backend = TritonBackend(fake_pb(FakeEngine(script)))

    async def go():
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(6))
        streams = [asyncio.create_task(_drain(backend)) for _ in range(40)]
        try:
            await asyncio.sleep(0.2)
            t0 = time.monotonic()
            prep = await asyncio.wait_for(backend.tokenize(_req()), 3)
            waited = time.monotonic() - t0
        finally:
            gate.set()  # the engine gets going: every stream gets its token
        outs = await asyncio.wait_for(asyncio.gather(*streams), 10)
        return waited, prep, outs
    waited, prep, outs = asyncio.run(go())
    assert waited < 0.5, waited
    assert prep.n_input == 3 and outs == [[[7]]] * 40


@pytest.mark.timeout(30)
def test_streams_waiting_for_a_first_response_stay_below_the_servers_bls_thread_pool():
    """Each engine stream waiting for its first response holds a thread of the server's Python-backend
    pool (shared with tokenizing and sending): at most `max_starting` wait at once; the rest start as
    first responses arrive."""
    gate, waiting, most, lock = threading.Event(), [0], [0], threading.Lock()

    def script(request):
        with lock:
            waiting[0] += 1
            most[0] = max(most[0], waiting[0])
        gate.wait()
        with lock:
            waiting[0] -= 1
        yield FakeResponse([7])

    backend = TritonBackend(fake_pb(FakeEngine(script)), max_starting=4)

    async def go():
        streams = [asyncio.create_task(_drain(backend)) for _ in range(10)]
        await asyncio.sleep(0.3)
        seen = most[0]
        gate.set()
        return seen, await asyncio.wait_for(asyncio.gather(*streams), 10)
    seen, outs = asyncio.run(go())
    assert seen == 4 and most[0] == 4 and outs == [[[7]]] * 10


def test_blocking_stream_hands_over_items_errors_and_the_end():
    def source():
        yield 1
        yield 2
        raise ValueError("boom")

    async def go():
        it = BlockingStream(source)
        got = [await it.next(1), await it.next(1)]
        with pytest.raises(ValueError, match="boom"):
            await it.next(1)
        done = BlockingStream(lambda: iter([5]))
        return got, await done.next(1), await done.next(1)
    assert asyncio.run(go()) == ([1, 2], 5, END)


def test_a_blocking_stream_never_reads_ahead_and_closed_dead_calls_cannot_starve_the_pool():
    """One call at a time, each asked for (no read-ahead: the thread-per-stream reader that kept stepping
    its iterator corrupted the stub's heap); a call left blocked in a dead iterator stops counting
    against the pool, and a call closed before it started never runs."""
    stepped, started = [], []

    def source():
        for i in range(5):
            stepped.append(i)
            yield i

    def dead():
        started.append(1)
        return iter([threading.Event().wait()])

    async def go():
        threads = StreamThreads(max_workers=2)
        stream = BlockingStream(source, threads)
        assert await stream.next(1) == 0
        await asyncio.sleep(0.1)
        ahead = list(stepped)
        stream.close()
        assert await stream.next(1) is END
        stuck = [BlockingStream(dead, threads) for _ in range(3)]  # 2 run and block, 1 waits for a thread
        for s in stuck:
            with pytest.raises(TimeoutError):
                await s.next(0.05)
            s.close()
        abandoned = threads.abandoned
        live = await asyncio.gather(*(BlockingStream(lambda: iter([1, 2]), threads).next(1) for _ in range(4)))
        return ahead, abandoned, live
    ahead, abandoned, live = asyncio.run(go())
    assert ahead == [0] and abandoned == 2 and live == [1] * 4
    assert len(started) == 2  # the third dead stream was closed before a thread took it


# -- a dead engine ends every stream ----------------------------------------------------------------

def _stalling_engine(alive: threading.Event):
    """Two tokens, then nothing ever again (the stub was killed)."""
    def script(request):
        if request.inputs.get("stop") is not None:  # a probe or a stop
            if not alive.is_set():
                yield FakeResponse(error="Stub process 'tensorrt_llm_0_0' is not healthy.")
            return
        yield FakeResponse([5])
        yield FakeResponse([6])
        threading.Event().wait()  # blocks forever
    return script


@pytest.mark.timeout(30)
def test_a_killed_engine_ends_the_stream_with_unavailable_within_the_check_interval():
    alive = threading.Event()
    alive.set()
    backend = TritonBackend(fake_pb(FakeEngine(_stalling_engine(alive))))
    backend.watch.check_after_s = 0.2

    async def go():
        got = []
        t0 = time.monotonic()
        with pytest.raises(ServingError) as e:
            async for step in backend.engine_stream("m", _req(), PREP, "acme"):
                got.append(step.ids)
                if len(got) == 2:
                    alive.clear()  # kill -9: the stub answers nothing, new requests get "not healthy"
        return got, e.value, time.monotonic() - t0
    got, err, took = asyncio.run(go())
    assert got == [[5], [6]] and err.kind == "unavailable" and err.retry_after
    assert "not healthy" in err.message and took < 1.5


@pytest.mark.timeout(30)
def test_a_restarted_engine_still_ends_the_streams_of_the_dead_process():
    """The launcher reloads the model: the new stub answers probes, but the old streams' responses are
    gone for good. The stub's pid tells them apart."""
    alive = threading.Event()
    alive.set()
    pids = {"m": frozenset({100})}
    backend = TritonBackend(fake_pb(FakeEngine(_stalling_engine(alive))), identity=lambda m: pids[m])
    backend.watch.check_after_s = 0.2

    async def go():
        stream = backend.engine_stream("m", _req(), PREP, "acme")
        assert (await stream.__anext__()).ids == [5]
        pids["m"] = frozenset({200})  # a new process answers for the model now
        with pytest.raises(ServingError) as e:
            async for _ in stream:
                pass
        return e.value
    err = asyncio.run(go())
    assert err.kind == "unavailable" and "pid 100" in err.message


@pytest.mark.timeout(30)
def test_an_engine_that_never_answers_probes_is_declared_dead_after_dead_after_s():
    async def silent_probe(model):
        await asyncio.sleep(3600)

    async def go():
        watch = EngineWatch(silent_probe, check_after_s=0.05, probe_timeout_s=0.05, dead_after_s=0.3)
        stream = BlockingStream(lambda: iter([threading.Event().wait()]))  # blocks forever
        t0 = time.monotonic()
        with pytest.raises(ServingError) as e:
            await watch.next(stream, "m")
        return e.value, time.monotonic() - t0
    err, took = asyncio.run(go())
    assert err.kind == "unavailable" and "has not answered" in err.message and 0.25 < took < 2.0


@pytest.mark.timeout(30)
def test_a_stream_that_ends_without_output_is_no_success_when_the_engine_is_dead():
    def script(request):
        if request.inputs.get("stop") is not None:
            yield FakeResponse(error="Stub process 'tensorrt_llm_0_0' is not healthy.")
        return  # the stream "ends" with nothing: what 2 of 8 gateway requests turned into a success

    backend = TritonBackend(fake_pb(FakeEngine(script)))
    with pytest.raises(ServingError) as e:
        asyncio.run(_drain(backend))
    assert e.value.kind == "unavailable"


@pytest.mark.timeout(30)
def test_an_empty_end_of_a_stream_begun_while_the_engine_restarted_is_no_success():
    """The stub was killed: a request starts while no engine process exists, Triton ends it empty, and
    by the time the gateway probes, the launcher's reload answers. Seen once in a clean-clone run."""
    pids = {"m": frozenset()}

    def script(request):
        if request.inputs.get("stop") is None:
            pids["m"] = frozenset({200})  # the reloaded stub: probes get answers again
        return iter(())

    backend = TritonBackend(fake_pb(FakeEngine(script)), identity=lambda m: pids[m])
    with pytest.raises(ServingError) as e:
        asyncio.run(_drain(backend))
    assert e.value.kind == "unavailable" and "restarting" in e.value.message
    pids["m"] = frozenset({200})
    assert asyncio.run(_drain(backend)) == []  # with its process up from the start, an empty end is a success


@pytest.mark.timeout(30)
def test_a_stream_begun_while_the_engine_was_dead_ends_once_a_new_process_answers_probes():
    """Begun between the stub's death and the launcher's reload, the request reached the dead stub: it
    never answers, while probes reach the reloaded model and get answers. No process when the stream
    began and one now is enough to end it, at the first check."""
    pids = {"m": frozenset()}

    def script(request):
        if request.inputs.get("stop") is not None:
            return iter(())  # the reloaded engine answers probes
        pids["m"] = frozenset({200})

        def dead_stub():
            threading.Event().wait()
            yield FakeResponse([5])
        return dead_stub()

    backend = TritonBackend(fake_pb(FakeEngine(script)), identity=lambda m: pids[m])
    backend.watch.check_after_s = 0.2
    with pytest.raises(ServingError) as e:
        asyncio.run(_drain(backend))
    assert e.value.kind == "unavailable" and "restarting" in e.value.message


def test_a_request_to_an_engine_being_reloaded_is_refused_before_it_is_sent():
    """While the launcher reloads the engine, Triton says it is not ready: refused at once, unavailable."""
    engine = FakeEngine(lambda request: iter([FakeResponse([5])]))
    engine.ready = False
    backend = TritonBackend(fake_pb(engine))
    with pytest.raises(ServingError) as e:
        asyncio.run(_drain(backend))
    assert e.value.kind == "unavailable" and e.value.retry_after and not engine.requests
    engine.ready = True
    assert asyncio.run(_drain(backend)) == [[5]]


@pytest.mark.timeout(30)
def test_an_empty_end_while_the_engine_is_not_ready_is_no_success_though_the_stop_probe_answers():
    """Measured on Triton 2.51 during a reload: of several requests failing "not ready" at once, some end
    with no response at all (their error responses share one id in the stub), the probe's `stop` too.
    The probe asks Triton's readiness first, so such an end is no success."""
    engine = FakeEngine(lambda request: iter(()))  # every stream, the probe's included, ends empty

    def script(request):
        engine.ready = False  # the launcher began reloading the engine after this request was admitted
        return iter(())
    engine.script = script
    backend = TritonBackend(fake_pb(engine), identity=lambda m: frozenset({100}))
    with pytest.raises(ServingError) as e:
        asyncio.run(_drain(backend))
    assert e.value.kind == "unavailable" and "not ready" in e.value.message


def test_a_live_engine_that_ends_without_output_is_a_success():
    def script(request):
        return iter(())

    backend = TritonBackend(fake_pb(FakeEngine(script)))
    assert asyncio.run(_drain(backend)) == []


@pytest.mark.timeout(30)
def test_a_stop_to_a_dead_engine_is_given_up_within_its_bound():
    def script(request):
        threading.Event().wait()
        yield FakeResponse()

    backend = TritonBackend(fake_pb(FakeEngine(script)))
    backend.STOP_TIMEOUT_S = 0.2
    t0 = time.monotonic()
    asyncio.run(backend.engine_stop("m", _req()))
    assert time.monotonic() - t0 < 1.0


def test_stub_processes_are_read_from_proc(tmp_path):
    repo = tmp_path / "repo"
    proc = tmp_path / "proc"
    stub = b"/opt/tritonserver/backends/python/triton_python_backend_stub"

    def add(pid, ppid, argv):
        d = proc / str(pid)
        d.mkdir(parents=True)
        (d / "stat").write_bytes(f"{pid} (triton_python_) S {ppid} 1 1".encode())
        (d / "cmdline").write_bytes(b"\0".join(argv) + b"\0")
    add(11, 7, [stub, str(repo / "tensorrt_llm" / "1" / "model.py").encode(), b"shm"])
    add(12, 7, [stub, str(repo / "gateway" / "1" / "model.py").encode(), b"shm"])
    add(13, 8, [stub, str(repo / "tensorrt_llm" / "1" / "model.py").encode(), b"shm"])  # another server's
    add(14, 7, [b"/usr/bin/python", str(repo / "tensorrt_llm" / "1" / "model.py").encode()])
    (proc / "self").mkdir()
    clock, rescans = [0.0], []
    pids = StubProcesses(str(repo), parent_pid=7, proc=str(proc), clock=lambda: clock[0], background=rescans.append)
    scans = []
    scan = pids._scan
    pids._scan = lambda: scans.append(clock[0]) or scan()
    assert pids("tensorrt_llm") == {11} and pids("gateway") == {12} and pids("absent") == frozenset()
    assert scans == [0.0]  # one scan serves every model for ttl_s
    os.rename(proc / "11", proc / "21")  # the stub died and a new one started
    assert pids("tensorrt_llm") == {11}  # cached for ttl_s
    clock[0] = 1.0
    assert pids("tensorrt_llm") == {21}  # its stub is gone: scanned at once, not in the background
    assert scans == [0.0, 1.0] and rescans == []
    # past ttl_s with the model's stubs alive: the cache serves, and every rescan_s a scan goes to the
    # background (off the gateway's event loop); what it finds (a stub started beside the first) serves the
    # next call
    add(22, 7, [stub, str(repo / "tensorrt_llm" / "1" / "model.py").encode(), b"shm"])
    clock[0] = 2.0
    assert pids("tensorrt_llm") == {21} and scans == [0.0, 1.0] and rescans == []  # its stubs read, no rescan
    clock[0] = 6.5
    assert pids("tensorrt_llm") == {21} and scans == [0.0, 1.0] and len(rescans) == 1
    clock[0] = 7.0
    assert pids("gateway") == {12} and len(rescans) == 1  # one rescan at a time
    rescans.pop()()
    assert scans == [0.0, 1.0, 7.0] and pids("tensorrt_llm") == {21, 22}
    clock[0] = 8.0
    assert pids("absent") == frozenset() and rescans == []  # never had a stub (a C++ backend): every rescan_s
    clock[0] = 12.5
    assert pids("absent") == frozenset() and len(rescans) == 1
    rescans.pop()()
    # its stubs all gone (a restart): scanned at once, then rescanned every ttl_s until the new one is found
    shutil.rmtree(proc / "21")
    shutil.rmtree(proc / "22")
    clock[0] = 13.0
    assert pids("tensorrt_llm") == frozenset() and scans[-1] == 13.0 and rescans == []
    add(31, 7, [stub, str(repo / "tensorrt_llm" / "1" / "model.py").encode(), b"shm"])
    clock[0] = 13.3
    assert pids("tensorrt_llm") == frozenset() and len(rescans) == 1
    rescans.pop()()
    assert pids("tensorrt_llm") == {31}
    assert StubProcesses(str(repo), parent_pid=7, proc=str(tmp_path / "none"))("tensorrt_llm") is None


def test_stub_processes_rescan_off_the_callers_thread(tmp_path):
    """The default background is a thread of its own: the caller (the gateway's event loop) never scans
    while the model's stubs live."""
    repo, proc = tmp_path / "repo", tmp_path / "proc"
    d = proc / "11"
    d.mkdir(parents=True)
    (d / "stat").write_bytes(b"11 (triton_python_) S 7 1 1")
    (d / "cmdline").write_bytes(b"triton_python_backend_stub\0" + str(repo / "m" / "1" / "model.py").encode() + b"\0")
    clock, threads = [0.0], []
    pids = StubProcesses(str(repo), parent_pid=7, proc=str(proc), clock=lambda: clock[0], rescan_s=0.5)
    scan = pids._scan
    pids._scan = lambda: threads.append(threading.current_thread().name) or scan()
    assert pids("m") == {11} and threads == ["MainThread"]  # nothing cached yet: at once
    clock[0] = 1.0
    assert pids("m") == {11}
    assert wait_until(lambda: [t[:10] for t in threads[1:]] == ["stub-scan_"] and not pids._rescanning, 5)


def test_the_gateway_settles_everything_when_the_engine_fails_mid_stream():
    class Failing(FakeBackend):
        async def engine_stream(self, model, req, prep, tenant):
            yield EngineStep([ord("a")])
            raise ServingError("unavailable", "engine model 'big' is not responding", retry_after=5.0)

    gw, reg = make_gateway(Failing())
    with pytest.raises(ServingError) as e:
        asyncio.run(collect(gw, GatewayRequest("k-acme", 20, text="hello", stream=True, model="big")))
    assert e.value.kind == "unavailable"
    assert gw.limiter.inflight["acme"] == 0 and gw.limiter.reserved["acme"] == 0
    assert gw.admission.slots("big").inflight == 0
    assert reg.value("gateway_inflight_requests", model="big") == 0
    assert reg.value("gateway_reserved_tokens", tenant="acme") == 0
    assert reg.value("gateway_requests_total", tenant="acme", model="big", outcome="error") == 1


# -- impossible requests are refused before anything is reserved --------------------------------------

RENDERED = '''
name: "tensorrt_llm"
parameters { key: "max_tokens_in_paged_kv_cache" value: { string_value: "2050" } }
parameters { key: "tokens_per_block" value: { string_value: "32" } }
parameters { key: "max_seq_len" value: { string_value: "8192" } }
parameters { key: "max_num_tokens" value: { string_value: "512" } }
'''


def test_engine_limits_come_from_the_rendered_engine_config(tmp_path):
    assert limits_from_parameters(config_parameters(RENDERED)) == EngineLimits(8192, 2048, tokens_per_block=32)  # whole blocks
    (tmp_path / "tensorrt_llm").mkdir()
    (tmp_path / "tensorrt_llm" / "config.pbtxt").write_text(RENDERED)
    limits = RepositoryEngineLimits(tmp_path)
    assert limits("tensorrt_llm").limit() == (2048, "KV cache capacity")
    assert limits("not_there").limit() is None
    engine = tmp_path / "engine"  # a TensorRT-LLM engine: max_seq_len from its build config
    engine.mkdir()
    (engine / "config.json").write_text('{"build_config": {"max_seq_len": 4096}}')
    assert limits_from_parameters({"gpt_model_path": str(engine), "max_tokens_in_paged_kv_cache": ""}) \
        == EngineLimits(4096, None)


def test_an_impossible_request_is_refused_before_reserving_tokens_or_a_slot():
    def limits(model):
        return EngineLimits(max_seq_len=8192, kv_cache_tokens=32 if model == "big" else 16)

    gw, reg = make_gateway()
    gw.engine_limits = limits
    calls = []
    acquire = gw.limiter.acquire

    async def spy(*a, **kw):
        calls.append(a)
        return await acquire(*a, **kw)
    gw.limiter.acquire = spy
    with pytest.raises(ServingError) as e:
        asyncio.run(collect(gw, GatewayRequest("k-acme", 40, text="hello", model="big")))
    err = e.value
    assert err.kind == "context_too_long" and err.field == "max_tokens"
    assert "45" in err.message and "32" in err.message and "max_tokens <= 27" in err.message
    assert calls == [] and gw.admission.slots("big").inflight == 0
    assert reg.value("gateway_rejections_total", tenant="acme", reason="context_too_long") == 1
    chunks = asyncio.run(collect(gw, GatewayRequest("k-acme", 20, text="hello", model="big")))
    assert chunks[-1].num_output_tokens == 20 and len(calls) == 1


def test_a_degraded_pick_too_small_for_the_request_falls_back_to_the_target():
    """A degradable tenant meets a saturated `big`: `small` would be picked, but its engine could never
    hold the request, so it waits for `big` instead of being refused."""
    from gateway.tenants import hash_key, parse_config
    from tests.gateway.test_gateway_lib import config_dict

    raw = config_dict()
    raw["tenants"]["std"] = {"tier": "standard", "api_key_sha256": [hash_key("k-std")]}
    gw, _ = make_gateway()
    cfg = parse_config(raw)
    gw.config = lambda: cfg
    gw.engine_limits = lambda m: EngineLimits(kv_cache_tokens=4096 if m == "big" else 16)
    big = gw.admission.slots("big")

    async def go():
        for _ in range(big.max_inflight):
            await big.acquire("someone", 0)
        asyncio.get_running_loop().call_later(0.1, big.release)
        short = await collect(gw, GatewayRequest("k-std", 4, text="hi", model="big"))  # fits small: degraded
        asyncio.get_running_loop().call_later(0.1, big.release)
        long = await collect(gw, GatewayRequest("k-std", 30, text="hi", model="big"))
        return short[-1].model_used, long[-1].model_used
    assert asyncio.run(go()) == ("small", "big")


# -- inputs that are not UTF-8 ---------------------------------------------------------------------

def _arrays(**values):
    return {k: np.array([[v] if not isinstance(v, list) else v], dtype=object) for k, v in values.items()}


@pytest.mark.parametrize("field", ["stop_words", "bad_words", "model", "adapter", "operation"])
def test_invalid_utf8_in_a_string_input_is_a_400_naming_it(field):
    arrays = _arrays(text_input=b"hi", max_tokens=4, **{field: [b"ok", b"\xff\xfe bad"] if field.endswith("words")
                                                       else b"\xc3\x28"})
    with pytest.raises(ServingError) as e:
        parse_gateway_request(arrays, {"api_key": "k"})
    assert e.value.kind == "invalid_argument" and e.value.field == field and "UTF-8" in e.value.message


def test_gateway_request_parsing():
    arrays = _arrays(text_input=b"hi", max_tokens=np.int32(4), stream=True, temperature=np.float32(0.5),
                     stop_words=[b"\xc3\xa9t\xc3\xa9", b"end"], model=b"auto", adapter=b"", operation=b"tokenize")
    req, op = parse_gateway_request(arrays, {"authorization": "Bearer k1"})
    assert (req.api_key, req.max_tokens, req.stream, req.model, req.adapter, op) == ("k1", 4, True, "auto", None, "tokenize")
    assert req.stop_words == ["été", "end"] and req.bad_words is None and req.sampling.temperature == 0.5
    with pytest.raises(ServingError) as e:
        parse_gateway_request(_arrays(operation=b"drop_tables"), {})
    assert e.value.field == "operation"


def test_the_gateway_passes_openai_ranges_on_and_checks_what_its_own_work_needs():
    """Temperature 3 and a bias of 150 are outside OpenAI's ranges (the front's to refuse) but inside the
    engine's contract; n = 0 would reserve no output tokens, and n past the engine's bound would be refused
    by the token bucket naming max_tokens."""
    req, _ = parse_gateway_request(_arrays(text_input=b"hi", max_tokens=4, temperature=np.float32(3.0),
                                           logit_bias=b'{"5": 150}'), {})
    assert req.sampling.temperature == 3.0 and req.outputs.logit_bias == {5: 150.0}
    for n in (0, 2**31 - 1):
        with pytest.raises(ServingError) as e:
            parse_gateway_request(_arrays(text_input=b"hi", max_tokens=4, num_return_sequences=n), {})
        assert e.value.field == "num_return_sequences"
