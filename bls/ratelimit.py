"""Token-based rate limits: requests/min and tokens/min buckets with continuous refill, plus a
concurrency cap, per tenant.

Admission reserves exact prompt tokens + max_tokens; `settle` refunds what was not generated and
frees the concurrency slot. Check-and-debit is atomic (one event-loop turn in memory, one Lua script in
Redis), so concurrent clients can never overshoot a bucket. With Redis, several gateway processes or
servers share one budget; if Redis is unreachable the `fail_open` / `fail_closed` policy applies.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from bls.errors import ServingError

log = logging.getLogger("gateway.ratelimit")


@dataclass
class Reservation:
    tenant: str
    tokens: int
    backend: str  # memory | redis | bypass (fail_open while Redis is down)
    settled: bool = False


def _rate_limited(tenant: str, what: str, retry_after: float) -> ServingError:
    return ServingError("rate_limited", f"tenant '{tenant}': {what} limit reached",
                        retry_after=max(retry_after, 0.001))


def _concurrency(tenant: str, limit: int) -> ServingError:
    return ServingError("rate_limited", f"tenant '{tenant}': {limit} concurrent requests already running",
                        retry_after=1.0)


def _check_fits(tenant: str, tpm: int, tokens: int) -> None:
    """A request larger than the whole bucket could never be admitted: say so instead of 429 forever."""
    if tokens > tpm:
        raise ServingError("context_too_long", f"tenant '{tenant}': request needs {tokens} tokens, "
                           f"more than its whole tokens/min budget of {tpm}", field="max_tokens")


class MemoryLimiter:
    """In-process buckets: correct for one gateway instance (its requests share one event loop)."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.buckets: dict[tuple[str, str], tuple[float, float]] = {}  # (tenant, kind) -> (level, stamp)
        self.inflight: dict[str, int] = {}
        self.reserved: dict[str, int] = {}

    def _level(self, tenant, kind, capacity, now) -> float:
        level, stamp = self.buckets.get((tenant, kind), (float(capacity), now))
        return min(float(capacity), level + (now - stamp) * capacity / 60.0)

    async def acquire(self, tenant: str, limits: dict, tokens: int) -> Reservation:
        now = self.clock()
        rpm, tpm, conc = limits["requests_per_minute"], limits["tokens_per_minute"], limits["max_concurrent"]
        _check_fits(tenant, tpm, tokens)
        r_level, t_level = self._level(tenant, "rpm", rpm, now), self._level(tenant, "tpm", tpm, now)
        if self.inflight.get(tenant, 0) >= conc:
            raise _concurrency(tenant, conc)
        if r_level < 1:
            raise _rate_limited(tenant, "requests/min", (1 - r_level) * 60.0 / rpm)
        if t_level < tokens:
            raise _rate_limited(tenant, "tokens/min", (tokens - t_level) * 60.0 / tpm)
        self.buckets[(tenant, "rpm")] = (r_level - 1, now)
        self.buckets[(tenant, "tpm")] = (t_level - tokens, now)
        self.inflight[tenant] = self.inflight.get(tenant, 0) + 1
        self.reserved[tenant] = self.reserved.get(tenant, 0) + tokens
        return Reservation(tenant, tokens, "memory")

    async def settle(self, r: Reservation, limits: dict, used_tokens: int) -> None:
        if r.settled:
            return
        r.settled = True
        now = self.clock()
        tpm = limits["tokens_per_minute"]
        refund = max(0, r.tokens - used_tokens)
        level = self._level(r.tenant, "tpm", tpm, now)
        self.buckets[(r.tenant, "tpm")] = (min(float(tpm), level + refund), now)
        self.inflight[r.tenant] -= 1
        self.reserved[r.tenant] -= r.tokens


# KEYS: rpm bucket, tpm bucket, inflight counter. ARGV: rpm, tpm, max_concurrent, tokens.
# Buckets are hashes {level, stamp_ms}; time comes from the Redis server so all gateways agree.
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rpm, tpm, conc, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local function level(key, cap)
  local v = redis.call('HMGET', key, 'level', 'stamp')
  if not v[1] then return cap end
  return math.min(cap, tonumber(v[1]) + (now - tonumber(v[2])) * cap / 60000.0)
