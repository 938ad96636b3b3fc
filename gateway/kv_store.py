"""Small values with a time to live, for the gateway's response cache and sessions: Redis when the
gateway has one (`redis_url`: every replica sees the same entries), else a bounded dict in this process.

Keys are made by the callers (digests that name the tenant); this module only stores bytes. Both stores
expire entries by TTL; the in-process one also evicts the least recently used entry past `max_entries`, so
it never grows without bound. A store that does not answer raises (the callers decide what that means).
`replace` writes only over the value read (compare and set), so a read, change and write of one key by
several gateway replicas loses no one's change.
"""
from __future__ import annotations

import time
from collections import OrderedDict


class MemoryKV:
    """One gateway process's store (one event loop: no locking needed)."""

    backend = "memory"

    def __init__(self, max_entries: int = 10_000, clock=time.monotonic):
        self.max_entries, self.clock = max_entries, clock
        self._data: OrderedDict[str, tuple[bytes, float]] = OrderedDict()

    async def get(self, key: str) -> bytes | None:
        found = self._data.get(key)
        if found is None:
            return None
        value, expires = found
        if expires <= self.clock():
            del self._data[key]
            return None
        self._data.move_to_end(key)
        return value

    async def set(self, key: str, value: bytes, ttl_s: float) -> None:
        self._data[key] = (value, self.clock() + ttl_s)
        self._data.move_to_end(key)
        while len(self._data) > self.max_entries:
            self._data.popitem(last=False)

    async def replace(self, key: str, expected: bytes | None, value: bytes, ttl_s: float) -> bool:
        """`value` in place of `expected` (None: where the key holds nothing); False (nothing written) when
        the key holds anything else."""
        if await self.get(key) != expected:
            return False
        await self.set(key, value, ttl_s)
        return True

    async def delete(self, key: str) -> bool:
        return self._data.pop(key, None) is not None

    def __len__(self) -> int:
        return len(self._data)


class RedisKV:
    """The same in Redis (GET / SET PX / DEL), through the gateway's own client (gateway/redis_client.py:
    redis-py cannot be imported inside the Triton stub)."""

    backend = "redis"

    def __init__(self, url: str):
        from gateway.redis_client import AsyncRedis, Script

        self.redis = AsyncRedis(url)
        self._replace = Script(self.redis, _REPLACE)

    async def get(self, key: str) -> bytes | None:
        return await self.redis.execute("GET", key)

    async def set(self, key: str, value: bytes, ttl_s: float) -> None:
        await self.redis.execute("SET", key, value, "PX", max(1, int(ttl_s * 1000)))

    async def replace(self, key: str, expected: bytes | None, value: bytes, ttl_s: float) -> bool:
        ttl_ms = max(1, int(ttl_s * 1000))
        if expected is None:
            return await self.redis.execute("SET", key, value, "PX", ttl_ms, "NX") is not None
        return bool(await self._replace([key], [expected, value, ttl_ms]))

    async def delete(self, key: str) -> bool:
        return bool(await self.redis.execute("DEL", key))


_REPLACE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
"""


def kv_store(redis_url: str | None, max_entries: int = 10_000):
    """Redis when a URL is configured, else in-process."""
    return RedisKV(redis_url) if redis_url else MemoryKV(max_entries)
