"""Token-based rate limits: requests/min and tokens/min buckets with continuous refill, plus a
concurrency cap, per tenant.

Admission reserves exact prompt tokens + max_tokens; `settle` refunds what was not generated and
frees the concurrency slot. Check-and-debit is atomic (one event-loop turn in memory, one Lua script in
Redis), so concurrent clients can never overshoot a bucket. With Redis, several gateway processes or
servers share one budget; if Redis is unreachable the `fail_open` / `fail_closed` policy applies.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from dataclasses import dataclass

from contracts.errors import ServingError

log = logging.getLogger("gateway.ratelimit")


@dataclass
class Reservation:
    tenant: str
    tokens: int
    backend: str  # memory | redis | bypass (fail_open while Redis is down)
    settled: bool = False
    id: str = ""  # redis: the member of the tenant's in-flight set that this reservation holds


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

    async def charge(self, tenant: str, limits: dict, tokens: int = 0, refuse: bool = True,
                     requests: int = 1) -> None:
        """Count `requests` requests and `tokens` tokens that hold no reservation (tokenize, detokenize, models,
        usage, a refusal after tokenizing). `refuse`: a 429 instead when the requests/min bucket is empty
        (charged before the work); else the buckets may go below zero (charged after the work: the
        tenant's next requests wait for the refill)."""
        now = self.clock()
        rpm, tpm = limits["requests_per_minute"], limits["tokens_per_minute"]
        r_level, t_level = self._level(tenant, "rpm", rpm, now), self._level(tenant, "tpm", tpm, now)
        if refuse and requests and r_level < requests:
            raise _rate_limited(tenant, "requests/min", (requests - r_level) * 60.0 / rpm)
        if refuse and t_level < max(tokens, 0) and (tokens or t_level < 0):  # short of tokens, or in debt
            raise _rate_limited(tenant, "tokens/min", (max(tokens, 0) - t_level) * 60.0 / tpm)
        self.buckets[(tenant, "rpm")] = (r_level - requests, now)
        self.buckets[(tenant, "tpm")] = (t_level - tokens, now)

    async def check(self, tenant: str, limits: dict) -> None:
        """A 429 now if the tenant has no request left this minute: before work a refusal would waste."""
        now = self.clock()
        rpm = limits["requests_per_minute"]
        r_level = self._level(tenant, "rpm", rpm, now)
        if r_level < 1:
            raise _rate_limited(tenant, "requests/min", (1 - r_level) * 60.0 / rpm)

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


# What every script starts with: the time from the Redis server (so all gateways agree) and a bucket's
# level now (a hash {level, stamp_ms}, refilled at cap per minute since its stamp; a missing one is full).
_NOW_AND_LEVEL = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function level(key, cap)
  local v = redis.call('HMGET', key, 'level', 'stamp')
  if not v[1] then return cap end
  return math.min(cap, tonumber(v[1]) + (now - tonumber(v[2])) * cap / 60000.0)
end
"""


# Concurrency in Redis is a sorted set of the requests in flight (member: the reservation id, score: when
# its lease runs out), not a counter: releasing removes that one member, so a release can be retried, and
# done twice, without ever freeing someone else's slot. A gateway whose acquire timed out cannot know
# whether the script ran (Redis may still execute it once it resumes, even after the connection is gone),
# so it sends a compensating release that also leaves a tombstone for the id: a late acquire of a
# released id does nothing. The lease bounds what a crashed gateway could leave behind.
#
# KEYS: rpm bucket, tpm bucket, in-flight set, released set.
# ARGV: rpm, tpm, max_concurrent, tokens, reservation id, lease ms.
_ACQUIRE = _NOW_AND_LEVEL + """
local rpm, tpm, conc, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local id, lease = ARGV[5], tonumber(ARGV[6])
if redis.call('ZSCORE', KEYS[4], id) then return {0, 'released', '0'} end
if redis.call('ZSCORE', KEYS[3], id) then return {1, 'ok', '0'} end
local r, k = level(KEYS[1], rpm), level(KEYS[2], tpm)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
if redis.call('ZCARD', KEYS[3]) >= conc then return {0, 'concurrency', '1000'} end
if r < 1 then return {0, 'requests/min', tostring(math.ceil((1 - r) * 60000.0 / rpm))} end
if k < cost then return {0, 'tokens/min', tostring(math.ceil((cost - k) * 60000.0 / tpm))} end
redis.call('HSET', KEYS[1], 'level', tostring(r - 1), 'stamp', now)
redis.call('HSET', KEYS[2], 'level', tostring(k - cost), 'stamp', now)
redis.call('PEXPIRE', KEYS[1], 120000)
redis.call('PEXPIRE', KEYS[2], 120000)
redis.call('ZADD', KEYS[3], now + lease, id)
redis.call('PEXPIRE', KEYS[3], lease)
return {1, 'ok', '0'}
"""
# Requests and tokens that hold no reservation (MemoryLimiter.charge / check).
# KEYS: rpm bucket, tpm bucket. ARGV: rpm, tpm, tokens, mode, requests (mode: charge: refuse when empty | debit: never
# refuse, may go below zero | check: refuse when no request is left, debit nothing).
_CHARGE = _NOW_AND_LEVEL + """
local rpm, tpm, cost, mode, n = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4], tonumber(ARGV[5])
local r, k = level(KEYS[1], rpm), level(KEYS[2], tpm)
if mode ~= 'debit' and r < math.max(n, 1) then
  return {0, 'requests/min', tostring(math.ceil((math.max(n, 1) - r) * 60000.0 / rpm))}
