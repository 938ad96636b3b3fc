"""Upstream providers in the gateway without Triton: the catalog's validation, the circuit breaker's states
on a hand-moved clock, the `auto` classifier's rule, routing with fallbacks, and an upstream lease from
admit to settle (reservation, the upstream's usage, the model's prices, the ledger's provider, the breaker
fed by settles, the fallback the next admit takes)."""
import asyncio
import json

import pytest

from gateway.admission import Admission
from gateway.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from gateway.catalog import BreakerSettings
from gateway.classify import complexity, prompt_text
from gateway.core import Gateway, GatewayRequest
from gateway.metrics import GatewayMetrics, MemoryRegistry
from gateway.ratelimit import MemoryLimiter
from gateway.tenants import ConfigError, hash_key, parse_config
from contracts.errors import ServingError, from_transport
from text.detokenize import Detokenizer
from contracts.usage_record import UsageRecord
from tests.gateway.test_gateway_lib import FakeBackend
from tests.support.clock import Clock

FRONT_KEY = "front-secret"
UPSTREAM = {"name": "acme-cloud", "base_url": "http://127.0.0.1:9/v1", "model": "their-model",
            "api_key_env": "ACME_CLOUD_KEY", "breaker": {"min_requests": 4, "error_rate": 0.5, "open_s": 10,
                                                          "probe_interval_s": 1}}


def config(auto_policy="default", **model_overrides):
    models = {
        "local": {"max_context_tokens": 4096, "capability": 1},
        "cloud": {"max_context_tokens": 8192, "capability": 3, "price_per_1k_input_tokens": 2.0,
                  "price_per_1k_output_tokens": 4.0, "fallback": ["local"], "tiers": ["enterprise", "standard"],
                  "provider": dict(UPSTREAM)},
    }
    for name, spec in model_overrides.items():
        models[name] = {**models.get(name, {}), **spec}
    return {
        "routing": {"default_model": "local", "models": models, "auto_policy": auto_policy,
                    "auto_long_prompt_tokens": 200},
        "tenants": {
            "acme": {"tier": "enterprise", "api_key_sha256": [hash_key("k-acme")],
                     "price_per_1k_input_tokens": 0.5, "price_per_1k_output_tokens": 1.0},
            "cheap": {"tier": "enterprise", "api_key_sha256": [hash_key("k-cheap")], "auto_max_price_per_1k": 1.0},
            "free1": {"tier": "free", "api_key_sha256": [hash_key("k-free")]},
        },
    }


def test_catalog_validation_names_the_bad_field():
    cfg = parse_config(config())
    cloud = cfg.catalog["cloud"]
    assert cloud.upstream.name == "acme-cloud" and cloud.provider == "acme-cloud"
    assert cfg.catalog["local"].provider == "local" and cfg.catalog["local"].upstream is None
    assert cloud.upstream.breaker.min_requests == 4 and "ACME_CLOUD_KEY" == cloud.upstream.api_key_env
    assert "key" not in json.dumps(cloud.upstream.route()).replace("api_key_env", "").replace("api_key_file", "")
    bad = [
        ({"cloud": {"provider": {**UPSTREAM, "base_url": "ftp://x"}}}, "routing.models.cloud.provider.base_url"),
        ({"cloud": {"provider": {**UPSTREAM, "base_url": "https://u:p@h/v1"}}}, "provider.base_url"),
        ({"cloud": {"provider": {**UPSTREAM, "api_key_file": "/k"}}}, "api_key_env or api_key_file"),
        ({"cloud": {"provider": {**UPSTREAM, "model": ""}}}, "provider.model"),
        ({"cloud": {"provider": {**UPSTREAM, "api_key": "sk-plain"}}}, r"unknown field\(s\) api_key"),
        ({"cloud": {"fallback": ["nowhere"]}}, "routing.models.cloud.fallback"),
        ({"cloud": {"tiers": ["gold"]}}, "routing.models.cloud.tiers"),
        ({"cloud": {"price_per_1k_input_tokens": -1}}, "price_per_1k_input_tokens"),
        ({"cloud": {"provider": {**UPSTREAM, "breaker": {"error_rate": 2}}}}, "breaker.error_rate"),
        ({"cloud": {"provider": {**UPSTREAM, "max_retries": 1.5}}}, "provider.max_retries"),
    ]
    for override, where in bad:
        with pytest.raises(ConfigError, match=where):
            parse_config(config(**override))
    with pytest.raises(ConfigError, match="routing.auto_policy"):
        parse_config(config(auto_policy="smart"))


