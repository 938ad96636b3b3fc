"""The models the gateway serves, typed once at config load: local engine models and upstream
OpenAI-compatible providers, each with its context window, prices, eligible tiers, fallbacks and the
capability the `auto` classifier reads (gateway/classify.py).

A model entry of `routing.models` is a local engine model unless it has a `provider` block:

    gpt-4o-mini:
      max_context_tokens: 128000
      price_per_1k_input_tokens: 0.00015     # what the ledger charges for this model (else the tenant's)
      price_per_1k_output_tokens: 0.0006
      tiers: [enterprise, standard]          # who may be routed here (default: every tier)
      capability: 3                          # 1 (small) .. 3 (strong): what `auto` needs for hard prompts
      fallback: [tensorrt_llm]               # tried in order when this one cannot answer
      provider:
        name: openai                         # recorded in the ledger (default: the base URL's host)
        base_url: https://api.openai.com/v1
        model: gpt-4o-mini                   # the upstream's own name
        api_key_env: OPENAI_API_KEY          # or api_key_file: /run/secrets/openai (read by the front)

The key itself never enters this config, the gateway, the lease or a log line: the front, the process
that calls the upstream, reads it from its environment or the file when it calls.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlparse

MODEL_FIELDS = ("max_context_tokens", "price_per_1k_input_tokens", "price_per_1k_output_tokens", "tiers",
                "capability", "fallback", "provider", "auto")
PROVIDER_FIELDS = ("name", "base_url", "model", "api_key_env", "api_key_file", "connect_timeout_s",
                   "first_byte_timeout_s", "idle_timeout_s", "max_retries", "backoff_base_s", "backoff_max_s",
                   "max_retry_after_s", "breaker")
BREAKER_FIELDS = ("window_s", "min_requests", "error_rate", "slow_ttft_s", "open_s", "probe_interval_s")


class CatalogError(ValueError):
    pass


@dataclass(frozen=True)
class BreakerSettings:
    """When an upstream's circuit opens: at least `min_requests` outcomes in the last `window_s` seconds
    of which at least `error_rate` failed (a first token later than `slow_ttft_s` counts as a failure);
    it stays open `open_s`, then lets one probe through every `probe_interval_s` until one succeeds."""
    window_s: float = 30.0
    min_requests: int = 3
    error_rate: float = 0.5
    slow_ttft_s: float = 20.0
    open_s: float = 10.0
    probe_interval_s: float = 2.0


@dataclass(frozen=True)
class Upstream:
    """An OpenAI-compatible endpoint; `route()` is what the front is told (never the key)."""
    name: str
    base_url: str
    model: str
    api_key_env: str | None = None
    api_key_file: str | None = None
    connect_timeout_s: float = 5.0
    first_byte_timeout_s: float = 30.0  # request sent -> first token: past it, the try failed
    idle_timeout_s: float = 60.0  # between two chunks once streaming
    max_retries: int = 2  # more tries of the same upstream, only before the first token
    backoff_base_s: float = 0.2  # full jitter: sleep uniform(0, min(max, base * 2**try))
    backoff_max_s: float = 2.0
    max_retry_after_s: float = 5.0  # an upstream's Retry-After longer than this: fall back instead of waiting
    breaker: BreakerSettings = field(default_factory=BreakerSettings)

    def route(self) -> dict:
        return {"name": self.name, "base_url": self.base_url, "model": self.model,
                "api_key_env": self.api_key_env, "api_key_file": self.api_key_file,
                "connect_timeout_s": self.connect_timeout_s, "first_byte_timeout_s": self.first_byte_timeout_s,
                "idle_timeout_s": self.idle_timeout_s, "max_retries": self.max_retries,
                "backoff_base_s": self.backoff_base_s, "backoff_max_s": self.backoff_max_s,
                "max_retry_after_s": self.max_retry_after_s}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    max_context_tokens: int | None = None
    price_in_per_1k: float | None = None  # None: the tenant's price
    price_out_per_1k: float | None = None
    tiers: tuple[str, ...] | None = None  # None: every tier
    capability: int = 1
    fallback: tuple[str, ...] = ()
    auto: bool = True  # a candidate of the `auto` classifier (when it is on)
    upstream: Upstream | None = None

    @property
    def provider(self) -> str:
        """What the ledger records: the upstream's name, or "local" for an engine model."""
        return self.upstream.name if self.upstream is not None else "local"

    def eligible(self, tier: str) -> bool:
        return self.tiers is None or tier in self.tiers

    def cost(self, tenant, n_in: int, n_out: int) -> float:
        """The model's prices where it sets them, else the tenant's."""
        p_in = tenant.price_in_per_1k if self.price_in_per_1k is None else self.price_in_per_1k
        p_out = tenant.price_out_per_1k if self.price_out_per_1k is None else self.price_out_per_1k
        return n_in / 1000 * p_in + n_out / 1000 * p_out

    def price_per_1k(self, tenant) -> float:
        """Input plus output price per 1k tokens: the order `auto` prefers (cheapest first)."""
        p_in = tenant.price_in_per_1k if self.price_in_per_1k is None else self.price_in_per_1k
        p_out = tenant.price_out_per_1k if self.price_out_per_1k is None else self.price_out_per_1k
        return p_in + p_out


