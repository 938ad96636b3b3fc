"""The gateway against real tritonservers (and a real Redis), through the clients/ library."""
import json
import queue
import threading
import time
import urllib.error
import urllib.request

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from clients import (AuthenticationError, ContextTooLongError, LLMClient, OverloadedError, PermissionDeniedError,
                     RateLimitError)
from contracts.tensors import GATEWAY
from tests.support.engine_stream import contract_inputs, gateway_operation
from tests.support.nginx import Nginx
from tests.support.redis import RedisServer
from tests.support.server import TritonServer, metric_value
from tests.support.wait import wait_until
from tests.support.tenants import Tenant, write_tenants

pytestmark = pytest.mark.integration

TENANTS = [
    Tenant("acme", price_in_per_1k=1.0, price_out_per_1k=2.0),
    Tenant("other", tier="standard"),
    Tenant("tiny", tier="standard", limits={"tokens_per_minute": 60, "max_context_tokens": 64}),
    Tenant("crowd", tier="standard",
           limits={"tokens_per_minute": 120, "max_concurrent": 64, "requests_per_minute": 1000}),
    Tenant("nomodel", tier="standard", allowed_models=()),
    Tenant("solo", tier="free", limits={"max_concurrent": 1}),
    Tenant("low1", tier="batch", limits={"max_concurrent": 20, "requests_per_minute": 1000}),
    Tenant("low2", tier="batch"),
    Tenant("vip"),
]


def start(tmp_path, name, **overrides):
    cfg = tmp_path / f"{name}.yaml"
    write_tenants(cfg, TENANTS)
    return TritonServer(overrides={"gateway_config": str(cfg), **overrides}).start()


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    s = start(tmp_path_factory.mktemp("gw"), "gw", gateway_max_inflight="2")
    yield s
    s.stop()


def client(server, key, **kw):
    return LLMClient(server.grpc_url, api_key=key, **kw)


def engine_requests(server) -> float:
    return metric_value(server.metrics(), "nv_inference_count", model="tensorrt_llm") or 0.0


def test_rejections_happen_before_any_engine_work(gw):
    before = engine_requests(gw)
    with pytest.raises(AuthenticationError):
        client(gw, "k-wrong").generate("hi", max_tokens=4)
    with pytest.raises(AuthenticationError):
        client(gw, None).generate("hi", max_tokens=4)
    with pytest.raises(PermissionDeniedError) as e:
        client(gw, "k-nomodel").generate("hi", max_tokens=4, model="tensorrt_llm")
    assert e.value.field == "model"
    with pytest.raises(ContextTooLongError):
        client(gw, "k-tiny").generate("word " * 80, max_tokens=4)
    assert engine_requests(gw) == before


def test_rate_limit_retry_after_and_other_tenants_unaffected(gw):
    tiny, other = client(gw, "k-tiny"), client(gw, "k-other")
    rejected = None
    for _ in range(8):
        try:
            tiny.generate("Hello there", max_tokens=8, min_tokens=8, temperature=0.0)
        except RateLimitError as e:
            rejected = e
            break
        assert other.generate("Hello there", max_tokens=4, temperature=0.0).text
    assert rejected is not None and rejected.retry_after > 0
    assert other.generate("Still fine?", max_tokens=4, temperature=0.0).text
    time.sleep(rejected.retry_after + 0.2)
    assert tiny.generate("Hello there", max_tokens=8, min_tokens=8, temperature=0.0).num_output_tokens == 8