def test_breaker_opens_on_the_error_rate_probes_half_open_and_closes():
    clock, changes = Clock(), []
    b = CircuitBreaker("up", BreakerSettings(window_s=10, min_requests=3, error_rate=0.5, slow_ttft_s=2, open_s=5,
                                             probe_interval_s=1), clock, lambda n, s: changes.append(s))
    b.record(0, True, 0.1)
    b.record(1, True, 0.1)  # one failed try, then a success: 1 of 3 outcomes failed
    assert b.state == CLOSED and b.allows()
    clock.t += 11  # those outcomes leave the window
    b.record(2, False)  # two failed tries, nothing else in the window yet: 2 < min_requests
    assert b.state == CLOSED
    b.record(1, False)
    assert b.state == OPEN and not b.allows() and b.retry_after() == pytest.approx(5)
    clock.t += 5
    assert b.state == HALF_OPEN
    assert b.allows() and not b.allows()  # one probe per probe_interval_s
    b.record(1, False)  # the probe failed: open again for open_s
    assert b.state == OPEN and b.retry_after() == pytest.approx(5)
    clock.t += 5
    assert b.allows()
    b.record(0, True, 3.0)  # a success slower than slow_ttft_s is a failure
    assert b.state == OPEN
    clock.t += 5
    assert b.allows()
    b.record(0, True, 0.2)
    assert b.state == CLOSED and b.allows() and b.retry_after() == 0
    assert changes == [OPEN, HALF_OPEN, OPEN, HALF_OPEN, OPEN, HALF_OPEN, CLOSED]


def test_the_classifier_rule():
    assert complexity("What is the capital of France?", 10, 200) == (1, "simple")
    assert complexity("Please compare these two plans step by step", 10, 200)[0] == 2
    assert complexity("```python\nprint(1)\n```", 10, 200) == (3, "code")
    assert complexity("Why does def f(x): fail with this traceback?", 10, 200) == (3, "code")
    assert complexity("hello", 500, 200) == (2, "long prompt")
    chat = json.dumps([{"role": "system", "content": "be brief"}, {"role": "user", "content": [
        {"type": "text", "text": "refactor this"}]}])
    assert prompt_text(None, chat) == "be brief\nrefactor this"


class LeaseBackend(FakeBackend):
    """FakeBackend plus what an engine lease asks of a backend (a test double: no Triton here)."""

    def engine_identity(self, model):
        return model

    def engine_call(self, model, req, prep, tenant):
        return {"inputs": {"input_ids": prep.input_ids.tolist()}, "cache_salt": tenant}


def make_gateway(raw, ledger=None, clock=None):
    cfg = parse_config(raw)
    reg = MemoryRegistry()
    gw = Gateway(lambda: cfg, MemoryLimiter(), Admission(4, 16, 1.0), GatewayMetrics(reg), LeaseBackend(),
                 Detokenizer([bytes([i]) for i in range(256)]), ledger=ledger, front_key_sha256=hash_key(FRONT_KEY))
    if clock is not None:
        gw.breakers.clock = clock
    return gw, reg


class ListLedger(list):
    def append(self, line):
        super().append(UsageRecord.from_dict(json.loads(line)))


def admit(gw, key="k-acme", model="cloud", text="hello there", max_tokens=20, avoid=None, **kw):
    req = GatewayRequest(key, max_tokens, text=text, model=model, front_key=FRONT_KEY,
                         lease={"avoid": avoid} if avoid else None, **kw)
    return asyncio.run(gw.leases.operation("admit", req))


def settle(gw, grant, **report):
    req = GatewayRequest(None, 1, front_key=FRONT_KEY, lease={"id": grant["lease"], **report})
    return asyncio.run(gw.leases.operation("settle", req))


