"""Gateway library without Triton: config validation and reload, buckets (memory and a real Redis),
admission fairness, routing, and the request flow with a fake backend."""
import asyncio
import json
import os
import time

import numpy as np
import pytest
import yaml

from contracts.generation import EngineStep
from gateway.admission import Admission, EngineSlots, Stopped
from text.detokenize import Detokenizer
from contracts.errors import ServingError
from contracts.api_keys import api_key_from
from gateway.core import Gateway, GatewayRequest
from gateway.edges import Preprocessed
from gateway.metrics import GatewayMetrics, MemoryRegistry
from gateway.ratelimit import MemoryLimiter, RedisLimiter
from gateway.routing import route
from gateway.tenants import ConfigError, ConfigWatcher, hash_key, load_config, parse_config
from tests.support.clock import Clock

LIMITS = {"requests_per_minute": 1000, "tokens_per_minute": 600, "max_concurrent": 100,
          "max_context_tokens": 4096, "max_output_tokens": 512}


def config_dict(**tenant_overrides):
    return {
        "routing": {"default_model": "big", "models": {"big": {"max_context_tokens": 4096},
                                                        "small": {"max_context_tokens": 1024}},
                    "degrade_to": {"big": "small"}, "auto_long_prompt_tokens": 100},
        "tenants": {
            "acme": {"tier": "enterprise", "api_key_sha256": [hash_key("k-acme")],
                     "price_per_1k_input_tokens": 1.0, "price_per_1k_output_tokens": 2.0},
            "free1": {"tier": "free", "api_key_sha256": hash_key("k-free"), "allowed_models": ["small"],
                      **tenant_overrides},
        },
    }


def test_config_validation_names_the_bad_field():
    cfg = parse_config(config_dict())
    assert cfg.authenticate("k-acme").name == "acme" and cfg.authenticate("wrong") is None
    assert cfg.authenticate("k-free").limits["max_concurrent"] == 2  # tier default
    bad = [
        ({"limits": {"tokens_per_minute": -5}}, "tenants.free1.limits.tokens_per_minute"),
        ({"limits": {"tokenz": 5}}, "tenants.free1.limits.tokenz"),
        ({"tier": "platinum"}, "tenants.free1.tier"),
        ({"api_key_sha256": "plain-key"}, "tenants.free1.api_key_sha256"),
        ({"price_per_1k_output_tokens": "cheap"}, "tenants.free1.price_per_1k_output_tokens"),
    ]
    for override, where in bad:
        with pytest.raises(ConfigError, match=where.replace(".", r"\.")):
            parse_config(config_dict(**override))


def test_config_reloads_when_the_file_changes_and_keeps_the_last_good_one(tmp_path):
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump(config_dict()))
    errors = []
    watcher = ConfigWatcher(path, interval=0, on_error=errors.append)
    assert watcher.get().authenticate("k-new") is None
    cfg = config_dict()
    cfg["tenants"]["new"] = {"tier": "standard", "api_key_sha256": [hash_key("k-new")]}
    path.write_text(yaml.safe_dump(cfg))
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert watcher.get().authenticate("k-new").name == "new"
    path.write_text("tenants: [broken")
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 2 * 10**9))
    assert watcher.get().authenticate("k-new").name == "new" and errors


def test_example_config_loads():
    from build.render import COMMON

    cfg = load_config(COMMON["gateway_config"])
    assert cfg.authenticate("sk-demo-acme-enterprise").tier == "enterprise"


def test_api_key_sources():
    assert api_key_from({"authorization": "Bearer abc"}) == "abc"
    assert api_key_from({"Authorization": "bearer xyz"}) == "xyz"
    assert api_key_from({"x-api-key": "k1"}) == "k1"
    assert api_key_from({"api_key": "k2"}) == "k2"
    assert api_key_from({"tenant": "acme"}) is None


def test_memory_bucket_refills_continuously_and_refunds():
    async def go():
        clock = Clock()
        lim = MemoryLimiter(clock)
        r1 = await lim.acquire("t", LIMITS, 500)
        with pytest.raises(ServingError) as e:
            await lim.acquire("t", LIMITS, 200)
        assert e.value.kind == "rate_limited" and e.value.retry_after == pytest.approx(10.0)  # 100 tokens at 10/s
        clock.t += 10.0
        r2 = await lim.acquire("t", LIMITS, 200)
        await lim.settle(r1, LIMITS, 100)  # 400 unused tokens come back
        await lim.settle(r1, LIMITS, 100)  # settling twice is a no-op
        await lim.acquire("t", LIMITS, 400)
        await lim.settle(r2, LIMITS, 200)
        assert lim.inflight["t"] == 1
    asyncio.run(go())


