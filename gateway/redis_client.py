"""A minimal asyncio Redis client (RESP2): just what the rate limiter needs (EVALSHA / EVAL).

Why not redis-py: inside the Triton 2.51 Python stub `import redis` fails, because redis-py imports
`ssl`, and the interpreter's `_ssl` extension needs a symbol (`_PyModule_Add`) that the stub's
embedded libpython lacks (measured: the gateway model failed to load). The protocol subset is small,
and the tests run it against a real redis-server.

Every call is bounded by `timeout` as a whole (waiting for a connection, connecting, writing and
reading the reply), and calls do not queue behind each other: each takes its own connection from a
small pool (`max_connections`), so one slow reply delays only its own caller. A connection whose call
failed or timed out is closed, never reused: its reply may still be on the way and would be read by
the next caller as its own. Tune both in the URL: `redis://host:6379/0?timeout=0.5&max_connections=16`.
"""
from __future__ import annotations

import asyncio
import hashlib
from urllib.parse import parse_qs, urlparse

DEFAULT_TIMEOUT_S = 0.5
DEFAULT_MAX_CONNECTIONS = 16


class RedisError(Exception):
    """An error reply from the server (the connection itself is fine)."""


def _encode(*parts) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for p in parts:
        b = p if isinstance(p, bytes) else str(p).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


async def _read(reader: asyncio.StreamReader):
    """One whole reply. Error elements inside an array come back as RedisError values, so the reply
    is always read to its end; only a top-level error reply raises."""
    reply = await _read_value(reader)
    if isinstance(reply, RedisError):
        raise reply
    return reply


async def _read_value(reader: asyncio.StreamReader):
    line = await reader.readline()
    if not line.endswith(b"\r\n"):
        raise ConnectionError("redis closed the connection")
    kind, rest = line[:1], line[1:-2]
    if kind == b"+":
        return rest
    if kind == b"-":
        return RedisError(rest.decode(errors="replace"))
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
        return None if n < 0 else [await _read_value(reader) for _ in range(n)]
    raise ConnectionError(f"unexpected reply {line!r}")


class _Connection:
    def __init__(self, reader, writer):
        self.reader, self.writer = reader, writer
        self.loop = asyncio.get_running_loop()

    def usable(self) -> bool:
        return self.loop is asyncio.get_running_loop() and not self.writer.is_closing() \
            and not self.reader.at_eof()

    def close(self) -> None:
        try:
            self.writer.close()
        except Exception:  # the loop it belonged to may be gone
            pass


class AsyncRedis:
    def __init__(self, url: str, timeout: float | None = None, max_connections: int | None = None):
        u = urlparse(url)
        if u.scheme != "redis":
            raise ValueError(f"only redis:// URLs are supported, got {url!r}")
        query = {k: v[-1] for k, v in parse_qs(u.query).items()}
        unknown = set(query) - {"timeout", "max_connections"}
        if unknown:
            raise ValueError(f"unknown redis URL option(s) {', '.join(sorted(unknown))}: "
                             "only timeout and max_connections")
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 6379
        self.db = int((u.path or "/0").lstrip("/") or 0)
        self.password = u.password
        self.timeout = float(timeout if timeout is not None else query.get("timeout", DEFAULT_TIMEOUT_S))
        self.max_connections = int(max_connections if max_connections is not None
                                   else query.get("max_connections", DEFAULT_MAX_CONNECTIONS))
        if self.timeout <= 0 or self.max_connections < 1:
            raise ValueError(f"redis URL {url!r}: timeout must be > 0 and max_connections >= 1")
        self._idle: list[_Connection] = []
        self._busy = 0  # calls holding a connection (or opening one)
        self._waiters: list[asyncio.Future] = []

    @property
    def open_connections(self) -> int:
        return self._busy + len(self._idle)

    async def execute(self, *parts):
        """One command; raises RedisError for an error reply, TimeoutError / OSError when the server
        does not answer within `timeout`."""
        return await asyncio.wait_for(self._execute(parts), self.timeout)

    async def _execute(self, parts):
        conn = await self._checkout()
        healthy = False
        try:
            if conn is None:
                conn = await self._connect()
            conn.writer.write(_encode(*parts))
            await conn.writer.drain()
            try:
                reply = await _read(conn.reader)
            except RedisError:
                healthy = True  # the whole error reply was read: the connection is in step
                raise
            healthy = True
            return reply
        finally:  # also on cancellation by the timeout: a half-read connection is closed, never reused
            self._checkin(conn if healthy else None, discard=conn if not healthy else None)

    async def _checkout(self) -> _Connection | None:
        """An idle connection, or None when the caller may open a new one; waits while all are busy."""
        while True:
            while self._idle:
                conn = self._idle.pop()
                if conn.usable():
                    self._busy += 1
                    return conn
                conn.close()
            if self._busy < self.max_connections:
                self._busy += 1
                return None
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:  # timed out while waiting: pass a wake-up it got on to the next one
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                elif waiter.done() and not waiter.cancelled():
                    self._wake_one()
                raise

    def _checkin(self, conn: _Connection | None, discard: _Connection | None = None) -> None:
        self._busy -= 1
        if discard is not None:
            discard.close()
        if conn is not None:
            self._idle.append(conn)
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:  # wake one waiter: a connection or a slot to open one is free
            waiter = self._waiters.pop(0)
            if not waiter.done():
                waiter.set_result(None)
                break

    async def _connect(self) -> _Connection:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        conn = _Connection(reader, writer)
        try:
            for cmd in ((("AUTH", self.password),) if self.password else ()) + ((("SELECT", self.db),) if self.db else ()):
                writer.write(_encode(*cmd))
                await writer.drain()
                await _read(reader)
        except BaseException:
            conn.close()
            raise
        return conn

    def close(self):
        for conn in self._idle:
            conn.close()
        self._idle.clear()


class Script:
    """EVALSHA with a fallback to EVAL when the server does not know the script yet."""

    def __init__(self, client: AsyncRedis, source: str):
        self.client, self.source = client, source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(self, keys: list[str], args: list):
        # one bound for both round trips: the caller waits at most the client's timeout
        return await asyncio.wait_for(self._run(keys, args), self.client.timeout)

    async def _run(self, keys, args):
        try:
            return await self.client._execute(("EVALSHA", self.sha, len(keys), *keys, *args))
        except RedisError as e:
            if not str(e).startswith("NOSCRIPT"):
                raise
            return await self.client._execute(("EVAL", self.source, len(keys), *keys, *args))