def test_an_upstream_lease_reserves_settles_with_the_upstreams_usage_at_the_models_prices():
    ledger = ListLedger()
    gw, reg = make_gateway(config(), ledger)
    grant = admit(gw)
    assert grant["model"] == "cloud" and grant["provider"]["model"] == "their-model"
    assert grant["provider"]["api_key_env"] == "ACME_CLOUD_KEY" and "inputs" not in grant
    assert gw.limiter.reserved["acme"] == len("hello there") + 20  # the local tokenizer's estimate + max_tokens
    assert gw.admission.slots("cloud").inflight == 0  # an upstream holds no engine slot
    done = settle(gw, grant, num_output_tokens=7, outcome="success", num_input_tokens=30, finish_reason="stop",
                  ttft_s=0.2)
    assert done["finish_reason"] == "stop" and gw.limiter.reserved["acme"] == 0
    (rec,) = ledger
    assert (rec.model, rec.provider, rec.prompt_tokens, rec.completion_tokens) == ("cloud", "acme-cloud", 30, 7)
    assert rec.cost == pytest.approx(30 / 1000 * 2.0 + 7 / 1000 * 4.0)  # the model's prices, not the tenant's
    assert reg.value("gateway_cost_total", tenant="acme", model="cloud") == pytest.approx(rec.cost)
    local = admit(gw, model="local")
    settle(gw, local, num_output_tokens=3, outcome="success")
    assert ledger[-1].provider == "local" and ledger[-1].cost == pytest.approx(11 / 1000 * 0.5 + 3 / 1000 * 1.0)


def test_a_leases_record_counts_its_first_token_and_its_end_from_the_same_start():
    """The front measures a lease's ttft from its own arrival, before it tokenized and admitted the request: its
    latency comes from the same start, so a record's ttft never exceeds its latency (the gateway's own clock
    starts at the admit). A latency that is not a number, or shorter than the ttft, is not taken."""
    ledger = ListLedger()
    gw, _ = make_gateway(config(), ledger)
    settle(gw, admit(gw, model="local"), num_output_tokens=3, outcome="success", ttft_s=0.25, latency_s=0.5)
    assert (ledger[-1].ttft_ms, ledger[-1].latency_ms) == (250.0, 500.0)
    for bad in ("0.5", True, -1.0, 0.1):
        settle(gw, admit(gw, model="local"), num_output_tokens=3, outcome="success", ttft_s=0.25, latency_s=bad)
        assert ledger[-1].ttft_ms == 250.0 and ledger[-1].latency_ms < 250.0  # the gateway's own: admit to settle
    settle(gw, admit(gw, model="local"), num_output_tokens=0, outcome="cancelled", latency_s=0.75)
    assert (ledger[-1].ttft_ms, ledger[-1].latency_ms) == (None, 750.0)


def test_what_an_upstream_cannot_honour_is_refused_naming_the_field_and_tiers_are_enforced():
    gw, _ = make_gateway(config())
    for kw, field in [({"tools": '[{"type": "function"}]'}, "tools"), ({"ignore_eos": True}, "ignore_eos")]:
        with pytest.raises(ServingError) as e:
            admit(gw, **kw)
        assert e.value.kind == "invalid_argument" and e.value.field == field
    assert gw.limiter.reserved.get("acme", 0) == 0
    with pytest.raises(ServingError) as e:
        admit(gw, key="k-free")
    assert e.value.kind == "permission_denied" and "free tier" in e.value.message
    assert {m["id"] for m in asyncio.run(gw.models("k-free"))} == {"local", "auto"}
    assert {(m["id"], m.get("owned_by")) for m in asyncio.run(gw.models("k-acme"))} >= {("cloud", "acme-cloud"), ("local", "local")}
    with pytest.raises(ServingError) as e:  # Triton-native clients cannot stream from an upstream
        asyncio.run(_collect(gw, GatewayRequest("k-acme", 5, text="hi", model="cloud")))
    assert e.value.kind == "invalid_argument" and e.value.field == "model"


async def _collect(gw, req):
    return [c async for c in gw.handle(req)]