async def _hammer(limiter, n_clients=64, tokens=50):
    async def client():
        try:
            await limiter.acquire("t", LIMITS, tokens)
            return tokens
        except ServingError as e:
            assert e.kind == "rate_limited"
            return 0
    return sum(await asyncio.gather(*(client() for _ in range(n_clients))))


def test_memory_zero_overshoot_with_64_concurrent_clients():
    admitted = asyncio.run(_hammer(MemoryLimiter()))
    assert admitted == 600  # exactly the bucket, never more


def test_redis_zero_overshoot_shared_by_two_limiters(redis_server):
    # what is tested is the shared bucket, not the fail-open path: a call that waits past the default 0.5 s
    # for one of 16 connections on a loaded host would be admitted unlimited (fail_open) and overshoot
    url = f"{redis_server.url}?timeout=30"

    async def go():
        a, b = RedisLimiter(url), RedisLimiter(url)
        got = await asyncio.gather(_hammer(a, 32), _hammer(b, 32))
        return sum(got)
    admitted = asyncio.run(go())
    assert 550 <= admitted <= 600  # refill during the run may add a token or so, overshoot never


def test_redis_retry_after_refund_and_fail_policies(redis_server):
    async def go():
        lim = RedisLimiter(redis_server.url)
        r = await lim.acquire("t", LIMITS, 600)
        with pytest.raises(ServingError) as e:
            await lim.acquire("t", LIMITS, 300)
        assert e.value.kind == "rate_limited" and 25 < e.value.retry_after <= 31
        await lim.settle(r, LIMITS, 100)  # refund 500
        await lim.acquire("t", LIMITS, 300)
    asyncio.run(go())
    redis_server.stop()
    up = []

    async def down(policy):
        lim = RedisLimiter(redis_server.url, policy, on_backend=up.append)
        return await lim.acquire("t", LIMITS, 10)
    assert asyncio.run(down("fail_open")).backend == "bypass"
    with pytest.raises(ServingError) as e:
        asyncio.run(down("fail_closed"))
    assert e.value.kind == "overloaded" and up == [False, False]


def test_admission_serves_higher_tiers_first_and_rotates_tenants():
    async def go():
        slots = EngineSlots("m", max_inflight=1, max_queue=100, max_wait_s=5)
        await slots.acquire("holder", 0)
        order = []

        async def waiter(tenant, prio):
            await slots.acquire(tenant, prio)
            order.append(tenant)
            slots.release()
        tasks = [asyncio.create_task(waiter("heavy", 2)) for _ in range(10)]
        tasks.append(asyncio.create_task(waiter("light", 2)))
        tasks.append(asyncio.create_task(waiter("vip", 0)))
        await asyncio.sleep(0.01)
        slots.release()
        await asyncio.gather(*tasks)
        return order
    order = asyncio.run(go())
    assert order[0] == "vip"
    assert order.index("light") <= 2  # not behind all ten of heavy's requests


def test_admission_bounds_and_timeouts():
    async def go():
        slots = EngineSlots("m", max_inflight=1, max_queue=1, max_wait_s=0.05)
        await slots.acquire("a", 0)
        pending = asyncio.create_task(slots.acquire("b", 0))
        await asyncio.sleep(0)
        with pytest.raises(ServingError, match="queue full"):
            await slots.acquire("c", 0)
        with pytest.raises(ServingError) as e:
            await pending
        assert e.value.kind == "overloaded" and e.value.retry_after >= 1
        assert slots.queued == 0 and slots.inflight == 1
    asyncio.run(go())


