"""Client connections bounded in time and number, below the app (uvicorn's h11 protocol, subclassed).

uvicorn 0.54 times out only an idle keep-alive connection after a response: a connection that sends
nothing, part of its headers or part of its body is held forever, each one a socket and buffers. Here:

- the request line and headers must be complete `header_timeout_s` after the connection opens, or after
  the previous response (an idle keep-alive connection closes sooner, at uvicorn's `timeout_keep_alive`);
- the whole body must have arrived `body_timeout_s` after the headers (however slowly it drips);
- at most `max_per_client` connections per client address at once (a connection over it gets a 429 and
  is closed before anything is read).

A connection past a deadline is closed; a request still running sees its client disconnect. What the
app reads of a body is bounded by the app itself (front/app.py `BodyLimit`).

A response sent before its request's body ended (refused unread: a key, a tier bound, an upload limit)
closes the connection lingering, as nginx does: the write side first, then up to `LINGER_BYTES` of the
rest of the body are read and dropped for up to `LINGER_S`. Closing at once would reset the connection
while the client still sends, and most clients (which send the whole body before reading) would see the
reset instead of the answer.

Each request's scope also carries its DirectBody (`DIRECT_BODY`): where the SSE body's per-token events are
written straight to the connection (front/app.py's fast lane).
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

import h11
from h11._writers import ChunkedWriter  # DirectBody: which framing h11 chose
from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_per_client: int = 256  # 0: no bound
    idle_timeout_s: float = 5.0  # uvicorn's timeout_keep_alive: between requests on one connection


LINGER_S = 3.0
LINGER_BYTES = 16 * 1024 * 1024
_limits = ConnectionLimits()
PROTOCOL = "front.connections:BoundedH11Protocol"  # uvicorn's `http=` (importable: --workers spawns)


_on_closed = None  # (reason) -> None: the front's metrics (llm_front_connections_closed_total)


def configure(limits: ConnectionLimits, on_closed=None) -> None:
    """Set the limits every connection of this process gets (before uvicorn serves), and what counts the
    connections closed at them (reason: header_timeout, body_timeout, too_many_connections)."""
    global _limits, _on_closed
    _limits, _on_closed = limits, on_closed


def _closed(reason: str) -> None:
    if _on_closed is not None:
        _on_closed(reason)


def _too_many() -> bytes:
    body = json.dumps({"error": {"message": "too many connections from this address", "type": "rate_limit_error",
                                 "param": None, "code": "too_many_connections"}}).encode()
    return (b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class _LingeringClose:
    """The transport as a request cycle sees it: its close() lingers while the request body is unread."""

    def __init__(self, protocol: "BoundedH11Protocol", transport):
        self._protocol, self._transport = protocol, transport
        # once per SSE event: found here, not through __getattr__ (2% of the front's samples:
        # benchmarks/results/2026-11-27-loop-profiles.json)
        self.write = transport.write

    def __getattr__(self, name):
        return getattr(self._transport, name)

    def close(self) -> None:
        cycle = self._protocol.cycle
        if cycle is not None and cycle.more_body and not self._transport.is_closing():
            self._protocol.linger()
        else:
            self._transport.close()


DIRECT_BODY = "front.direct_body"  # the ASGI scope's extension that holds a request's DirectBody


class DirectBody:
    """A streamed response's body written straight to its connection, beside ASGI's `send`: the SSE body's
    per-token events (front/app.py), gathered until `flush()` and then written as one chunk of the
    response's chunked body. An event through `send` costs its generator's wake-up, Starlette's middleware
    wrappers and h11's state machine; here it is bytes appended and one socket write per engine read
    (docs/benchmarks.md, the front's cost per token).

    Writable only between the response's start and its end, its client connected and not pushing back
    (uvicorn's flow control: the slow path's `send` waits for the drain), and with the body chunked
    (HTTP/1.1; h11 writes an HTTP/1.0 client's body unframed, so that one keeps to `send`). The app writes
    here only while its own `send` is idle (the body generator waits for the engine), so the two never
    interleave."""

    __slots__ = ("_protocol", "_cycle", "_parts", "_chunked", "add")

    def __init__(self, protocol: "BoundedH11Protocol", cycle):
        self._protocol, self._cycle = protocol, cycle
        self._parts: list[bytes] = []
        self._chunked: bool | None = None  # known once the response has started
        self.add = self._parts.append  # add(data): an event for the next flush (a call per token fewer)

    def writable(self) -> bool:
        cycle = self._cycle
        if not cycle.response_started or cycle.response_complete or cycle.disconnected \
                or self._protocol.flow.write_paused:
            return False
        if self._chunked is None:  # h11's framing of this response (a private attribute: h11 pinned; if it
            # is ever gone, every event keeps to `send`)
            self._chunked = type(getattr(self._protocol.conn, "_writer", None)) is ChunkedWriter
        return self._chunked

    def flush(self) -> None:
        parts = self._parts
        if not parts:
            return
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        parts.clear()
        transport = self._protocol.transport
        if not transport.is_closing():
            transport.write(b"%x\r\n%b\r\n" % (len(data), data))


class BoundedH11Protocol(H11Protocol):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits = _limits
        self.timeout_keep_alive = self.limits.idle_timeout_s
        self._deadline = None  # TimerHandle: headers or body due
        self._timed_cycle = None  # the request whose headers have arrived
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
                transport.write(_too_many())
                transport.close()
                _closed("too_many_connections")
                return
            counts[host] += 1
            self._counted = host
        self._arm(self.limits.header_timeout_s)

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
        super().data_received(data)

    def linger(self) -> None:
        self._lingering = 1
        self._disarm()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.flow.resume_reading()
        self._deadline = self.loop.call_later(LINGER_S, self.transport.close)

    def on_response_complete(self) -> None:
        if self._lingering:
            self.server_state.total_requests += 1
            return
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm(self.limits.header_timeout_s)  # the next request's headers

    def handle_events(self) -> None:
        super().handle_events()
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            return
        if cycle is not self._timed_cycle:  # a new request's headers are complete: now its body is due
            self._timed_cycle = cycle
            cycle.transport = _LingeringClose(self, self.transport)
            cycle.scope.setdefault("extensions", {})[DIRECT_BODY] = DirectBody(self, cycle)
            self._disarm()
            if cycle.more_body:
                self._arm(self.limits.body_timeout_s)
        elif not cycle.more_body:  # its body is complete
            self._disarm()

    def _arm(self, seconds: float) -> None:
        self._disarm()
        if seconds > 0:
            self._deadline = self.loop.call_later(seconds, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and cycle is self._timed_cycle and not cycle.more_body:
            return  # the body arrived meanwhile: the app is answering
        if not self.transport.is_closing():
            if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE) and (cycle is None or not cycle.response_started):
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            self.transport.close()
            in_body = cycle is not None and cycle is self._timed_cycle and not cycle.response_complete
            _closed("body_timeout" if in_body else "header_timeout")
