"""A minimal asyncio Redis client (RESP2): just what the rate limiter needs (EVALSHA / EVAL).

Why not redis-py: inside the Triton 2.51 Python stub `import redis` fails, because redis-py imports
`ssl`, and the interpreter's `_ssl` extension needs a symbol (`_PyModule_Add`) that the stub's
embedded libpython lacks (measured: the gateway model failed to load). The protocol subset is small,
and the tests run it against a real redis-server.
"""
from __future__ import annotations

import asyncio
import hashlib
from urllib.parse import urlparse


class RedisError(Exception):
    pass


def _encode(*parts) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for p in parts:
        b = p if isinstance(p, bytes) else str(p).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


async def _read(reader: asyncio.StreamReader):
    line = await reader.readline()
    if not line:
        raise ConnectionError("redis closed the connection")
    kind, rest = line[:1], line[1:-2]
    if kind == b"+":
        return rest
    if kind == b"-":
        raise RedisError(rest.decode())
    if kind == b":":
        return int(rest)
    if kind == b"$":
        n = int(rest)
        if n < 0:
            return None
        data = await reader.readexactly(n + 2)
        return data[:-2]
    if kind == b"*":
        n = int(rest)
        return None if n < 0 else [await _read(reader) for _ in range(n)]
    raise RedisError(f"unexpected reply {line!r}")


class AsyncRedis:
    def __init__(self, url: str, timeout: float = 0.5):
        u = urlparse(url)
        if u.scheme != "redis":
            raise ValueError(f"only redis:// URLs are supported, got {url!r}")
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 6379
        self.db = int((u.path or "/0").lstrip("/") or 0)
        self.password = u.password
        self.timeout = timeout
        self._conn = None
        self._lock = asyncio.Lock()

    async def _connect(self):
        reader, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), self.timeout)
        self._conn = (reader, writer)
        if self.password:
            await self._roundtrip("AUTH", self.password)
        if self.db:
            await self._roundtrip("SELECT", self.db)

    async def _roundtrip(self, *parts):
        reader, writer = self._conn
        writer.write(_encode(*parts))
        await writer.drain()
        return await asyncio.wait_for(_read(reader), self.timeout)

    async def execute(self, *parts):
        async with self._lock:  # one connection, one command at a time: replies stay in order
            try:
                if self._conn is None:
                    await self._connect()
                return await self._roundtrip(*parts)
            except RedisError:
                raise
            except Exception:
                self.close()
                raise

    def close(self):
        if self._conn is not None:
            self._conn[1].close()
            self._conn = None


class Script:
    """EVALSHA with a fallback to EVAL when the server does not know the script yet."""

    def __init__(self, client: AsyncRedis, source: str):
        self.client, self.source = client, source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(self, keys: list[str], args: list):
        try:
            return await self.client.execute("EVALSHA", self.sha, len(keys), *keys, *args)
        except RedisError as e:
            if not str(e).startswith("NOSCRIPT"):
                raise
            return await self.client.execute("EVAL", self.source, len(keys), *keys, *args)