def test_a_stopped_waiter_leaves_the_queue_and_one_granted_as_it_stops_gives_its_slot_back():
    async def go():
        slots = EngineSlots("m", max_inflight=1, max_queue=4, max_wait_s=5)
        await slots.acquire("a", 0)
        stopped = asyncio.Event()
        pending = asyncio.create_task(slots.acquire("b", 0, stopped=stopped))
        behind = asyncio.create_task(slots.acquire("c", 0))
        await asyncio.sleep(0)
        assert slots.queued == 2
        stopped.set()
        with pytest.raises(Stopped):
            await pending
        assert slots.queued == 1 and slots.inflight == 1  # b gone; c still waits its turn
        slots.release()
        assert await behind >= 0 and slots.inflight == 1  # c, not b, got the slot
        slots.release()
        # granted and stopped in the same turn of the loop: the slot goes back, nothing stays held
        await slots.acquire("a", 0)
        stopped = asyncio.Event()
        pending = asyncio.create_task(slots.acquire("b", 0, stopped=stopped))
        await asyncio.sleep(0)
        slots.release()  # grants b
        stopped.set()
        with pytest.raises(Stopped):
            await pending
        assert slots.inflight == 0 and slots.queued == 0
        # a stop that came before the wait: not queued at all
        await slots.acquire("a", 0)
        with pytest.raises(Stopped):
            await slots.acquire("b", 0, stopped=stopped)
        assert slots.queued == 0 and slots.inflight == 1
    asyncio.run(go())


def test_admission_holds_a_tenant_to_its_kv_share_without_holding_back_others():
    """KV in whole blocks: acme (60% of 1000 tokens) runs 3 requests of 200; its 4th waits, while globex's
    short request behind it goes straight to the engine; a release grants acme's 4th."""
    async def go():
        slots = EngineSlots("m", max_inflight=16, max_queue=100, max_wait_s=5, kv_tokens=1000, tokens_per_block=32)
        assert slots.kv_need(190) == 192 and slots.kv_cap(60) == 600
        for _ in range(3):
            assert await slots.acquire("acme", 0, 190, 60) == 0.0
        fourth = asyncio.create_task(slots.acquire("acme", 0, 190, 60))
        await asyncio.sleep(0.01)
        assert not fourth.done() and slots.queued == 1
        await asyncio.wait_for(slots.acquire("globex", 1, 50, 50), 1)  # behind acme's waiter, not held by it
        assert slots.kv_held == 3 * 192 + 64 and slots.inflight == 4
        slots.release("acme", 190)
        await asyncio.wait_for(fourth, 1)
        assert slots.kv_by_tenant["acme"] == 3 * 192 and slots.queued == 0
        # the whole cache: a request that does not fit waits even within its tenant's share
        big = asyncio.create_task(slots.acquire("initech", 1, 400, 50))
        await asyncio.sleep(0.01)
        assert not big.done()
        slots.release("acme", 190)
        await asyncio.wait_for(big, 1)
        for _ in range(2):
            slots.release("acme", 190)
        slots.release("globex", 50)
        slots.release("initech", 400)
        assert (slots.inflight, slots.kv_held, dict(slots.kv_by_tenant)) == (0, 0, {})
        await asyncio.wait_for(slots.acquire("acme", 0, 700, 60), 1)  # over its share, but alone: it runs
        wait = asyncio.create_task(slots.acquire("acme", 0, 10, 60))
        await asyncio.sleep(0.01)
        assert not wait.done()
        slots.release("acme", 700)
        await asyncio.wait_for(wait, 1)
    asyncio.run(go())


def test_admission_without_a_known_kv_size_shares_slots():
    async def go():
        slots = EngineSlots("m", max_inflight=4, max_queue=100, max_wait_s=5)
        await slots.acquire("acme", 0, 5000, 50)
        await slots.acquire("acme", 0, 5000, 50)
        third = asyncio.create_task(slots.acquire("acme", 0, 10, 50))
        await asyncio.sleep(0.01)
        assert not third.done()
        await asyncio.wait_for(slots.acquire("globex", 1, 10, 50), 1)
        slots.release("acme", 5000)
        await asyncio.wait_for(third, 1)
    asyncio.run(go())