end
local r, k = level(KEYS[1], rpm), level(KEYS[2], tpm)
local inflight = tonumber(redis.call('GET', KEYS[3]) or '0')
if inflight >= conc then return {0, 'concurrency', '1000'} end
if r < 1 then return {0, 'requests/min', tostring(math.ceil((1 - r) * 60000.0 / rpm))} end
if k < cost then return {0, 'tokens/min', tostring(math.ceil((cost - k) * 60000.0 / tpm))} end
redis.call('HSET', KEYS[1], 'level', tostring(r - 1), 'stamp', now)
redis.call('HSET', KEYS[2], 'level', tostring(k - cost), 'stamp', now)
redis.call('PEXPIRE', KEYS[1], 120000)
redis.call('PEXPIRE', KEYS[2], 120000)
redis.call('INCR', KEYS[3])
redis.call('PEXPIRE', KEYS[3], 3600000)
return {1, 'ok', '0'}
"""
# KEYS: tpm bucket, inflight counter. ARGV: tpm, refund tokens.
_SETTLE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local tpm, refund = tonumber(ARGV[1]), tonumber(ARGV[2])
local v = redis.call('HMGET', KEYS[1], 'level', 'stamp')
local k = tpm
if v[1] then k = math.min(tpm, tonumber(v[1]) + (now - tonumber(v[2])) * tpm / 60000.0) end
redis.call('HSET', KEYS[1], 'level', tostring(math.min(tpm, k + refund)), 'stamp', now)
redis.call('PEXPIRE', KEYS[1], 120000)
if tonumber(redis.call('GET', KEYS[2]) or '0') > 0 then redis.call('DECR', KEYS[2]) end
return 1
"""


class RedisLimiter:
    """The same buckets in Redis, shared by every gateway that points at it."""

    def __init__(self, url: str, fail_policy: str = "fail_open", prefix: str = "llmgw", on_backend=None):
        from bls.redis_client import AsyncRedis, Script

        if fail_policy not in ("fail_open", "fail_closed"):
            raise ValueError(f"fail policy must be fail_open or fail_closed, got {fail_policy!r}")
        self.redis = AsyncRedis(url)
        self.fail_policy = fail_policy
        self.prefix = prefix
        self.on_backend = on_backend or (lambda up: None)  # metric hook: True when Redis answered
        self._acquire = Script(self.redis, _ACQUIRE)
        self._settle = Script(self.redis, _SETTLE)
        self.reserved: dict[str, int] = {}

    def _keys(self, tenant):
        p = f"{self.prefix}:{{{tenant}}}"  # hash tag: one slot per tenant on Redis Cluster
        return f"{p}:rpm", f"{p}:tpm", f"{p}:inflight"

    async def acquire(self, tenant: str, limits: dict, tokens: int) -> Reservation:
        tpm = limits["tokens_per_minute"]
        _check_fits(tenant, tpm, tokens)
        try:
            ok, what, retry_ms = await self._acquire(
                keys=list(self._keys(tenant)),
                args=[limits["requests_per_minute"], tpm, limits["max_concurrent"], tokens])
        except Exception as e:  # connection refused, timeout, ...
            self.on_backend(False)
            if self.fail_policy == "fail_closed":
                log.error("redis unreachable (%s): fail_closed, rejecting", e)
                raise ServingError("overloaded", "rate limiter unavailable (fail_closed)", retry_after=1.0) from None
            log.warning("redis unreachable (%s): fail_open, admitting without limits", e)
            return Reservation(tenant, tokens, "bypass")
        self.on_backend(True)
        if not int(ok):
            what = what.decode() if isinstance(what, bytes) else what
            if what == "concurrency":
                raise _concurrency(tenant, limits["max_concurrent"])
            raise _rate_limited(tenant, what, int(retry_ms) / 1000.0)
        self.reserved[tenant] = self.reserved.get(tenant, 0) + tokens
        return Reservation(tenant, tokens, "redis")

    async def settle(self, r: Reservation, limits: dict, used_tokens: int) -> None:
        if r.settled:
            return
        r.settled = True
        if r.backend != "redis":
            return
        self.reserved[r.tenant] -= r.tokens
        rpm_key, tpm_key, inflight_key = self._keys(r.tenant)
        try:
            await self._settle(keys=[tpm_key, inflight_key],
                               args=[limits["tokens_per_minute"], max(0, r.tokens - used_tokens)])
            self.on_backend(True)
        except Exception as e:
            self.on_backend(False)
            log.warning("redis unreachable while settling %s (%s): refund lost", r.tenant, e)