def test_failed_settles_open_the_circuit_and_admits_fall_back_until_it_closes():
    clock = Clock()
    gw, reg = make_gateway(config(), clock=clock)
    for _ in range(2):  # two requests whose every try failed (the front's report)
        grant = admit(gw)
        assert grant["model"] == "cloud"
        settle(gw, grant, num_output_tokens=0, outcome="error", error_kind="upstream_unavailable", upstream_failures=3,
               upstream_errors=["connect", "connect", "connect"], before_first_token=True)
    assert reg.value("gateway_upstream_circuit_state", upstream="acme-cloud") == 2
    assert reg.value("gateway_upstream_errors_total", upstream="acme-cloud", kind="connect") == 6
    # tries that failed before a first token are no client-visible outcome: a fallback answers them
    assert reg.value("gateway_requests_total", tenant="acme", model="cloud", outcome="error") == 0
    fallback = admit(gw)  # the circuit is open: the fallback answers the explicit request
    assert fallback["model"] == "local" and "provider" not in fallback and "inputs" in fallback
    assert reg.value("gateway_fallbacks_total", requested="cloud", used="local") == 1
    settle(gw, fallback, num_output_tokens=1, outcome="success")
    clock.t += 10  # open_s later: half-open, one probe goes to the upstream
    probe = admit(gw)
    assert probe["model"] == "cloud" and admit(gw)["model"] == "local"
    settle(gw, probe, num_output_tokens=2, outcome="success", num_input_tokens=5, ttft_s=0.1)
    assert reg.value("gateway_upstream_circuit_state", upstream="acme-cloud") == 0
    assert admit(gw)["model"] == "cloud"
    # the front's own fallback: a model it tried is avoided; nothing left is a 503
    assert admit(gw, avoid=["cloud"])["model"] == "local"
    gw2, _ = make_gateway(config(cloud={"fallback": []}))
    with pytest.raises(ServingError) as e:
        admit(gw2, avoid=["cloud"])
    assert e.value.kind == "upstream_unavailable" and e.value.retry_after


def test_a_cancelled_upstream_stream_says_nothing_to_the_breaker():
    gw, reg = make_gateway(config())
    for _ in range(5):
        settle(gw, admit(gw), num_output_tokens=2, outcome="cancelled")
    assert gw.breakers.breakers["acme-cloud"].state == CLOSED


def pick(gw, **kw) -> str:
    """The model an admit picks (its lease settled at once: nothing stays held)."""
    grant = admit(gw, **kw)
    settle(gw, grant, num_output_tokens=0, outcome="cancelled")
    return grant["model"]


def test_auto_with_the_classifier_picks_the_cheapest_able_model_under_the_ceiling():
    gw, _ = make_gateway(config(auto_policy="classifier"))
    assert pick(gw, model="auto", text="What is the capital of France?") == "local"
    assert pick(gw, model="auto", text="```\nint main() {}\n``` why does this segfault?") == "cloud"
    # a tenant whose ceiling is under the strong model's price gets the best it may pay for
    assert pick(gw, key="k-cheap", model="auto", text="```\nx = 1\n```") == "local"
    # the free tier is not eligible for the upstream, and tools need the local engine
    assert pick(gw, key="k-free", model="auto", text="```\nx = 1\n```", max_tokens=5) == "local"
    assert pick(gw, model="auto", text="```\nx\n```", tools='[{"type": "function"}]') == "local"
    # the upstream failed for this request: auto's next candidate
    assert pick(gw, model="auto", text="```\nx = 1\n```", avoid=["cloud"]) == "local"


def test_the_shipped_config_degrades_only_where_the_render_made_the_small_engine(tmp_path):
    """deploy/gateway.example.yaml names tensorrt_llm_small as the degrade target; a repository without it
    (compose, Kubernetes, a plain render) neither lists it nor routes to it."""
    from gateway.engine_limits import RepositoryEngineLimits
    from gateway.tenants import load_config
    from build.render import COMMON

    cfg = load_config(COMMON["gateway_config"])
    (tmp_path / "tensorrt_llm").mkdir()
    (tmp_path / "tensorrt_llm" / "config.pbtxt").write_text('name: "tensorrt_llm"\n')
    hobbyist, acme = "sk-demo-hobbyist-free", "sk-demo-acme-enterprise"

    def gateway():
        return Gateway(lambda: cfg, MemoryLimiter(), Admission(4, 16, 1.0), GatewayMetrics(MemoryRegistry()),
                       LeaseBackend(), Detokenizer([bytes([i]) for i in range(256)]),
                       engine_limits=RepositoryEngineLimits(tmp_path), front_key_sha256=hash_key(FRONT_KEY))

    plain = gateway()
    assert {m["id"] for m in asyncio.run(plain.models(acme))} == {"tensorrt_llm", "auto"}
    assert pick(plain, key=hobbyist, model="auto", text="Hi", max_tokens=5) == "tensorrt_llm"
    (tmp_path / "tensorrt_llm_small").mkdir()
    (tmp_path / "tensorrt_llm_small" / "config.pbtxt").write_text('name: "tensorrt_llm_small"\n')
    rendered = gateway()  # as `make serve` renders it (Makefile SMALL_ENGINE)
    assert {m["id"] for m in asyncio.run(rendered.models(acme))} == {"tensorrt_llm", "tensorrt_llm_small", "auto"}
    assert pick(rendered, key=hobbyist, model="auto", text="Hi", max_tokens=5) == "tensorrt_llm_small"
    assert pick(rendered, key=acme, model="auto", text="Hi", max_tokens=5) == "tensorrt_llm"  # enterprise stays