def test_routing_explicit_auto_and_degrade():
    cfg = parse_config(config_dict())
    acme, free = cfg.authenticate("k-acme"), cfg.authenticate("k-free")
    assert route(cfg, "big", acme, 50, 1, lambda m: False) == "big"
    assert route(cfg, "big", acme, 50, 1, lambda m: True) == "big"  # enterprise never degrades
    assert route(cfg, "auto", acme, 50, 1, lambda m: False) == "big"
    assert route(cfg, "auto", free, 50, 1, lambda m: False) == "small"  # short prompt, degradable tier
    with pytest.raises(ServingError) as e:
        route(cfg, "big", free, 50, 1, lambda m: False)
    assert e.value.kind == "permission_denied"
    with pytest.raises(ServingError) as e:
        route(cfg, "huge", acme, 50, 1, lambda m: False)
    assert e.value.kind == "not_found"
    with pytest.raises(ServingError) as e:
        route(cfg, "small", acme, 2000, 1, lambda m: False)
    assert e.value.kind == "context_too_long"


def test_routing_never_degrades_to_a_model_the_tenants_tier_may_not_use():
    raw = config_dict(allowed_models=["*"])
    raw["routing"]["models"]["small"]["tiers"] = ["enterprise"]
    cfg = parse_config(raw)
    free = cfg.authenticate("k-free")
    assert route(cfg, "big", free, 50, 1, lambda m: True) == "big"  # saturated, but small is not the free tier's
    with pytest.raises(ServingError) as e:
        route(cfg, "small", free, 50, 1, lambda m: False)
    assert e.value.kind == "permission_denied" and "free tier" in e.value.message


class FakeBackend:
    """Tokenizes by bytes and streams the prompt's bytes back, one token per step."""

    def __init__(self, steps_before_pause=None):
        self.stopped = []
        self.steps_before_pause = steps_before_pause

    async def tokenize(self, req):
        ids = list(req.text.encode()) if isinstance(req.text, str) else list(req.text)
        if not ids:
            raise ServingError("invalid_argument", "text_input: must not be empty", field="text_input")
        return Preprocessed.from_tensors({"INPUT_ID": np.array([ids]), "REQUEST_INPUT_LEN": np.array([[len(ids)]])})

    async def engine_stream(self, model, req, prep, tenant):
        for i in range(req.max_tokens):
            await asyncio.sleep(0)
            yield EngineStep([ord("a") + i % 26])

    async def engine_stop(self, model, req):
        self.stopped.append(req.request_id)


def make_gateway(backend=None, front_key_sha256=None, **limit_overrides):
    raw = config_dict()
    raw["tenants"]["acme"]["limits"] = {"tokens_per_minute": 1000, "max_context_tokens": 64, **limit_overrides}
    cfg = parse_config(raw)
    reg = MemoryRegistry()
    detok = Detokenizer([bytes([i]) for i in range(256)])
    gw = Gateway(lambda: cfg, MemoryLimiter(), Admission(4, 16, 1.0), GatewayMetrics(reg), backend or FakeBackend(),
                 detok, front_key_sha256=front_key_sha256)
    return gw, reg


async def collect(gw, req, is_cancelled=lambda: False):
    return [c async for c in gw.handle(req, is_cancelled)]


def test_gateway_flow_errors_and_usage():
    gw, reg = make_gateway()
    chunks = asyncio.run(collect(gw, GatewayRequest("k-acme", 5, text="hello", stream=True, model="big")))
    assert "".join(c.text for c in chunks) == "abcde" and chunks[-1].final
    assert (chunks[-1].model_used, chunks[-1].finish_reason, chunks[-1].num_input_tokens,
            chunks[-1].num_output_tokens) == ("big", "length", 5, 5)
    assert reg.value("gateway_output_tokens_total", tenant="acme", model="big") == 5
    assert reg.value("gateway_cost_total", tenant="acme", model="big") == pytest.approx(5 / 1000 + 10 / 1000)
    for req, kind in [
        (GatewayRequest("bad", 5, text="x"), "unauthenticated"),
        (GatewayRequest("k-free", 5, text="x", model="big"), "permission_denied"),
        (GatewayRequest("k-acme", 5, text="x" * 70, model="big"), "context_too_long"),
        (GatewayRequest("k-acme", 600, text="x", model="big"), "context_too_long"),
        (GatewayRequest("k-acme", 5, text="", model="big"), "invalid_argument"),
    ]:
        with pytest.raises(ServingError) as e:
            asyncio.run(collect(gw, req))
        assert e.value.kind == kind
    assert reg.value("gateway_rejections_total", tenant="unknown", reason="unauthenticated") == 1