def _number(where: str, value, lo: float = 0.0, integer: bool = False, positive: bool = False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise CatalogError(f"{where}: must be {'an integer' if integer else 'a number'}, got {value!r}")
    if value < lo or (positive and value <= 0):
        raise CatalogError(f"{where}: must be {'> 0' if positive else f'>= {lo:g}'}, got {value!r}")
    return value


def _strings(where: str, value) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise CatalogError(f"{where}: must be a list of names")
    return tuple(value)


def _unknown(where: str, spec: dict, known) -> None:
    extra = set(spec) - set(known)
    if extra:
        raise CatalogError(f"{where}: unknown field(s) {', '.join(sorted(extra))} (known: {', '.join(known)})")


def parse_breaker(where: str, raw) -> BreakerSettings:
    if raw is None:
        return BreakerSettings()
    if not isinstance(raw, dict):
        raise CatalogError(f"{where}: must be a mapping")
    _unknown(where, raw, BREAKER_FIELDS)
    kw = {}
    for k, v in raw.items():
        if k == "min_requests":
            kw[k] = _number(f"{where}.{k}", v, 1, integer=True)
        elif k == "error_rate":
            kw[k] = float(_number(f"{where}.{k}", v, positive=True))
            if kw[k] > 1:
                raise CatalogError(f"{where}.error_rate: must be in (0, 1], got {v!r}")
        else:
            kw[k] = float(_number(f"{where}.{k}", v, positive=True))
    return BreakerSettings(**kw)


def parse_upstream(where: str, raw) -> Upstream:
    if not isinstance(raw, dict):
        raise CatalogError(f"{where}: must be a mapping")
    _unknown(where, raw, PROVIDER_FIELDS)
    base_url, model = raw.get("base_url"), raw.get("model")
    parsed = urlparse(base_url) if isinstance(base_url, str) else None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise CatalogError(f"{where}.base_url: must be an http(s) URL such as https://api.openai.com/v1")
    if parsed.username or parsed.password or parsed.query:
        raise CatalogError(f"{where}.base_url: no credentials or query in the URL (use api_key_env / api_key_file)")
    if not isinstance(model, str) or not model:
        raise CatalogError(f"{where}.model: the upstream's model name is required")
    env, path = raw.get("api_key_env"), raw.get("api_key_file")
    if env is not None and path is not None:
        raise CatalogError(f"{where}: api_key_env or api_key_file, not both")
    for k, v in (("api_key_env", env), ("api_key_file", path)):
        if v is not None and (not isinstance(v, str) or not v):
            raise CatalogError(f"{where}.{k}: must be a non-empty string")
    name = raw.get("name", parsed.hostname)
    if not isinstance(name, str) or not name:
        raise CatalogError(f"{where}.name: must be a non-empty string")
    kw = {}
    for k in ("connect_timeout_s", "first_byte_timeout_s", "idle_timeout_s", "backoff_base_s", "backoff_max_s"):
        if k in raw:
            kw[k] = float(_number(f"{where}.{k}", raw[k], positive=True))
    if "max_retry_after_s" in raw:
        kw["max_retry_after_s"] = float(_number(f"{where}.max_retry_after_s", raw["max_retry_after_s"]))
    if "max_retries" in raw:
        kw["max_retries"] = _number(f"{where}.max_retries", raw["max_retries"], 0, integer=True)
    return Upstream(name=name, base_url=base_url.rstrip("/"), model=model, api_key_env=env, api_key_file=path,
                    breaker=parse_breaker(f"{where}.breaker", raw.get("breaker")), **kw)


def parse_catalog(models: dict, tiers) -> dict[str, ModelSpec]:
    """`routing.models` -> {name: ModelSpec}; every reference (fallback, tiers) checked."""
    if not isinstance(models, dict) or not models:
        raise CatalogError("routing.models: must be a non-empty mapping of model name -> settings")
    catalog = {}
    for name, spec in models.items():
        where = f"routing.models.{name}"
        spec = {} if spec is None else spec
        if not isinstance(spec, dict):
            raise CatalogError(f"{where}: must be a mapping")
        _unknown(where, spec, MODEL_FIELDS)
        ctx = spec.get("max_context_tokens")
        prices = {}
        for key, attr in (("price_per_1k_input_tokens", "price_in_per_1k"),
                          ("price_per_1k_output_tokens", "price_out_per_1k")):
            if key in spec:
                prices[attr] = float(_number(f"{where}.{key}", spec[key]))
        spec_tiers = _strings(f"{where}.tiers", spec["tiers"]) if "tiers" in spec else None
        for t in spec_tiers or ():
            if t not in tiers:
                raise CatalogError(f"{where}.tiers: unknown tier {t!r} (known: {', '.join(tiers)})")
        auto = spec.get("auto", True)
        if not isinstance(auto, bool):
            raise CatalogError(f"{where}.auto: must be true or false")
        catalog[name] = ModelSpec(
            name=name,
            max_context_tokens=None if ctx is None else _number(f"{where}.max_context_tokens", ctx, 1, integer=True),
            tiers=spec_tiers,
            capability=_number(f"{where}.capability", spec.get("capability", 1), 1, integer=True),
            fallback=_strings(f"{where}.fallback", spec["fallback"]) if "fallback" in spec else (),
            auto=auto,
            upstream=parse_upstream(f"{where}.provider", spec["provider"]) if "provider" in spec else None,
            **prices)
    for name, spec in catalog.items():
        for f in spec.fallback:
            if f not in catalog or f == name:
                raise CatalogError(f"routing.models.{name}.fallback: {f!r} is not another model of routing.models")
    return catalog
