"""A test double of a failing network between the front and an upstream provider (not of the API: the
upstream behind it is a real OpenAI-compatible server). A TCP proxy on a loopback port, run in its own
thread, in one of these modes:

  pass    bytes flow both ways unchanged
  down    nothing listens on the port (connection refused), as a killed upstream; open connections are cut
  stall   connections are accepted and the request read, and nothing is ever answered
  status  every request is answered with `status` (a JSON error body, `Retry-After` if given), then closed
  cut     bytes flow until the upstream's answer has sent `cut_after` SSE events, then both sides are cut

Changing the mode cuts the connections in flight (a client's pooled keep-alive connections included),
as a restarted or crashed server would. `requests` counts connections accepted per mode.
"""
from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter

from tests.support.server import HOST, free_port


class FaultProxy:
    def __init__(self, target_port: int, port: int | None = None):
        self.port = port or free_port()
        self.target_port = target_port
        self.mode, self.status, self.retry_after, self.cut_after = "pass", 500, None, 2
        self.requests: Counter = Counter()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server: asyncio.AbstractServer | None = None
        self.writers: set = set()

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}/v1"

    def start(self) -> "FaultProxy":
        self.thread.start()
        self._call(self._listen())
        return self

    def stop(self) -> None:
        self._call(self._set("down", 500, None, 2))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    def set(self, mode: str, status: int = 500, retry_after: float | None = None, cut_after: int = 2) -> None:
        assert mode in ("pass", "down", "stall", "status", "cut"), mode
        self._call(self._set(mode, status, retry_after, cut_after))

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    async def _listen(self) -> None:
        self.server = await asyncio.start_server(self._connection, HOST, self.port, reuse_address=True)

    async def _set(self, mode, status, retry_after, cut_after) -> None:
        self.mode, self.status, self.retry_after, self.cut_after = mode, status, retry_after, cut_after
        for w in list(self.writers):
            w.transport.abort()
        self.writers.clear()
        if mode == "down" and self.server is not None:
            self.server.close()
            self.server = None
        elif mode != "down" and self.server is None:
            await self._listen()

    async def _connection(self, reader, writer) -> None:
        mode = self.mode
        self.requests[mode] += 1
        self.writers.add(writer)
        try:
            if mode == "stall":
                await reader.read()  # until the client gives up
            elif mode == "status":
                await _read_request(reader)
                body = json.dumps({"error": {"message": f"injected {self.status}", "type": "server_error"}}).encode()
                head = [f"HTTP/1.1 {self.status} Injected", "content-type: application/json",
                        f"content-length: {len(body)}", "connection: close"]
                if self.retry_after is not None:
                    head.append(f"retry-after: {self.retry_after:g}")
                writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
                await writer.drain()
            else:
                await self._pipe(reader, writer, mode == "cut")
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.writers.discard(writer)
            writer.transport.abort()

    async def _pipe(self, reader, writer, cut: bool) -> None:
        up_reader, up_writer = await asyncio.open_connection(HOST, self.target_port)
        self.writers.add(up_writer)

        async def pump(src, dst, count_events: bool):
            events = 0
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
                events += data.count(b"data: {") if count_events else 0
                if cut and count_events and events >= self.cut_after:
                    return
        try:
            tasks = {asyncio.ensure_future(pump(reader, up_writer, False)),
                     asyncio.ensure_future(pump(up_reader, writer, True))}
            _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in pending:
                t.cancel()
        finally:
            self.writers.discard(up_writer)
            up_writer.transport.abort()


async def _read_request(reader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    if length:
        await reader.readexactly(length)