def _concurrently(one, n):
    """Run `one()` in n threads at once; returns (sum of what admitted calls returned, seconds)."""
    admitted, lock = [], threading.Lock()

    def run():
        got = one()
        if got is not None:
            with lock:
                admitted.append(got)
    threads = [threading.Thread(target=run) for _ in range(n)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(admitted), time.monotonic() - t0


def _crowd(server, n=64):
    """n concurrent gRPC clients of tenant crowd; tokens admitted (prompt + max_tokens each)."""
    def one():
        try:
            r = client(server, "k-crowd").generate("Hi", max_tokens=1, temperature=0.0)
            return r.num_input_tokens + 1
        except (RateLimitError, OverloadedError):  # refused by the bucket, or by a full admission queue
            return None
    return _concurrently(one, n)


def test_64_concurrent_clients_never_exceed_the_tokens_limit(gw):
    admitted, elapsed = _crowd(gw)
    assert 0 < admitted <= 120 + elapsed * 2 + 2  # the bucket plus its refill (2 tokens/s) during the run


def test_disconnect_refunds_frees_slot_and_kv_blocks(gw):
    solo = client(gw, "k-solo")
    pieces = list(solo.stream("Once upon a time, in a village by the sea,", max_tokens=200, cancel_after=3, min_tokens=200,
                              temperature=0.0))
    assert len(pieces) == 3
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = gw.metrics()
        used = metric_value(text, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="used")
        reserved = metric_value(text, "gateway_reserved_tokens", tenant="solo")
        if used == 0 and reserved == 0:
            break
        time.sleep(0.2)
    assert used == 0 and reserved == 0
    cancelled = lambda: metric_value(gw.metrics(), "gateway_requests_total", tenant="solo", outcome="cancelled")  # noqa: E731
    wait_until(lambda: cancelled() == 1, 5)  # the gateway applies its metrics every 50 ms
    assert cancelled() == 1
    # the single concurrency slot is free again
    assert solo.generate("Hi", max_tokens=2, temperature=0.0).text


def _gateway_stream(server, key: str, stream_id: str, responses: queue.Queue):
    """A Triton-native generate stream on the gateway model, named stream_id; its responses into `responses`."""
    c = grpcclient.InferenceServerClient(server.grpc_url)
    c.start_stream(callback=lambda result, error: responses.put((result, error)),
                   headers={"authorization": f"Bearer {key}"})
    inputs = contract_inputs(GATEWAY, {"text_input": "Once upon a time, in a village by the sea,", "max_tokens": 400,
                                       "stream": True, "ignore_eos": True})
    c.async_stream_infer("gateway", inputs, parameters={"stream_id": stream_id, "triton_enable_empty_final_response": True})
    return c


def _stop(server, key: str, stream_id: str) -> dict:
    """The gateway's `stop` operation for stream_id, with `key`: its JSON answer; raises its error."""
    result = gateway_operation(server.grpc_url, "stop", key, {"stream_id": stream_id})
    return json.loads(result.as_numpy("text_output").reshape(-1)[0])


def test_a_stream_is_stopped_by_its_own_key_only_and_ends_cancelled(gw):
    responses: queue.Queue = queue.Queue()
    before = metric_value(gw.metrics(), "gateway_requests_total", tenant="vip", model="tensorrt_llm",
                          outcome="cancelled") or 0
    c = _gateway_stream(gw, "k-vip", "s-1", responses)
    try:
        result, error = responses.get(timeout=60)  # generating
        assert error is None
        assert _stop(gw, "k-other", "s-1") == {"stopped": False}  # another tenant's key: not its stream
        assert _stop(gw, "k-vip", "s-other") == {"stopped": False}
        time.sleep(0.5)
        assert responses.qsize() > 0  # still streaming
        assert _stop(gw, "k-vip", "s-1") == {"stopped": True}
        final = None
        while final is None:
            result, error = responses.get(timeout=30)
            assert error is None
            if result.get_response().parameters["triton_final_response"].bool_param:
                final = result
    finally:
        c.stop_stream()
        c.close()
    assert wait_until(lambda: (metric_value(gw.metrics(), "gateway_requests_total", tenant="vip", model="tensorrt_llm",
                                            outcome="cancelled") or 0) == before + 1, 5)
    assert _stop(gw, "k-vip", "s-1") == {"stopped": False}  # ended: forgotten
    with pytest.raises(InferenceServerException, match="(?i)unauthenticated|api key"):
        _stop(gw, "k-wrong", "s-1")


def test_higher_tier_first_and_fair_within_a_tier(gw):
    finished, lock = [], threading.Lock()

    def wait_queued(n):  # the gateway's own gauge: how many requests wait for a slot right now
        deadline = time.monotonic() + 60
        while (metric_value(gw.metrics(), "gateway_admission_queue_depth", model="tensorrt_llm") or 0) < n:
            assert time.monotonic() < deadline, f"{n} requests never queued"
            time.sleep(0.05)

    def run(key, tag):
        client(gw, key).generate("Count slowly: one, two,", max_tokens=4, min_tokens=4, temperature=0.0)
        with lock:
            finished.append(tag)

    # both gateway slots held by streams that have produced a piece: provably busy on any machine
    hogs = [client(gw, "k-low1").stream("Count: one, two,", max_tokens=400, min_tokens=400) for _ in range(2)]
    for hog in hogs:
        next(hog)
    waiting = [threading.Thread(target=run, args=("k-low1", "low1")) for _ in range(10)]
    for t in waiting:
        t.start()
    wait_queued(10)
    rest = [threading.Thread(target=run, args=("k-low2", "low2")), threading.Thread(target=run, args=("k-vip", "vip"))]
    for t in rest:
        t.start()
    wait_queued(12)
    for hog in hogs:
        hog.close()  # the client cancels; the gateway frees both slots
    for t in waiting + rest:
        t.join()
    assert finished.index("vip") <= 1, finished  # the enterprise request jumps the batch-tier queue
    assert finished.index("low2") <= 4, finished  # 1 request vs 10 queued earlier: not last


def test_token_counters_equal_tokens_received(gw):
    acme = client(gw, "k-acme")
    results = [acme.generate(p, max_tokens=6, temperature=0.0) for p in ("One", "Two words", "Three more words")]
    n_out, n_in = sum(r.num_output_tokens for r in results), sum(r.num_input_tokens for r in results)
    counted = lambda: (metric_value(gw.metrics(), "gateway_output_tokens_total", tenant="acme"),  # noqa: E731
                       metric_value(gw.metrics(), "gateway_input_tokens_total", tenant="acme"))
    wait_until(lambda: counted() == (n_out, n_in), 5)  # the gateway applies its metrics every 50 ms
    assert counted() == (n_out, n_in)
    assert results[0].model_used == "tensorrt_llm" and results[0].finish_reason in ("length", "stop")


def _crowd_http(url, n=64):
    """n concurrent HTTP /generate requests of tenant crowd through `url` (the load balancer)."""
    def one():
        body = json.dumps({"api_key": "k-crowd", "text_input": "Hi", "max_tokens": 1, "temperature": 0.0}).encode()
        req = urllib.request.Request(f"http://{url}/v2/models/gateway/generate", data=body, method="POST")
        try:
            out = json.loads(urllib.request.urlopen(req, timeout=120).read())
            return out["num_input_tokens"] + 1
        except urllib.error.HTTPError as e:
            assert "kind=rate_limited" in e.read().decode()
            return None
    return _concurrently(one, n)


def test_redis_shared_budget_across_two_servers_behind_nginx_and_fail_open(tmp_path):
    with RedisServer() as redis_server:
        a = start(tmp_path, "a", gateway_redis_url=redis_server.url, gateway_fail_policy="fail_open")
        try:
            b = start(tmp_path, "b", gateway_redis_url=redis_server.url, gateway_fail_policy="fail_open")
            try:
                with Nginx([a.http_url, b.http_url]) as lb:  # round robin: the tenant hits both replicas
                    admitted, elapsed = _crowd_http(lb.url)
                served = [metric_value(s.metrics(), "gateway_requests_total", tenant="crowd") or 0 for s in (a, b)]
                assert all(n > 0 for n in served), served  # both gateways admitted some
                assert 0 < admitted <= 120 + elapsed * 2 + 2
                redis_server.stop()  # the shared store goes away mid-test
                r = client(a, "k-other").generate("Still serving?", max_tokens=3, temperature=0.0)
                assert r.num_output_tokens >= 1
                assert metric_value(a.metrics(), "gateway_ratelimit_backend_up") == 0
            finally:
                b.stop()
        finally:
            a.stop()


ROUTED = [
    Tenant("acme"),
    Tenant("std", tier="standard"),
    Tenant("hobby", tier="free"),
]


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    """Two engine models from the same checkpoint, the second with smaller limits: an honest CPU
    stand-in for a smaller model (same weights, so not cheaper; docs/gateway.md says so)."""
    cfg = tmp_path_factory.mktemp("routed") / "gw.yaml"
    write_tenants(cfg, ROUTED, models={"tensorrt_llm": 8192, "tensorrt_llm_small": 1024},
                  degrade_to={"tensorrt_llm": "tensorrt_llm_small"}, auto_long_prompt_tokens=64)
    s = TritonServer(overrides={"gateway_config": str(cfg), "gateway_max_inflight": "1"},
                     extra_engines={"tensorrt_llm_small": {"max_seq_len": "1024", "max_num_tokens": "128",
                                                           "max_tokens_in_paged_kv_cache": "4096"}}).start()
    yield s
    s.stop()


def test_auto_routing_by_prompt_length_and_tier(routed):
    short, long_prompt = "Hello there", "word " * 80
    assert client(routed, "k-acme").generate(short, max_tokens=2, model="auto").model_used == "tensorrt_llm"
    assert client(routed, "k-hobby").generate(short, max_tokens=2, model="auto").model_used == "tensorrt_llm_small"
    assert client(routed, "k-hobby").generate(long_prompt, max_tokens=2, model="auto").model_used == "tensorrt_llm"


def test_saturated_target_degrades_tiers_that_allow_it(routed):
    def settled(tenant):
        return metric_value(routed.metrics(), "gateway_requests_total", tenant=tenant) or 0

    before = settled("acme")
    busy = client(routed, "k-acme").stream("Count: one, two,", max_tokens=400, min_tokens=400, model="tensorrt_llm")
    next(busy)  # a first piece: the big engine's only gateway slot is held, whatever the machine's speed
    try:
        r = client(routed, "k-std").generate("Hi", max_tokens=2, model="tensorrt_llm")
        assert r.model_used == "tensorrt_llm_small"
    finally:
        busy.close()  # the client cancels; the gateway stops the engine work and frees the slot
    deadline = time.monotonic() + 30
    while settled("acme") == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert settled("acme") == before + 1
    assert client(routed, "k-std").generate("Hi", max_tokens=2, model="tensorrt_llm").model_used == "tensorrt_llm"
