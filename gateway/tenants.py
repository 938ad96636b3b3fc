"""Tenants, tiers and routing from one gateway config file (YAML or JSON), validated at load and
reloaded when the file changes.

API keys are stored only as SHA-256 hex digests; a tenant is found from the key alone.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from gateway.response_cache import CachePolicy, CachePolicyError, parse_cache_policy
from gateway.sessions import SessionPolicy, SessionPolicyError, parse_session_policy
from gateway.catalog import CatalogError, ModelSpec, parse_catalog
from contracts.errors import ServingError
from contracts.tensors import LOOKAHEAD_INPUTS

LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent", "max_context_tokens",
                "max_output_tokens", "max_prompt_bytes", "max_tokenizing", "kv_share_percent")
# max_prompt_bytes: the prompt's UTF-8 bytes (text or all messages), checked before tokenizing, so a prompt
#   the tenant's context could never hold costs no tokenizer time (a token is rarely over 8 bytes: 16 per
#   token of max_context_tokens leaves room for odd text);
# max_tokenizing: the tenant's prompts being tokenized at once (the tokenizer is shared by every tenant);
# kv_share_percent: the share of an engine's KV cache the tenant's requests may hold while another
#   tenant's request waits for room (gateway/admission.py)
DEFAULT_TIERS = {  # priority: lower is served first
    "enterprise": {"priority": 0, "requests_per_minute": 600, "tokens_per_minute": 200_000,
                   "max_concurrent": 32, "max_context_tokens": 8192, "max_output_tokens": 2048,
                   "max_prompt_bytes": 131072, "max_tokenizing": 4, "kv_share_percent": 60, "degrade": False},
    "standard": {"priority": 1, "requests_per_minute": 120, "tokens_per_minute": 50_000,
                 "max_concurrent": 8, "max_context_tokens": 4096, "max_output_tokens": 1024,
                 "max_prompt_bytes": 65536, "max_tokenizing": 2, "kv_share_percent": 50, "degrade": True},
    "free": {"priority": 2, "requests_per_minute": 20, "tokens_per_minute": 5_000,
             "max_concurrent": 2, "max_context_tokens": 2048, "max_output_tokens": 256,
             "max_prompt_bytes": 32768, "max_tokenizing": 1, "kv_share_percent": 25, "degrade": True},
    "batch": {"priority": 3, "requests_per_minute": 60, "tokens_per_minute": 100_000,
              "max_concurrent": 4, "max_context_tokens": 8192, "max_output_tokens": 2048,
              "max_prompt_bytes": 131072, "max_tokenizing": 1, "kv_share_percent": 50, "degrade": True},
}


class ConfigError(ValueError):
    pass


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Tenant:
    name: str
    tier: str
    priority: int
    limits: dict  # LIMIT_FIELDS -> int
    allowed_models: tuple[str, ...]
    allowed_adapters: tuple[str, ...]
    price_in_per_1k: float
    price_out_per_1k: float
    degrade: bool
    response_cache: CachePolicy | None = None  # opt-in (gateway/response_cache.py)
    sessions: SessionPolicy | None = SessionPolicy()  # on unless `sessions: false` (gateway/sessions.py)
    auto_max_price_per_1k: float | None = None  # `auto` (classifier) never picks a model priced above this
    # speculative decoding: the (w, n, g) the engine gets for this tenant's requests (TensorRT-LLM's
    # lookahead inputs); None: the engine's own default; (1, 1, 0): off
    lookahead: tuple[int, int, int] | None = None

    def lookahead_inputs(self) -> dict | None:
        """The engine inputs that carry `lookahead`, by name (None when the engine decides)."""
        if self.lookahead is None:
            return None
        return dict(zip(LOOKAHEAD_INPUTS, self.lookahead))

    def model_refusal(self, spec: ModelSpec) -> ServingError | None:
        """Why this tenant may not use a model (its `allowed_models`, the model's `tiers`), or None: the one
        place tenant model permission is decided. Requests, routing, fallbacks, the model list and the
        response cache all ask here."""
        if "*" not in self.allowed_models and spec.name not in self.allowed_models:
            return ServingError("permission_denied", f"tenant '{self.name}' may not use model {spec.name!r}",
                                field="model")
        if not spec.eligible(self.tier):
            return ServingError("permission_denied", f"model {spec.name!r} is not available to the {self.tier} "
                                "tier", field="model")
        return None

    def may_use(self, spec: ModelSpec) -> bool:
        return self.model_refusal(spec) is None

    def output_refusal(self, max_tokens: int) -> ServingError | None:
        """max_tokens over the tenant's output quota (its policy; what a model can hold: routing.context_refusal)."""
        quota = self.limits["max_output_tokens"]
        if max_tokens <= quota:
            return None
        return ServingError("context_too_long", f"max_tokens {max_tokens} is over tenant '{self.name}''s quota of "
                            f"{quota} output tokens", field="max_tokens")

    def context_refusal(self, prompt_tokens: int, max_tokens: int) -> ServingError | None:
        """Prompt + max_tokens over the tenant's context quota (its policy, decided here only)."""
        quota = self.limits["max_context_tokens"]
        if prompt_tokens + max_tokens <= quota:
            return None
        return ServingError("context_too_long", f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) is "
                            f"over tenant '{self.name}''s quota of {quota} context tokens", field="max_tokens")

    def allows_adapter(self, adapter: str) -> bool:
        return "*" in self.allowed_adapters or adapter in self.allowed_adapters

    def cost(self, input_tokens: int, output_tokens: int) -> float:
        return input_tokens / 1000 * self.price_in_per_1k + output_tokens / 1000 * self.price_out_per_1k