end
if mode == 'charge' and k < math.max(cost, 0) and (cost > 0 or k < 0) then
  return {0, 'tokens/min', tostring(math.ceil((cost - k) * 60000.0 / tpm))}
end
if mode == 'check' then return {1, 'ok', '0'} end
redis.call('HSET', KEYS[1], 'level', tostring(r - n), 'stamp', now)
redis.call('HSET', KEYS[2], 'level', tostring(k - cost), 'stamp', now)
redis.call('PEXPIRE', KEYS[1], 120000)
redis.call('PEXPIRE', KEYS[2], 120000)
return {1, 'ok', '0'}
"""
# KEYS: rpm bucket, tpm bucket, in-flight set, released set.
# ARGV: rpm, tpm, reservation id, tokens to refund, compensate (1: the request never ran), lease ms.
# Refunds only when this call removed the member, so retries and duplicates refund nothing.
_RELEASE = _NOW_AND_LEVEL + """
local rpm, tpm, id, refund = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local compensate, lease = ARGV[5] == '1', tonumber(ARGV[6])
if compensate then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
  redis.call('ZADD', KEYS[4], now + lease, id)
  redis.call('PEXPIRE', KEYS[4], lease)
end
if redis.call('ZREM', KEYS[3], id) == 0 then return 0 end
local function refill(key, cap, amount)
  redis.call('HSET', key, 'level', tostring(math.min(cap, level(key, cap) + amount)), 'stamp', now)
  redis.call('PEXPIRE', key, 120000)