class TwoSequences(FakeBackend):
    """n = 2: sequence 0 ends on its own after 2 tokens, sequence 1 runs to max_tokens."""

    async def engine_stream(self, model, req, prep, tenant):
        for i in range(req.max_tokens):
            await asyncio.sleep(0)
            if i < 2:
                yield EngineStep([ord("a") + i], sequence_index=0)
            yield EngineStep([ord("A") + i], sequence_index=1)


def test_each_sequence_of_n_ends_with_its_own_finish_reason_and_the_request_with_length_if_any_was_cut():
    from contracts.generation import Outputs
    gw, _ = make_gateway(TwoSequences())
    chunks = asyncio.run(collect(gw, GatewayRequest("k-acme", 4, text="hello", model="big",
                                                    outputs=Outputs(num_return_sequences=2))))
    ends = {c.sequence_index: c.finish_reason for c in chunks if c.finish_reason and not c.final}
    assert ends == {0: "stop", 1: "length"}
    assert (chunks[-1].final, chunks[-1].finish_reason, chunks[-1].num_output_tokens) == (True, "length", 6)


def test_cancelled_client_stops_engine_refunds_and_frees_the_slot():
    backend = FakeBackend()
    gw, reg = make_gateway(backend)
    seen = []
    req = GatewayRequest("k-acme", 40, text="hi", stream=True, model="big")
    asyncio.run(collect(gw, req, is_cancelled=lambda: len(seen.append(1) or seen) > 3))
    assert backend.stopped == [req.request_id]
    assert gw.limiter.inflight["acme"] == 0 and gw.limiter.reserved["acme"] == 0
    assert gw.admission.slots("big").inflight == 0
    level, _ = gw.limiter.buckets[("acme", "tpm")]
    assert level > 1000 - 2 - 40  # the unused part of max_tokens came back
    assert reg.value("gateway_requests_total", tenant="acme", model="big", outcome="cancelled") == 1


def test_stop_ends_the_callers_own_named_stream_as_cancelled():
    """`stop` with the stream's key and stream_id ends it as a client gone would (engine stop, refund,
    cancelled); another key, or another id, stops nothing; an id in flight is not taken twice."""
    backend = FakeBackend()
    gw, reg = make_gateway(backend)
    req = GatewayRequest("k-acme", 40, text="hi", stream=True, model="big", stream_id="s-1")

    async def scenario():
        stream = gw.handle(req)
        got = [await stream.__anext__() for _ in range(3)]  # under way
        with pytest.raises(ServingError) as e:  # the same key and id again, while in flight
            await gw.handle(GatewayRequest("k-acme", 4, text="hi", model="big", stream_id="s-1")).__anext__()
        assert e.value.kind == "invalid_argument" and e.value.field == "stream_id"
        assert stop_answer(await gw.operation("stop", GatewayRequest("k-free", None, stream_id="s-1"))) == \
            {"stopped": False}  # another tenant's key
        assert gw.streams.stop(GatewayRequest("k-acme", None, stream_id="s-2")) is False
        with pytest.raises(ServingError) as e:
            await gw.operation("stop", GatewayRequest("bad", None, stream_id="s-1"))
        assert e.value.kind == "unauthenticated"
        with pytest.raises(ServingError) as e:
            await gw.operation("stop", GatewayRequest("k-acme", None))
        assert e.value.field == "stream_id"
        assert stop_answer(await gw.operation("stop", GatewayRequest("k-acme", None, stream_id="s-1"))) == \
            {"stopped": True}
        return got + [c async for c in stream]

    chunks = asyncio.run(scenario())
    assert not chunks[-1].final and len(chunks) < 40  # ended early, without a final chunk (a cancelled stream)
    assert backend.stopped == [req.request_id]
    assert gw.limiter.reserved["acme"] == 0 and gw.admission.slots("big").inflight == 0
    assert reg.value("gateway_requests_total", tenant="acme", model="big", outcome="cancelled") == 1
    assert gw.streams.live == {}  # forgotten once ended


def stop_answer(out: dict) -> dict:
    """The JSON answer of `stop` in its output tensor."""
    assert set(out) == {"text_output"}
    return json.loads(out["text_output"][0][0])


def _hold_every_slot(gw, model="big"):
    """Take each of the model's engine slots (make_gateway: 4), so the next request waits in the queue."""
    slots = gw.admission.slots(model)

    async def hold():
        for _ in range(slots.max_inflight):
            await slots.acquire("someone-else", 0)
    return slots, hold()


