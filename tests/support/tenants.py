"""The gateway config the integration tests boot with, built from a few typed tenants instead of a YAML
dict per module (the format is gateway/tenants.py's, the same as deploy/gateway.example.yaml).

    config = gateway_config([Tenant("acme"), Tenant("solo", tier="free", limits={"max_concurrent": 1})])
    stack = TritonServer(overrides={"gateway_config": str(write_config(tmp / "gw.yaml", config))})

A tenant's API key is `k-<name>` unless given; the config holds only its SHA-256, as in production.
`STANDARD_TENANTS` are the tenants of the session's shared stack (tests/conftest.py `shared_stack`): one per
module whose tests count state (usage, limits, reservations), so no module sees another's traffic there.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from gateway.tenants import hash_key, parse_config


@dataclass(frozen=True)
class Tenant:
    name: str
    tier: str = "enterprise"
    key: str = ""  # empty: k-<name>
    limits: dict = field(default_factory=dict)  # overrides of the tier's limits (gateway/tenants.py LIMIT_FIELDS)
    allowed_models: tuple[str, ...] | None = None  # None: every model
    allowed_adapters: tuple[str, ...] = ()
    price_in_per_1k: float = 0.0
    price_out_per_1k: float = 0.0
    extra: dict = field(default_factory=dict)  # any other tenant field as the config spells it (sessions, ...)

    @property
    def api_key(self) -> str:
        return self.key or f"k-{self.name}"

    def entry(self) -> dict:
        """This tenant as the gateway config spells it."""
        out = {"tier": self.tier, "api_key_sha256": [hash_key(self.api_key)]}
        if self.limits:
            out["limits"] = dict(self.limits)
        if self.allowed_models is not None:
            out["allowed_models"] = list(self.allowed_models)
        if self.allowed_adapters:
            out["allowed_adapters"] = list(self.allowed_adapters)
        if self.price_in_per_1k or self.price_out_per_1k:
            out["price_per_1k_input_tokens"] = self.price_in_per_1k
            out["price_per_1k_output_tokens"] = self.price_out_per_1k
        return {**out, **self.extra}


def gateway_config(tenants, models: dict | None = None, default_model: str = "tensorrt_llm", **routing) -> dict:
    """The config for these tenants. `models`: model name -> max_context_tokens, or -> its full catalog entry
    (default: the one engine model with 8,192 tokens); `routing`: more routing fields (degrade_to, ...).
    Checked by the gateway's own parser, so a test config the gateway would refuse fails here, at once."""
    tenants = list(tenants)
    names = [t.name for t in tenants]
    keys = [t.api_key for t in tenants]
    if len(set(names)) != len(names) or len(set(keys)) != len(keys):
        raise ValueError(f"tenant names and keys must be distinct: {names}")
    models = models or {"tensorrt_llm": 8192}
    raw = {"routing": {"default_model": default_model,
                       "models": {m: v if isinstance(v, dict) else {"max_context_tokens": v}
                                  for m, v in models.items()}, **routing},
           "tenants": {t.name: t.entry() for t in tenants}}
    parse_config(raw)
    return raw


def write_config(path: Path, config: dict) -> Path:
    path = Path(path)
    path.write_text(yaml.safe_dump(config))
    return path


def write_tenants(path: Path, tenants, **kw) -> Path:
    """`gateway_config(tenants, **kw)` written to `path` (YAML): the `gateway_config` knob's value."""
    return write_config(path, gateway_config(tenants, **kw))


# -- the shared stack's tenants ------------------------------------------------------------------------
# tensorrt_llm_big is listed but not served: /v1/models lists it for tenants allowed every model, and a
# tenant limited to tensorrt_llm is refused it (tests/front/test_front_server.py)
STANDARD_MODELS = {"tensorrt_llm": 8192, "tensorrt_llm_big": 8192}
STANDARD_TENANTS = (
    # tests/front/test_front_server.py; a 2,048-token context window, so a long prompt overflows it
    Tenant("front", limits={"max_context_tokens": 2048}),
    Tenant("front-standard", tier="standard", allowed_models=("tensorrt_llm",)),
    Tenant("front-solo", tier="free", limits={"max_concurrent": 1}),
    # tests/front/test_responses_api.py
    Tenant("responses", limits={"max_output_tokens": 200}),
    Tenant("responses-other", limits={"max_output_tokens": 200}),  # another tenant: sees none of its responses
    Tenant("responses-unstored", extra={"sessions": False}),  # keeps no conversations: stores no response
    Tenant("responses-window", limits={"max_context_tokens": 400}),  # a conversation soon over its window
    Tenant("responses-small-store", extra={"sessions": {"max_bytes": 4096}}),  # a long response is not kept
    # tests/front/test_tools_structured.py
    Tenant("tools", allowed_adapters=("demo-support",)),
    # tests/front/test_fuzz.py: never refused for volume, limits are not what it tests
    Tenant("fuzz", limits={"requests_per_minute": 10**7, "tokens_per_minute": 10**9, "max_concurrent": 64}),
    # tests/load/test_loadtest_front.py: load runs whose limits never throttle
    Tenant("loadtest", limits={"requests_per_minute": 10**6, "tokens_per_minute": 10**9, "max_concurrent": 64}),
)
# and the demo tenants of deploy/gateway.example.yaml as written there (acme, globex, hobbyist, nightly;
# their keys, sk-demo-*, are in docs/gateway.md): what the clients, the load-test profile and the
# perf_analyzer tests send with, as against `make serve`
DEMO_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "gateway.example.yaml"


def standard_config() -> dict:
    raw = gateway_config(STANDARD_TENANTS, models=STANDARD_MODELS)
    demo = yaml.safe_load(DEMO_CONFIG.read_text())
    clash = set(raw["tenants"]) & set(demo["tenants"])
    if clash:
        raise ValueError(f"standard tenants named like demo tenants: {sorted(clash)}")
    raw["tenants"].update(demo["tenants"])
    raw["tiers"] = demo.get("tiers") or {}
    parse_config(raw)
    return raw