end
refill(KEYS[2], tpm, refund)
if compensate then refill(KEYS[1], rpm, 1) end
return 1
"""


class RedisLimiter:
    """The same buckets in Redis, shared by every gateway that points at it.

    Each reservation has an id; its release removes exactly that id, and is retried in the background
    until Redis answers (a stalled Redis must not keep a slot held). An acquire that failed or timed
    out on the way is compensated the same way (see `_ACQUIRE`), so a stall leaves nothing behind."""

    RETRY_S = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0)  # backoff between release attempts, then every 2 s

    def __init__(self, url: str, fail_policy: str = "fail_open", prefix: str = "llmgw", on_backend=None,
                 lease_s: float = 3600.0):
        from gateway.redis_client import AsyncRedis, Script

        if fail_policy not in ("fail_open", "fail_closed"):
            raise ValueError(f"fail policy must be fail_open or fail_closed, got {fail_policy!r}")
        self.redis = AsyncRedis(url)
        self.fail_policy = fail_policy
        self.prefix = prefix
        self.lease_ms = int(lease_s * 1000)
        self.on_backend = on_backend or (lambda up: None)  # metric hook: True when Redis answered
        self._acquire = Script(self.redis, _ACQUIRE)
        self._release = Script(self.redis, _RELEASE)
        self._charge = Script(self.redis, _CHARGE)
        self.reserved: dict[str, int] = {}
        self.pending_releases: set[asyncio.Task] = set()  # releases still waiting for Redis

    def _keys(self, tenant):
        p = f"{self.prefix}:{{{tenant}}}"  # hash tag: one slot per tenant on Redis Cluster
        return [f"{p}:rpm", f"{p}:tpm", f"{p}:leases", f"{p}:released"]

    async def acquire(self, tenant: str, limits: dict, tokens: int) -> Reservation:
        from gateway.redis_client import RedisError

        tpm = limits["tokens_per_minute"]
        _check_fits(tenant, tpm, tokens)
        rid = uuid.uuid4().hex
        try:
            ok, what, retry_ms = await self._acquire(
                keys=self._keys(tenant),
                args=[limits["requests_per_minute"], tpm, limits["max_concurrent"], tokens, rid, self.lease_ms])
        except asyncio.CancelledError:  # the request went away mid-call: the script may still run
            self._release_later(tenant, rid, limits, tokens, compensate=True)
            raise
        except Exception as e:  # connection refused, timeout, ...
            self.on_backend(False)
            if not isinstance(e, RedisError):  # the script may have run, or may run yet: undo it
                self._release_later(tenant, rid, limits, tokens, compensate=True)
            if self.fail_policy == "fail_closed":
                log.error("redis unreachable (%s): fail_closed, rejecting", _why(e))
                raise ServingError("overloaded", "rate limiter unavailable (fail_closed)", retry_after=1.0) from None
            log.warning("redis unreachable (%s): fail_open, admitting without limits", _why(e))
            return Reservation(tenant, tokens, "bypass")
        self.on_backend(True)
        if not int(ok):
            what = what.decode() if isinstance(what, bytes) else what
            if what == "concurrency":
                raise _concurrency(tenant, limits["max_concurrent"])
            raise _rate_limited(tenant, what, int(retry_ms) / 1000.0)
        self.reserved[tenant] = self.reserved.get(tenant, 0) + tokens
        return Reservation(tenant, tokens, "redis", id=rid)

    async def charge(self, tenant: str, limits: dict, tokens: int = 0, refuse: bool = True,
                     requests: int = 1) -> None:
        await self._bucket_op(tenant, limits, tokens, "charge" if refuse else "debit", requests)

    async def check(self, tenant: str, limits: dict) -> None:
        await self._bucket_op(tenant, limits, 0, "check", 1)

    async def _bucket_op(self, tenant: str, limits: dict, tokens: int, mode: str, requests: int) -> None:
        """MemoryLimiter.charge / check in Redis; while Redis is unreachable the fail policy decides, as
        for a reservation (fail_open: nothing is counted)."""
        try:
            ok, what, retry_ms = await self._charge(
                keys=self._keys(tenant)[:2],
                args=[limits["requests_per_minute"], limits["tokens_per_minute"], tokens, mode, requests])
        except Exception as e:
            self.on_backend(False)
            if self.fail_policy == "fail_closed" and mode != "debit":
                raise ServingError("overloaded", "rate limiter unavailable (fail_closed)", retry_after=1.0) from None
            log.warning("redis unreachable (%s): %s not counted", _why(e), mode)
            return
        self.on_backend(True)
        if not int(ok):
            what = what.decode() if isinstance(what, bytes) else what
            raise _rate_limited(tenant, what, int(retry_ms) / 1000.0)

    async def settle(self, r: Reservation, limits: dict, used_tokens: int) -> None:
        if r.settled:
            return
        r.settled = True
        if r.backend != "redis":
            return
        self.reserved[r.tenant] -= r.tokens
        refund = max(0, r.tokens - used_tokens)
        if not await self._release_once(r.tenant, r.id, limits, refund, compensate=False):
            self._release_later(r.tenant, r.id, limits, refund, compensate=False)

    async def _release_once(self, tenant, rid, limits, refund, compensate) -> bool:
        try:
            await self._release(keys=self._keys(tenant),
                                args=[limits["requests_per_minute"], limits["tokens_per_minute"], rid, refund,
                                      1 if compensate else 0, self.lease_ms])
        except Exception as e:
            self.on_backend(False)
            log.warning("redis unreachable while releasing a reservation of %s (%s): retrying", tenant, _why(e))
            return False
        self.on_backend(True)
        return True

    def _release_later(self, tenant, rid, limits, refund, compensate) -> None:
        async def retry():
            deadline = time.monotonic() + self.lease_ms / 1000.0  # after the lease nothing is held anyway
            for attempt in itertools.count():
                if await self._release_once(tenant, rid, limits, refund, compensate):
                    return
                if time.monotonic() > deadline:
                    log.error("gave up releasing a reservation of %s after %.0f s", tenant, self.lease_ms / 1000)
                    return
                await asyncio.sleep(self.RETRY_S[min(attempt, len(self.RETRY_S) - 1)])

        task = asyncio.get_running_loop().create_task(retry())
        self.pending_releases.add(task)
        task.add_done_callback(self.pending_releases.discard)


def _why(e: Exception) -> str:
    return str(e) or type(e).__name__