@dataclass
class Routing:
    default_model: str = "tensorrt_llm"
    models: dict = field(default_factory=lambda: {"tensorrt_llm": {"max_context_tokens": 8192}})
    degrade_to: dict = field(default_factory=dict)  # model -> smaller model when saturated
    auto_long_prompt_tokens: int = 1024  # `auto`: prompts at least this long go to the default model
    # `auto`: "default" (the default model, or its degrade_to for short prompts of degradable tiers) or
    # "classifier" (complexity and cost among every eligible model, local or upstream: gateway/classify.py)
    auto_policy: str = "default"


@dataclass
class GatewayConfig:
    tenants: dict[str, Tenant]  # by key hash
    tiers: dict[str, dict]
    routing: Routing
    catalog: dict[str, ModelSpec] = field(default_factory=dict)  # routing.models, typed (gateway/catalog.py)

    def authenticate(self, key: str | None) -> Tenant | None:
        return self.tenants.get(hash_key(key)) if key else None


def _positive_int(where: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{where}: must be a positive integer, got {value!r}")
    return value


def _percent(where: str, value) -> int:
    if value > 100:
        raise ConfigError(f"{where}: must be a percentage from 1 to 100, got {value!r}")
    return value


def _price(where: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ConfigError(f"{where}: must be a number >= 0, got {value!r}")
    return float(value)


def _str_list(where: str, value) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}: must be a list of strings")
    return tuple(value)


def _lookahead(where: str, value) -> tuple[int, int, int] | None:
    """A tenant's `speculative_decoding`: absent (the engine's default), `off`, or {window_size,
    ngram_size, verification_set_size} (TensorRT-LLM's lookahead (w, n, g); the engine bounds them)."""
    if value is None:
        return None
    if value == "off" or value is False:
        return (1, 1, 0)
    names = ("window_size", "ngram_size", "verification_set_size")
    if not isinstance(value, dict) or set(value) - set(names) or set(names) - set(value):
        raise ConfigError(f"{where}: must be 'off' or a mapping with exactly {', '.join(names)}")
    out = []
    for n, low in zip(names, (1, 1, 0)):
        v = value[n]
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ConfigError(f"{where}.{n}: must be an integer >= {low}, got {v!r}")
        out.append(v)
    return tuple(out)


def parse_config(raw: dict) -> GatewayConfig:
    if not isinstance(raw, dict):
        raise ConfigError("the gateway config must be a mapping with 'tenants'")
    tiers = {k: dict(v) for k, v in DEFAULT_TIERS.items()}
    for name, spec in (raw.get("tiers") or {}).items():
        if not isinstance(spec, dict):
            raise ConfigError(f"tiers.{name}: must be a mapping")
        unknown = set(spec) - set(LIMIT_FIELDS) - {"priority", "degrade"}
        if unknown:
            raise ConfigError(f"tiers.{name}: unknown field(s) {', '.join(sorted(unknown))}")
        tiers.setdefault(name, {"priority": 10, "degrade": True, **DEFAULT_TIERS["standard"]})
        tiers[name].update(spec)
    for name, spec in tiers.items():
        for f in LIMIT_FIELDS:
            _positive_int(f"tiers.{name}.{f}", spec[f])
        _percent(f"tiers.{name}.kv_share_percent", spec["kv_share_percent"])
        if not isinstance(spec["priority"], int):
            raise ConfigError(f"tiers.{name}.priority: must be an integer")
    routing_raw = raw.get("routing") or {}
    routing = Routing(**{k: v for k, v in routing_raw.items() if k in Routing.__dataclass_fields__})
    unknown = set(routing_raw) - set(Routing.__dataclass_fields__)
    if unknown:
        raise ConfigError(f"routing: unknown field(s) {', '.join(sorted(unknown))}")
    if routing.default_model not in routing.models:
        raise ConfigError(f"routing.default_model: {routing.default_model!r} is not in routing.models")
    for src, dst in routing.degrade_to.items():
        if src not in routing.models or dst not in routing.models:
            raise ConfigError(f"routing.degrade_to.{src}: both models must be in routing.models")
    if routing.auto_policy not in ("default", "classifier"):
        raise ConfigError(f"routing.auto_policy: must be 'default' or 'classifier', got {routing.auto_policy!r}")
    try:
        catalog = parse_catalog(routing.models, tiers)
    except CatalogError as e:
        raise ConfigError(str(e)) from None
    tenants: dict[str, Tenant] = {}
    entries = raw.get("tenants")
    if not isinstance(entries, dict) or not entries:
        raise ConfigError("tenants: must be a non-empty mapping of tenant name -> settings")
    for name, spec in entries.items():
        where = f"tenants.{name}"
        if not isinstance(spec, dict):
            raise ConfigError(f"{where}: must be a mapping")
        tier = spec.get("tier", "standard")
        if tier not in tiers:
            raise ConfigError(f"{where}.tier: unknown tier {tier!r} (known: {', '.join(tiers)})")
        limits = {f: tiers[tier][f] for f in LIMIT_FIELDS}
        for f, v in (spec.get("limits") or {}).items():
            if f not in LIMIT_FIELDS:
                raise ConfigError(f"{where}.limits.{f}: unknown limit (known: {', '.join(LIMIT_FIELDS)})")
            limits[f] = _positive_int(f"{where}.limits.{f}", v)
        _percent(f"{where}.limits.kv_share_percent", limits["kv_share_percent"])
        hashes = spec.get("api_key_sha256")
        hashes = [hashes] if isinstance(hashes, str) else hashes
        if not hashes or not all(isinstance(h, str) and len(h) == 64 and all(c in "0123456789abcdef" for c in h)
                                 for h in hashes):
            raise ConfigError(f"{where}.api_key_sha256: must be one or more lowercase SHA-256 hex digests")
        tenant = Tenant(
            name=name, tier=tier, priority=int(spec.get("priority", tiers[tier]["priority"])), limits=limits,
            allowed_models=_str_list(f"{where}.allowed_models", spec.get("allowed_models", ["*"])),
            allowed_adapters=_str_list(f"{where}.allowed_adapters", spec.get("allowed_adapters", [])),
            price_in_per_1k=_price(f"{where}.price_per_1k_input_tokens", spec.get("price_per_1k_input_tokens", 0)),
            price_out_per_1k=_price(f"{where}.price_per_1k_output_tokens", spec.get("price_per_1k_output_tokens", 0)),
            degrade=bool(spec.get("degrade", tiers[tier]["degrade"])),
            **_conversation_policies(where, spec),
            auto_max_price_per_1k=None if spec.get("auto_max_price_per_1k") is None else _price(
                f"{where}.auto_max_price_per_1k", spec["auto_max_price_per_1k"]),
            lookahead=_lookahead(f"{where}.speculative_decoding", spec.get("speculative_decoding")),
        )
        for h in hashes:
            if h in tenants:
                raise ConfigError(f"{where}.api_key_sha256: key already belongs to tenant {tenants[h].name!r}")
            tenants[h] = tenant
    return GatewayConfig(tenants, tiers, routing, catalog)


def _conversation_policies(where: str, spec: dict) -> dict:
    try:
        return {"response_cache": parse_cache_policy(f"{where}.response_cache", spec.get("response_cache")),
                "sessions": parse_session_policy(f"{where}.sessions", spec.get("sessions"))}
    except (CachePolicyError, SessionPolicyError) as e:
        raise ConfigError(str(e)) from None


def load_config(path: str | Path) -> GatewayConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read gateway config {path}: {e.strerror}") from None
    try:
        raw = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {e}") from None
    return parse_config(raw)


class ConfigWatcher:
    """Holds the current config; `get()` reloads it when the file's mtime changes (checked at most
    every `interval` seconds). A broken edit keeps the last good config and reports the error."""

    def __init__(self, path: str | Path, interval: float = 1.0, on_error=None):
        self.path = Path(path)
        self.interval = interval
        self.on_error = on_error or (lambda e: None)
        self.config = load_config(self.path)
        self.mtime = os.stat(self.path).st_mtime_ns
        self.checked = time.monotonic()

    def get(self) -> GatewayConfig:
        now = time.monotonic()
        if now - self.checked >= self.interval:
            self.checked = now
            try:
                mtime = os.stat(self.path).st_mtime_ns
                if mtime != self.mtime:
                    self.config, self.mtime = load_config(self.path), mtime
            except (OSError, ConfigError) as e:
                self.on_error(e)
        return self.config
