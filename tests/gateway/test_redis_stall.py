"""The Redis client and limiter against a real redis-server that stalls (SIGSTOP) mid-traffic: every call
is bounded by its timeout, calls do not queue behind each other, and a stall leaves no slot held."""
import asyncio
import os
import signal
import time
from contextlib import contextmanager

import pytest
import redis

from contracts.errors import ServingError
from gateway.ratelimit import RedisLimiter
from gateway.redis_client import AsyncRedis

SOLO = {"requests_per_minute": 1000, "tokens_per_minute": 100_000, "max_concurrent": 1,
        "max_context_tokens": 4096, "max_output_tokens": 512}


@contextmanager
def stalled(server):
    """Redis stops answering (the process is stopped; its socket still accepts and buffers commands)."""
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)


async def _timed(coro):
    t0 = time.monotonic()
    try:
        return await coro, time.monotonic() - t0
    except Exception as e:
        return e, time.monotonic() - t0


def test_one_slow_call_does_not_delay_the_others(redis_server):
    """A command whose reply takes 0.6 s (BLPOP on an empty list) and a PING sent right after: the PING
    answers at once on another connection instead of queueing behind the slow one."""
    async def go():
        r = AsyncRedis(redis_server.url, timeout=2.0)
        await r.execute("PING")
        slow = asyncio.create_task(_timed(r.execute("BLPOP", "nothing-here", "0.6")))
        await asyncio.sleep(0.05)
        pong, fast_s = await _timed(r.execute("PING"))
        (_, slow_s) = await slow
        return pong, fast_s, slow_s
    pong, fast_s, slow_s = asyncio.run(go())
    assert pong == b"PONG" and fast_s < 0.2 and slow_s > 0.5


def test_every_call_is_bounded_by_the_timeout_during_a_stall(redis_server):
    """20 concurrent calls into a stopped Redis all fail within about one timeout (one connection
    behind a lock made the last one wait 20 timeouts), and the next calls after it resumes get their
    own replies, not the stale replies of calls that timed out."""
    async def go():
        r = AsyncRedis(redis_server.url + "?timeout=0.3&max_connections=8")
        await r.execute("PING")
        with stalled(redis_server):
            t0 = time.monotonic()
            outcomes = await asyncio.gather(*(_timed(r.execute("ECHO", f"stale-{i}")) for i in range(20)))
            wall = time.monotonic() - t0
        await asyncio.sleep(0.1)
        fresh = [await r.execute("ECHO", f"fresh-{i}") for i in range(10)]
        return outcomes, wall, fresh, getattr(r, "open_connections", 1)
    outcomes, wall, fresh, n_open = asyncio.run(go())
    assert all(isinstance(o, (TimeoutError, asyncio.TimeoutError)) for o, _ in outcomes), outcomes
    assert max(s for _, s in outcomes) < 0.6 and wall < 0.6, (wall, outcomes)
    assert fresh == [f"fresh-{i}".encode() for i in range(10)]
    assert n_open <= 8


def _leases(url, tenant):
    return redis.Redis.from_url(url).zcard(f"llmgw:{{{tenant}}}:leases")


@pytest.mark.parametrize("policy", ["fail_open", "fail_closed"])
def test_a_stall_during_acquires_leaves_no_slot_held(redis_server, policy):
    """Acquires of a concurrency-1 tenant time out while Redis is stopped for 2.5 s; Redis runs them
    when it resumes (their bytes are in its socket buffer). Before: the in-flight counter stayed at 1
    with an hour's TTL and the tenant was refused with nothing running. Now each timed-out acquire is
    compensated, so the tenant's next request is admitted, and the shared buckets are refunded."""
    up = []

    async def go():
        lim = RedisLimiter(redis_server.url + "?timeout=0.3", policy, on_backend=up.append)
        held = await lim.acquire("solo", SOLO, 100)  # a request that runs through the stall
        await lim.settle(held, SOLO, 100)
        with stalled(redis_server):
            t0 = time.monotonic()
            outcomes = await asyncio.gather(*(_timed(lim.acquire("solo", SOLO, 100)) for _ in range(6)))
            stall_wall = time.monotonic() - t0
            await asyncio.sleep(2.5)
        deadline = time.monotonic() + 5
        while getattr(lim, "pending_releases", ()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        pending = len(getattr(lim, "pending_releases", ()))
        r = await lim.acquire("solo", SOLO, 100)  # raises `concurrency` if a slot were still held
        leases = _leases(redis_server.url, "solo")
        await lim.settle(r, SOLO, 100)
        return outcomes, stall_wall, pending, r.backend, leases
    outcomes, stall_wall, pending, backend, leases = asyncio.run(go())
    assert stall_wall < 1.0, stall_wall  # every acquire bounded by the 0.3 s timeout, none queued
    for o, _ in outcomes:
        if policy == "fail_open":
            assert o.backend == "bypass"
        else:
            assert isinstance(o, ServingError) and o.kind == "overloaded"
    assert pending == 0 and backend == "redis" and leases == 1
    assert _leases(redis_server.url, "solo") == 0
    assert up[-1] is True and False in up  # the gauge went down during the stall and back up after
    tpm = redis.Redis.from_url(redis_server.url).hget("llmgw:{solo}:tpm", "level")
    assert float(tpm) > 100_000 - 3 * 100 - 50  # compensated acquires gave their tokens back


def test_release_is_exactly_once_and_retried_until_redis_answers(redis_server):
    """A settle that meets a stalled Redis is retried in the background until it lands; settling twice,
    or a retry arriving after the first attempt did land, frees nothing more than the one slot."""
    limits = {**SOLO, "max_concurrent": 2}

    async def go():
        lim = RedisLimiter(redis_server.url + "?timeout=0.3")
        a = await lim.acquire("duo", limits, 10)
        b = await lim.acquire("duo", limits, 10)
        with stalled(redis_server):
            await lim.settle(a, limits, 10)
            assert len(getattr(lim, "pending_releases", ())) == 1
            await asyncio.sleep(0.5)
        deadline = time.monotonic() + 5
        while getattr(lim, "pending_releases", ()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await lim.settle(a, limits, 10)  # a second settle is a no-op
        await lim._release_once("duo", a.id, limits, 10, compensate=False)  # a duplicate release too
        still = _leases(redis_server.url, "duo")
        c = await lim.acquire("duo", limits, 10)  # a's slot is free, b's still held
        with pytest.raises(ServingError, match="concurrent"):
            await lim.acquire("duo", limits, 10)
        for r in (b, c):
            await lim.settle(r, limits, 10)
        return still
    assert asyncio.run(go()) == 1
    assert _leases(redis_server.url, "duo") == 0