def test_stop_takes_a_named_stream_out_of_the_admission_queue():
    """A stream still waiting for an engine slot ends at once on its caller's `stop`, with no chunk: it
    leaves the queue, its reservation is refunded, it is counted cancelled, the engine never sees it."""
    backend = FakeBackend()
    gw, reg = make_gateway(backend)
    req = GatewayRequest("k-acme", 40, text="hi", stream=True, model="big", stream_id="s-q")

    async def scenario():
        slots, hold = _hold_every_slot(gw)
        await hold
        chunks = asyncio.create_task(collect(gw, req))
        while slots.queued == 0:
            await asyncio.sleep(0.001)
        assert gw.limiter.reserved["acme"] > 0
        assert stop_answer(await gw.operation("stop", GatewayRequest("k-acme", None, stream_id="s-q"))) == \
            {"stopped": True}
        got = await asyncio.wait_for(chunks, 1)  # well before the queue's own 1 s limit
        return got, slots

    chunks, slots = asyncio.run(scenario())
    assert chunks == [] and slots.queued == 0 and slots.inflight == slots.max_inflight  # the holder's only
    assert backend.stopped == []  # nothing reached the engine, so nothing to stop there
    assert gw.limiter.reserved["acme"] == 0 and gw.limiter.inflight["acme"] == 0
    assert reg.value("gateway_requests_total", tenant="acme", model="big", outcome="cancelled") == 1
    assert gw.streams.live == {}


def test_stop_takes_a_fronts_admission_out_of_the_queue_and_grants_no_lease():
    """The front names each admission (stream_id): a client gone while it waits gets the `stop`, and the
    admit answers `cancelled` instead of granting a lease no one would settle."""
    gw, reg = make_gateway(front_key_sha256=hash_key("fk"))
    req = GatewayRequest("k-acme", 40, text="hi", model="big", front_key="fk", stream_id="adm-1")

    async def scenario():
        slots, hold = _hold_every_slot(gw)
        await hold
        admit = asyncio.create_task(gw.operation("admit", req))
        while slots.queued == 0:
            await asyncio.sleep(0.001)
        assert gw.streams.stop(GatewayRequest("k-acme", None, stream_id="adm-1"))
        with pytest.raises(ServingError) as e:
            await asyncio.wait_for(admit, 1)
        return e.value, slots

    err, slots = asyncio.run(scenario())
    assert err.kind == "cancelled"
    assert slots.queued == 0 and gw.leases.live == {} and gw.streams.live == {}
    assert gw.limiter.reserved["acme"] == 0 and gw.limiter.inflight["acme"] == 0
    assert reg.value("gateway_requests_total", tenant="acme", model="big", outcome="cancelled") == 1


def test_per_tenant_speculative_decoding_reaches_the_engine_inputs():
    """A tenant's `speculative_decoding` becomes the engine's lookahead inputs on the gateway's own engine
    call and on the front's leases (both read TritonBackend.engine_values); absent: none are sent."""
    from gateway.triton_backend import TritonBackend

    class Recording(FakeBackend):
        async def engine_stream(self, model, req, prep, tenant):
            self.values = TritonBackend.engine_values(req, prep)
            async for ids in super().engine_stream(model, req, prep, tenant):
                yield ids

    raw = config_dict(speculative_decoding={"window_size": 1, "ngram_size": 4, "verification_set_size": 1})
    raw["tenants"]["acme"]["speculative_decoding"] = "off"
    cfg = parse_config(raw)
    assert cfg.authenticate("k-free").lookahead == (1, 4, 1) and cfg.authenticate("k-acme").lookahead == (1, 1, 0)
    seen = {}
    for key, model in (("k-free", "small"), ("k-acme", "big")):
        backend = Recording()
        gw = Gateway(lambda: cfg, MemoryLimiter(), Admission(4, 16, 1.0), GatewayMetrics(MemoryRegistry()), backend,
                     Detokenizer([bytes([i]) for i in range(256)]))
        asyncio.run(collect(gw, GatewayRequest(key, 3, text="hi", model=model)))
        seen[key] = {k: int(v.reshape(-1)[0]) for k, v in backend.values.items() if k.startswith("lookahead_")}
        assert all(backend.values[k].dtype == np.int32 for k in seen[key])
    assert seen["k-free"] == {"lookahead_window_size": 1, "lookahead_ngram_size": 4,
                              "lookahead_verification_set_size": 1}
    assert seen["k-acme"] == {"lookahead_window_size": 1, "lookahead_ngram_size": 1,
                              "lookahead_verification_set_size": 0}
    del raw["tenants"]["acme"]["speculative_decoding"]
    backend = Recording()
    gw = Gateway(lambda: parse_config(raw), MemoryLimiter(), Admission(4, 16, 1.0), GatewayMetrics(MemoryRegistry()),
                 backend, Detokenizer([bytes([i]) for i in range(256)]))
    asyncio.run(collect(gw, GatewayRequest("k-acme", 3, text="hi", model="big")))
    assert not [k for k in backend.values if k.startswith("lookahead_")]
    for bad in ("on", {"ngram_size": 4}, {"window_size": 1, "ngram_size": 0, "verification_set_size": 1}):
        with pytest.raises(ConfigError, match=r"tenants\.free1\.speculative_decoding"):
            parse_config(config_dict(speculative_decoding=bad))