def test_an_open_circuit_without_a_fallback_says_when_to_retry():
    clock = Clock()
    gw, _ = make_gateway(config(cloud={"fallback": []}), clock=clock)
    for _ in range(2):
        settle(gw, admit(gw), num_output_tokens=0, outcome="error", error_kind="upstream_unavailable",
               upstream_failures=2)
    clock.t += 3
    with pytest.raises(ServingError) as e:
        admit(gw)
    assert e.value.kind == "upstream_unavailable" and e.value.retry_after == pytest.approx(7)  # open_s 10 - 3


def test_usage_reports_group_by_provider():
    from ledger.reports import aggregate

    base = {"tenant": "acme", "day": "2026-11-25", "outcome": "success", "ttft_ms": 10.0, "latency_ms": 20.0}
    rows = [{**base, "model": "cloud", "provider": "acme-cloud", "prompt_tokens": 10, "completion_tokens": 5,
             "cost": 0.04},
            {**base, "model": "cloud", "provider": "acme-cloud", "prompt_tokens": 0, "completion_tokens": 0,
             "cost": 0.0, "outcome": "error"},
            {**base, "model": "local", "provider": "local", "prompt_tokens": 3, "completion_tokens": 2, "cost": 0.01}]
    got = {(r["provider"], r["model"]): (r["requests"], r["errors"], r["cost"]) for r in aggregate(rows, "provider")}
    assert got == {("acme-cloud", "cloud"): (2, 1, 0.04), ("local", "local"): (1, 0, 0.01)}


def test_a_failure_after_the_first_token_is_a_client_visible_error():
    gw, reg = make_gateway(config())
    settle(gw, admit(gw), num_output_tokens=3, outcome="error", error_kind="upstream_unavailable",
           upstream_failures=1, upstream_errors=["mid_stream"])
    assert reg.value("gateway_requests_total", tenant="acme", model="cloud", outcome="error") == 1
    assert reg.value("gateway_output_tokens_total", tenant="acme", model="cloud") == 3  # charged what it got


def test_settles_sent_together_are_each_settled_and_an_unknown_lease_is_refused_in_its_place():
    """The front sends the settles that queued up as one request (front/grouped_settles.py): each is
    settled as if alone, in order, and a lease the gateway no longer knows gets its error in its place."""
    ledger = ListLedger()
    gw, _ = make_gateway(config(), ledger)
    first, second = admit(gw, model="local"), admit(gw, model="local", max_tokens=10)
    req = GatewayRequest(None, 1, front_key=FRONT_KEY, lease={"leases": [
        {"id": first["lease"], "num_output_tokens": 3, "outcome": "success", "finish_reason": "length"},
        {"id": "no-such-lease", "num_output_tokens": 1, "outcome": "success"},
        {"id": second["lease"], "num_output_tokens": 0, "outcome": "cancelled"}]})
    answers = asyncio.run(gw.leases.operation("settle", req))["settled"]
    assert [a.get("settled") for a in answers] == [first["lease"], None, second["lease"]]
    assert answers[0]["finish_reason"] == "length" and from_transport(answers[1]["error"]).kind == "not_found"
    assert gw.leases.live == {} and gw.limiter.reserved["acme"] == 0 and gw.admission.slots("local").inflight == 0
    assert [(r.completion_tokens, r.outcome) for r in ledger] == [(3, "success"), (0, "cancelled")]
    for leases in ([], "x", [{"id": first["lease"]}] * 1025):
        with pytest.raises(ServingError) as e:
            asyncio.run(gw.leases.operation("settle", GatewayRequest(None, 1, front_key=FRONT_KEY,
                                                                     lease={"leases": leases})))
        assert e.value.field == "lease"
