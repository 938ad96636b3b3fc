"""The gateway's lease socket: the front's lease operations on a Unix socket served by the gateway's own
event loop, past Triton's HTTP server and the Python backend's IPC (the frames: contracts/lease_frames.py;
the front's end: front/lease_socket.py; docs/gateway.md).

The socket serves the operations the front sends (admit, one or grouped; settle; renew; engine_check; stop)
and nothing else: `generate` and the other operations stay Triton's. Each is read from the same body
Triton's generate_stream would take and decided by the same code (gateway/request.py, Gateway.answers), so
what a key may do is what it may do through Triton: every lease operation carries the front's key, an admit
the client's. The socket file is the owner's alone (0600, in the folder the launcher made for it).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator

import orjson

from contracts.errors import as_serving_error, invalid
from contracts.lease_frames import ANSWER, ERROR, LAST, FrameReader, answer_frame
from gateway.core import LEASE_OPERATIONS
from gateway.request import generate_body, grouped_admits, parse_gateway_request

log = logging.getLogger("gateway.lease_socket")

# what the front's lease path sends (front/engine_direct.py); every answer is JSON (gateway/core.py json_answer)
SOCKET_OPERATIONS = (*LEASE_OPERATIONS, "stop")


async def socket_answers(gateway, body: dict) -> AsyncIterator[tuple[bytes, bool]]:
    """An operation's answers as (JSON, last), read and decided as model.py does one through Triton."""
    arrays, parameters = generate_body(body)
    req, operation = parse_gateway_request(arrays, parameters)  # 400s name the field
    if operation not in SOCKET_OPERATIONS:
        raise invalid("operation", f"{operation!r} is not served on the lease socket (only "
                      f"{', '.join(SOCKET_OPERATIONS)}): send it to Triton")
    # closed even when a write fails: a grouped admit's admits still waiting leave the admission queue
    async with contextlib.aclosing(gateway.answers(operation, req, arrays.get("token_ids"), grouped_admits)) as answers:
        async for out, last in answers:
            yield out["text_output"][0][0], last


class LeaseSocket:
    """The server: one task per operation, so an admit waiting for a slot holds back nothing behind it."""

    def __init__(self, path: str, gateway):
        self.path, self.gateway = path, gateway
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        """Listen on `path` (a file left by an earlier process of this gateway is replaced)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.server = await asyncio.get_running_loop().create_unix_server(lambda: _Connection(self), self.path)
        os.chmod(self.path, 0o600)
        log.info("lease operations on %s", self.path)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


class _Connection(asyncio.Protocol):
    def __init__(self, server: LeaseSocket):
        self.server = server
        self.reader = FrameReader()
        self.transport = None
        self.tasks: set[asyncio.Task] = set()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        for task in list(self.tasks):  # an admit still waiting leaves the admission queue: no one will read it
            task.cancel()

    def data_received(self, data: bytes) -> None:
        try:
            operations = [_operation(payload) for payload in self.reader.feed(data)]
        except ValueError as e:  # not this protocol: nothing to answer it by, nothing more to trust
            log.warning("lease socket: %s; closing the connection", e)
            self.transport.abort()
            return
        loop = asyncio.get_running_loop()
        for op_id, body in operations:
            task = loop.create_task(self._serve(op_id, body))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _serve(self, op_id: int, body: dict) -> None:
        write = self.transport.write
        try:
            async with contextlib.aclosing(socket_answers(self.server.gateway, body)) as answers:
                async for answer, last in answers:
                    if not self.transport.is_closing():
                        write(answer_frame(op_id, LAST if last else ANSWER, answer))
        except Exception as e:  # noqa: BLE001 - the operation's failure is its answer, as through Triton
            if not self.transport.is_closing():
                write(answer_frame(op_id, ERROR, as_serving_error(e).wire().encode()))


def _operation(payload: bytes) -> tuple[int, dict]:
    """(id, body) of an operation's frame; ValueError if it is not one."""
    body = orjson.loads(payload)
    op_id = body.pop("id", None) if isinstance(body, dict) else None
    if type(op_id) is not int or not 0 <= op_id < 1 << 32:
        raise ValueError("an operation without an integer id")
    return op_id, body