def test_what_only_the_local_engine_can_honour_is_refused_for_an_upstream_model():
    """n, log probs, echo, logit_bias and token-id prompts are the engine's own (its distribution, its
    vocabulary, its sequences): an upstream provider's model refuses them by name, never drops them."""
    from gateway.core import upstream_unsupported
    from contracts.generation import Outputs

    plain = GatewayRequest("k", 4, text="hi")
    assert upstream_unsupported(plain) is None
    for kw, field in ((dict(outputs=Outputs(num_return_sequences=2)), "num_return_sequences"),
                      (dict(outputs=Outputs(logprobs=0)), "logprobs"),
                      (dict(outputs=Outputs(echo_logprobs=True)), "echo_logprobs"),
                      (dict(outputs=Outputs(logit_bias={3: 1.0})), "logit_bias"),
                      (dict(prompt_ids=[1, 2]), "prompt_ids")):
        assert upstream_unsupported(GatewayRequest("k", 4, text=None if "prompt_ids" in kw else "hi", **kw)) == field


def test_the_prompt_byte_bound_counts_the_tools_and_names_the_largest_input():
    """Tools are rendered into the prompt, so they count toward the tier's byte bound; the refusal names the
    input that made the prompt big (a client that sent huge tools is told `tools`, not `messages`)."""
    gw, _ = make_gateway(max_prompt_bytes=1000)
    tools = json.dumps([{"type": "function", "function": {"name": "f", "description": "x" * 2000}}])
    messages = json.dumps([{"role": "user", "content": "hi"}])
    for req, field in ((GatewayRequest("k-acme", 5, messages=messages, tools=tools, model="big"), "tools"),
                       (GatewayRequest("k-acme", 5, messages=json.dumps([{"role": "user", "content": "y" * 2000}]),
                                       tools=json.dumps([]), model="big"), "messages"),
                       (GatewayRequest("k-acme", 5, text="z" * 1500, model="big"), "text_input")):
        with pytest.raises(ServingError) as e:
            asyncio.run(collect(gw, req))
        assert (e.value.kind, e.value.field) == ("context_too_long", field)


def test_models_and_whoami_answer_typed_outputs_of_the_contract_not_json_text():
    from contracts.tensors import GATEWAY
    gw, _ = make_gateway()
    who = asyncio.run(gw.operation("whoami", GatewayRequest("k-free", None)))
    models = asyncio.run(gw.operation("models", GatewayRequest("k-acme", None)))
    for out in (who, models):
        assert "text_output" not in out and set(out) <= set(GATEWAY.output_names)
        for name, value in out.items():  # each converts to its declared type, as model.py sends it
            np.array(value, dtype=GATEWAY.output(name).numpy_dtype)
    assert (who["tenant"], who["tier"]) == ([[b"free1"]], [[b"free"]]) and who["max_prompt_bytes"][0][0] > 0
    assert models["model_ids"] == [[b"big", b"small", b"auto"]]
    assert models["model_owners"] == [[b"local", b"local", b""]]
    assert models["model_context_tokens"] == [[64, 64, 64]] and models["model_parents"] == [[b"", b"", b""]]
