"""The gateway against real tritonservers when things go wrong (issue 18): a full KV cache, invalid
UTF-8, a Redis that stalls, and an engine stub killed with SIGKILL mid-stream."""
import os
import signal
import threading
import time

import psutil
import pytest
import redis

from clients import BadRequestError, ContextTooLongError, LLMClient, LLMError
from tests.support.redis import RedisServer
from tests.support.server import TritonServer, metric_value
from tests.support.tenants import Tenant, write_tenants

pytestmark = pytest.mark.integration

TENANTS = [
    # the whole KV cache for one tenant: these tests fill it on purpose
    Tenant("acme", limits={"max_concurrent": 64, "requests_per_minute": 10_000, "tokens_per_minute": 10_000_000,
                           "kv_share_percent": 100}),
    Tenant("globex", tier="standard"),
    Tenant("solo", tier="free", limits={"max_concurrent": 1, "requests_per_minute": 1000}),
]
KV_TOKENS = 2048


def _start(tmp_path, **overrides):
    cfg = tmp_path / "gw.yaml"
    write_tenants(cfg, TENANTS)
    return TritonServer(overrides={"gateway_config": str(cfg), **overrides}).start()


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The CPU engine with a 2,048-token KV cache (finding 10's set-up)."""
    # streams that wait for the cache wait in the gateway now (its admission counts KV), as long as they need
    s = _start(tmp_path_factory.mktemp("small"), max_tokens_in_paged_kv_cache=str(KV_TOKENS),
               gateway_max_queue_wait_s="300")
    yield s
    s.stop()


def _first_piece(client, prompt):
    t0 = time.monotonic()
    for _ in client.stream(prompt, max_tokens=8, temperature=0.0, cancel_after=1):
        break
    return time.monotonic() - t0


def _gauges_settle(server, timeout=10.0):
    """gateway_reserved_tokens (all tenants) and gateway_inflight_requests once both are 0, else last."""
    deadline = time.monotonic() + timeout
    while True:
        text = server.metrics()
        got = (metric_value(text, "gateway_reserved_tokens") or 0, metric_value(text, "gateway_inflight_requests") or 0)
        if got == (0, 0) or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


@pytest.mark.parametrize("field", ["model", "adapter"])
def test_invalid_utf8_is_a_400_naming_the_field(small, field):
    with pytest.raises(BadRequestError) as e:
        LLMClient(small.grpc_url, api_key="k-acme").generate("Hi", max_tokens=2, **{field: b"\xc3\x28"})
    assert e.value.field == field and "UTF-8" in str(e.value)


def test_a_full_cache_neither_delays_refusals_nor_first_tokens_behind_the_ensemble(small):
    """12 long streams fill the 2,048-token cache (some run, the others wait: in the gateway, whose
    admission counts KV, never in the engine's queue). Then, at the same moment: an impossible request
    is refused by the gateway at once, naming max_tokens (it used to take 10-20 s: it went through
    admission to the engine), and another tenant's short request gets its first token about as soon
    through the gateway as through the ensemble (it used to wait 10-20 s longer, behind the stub's
    executor threads that the queued streams held)."""
    gw = LLMClient(small.grpc_url, api_key="k-acme", timeout_s=300)
    other = LLMClient(small.grpc_url, api_key="k-globex", timeout_s=300)
    ens = LLMClient(small.grpc_url, model="ensemble", timeout_s=300)
    _first_piece(gw, "Hello")
    done, errors = [], []

    def long_stream(i):
        try:
            done.append(gw.generate(f"Stream {i}: count from one to a thousand:", max_tokens=256, min_tokens=256,
                                    temperature=0.0).num_output_tokens)
        except LLMError as e:
            errors.append(e)
    streams = [threading.Thread(target=long_stream, args=(i,)) for i in range(12)]
    for t in streams:
        t.start()
    deadline = time.monotonic() + 60
    while (metric_value(small.metrics(), "gateway_admission_queue_depth") or 0) < 1:
        assert time.monotonic() < deadline, "the cache never filled"
        time.sleep(0.05)
    # what the gateway let through fits in the engine: its queue empties (as soon as the engine has taken
    # in the arrivals of one step) while the rest still wait in the gateway
    while True:
        text = small.metrics()
        if (metric_value(text, "nv_trt_llm_request_metrics", request_type="waiting") or 0) == 0:
            break
        assert time.monotonic() < deadline, "the engine's queue never emptied"
        time.sleep(0.05)
    assert (metric_value(text, "gateway_admission_queue_depth") or 0) >= 1
    assert (metric_value(text, "gateway_kv_held_tokens") or 0) > KV_TOKENS * 0.8
    results = {}

    def refuse():
        t0 = time.monotonic()
        try:
            gw.generate("Too long " * 20, max_tokens=KV_TOKENS)
        except LLMError as e:
            results["refusal"] = (e, time.monotonic() - t0)

    probes = [threading.Thread(target=refuse),
              threading.Thread(target=lambda: results.__setitem__("gateway", _first_piece(other, "Say hi"))),
              threading.Thread(target=lambda: results.__setitem__("ensemble", _first_piece(ens, "Say hi")))]
    for t in probes:
        t.start()
    for t in probes + streams:
        t.join()
    err, refusal_s = results["refusal"]
    assert isinstance(err, ContextTooLongError) and err.field == "max_tokens", err
    assert str(KV_TOKENS) in str(err) and refusal_s < 1.0, (refusal_s, err)
    assert results["gateway"] <= 1.5 * results["ensemble"] + 2.0, results
    assert errors == [] and done == [256] * 12
    assert _gauges_settle(small) == (0, 0)


def _engine_stub(server):
    for p in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            cmd = p.cmdline()
        except psutil.Error:
            continue
        if cmd and cmd[0].endswith("triton_python_backend_stub") and any("/tensorrt_llm/1/model.py" in c for c in cmd):
            return p
    raise AssertionError("no tensorrt_llm stub found")


def test_a_killed_engine_ends_every_stream_with_an_error_and_settles(small):
    """kill -9 of the engine's stub during 6 gateway streams: every client gets an error (never a success
    with empty text) within a few seconds, and no reservation or engine slot stays held. It used to be
    60+ s of silence per stream and 1,248 tokens reserved for good."""
    gw = LLMClient(small.grpc_url, api_key="k-acme", timeout_s=60)
    started, outcomes, lock = threading.Barrier(7), {}, threading.Lock()

    def run(i):
        pieces = 0
        try:
            # 6 x ~210 tokens fit the 2,048-token cache at once: every stream runs when the stub dies
            for _ in gw.stream(f"Story {i}: once upon a time", max_tokens=200, min_tokens=200, temperature=0.0):
                pieces += 1
                if pieces == 1:
                    started.wait(60)
            outcome = ("success", time.monotonic())
        except LLMError as e:
            outcome = (e, time.monotonic())
        with lock:
            outcomes[i] = outcome
    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    started.wait(120)  # every stream has a first piece
    stub = _engine_stub(small)
    killed_at = time.monotonic()
    stub.send_signal(signal.SIGKILL)
    with lock:
        assert not outcomes, "a stream ended before the engine died: the test proves nothing"
    for t in threads:
        t.join(30)
    assert len(outcomes) == 6, f"{6 - len(outcomes)} streams still hang"
    for i, (outcome, at) in outcomes.items():
        assert isinstance(outcome, LLMError), f"stream {i} ended with {outcome} after its engine died"
        assert outcome.kind == "unavailable" and outcome.retry_after, outcome
        assert at - killed_at < 3.0, (i, at - killed_at)
    assert _gauges_settle(small) == (0, 0)
    # the launcher reloads the engine; the gateway serves again without a restart of its own
    deadline = time.monotonic() + 120
    while True:
        try:
            assert gw.generate("Hi", max_tokens=2, temperature=0.0).num_output_tokens >= 1
            break
        except LLMError as e:
            assert e.kind == "unavailable" and time.monotonic() < deadline, e
            time.sleep(1)


def test_a_redis_stall_leaves_no_slot_held(tmp_path):
    """Redis stopped for 2.5 s while a concurrency-1 tenant's requests run (fail_open: they are served
    without limits); once it resumes, nothing is left in its in-flight set and its next request is
    admitted. It used to be refused ("1 concurrent requests already running") for an hour."""
    with RedisServer() as r:
        s = _start(tmp_path, gateway_redis_url=r.url + "?timeout=0.3", gateway_fail_policy="fail_open")
        try:
            solo = LLMClient(s.grpc_url, api_key="k-solo", timeout_s=60)
            assert solo.generate("Hi", max_tokens=2, temperature=0.0).num_output_tokens >= 1
            os.kill(r.proc.pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                for _ in range(3):
                    assert solo.generate("Hi", max_tokens=2, temperature=0.0).num_output_tokens >= 1
                served_s = time.monotonic() - t0
                time.sleep(max(0.0, 2.5 - served_s))
                assert metric_value(s.metrics(), "gateway_ratelimit_backend_up") == 0
                # what the LLMGatewayFailOpen alert reads: no limits are enforced right now
                assert metric_value(s.metrics(), "gateway_ratelimit_fail_open_active") == 1
            finally:
                os.kill(r.proc.pid, signal.SIGCONT)
            leases = redis.Redis.from_url(r.url)
            deadline = time.monotonic() + 10
            while leases.zcard("llmgw:{solo}:leases") and time.monotonic() < deadline:
                time.sleep(0.1)
            assert leases.zcard("llmgw:{solo}:leases") == 0
            # the gauge is the last store call's result: a call begun in the stall may still fail after the
            # resume, so each request after it must bring the gauge back up (within a few)
            for _ in range(10):
                assert solo.generate("Hi", max_tokens=2, temperature=0.0).num_output_tokens >= 1
                if metric_value(s.metrics(), "gateway_ratelimit_backend_up") == 1:
                    break
                time.sleep(0.3)
            assert metric_value(s.metrics(), "gateway_ratelimit_backend_up") == 1
            assert metric_value(s.metrics(), "gateway_ratelimit_fail_open_active") == 0
        finally:
            s.stop()

