"""Client connections bounded in time, size and number, below the app (uvicorn's httptools protocol,
subclassed: llhttp parses the request in C; uvicorn's h11 protocol, parsing in Python, cost 5x the Python
calls and time a request: benchmarks/results/2026-11-28-protocol-bench.json).

uvicorn 0.54 times out only an idle keep-alive connection after a response, and its httptools protocol
bounds neither the size of a request's head nor the time it takes: a connection that sends nothing, part of
its headers or part of its body is held forever, each one a socket and buffers. Here:

- the request line and headers must be complete `header_timeout_s` after the connection opens, or after
  the first bytes of a later request on a kept-alive connection (one idle between requests closes at
  uvicorn's `timeout_keep_alive`), and hold at most `max_head_bytes` (a larger head gets a 431 and the
  connection is closed);
- the whole body must have arrived `body_timeout_s` after the headers (however slowly it drips);
- at most `max_per_client` connections per client address at once (a connection over it gets a 429 and
  is closed before anything is read).

A connection past a deadline is closed; a request still running sees its client disconnect. What the
app reads of a body is bounded by the app itself (front/app.py `BodyLimit`).

A response sent before its request's body ended (refused unread: a key, a tier bound, an upload limit)
closes the connection lingering, as nginx does: the write side first, then up to `LINGER_BYTES` of the
rest of the body are read and dropped for up to `LINGER_S`. Closing at once would reset the connection
while the client still sends, and most clients (which send the whole body before reading) would see the
reset instead of the answer; keeping it open would read the rest of a body no one wants.

Each request's scope also carries its DirectBody (`DIRECT_BODY`): where the SSE body's per-token events are
written straight to the connection (front/app.py's fast lane).
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_per_client: int = 256  # 0: no bound
    idle_timeout_s: float = 5.0  # uvicorn's timeout_keep_alive: between requests on one connection
    max_head_bytes: int = 32 * 1024  # a request's line and headers (nginx's large_client_header_buffers: 32 KiB)


LINGER_S = 3.0
LINGER_BYTES = 16 * 1024 * 1024
_limits = ConnectionLimits()
PROTOCOL = "front.connections:BoundedHttpToolsProtocol"  # uvicorn's `http=` (importable: --workers spawns)


_on_closed = None  # (reason) -> None: the front's metrics (llm_front_connections_closed_total)


def configure(limits: ConnectionLimits, on_closed=None) -> None:
    """Set the limits every connection of this process gets (before uvicorn serves), and what counts the
    connections closed at them (reason: header_timeout, body_timeout, too_many_connections,
    head_too_large, invalid_http)."""
    global _limits, _on_closed
    _limits, _on_closed = limits, on_closed


def _closed(reason: str) -> None:
    if _on_closed is not None:
        _on_closed(reason)


def _refusal(status: bytes, message: str, error_type: str, code: str, extra: bytes = b"") -> bytes:
    """A whole response that closes its connection, in the OpenAI error shape."""
    body = json.dumps({"error": {"message": message, "type": error_type, "param": None, "code": code}}).encode()
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n" + extra + b"connection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


TOO_MANY = _refusal(b"429 Too Many Requests", "too many connections from this address", "rate_limit_error",
                    "too_many_connections", b"retry-after: 1\r\n")
HEAD_TOO_LARGE = _refusal(b"431 Request Header Fields Too Large", "the request line and headers are too large",
                          "invalid_request_error", "head_too_large")
INVALID_HTTP = _refusal(b"400 Bad Request", "the request is not valid HTTP/1.1 (its request line, a header or "
                        "the body's framing)", "invalid_request_error", "invalid_http")
TIMED_OUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class HeadTooLarge(Exception):
    pass


HEAD_REFUSED = -2  # BoundedHttpToolsProtocol._head_bytes once a complete head was found too large


class _LingeringClose:
    """The transport as a request cycle sees it: its close() lingers while a request body is unread (the
    connection's latest request's: the parser reads no head before the body ahead of it has ended). It
    holds no cycle, which holds it: a request leaves no reference cycle for the collector."""

    def __init__(self, protocol: "BoundedHttpToolsProtocol"):
        self._protocol, self._transport = protocol, protocol.transport
        # once per SSE event: found here, not through __getattr__ (2% of the front's samples:
        # benchmarks/results/2026-11-27-loop-profiles.json)
        self.write = self._transport.write

    def __getattr__(self, name):
        return getattr(self._transport, name)

    def close(self) -> None:
        if self._protocol.cycle.more_body and not self._transport.is_closing():
            self._protocol.linger()
        else:
            self._transport.close()


class _UnframedCycle(RequestResponseCycle):
    """An HTTP/1.0 request's cycle. uvicorn's httptools cycle frames a body of unknown length (an SSE
    stream) as chunks whatever the client's version, and an HTTP/1.0 client knows no chunks: here that body
    is sent as it is and ends when the connection closes (HTTP/1.0's own framing; the cycle is never kept
    alive)."""

    unframed = False

    async def send(self, message) -> None:
        if not self.response_started and message["type"] == "http.response.start" \
                and self.scope["method"] != "HEAD" and message["status"] not in (204, 304) \
                and not any(name.lower() in (b"content-length", b"transfer-encoding")
                            for name, _ in message.get("headers", ())):
            self.unframed, self.chunked_encoding = True, False  # uvicorn then adds no transfer-encoding
        if not self.unframed or message["type"] != "http.response.body" or self.response_complete \
                or self.disconnected:
            return await super().send(message)
        if self.flow.write_paused:
            await self.flow.drain()
            if self.disconnected:
                return
        self.transport.write(message.get("body", b""))
        if not message.get("more_body", False):
            self.response_complete = True
            self.message_event.set()
            self.transport.close()
            self.on_response()


DIRECT_BODY = "front.direct_body"  # the ASGI scope's extension that holds a request's DirectBody


class DirectBody:
    """A streamed response's body written straight to its connection, beside ASGI's `send`: the SSE body's
    per-token events (front/app.py), gathered until `flush()` and then written as one chunk of the
    response's chunked body. An event through `send` costs its generator's wake-up, Starlette's middleware
    wrappers and uvicorn's `send`; here it is bytes appended and one socket write per engine read
    (docs/benchmarks.md, the front's cost per token).

    Writable only between the response's start and its end, its client connected and not pushing back
    (uvicorn's flow control: the slow path's `send` waits for the drain), and with the body chunked
    (an HTTP/1.0 client's body goes unframed, so that one keeps to `send`). The app writes here only while
    its own `send` is idle (the body generator waits for the engine), so the two never interleave."""

    __slots__ = ("_protocol", "_cycle", "_parts", "add")

    def __init__(self, protocol: "BoundedHttpToolsProtocol", cycle: RequestResponseCycle):
        self._protocol, self._cycle = protocol, cycle
        self._parts: list[bytes] = []
        self.add = self._parts.append  # add(data): an event for the next flush (a call per token fewer)

    def writable(self) -> bool:
        cycle = self._cycle
        return cycle.response_started and not cycle.response_complete and not cycle.disconnected \
            and not self._protocol.flow.write_paused and cycle.chunked_encoding is True

    def flush(self) -> None:
        parts = self._parts
        if not parts:
            return
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        parts.clear()
        transport = self._protocol.transport
        if not transport.is_closing():
            transport.write(b"%x\r\n%b\r\n" % (len(data), data))


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits = _limits
        self.timeout_keep_alive = self.limits.idle_timeout_s
        self._deadline = None  # TimerHandle: headers or body due
        self._due: str | None = None  # what is due at the deadline: header_timeout or body_timeout
        self._head_bytes = 0  # >= 0: bytes received while a request's head is incomplete; -1: in a body
        self._counted: str | None = None  # the client address this connection counts against
        self._lingering = 0  # > 0: the response is out, the rest of the body is read and dropped (bytes)

    def _per_client(self) -> Counter:
        counts = getattr(self.server_state, "per_client", None)
        if counts is None:
            counts = self.server_state.per_client = Counter()
        return counts

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        host = self.client[0] if self.client else None
        if host is not None and self.limits.max_per_client:
            counts = self._per_client()
            if counts[host] >= self.limits.max_per_client:
                self._refuse(TOO_MANY, "too_many_connections")
                return
            counts[host] += 1
            self._counted = host
        self._arm(self.limits.header_timeout_s, "header_timeout")

    def connection_lost(self, exc) -> None:
        self._disarm()
        if self._counted is not None:
            counts = self._per_client()
            counts[self._counted] -= 1
            if counts[self._counted] <= 0:
                del counts[self._counted]
            self._counted = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            self._lingering += len(data)
            if self._lingering > LINGER_BYTES:
                self.transport.close()
            return
        if self._head_bytes >= 0:
            self._head_bytes += len(data)
        super().data_received(data)
        # a deadline only for what this read left incomplete (most requests come whole in one read: no timer)
        if self.transport.is_closing():
            return
        if self._head_bytes > 0:
            if self._head_bytes > self.limits.max_head_bytes:
                self._refuse(HEAD_TOO_LARGE, "head_too_large")  # still incomplete, and already too large
            elif self._due is None and (self.cycle is None or self.cycle.response_complete):
                self._arm(self.limits.header_timeout_s, "header_timeout")  # (not while a response streams: a
                # pipelined head waits for it, then uvicorn's keep-alive timeout bounds it)
        elif self._head_bytes == -1 and self._due != "body_timeout":
            self._arm(self.limits.body_timeout_s, "body_timeout")

    def _refuse(self, response: bytes | None, reason: str) -> None:
        """Answers with `response` (if any, and only where no other response is being written), closes, and
        counts the close under `reason`."""
        self._disarm()
        cycle = self.cycle
        if response is not None and (cycle is None or cycle.response_complete or not cycle.response_started):
            self.transport.write(response)
        self.transport.close()
        _closed(reason)

    def linger(self) -> None:
        self._lingering = 1
        self._disarm()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.flow.resume_reading()
        self._deadline, self._due = self.loop.call_later(LINGER_S, self.transport.close), "linger"

    def send_400_response(self, msg: str) -> None:  # the parser stopped: llhttp refused the request, or
        if self._head_bytes == HEAD_REFUSED:  # on_headers_complete found its head too large
            self._refuse(HEAD_TOO_LARGE, "head_too_large")
            return
        self._refuse(INVALID_HTTP, "invalid_http")

    def on_headers_complete(self) -> None:
        if self._head_bytes > self.limits.max_head_bytes \
                and len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers) > self.limits.max_head_bytes:
            self._head_bytes = HEAD_REFUSED  # (what this read held may be body too: the exact size decides)
            raise HeadTooLarge  # stops the parser: no cycle, no app (uvicorn answers through send_400_response)
        self._head_bytes = -1
        if self._due is not None:
            self._disarm()
        before = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is before:  # an upgrade taken over by another protocol (the front serves with ws="none")
            return
        if self.scope["http_version"] == "1.0":
            cycle.__class__ = _UnframedCycle  # made by the call above, nothing sent yet
        cycle.transport = _LingeringClose(self)
        self.scope.setdefault("extensions", {})[DIRECT_BODY] = DirectBody(self, cycle)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._head_bytes = 0  # what follows is the next request's
        if self._due is not None:
            self._disarm()  # the body is whole: the app is answering

    def on_response_complete(self) -> None:
        cycle = self.cycle
        if cycle.response_complete:  # (a pipelined request's cycle may be the latest: that one is not done)
            # scope -> DirectBody -> cycle -> scope: freed now, not by the cyclic collector, whose full passes
            # over the heap stall the loop
            cycle.scope["extensions"].pop(DIRECT_BODY, None)
            if not self._lingering and cycle.more_body:
                cycle.transport.close()  # answered before its body ended, kept alive: not reused (it lingers)
        if self._lingering:
            self.server_state.total_requests += 1
            return
        super().on_response_complete()  # (an idle connection closes at uvicorn's keep-alive timeout; the next
        # request's head is due header_timeout_s after its first bytes: data_received)

    def _arm(self, seconds: float, reason: str) -> None:
        self._disarm()
        if seconds > 0:
            self._deadline, self._due = self.loop.call_later(seconds, self._expire, reason), reason

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = self._due = None

    def _expire(self, reason: str) -> None:
        self._deadline = self._due = None
        if self.transport.is_closing():
            return
        cycle = self.cycle  # no 408 to an idle kept-alive connection: a client sending its next request then
        # would take it for that request's answer
        self._refuse(TIMED_OUT if cycle is None or not cycle.response_started else None, reason)
