"""The tenant-scoped exact-match response cache: a deterministic request asked again returns the answer
it got before, without engine work.

Opt-in per tenant (`response_cache:` in the gateway config). Only deterministic requests are cached:
temperature 0, top_k 1, or a seed (the engine's answer is then a function of the request). The key is a
SHA-256 digest of the tenant and every field of the request but those that say who asks and how the answer
travels (NOT_IN_KEY): prompt, messages or token ids, tools, all sampling values, stop and bad words,
max_tokens, ignore_eos, logit_bias, the guide, and whatever field is added later; a change in any of them
is another entry, and no entry is ever shared between tenants (the tenant is inside the
digest, and a hit is checked against the tenant stored with it). How a request is delivered (streamed or
not, the caller's name for it: `stream_id`) is not part of the key: the answer is the same.

A hit still goes through the gateway's policy (gateway/core.py): the caller is authenticated, the model
and adapter must still be allowed, the tenant's request and token budgets are charged, and the usage ledger
records it, costed as the tenant's `billing` says (`full`: as the answer first cost; `free`: 0).
A store that does not answer is a miss (counted as `error`), never a failed request.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields, is_dataclass

from gateway.kv_store import MemoryKV, RedisKV

BILLING = ("full", "free")
MAX_ANSWER_BYTES = 1 << 20  # longer answers are served but not kept


class CachePolicyError(ValueError):
    pass


@dataclass(frozen=True)
class CachePolicy:
    """A tenant's `response_cache:` settings."""
    ttl_s: float = 3600.0
    billing: str = "full"  # BILLING: what a hit costs in the ledger (the rate limits count its tokens either way)


def parse_cache_policy(where: str, raw) -> CachePolicy | None:
    """`response_cache: true` (defaults), a mapping {enabled, ttl_s, billing}, or absent / false (off)."""
    if raw is None or raw is False:
        return None
    if raw is True:
        return CachePolicy()
    if not isinstance(raw, dict):
        raise CachePolicyError(f"{where}: must be true, false or a mapping with ttl_s / billing")
    unknown = set(raw) - {"enabled", "ttl_s", "billing"}
    if unknown:
        raise CachePolicyError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    if raw.get("enabled", True) is False:
        return None
    ttl = raw.get("ttl_s", CachePolicy.ttl_s)
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or ttl <= 0:
        raise CachePolicyError(f"{where}.ttl_s: must be a number of seconds > 0, got {ttl!r}")
    billing = raw.get("billing", "full")
    if billing not in BILLING:
        raise CachePolicyError(f"{where}.billing: must be one of {', '.join(BILLING)}, got {billing!r}")
    return CachePolicy(float(ttl), billing)


def is_deterministic(sampling) -> bool:
    """The engine's answer depends on the request alone: greedy (temperature 0 or top_k 1) or seeded."""
    return sampling.temperature == 0 or sampling.top_k == 1 or sampling.seed is not None


# GatewayRequest fields that do not shape the answer: who asks and how it is delivered or accounted.
# Every other field, present or added later, is part of the key.
# `prepared`: the prompt's tokens as the front made them, by the same preprocessor the gateway would call
# on the prompt fields that are in the key (a request tokenized by either has one entry)
NOT_IN_KEY = frozenset({"api_key", "stream", "request_id", "stream_id", "on_behalf_of", "tier", "batch_id", "front_key",
                        "lease", "session_id", "kv_retention", "lookahead", "user", "prepared", "prompt_cache_key"})


def _canonical(value):
    """A JSON-ready form that is equal exactly when the values are: bytes as text, dataclasses as their
    fields, mappings as sorted (key, value) pairs whatever their key types."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"bytes": bytes(value).decode("utf-8", "surrogateescape")}
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _canonical(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, dict):
        return sorted(([repr(k), _canonical(v)] for k, v in value.items()), key=lambda kv: kv[0])
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if hasattr(value, "tolist"):  # numpy
        return value.tolist()
    return value


def cache_key(tenant: str, req) -> str | None:
    """The entry's digest for a generate request (gateway/core.py GatewayRequest), or None when it is
    not cacheable (not deterministic). `model` "auto" and an absent one are the same ask."""
    if not is_deterministic(req.sampling):
        return None
    asked = {f.name: _canonical(getattr(req, f.name)) for f in fields(req) if f.name not in NOT_IN_KEY}
    asked["model"] = req.model or "auto"
    canonical = json.dumps({"tenant": tenant, "request": asked}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8", "surrogateescape")).hexdigest()


@dataclass(frozen=True)
class CachedAnswer:
    tenant: str
    text: str
    model: str
    finish_reason: str
    num_input_tokens: int
    num_output_tokens: int

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "CachedAnswer | None":
        try:
            d = json.loads(raw)
            return cls(str(d["tenant"]), str(d["text"]), str(d["model"]), str(d["finish_reason"]),
                       int(d["num_input_tokens"]), int(d["num_output_tokens"]))
        except (ValueError, KeyError, TypeError):
            return None  # not ours, or from an older layout: a miss


class ResponseCache:
    PREFIX = "llm:rcache:"

    def __init__(self, store: MemoryKV | RedisKV, metrics):
        self.store, self.metrics = store, metrics

    async def get(self, tenant: str, key: str) -> CachedAnswer | None:
        try:
            raw = await self.store.get(self.PREFIX + key)
        except Exception:  # noqa: BLE001 - an unreachable store is a miss
            self.metrics.response_cache(tenant, "error")
            return None
        answer = CachedAnswer.from_bytes(raw) if raw is not None else None
        if answer is None or answer.tenant != tenant:
            self.metrics.response_cache(tenant, "miss")
            return None
        self.metrics.response_cache(tenant, "hit")
        return answer

    async def put(self, key: str, answer: CachedAnswer, policy: CachePolicy) -> None:
        raw = answer.to_bytes()
        if len(raw) > MAX_ANSWER_BYTES:
            return
        try:
            await self.store.set(self.PREFIX + key, raw, policy.ttl_s)
            self.metrics.response_cache(answer.tenant, "stored")
        except Exception:  # noqa: BLE001 - the answer was served; keeping it is best effort
            self.metrics.response_cache(answer.tenant, "error")
