"""The front's end of the gateway's lease socket: its lease operations (admit, settle, renew, engine_check,
stop) on one Unix connection to the gateway's process, many in flight at once, each answered by id
(contracts/lease_frames.py; the gateway's end: gateway/lease_socket.py; docs/gateway.md).

The gateway opens the socket at its first request, so the front asks Triton until the socket answers: while
no connection is open, `ready()` is False and starts one attempt (at most one every `retry_s`); the caller
sends that operation through Triton's HTTP generate_stream as before. A connection that closes fails the
operations on it `unavailable`, as a closed HTTP connection does, and the next one goes through Triton
while a new connection is tried.
"""
from __future__ import annotations

import asyncio
import logging
import time

import orjson

from contracts.errors import ServingError, from_transport
from contracts.lease_frames import ERROR, LAST, FrameReader, frame, read_answer
from front.engine_http import ItemQueue

log = logging.getLogger("front.lease_socket")


def _unavailable(why: str) -> ServingError:
    return ServingError("unavailable", f"the gateway's lease socket {why}", retry_after=1.0)


class LeaseOperation(ItemQueue):
    """One operation's answers, in order: `next()` -> (the answer's JSON, whether it is the last), or raises
    its error."""

    def __init__(self, timeout_s: float, forget):
        """`forget()`: its connection stops waiting for it (at the timeout)."""
        super().__init__()
        self._done = False
        self._timer = asyncio.get_running_loop().call_later(timeout_s, self._expire, timeout_s, forget)

    def _expire(self, timeout_s: float, forget) -> None:
        forget()
        self._fail(_unavailable(f"gave no answer within {timeout_s:g} s"))

    def _push(self, item) -> None:
        if self._done:
            return
        if isinstance(item, Exception) or item[1]:  # its last
            self._done = True
            self._timer.cancel()
        super()._push(item)

    def _fail(self, err: ServingError) -> None:
        self._push(err)


class _Connection(asyncio.Protocol):
    def __init__(self, client: "LeaseSocketClient"):
        self.client = client
        self.reader = FrameReader()
        self.transport = None
        self.ops: dict[int, LeaseOperation] = {}
        self.closed = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.client._conn is self:
            self.client._conn = None
        ops, self.ops = self.ops, {}
        for op in ops.values():
            op._fail(_unavailable("closed before the answer"))

    def data_received(self, data: bytes) -> None:
        try:
            for payload in self.reader.feed(data):
                op_id, kind, body = read_answer(payload)
                op = self.ops.get(op_id) if kind != LAST and kind != ERROR else self.ops.pop(op_id, None)
                if op is None:  # its operation timed out meanwhile
                    continue
                if kind == ERROR:
                    op._fail(from_transport(body.decode(errors="replace")))
                else:
                    op._push((body, kind == LAST))
        except ValueError:  # not this protocol: nothing on this connection can be trusted
            self.transport.abort()


class LeaseSocketClient:
    """One front process's connection to the gateway's lease socket, opened on first use and again after it
    closes; many operations in flight on it, each answered by its id."""

    def __init__(self, path: str, timeout_s: float = 600.0, retry_s: float = 1.0):
        self.path, self.timeout_s, self.retry_s = path, timeout_s, retry_s
        self._conn: _Connection | None = None
        self._connecting: asyncio.Task | None = None
        self._next_try = float("-inf")
        self._next_id = 0
        self._warned = False

    def ready(self) -> bool:
        """Whether an operation can go on the socket now; if not, a connection is tried in the background (at
        most once every retry_s) and the caller sends this one through Triton."""
        if self._conn is not None:
            return True
        now = time.monotonic()
        if self._connecting is None and now >= self._next_try:
            self._next_try = now + self.retry_s
            self._connecting = asyncio.ensure_future(self._connect())
        return False

    async def _connect(self) -> None:
        try:
            _, conn = await asyncio.get_running_loop().create_unix_connection(lambda: _Connection(self), self.path)
            if not conn.closed:
                self._conn = conn
                self._warned = False
        except (FileNotFoundError, ConnectionRefusedError):  # not open yet (the gateway opens it at its first
            pass  # request), or its gateway gone: Triton meanwhile
        except OSError as e:  # not ours to open (permissions, a path too long): said once, Triton meanwhile
            if not self._warned:
                self._warned = True
                log.warning("the gateway's lease socket %s cannot be opened (%s): lease operations go through "
                            "Triton", self.path, e)
        finally:
            self._connecting = None

    def operation(self, body: dict) -> LeaseOperation:
        """Send one operation (its generate_stream body, without `id`); call only while ready()."""
        conn = self._conn
        op_id = self._next_id = (self._next_id + 1) & 0xFFFFFFFF
        op = LeaseOperation(self.timeout_s, lambda: conn.ops.pop(op_id, None))
        conn.ops[op_id] = op
        conn.transport.write(frame(orjson.dumps({**body, "id": op_id})))
        return op

    async def close(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()
        if self._conn is not None:
            self._conn.transport.close()
