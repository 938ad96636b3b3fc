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
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_per_client: int = 256  # 0: no bound
    idle_timeout_s: float = 5.0  # uvicorn's timeout_keep_alive: between requests on one connection


_limits = ConnectionLimits()
PROTOCOL = "front.connections:BoundedH11Protocol"  # uvicorn's `http=` (importable: --workers spawns)


def configure(limits: ConnectionLimits) -> None:
    """Set the limits every connection of this process gets (before uvicorn serves)."""
    global _limits
    _limits = limits


def _too_many() -> bytes:
    body = json.dumps({"error": {"message": "too many connections from this address", "type": "rate_limit_error",
                                 "param": None, "code": "too_many_connections"}}).encode()
    return (b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class BoundedH11Protocol(H11Protocol):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits = _limits
        self.timeout_keep_alive = self.limits.idle_timeout_s
        self._deadline = None  # TimerHandle: headers or body due
        self._timed_cycle = None  # the request whose headers have arrived
        self._counted: str | None = None  # the client address this connection counts against

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

    def handle_events(self) -> None:
        super().handle_events()
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            return
        if cycle is not self._timed_cycle:  # a new request's headers are complete: now its body is due
            self._timed_cycle = cycle
            self._disarm()
            if cycle.more_body:
                self._arm(self.limits.body_timeout_s)
        elif not cycle.more_body:  # its body is complete
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm(self.limits.header_timeout_s)  # the next request's headers

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
