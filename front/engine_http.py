"""The engine model over Triton's HTTP `generate_stream` (server-sent events, JSON), on keep-alive HTTP/1.1
connections of the front's own: the front's other engine reader, beside the gRPC stream
(front/engine_direct.py EngineStream; `--engine-protocol`).

Why: a token read from tritonclient's grpc.aio stream costs a gRPC message, its poller thread's hand-off
to the loop and a reader task's wake-up; here an event is parsed in the connection's `data_received`
(chunked framing, one `data:` line, orjson) and handed straight to the stream's consumer, with no task of
its own (benchmarks/results/2026-11-27-front-engine-protocol*.json).

What Triton 2.51 sends (measured against the real server, docs/benchmarks.md):
- a body of the model's inputs by name (no batch dimension: a single value is a scalar, a tensor a flat
  list; [2, -1] inputs such as stop_words_list flat too), any other field a request parameter, `id` the
  request id (the engine's `stop` finds the request by it);
- one `data: {...}` event per response, outputs by name (a single value as a scalar, else a flat list);
  no event for a response without outputs (an empty final response);
- the stream's end: the chunked body ends right after the final response; no flag, no sentinel;
- an error: `data: {"error": "..."}`, with status 400 when it is the first response (whatever its code)
  and 200 after some output; a request Triton refuses itself (an unknown model: 404, a body it cannot
  convert: 500) as a JSON body `{"error": "..."}`;
- a stream whose engine stub died stays open, as over gRPC (the front's watchdog ends it);
- closing the connection cancels the request in the model (the front ends abandoned requests with the
  engine's `stop` instead and reads them to the end, as over gRPC).
"""
from __future__ import annotations

import asyncio
from collections import deque
from typing import Protocol

import numpy as np
import orjson

from contracts.errors import ServingError, from_transport
from contracts.generation import EngineStep

HEAD_MAX = 64 * 1024  # a response's status line and headers
_HEAD, _SIZE, _DATA, _CRLF, _TRAILER, _LENGTH, _DONE = range(7)


class StreamCancelled(Exception):
    """The stream was cancelled under its reader (the watchdog, or a cancel after the drain's bound)."""


def unavailable(why: str) -> ServingError:
    return ServingError("unavailable", f"the engine connection {why}", retry_after=1.0)


def engine_body(inputs: dict, request_id: str, parameters: dict) -> bytes:
    """A generate_stream body: each input (batch dimension first, a batch of one) without its batch
    dimension, flat, a single value as a scalar; `id` and the request's parameters beside them."""
    return orjson.dumps({**body_fields(inputs, parameters), "id": request_id})


def body_fields(inputs: dict, parameters: dict) -> dict:
    """A generate_stream body's fields but its `id` (engine_body; the lease socket's operations carry the
    same, front/lease_socket.py)."""
    body = {}
    for name, value in inputs.items():
        flat = _flat(value[0]) if isinstance(value, list) and value else value
        body[name] = flat[0] if isinstance(flat, list) and len(flat) == 1 else flat
    body.update(parameters)
    return body


def _flat(value):
    if not isinstance(value, list):
        return [value]
    if not value or not isinstance(value[0], list):
        return value
    out = []
    for v in value:
        out.extend(_flat(v))
    return out


def _chunk_size(line: bytes) -> int:
    """A chunk-size line's size (hex, any chunk extension after `;` ignored)."""
    return int(line, 16) if b";" not in line else int(line.split(b";", 1)[0], 16)


def _scalar(value) -> int:
    return value if not isinstance(value, list) else value[0]


_BESIDE_IDS = frozenset(("sequence_index", "output_log_probs", "generation_logits", "context_logits"))


def engine_step(event: dict, prompt_len: int) -> EngineStep | None:
    """An engine response's event as EngineStep (None without output_ids), as EngineStep.from_outputs reads
    the gRPC tensors: the arrays arrive flat, so the logits' rows are the step's tokens and the prompt."""
    ids = event.get("output_ids")
    if ids is None:
        return None
    if not isinstance(ids, list):
        ids = [ids]
    n = event.get("sequence_length")
    n = len(ids) if n is None else n if type(n) is int else _scalar(n)
    if n != len(ids):
        ids = ids[:n]
    if _BESIDE_IDS.isdisjoint(event):  # a streamed step's tokens alone: the per-token case
        return EngineStep(ids)
    index = event.get("sequence_index")
    lps, gen, ctx = event.get("output_log_probs"), event.get("generation_logits"), event.get("context_logits")
    if lps is None and gen is None and ctx is None:
        return EngineStep(ids, 0 if index is None else _scalar(index))
    lps = None if lps is None else np.asarray(lps, dtype=np.float32).reshape(-1)[:n]
    if gen is not None:
        gen = np.asarray(gen, dtype=np.float32).reshape(-1)
        gen = gen.reshape(n, -1) if n and gen.size else None
    if ctx is not None:
        ctx = np.asarray(ctx, dtype=np.float32).reshape(-1)
        ctx = ctx.reshape(prompt_len, -1) if prompt_len and ctx.size else None
    return EngineStep(ids, 0 if index is None else _scalar(index), lps, gen, ctx)


class _Connection(asyncio.Protocol):
    """One keep-alive connection to Triton's HTTP server, one response at a time: parses the response's
    head and chunked body and hands each `data:` event to the stream that owns the connection."""

    def __init__(self, pool: "EngineHttpClient"):
        self.pool = pool
        self.transport = None
        self.stream: HttpEngineStream | None = None
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.state, self.buf, self.need, self.parts = _HEAD, b"", 0, []
        self.status, self.keep_alive, self.sse, self.body = 0, True, b"", []
        self.got_any = False

    # -- asyncio.Protocol ----------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.pool._forget(self)
        stream, self.stream = self.stream, None
        if stream is not None:
            stream._lost(self)

    def data_received(self, data: bytes) -> None:
        stream = self.stream
        if stream is None:  # nothing asked: the server has no business sending
            self.transport.abort()
            return
        try:
            self._read(stream, data)
        finally:
            if stream.sink is not None:  # what the sink took from this read goes out in one write
                stream.sink.flush()

    def _read(self, stream: "HttpEngineStream", data: bytes) -> None:
        self.got_any = True
        if self.buf:
            data, self.buf = self.buf + data, b""
        pos, n = 0, len(data)
        try:
            sink = stream.sink
            if sink is not None and self.state == _SIZE and not self.sse and stream._waiter is not None \
                    and not stream._items and not stream._done.done():
                lane = sink.lane()  # the sink takes every plain step of this read: in one call (front/token_lane.py)
                if lane is not None:
                    pos = lane.feed(data, 0)
            while pos < n and self.state != _DONE:
                state = self.state
                if state == _SIZE:  # the usual case first: a whole chunk in this read (Triton's one event per
                    # chunk), its events handed on in one step; else the states below take it
                    i = data.find(b"\r\n", pos)
                    if i >= 0:
                        size = _chunk_size(data[pos:i])
                        end = i + 2 + size
                        if size and end + 2 <= n and data[end:end + 2] == b"\r\n":
                            self._chunk(data[i + 2:end])
                            pos = end + 2
                            continue
                if state == _DATA:
                    pos = self._data(data, pos)
                elif state == _LENGTH:
                    pos = self._length(data, pos)
                elif state == _HEAD:
                    pos = self._head_bytes(data, pos)
                else:
                    pos = self._line(data, pos)
                if pos is None:  # the rest is kept until more arrives
                    return
        except Exception as e:  # noqa: BLE001 - a response this parser cannot read: the connection is done
            self.stream = None
            self.keep_alive = False
            self.transport.abort()
            stream._fail(unavailable(f"sent a response the front cannot read ({e})"), self)
            return
        if self.state == _DONE:
            if pos < n:
                self.keep_alive = False  # bytes beyond the response: nothing to trust on this connection
            self._complete(stream)

    # -- the parser's states: each takes what it can from `data` at `pos` -> the next position, or None
    # when what it needs has not all arrived (the rest is kept in `buf`) --------------------------------
    def _keep(self, rest: bytes, why: str) -> None:
        self.buf = rest
        if len(rest) > HEAD_MAX:
            raise ValueError(why)

    def _data(self, data: bytes, pos: int) -> int:
        """A chunk's data (one SSE event or part of one)."""
        n = len(data)
        take = min(self.need, n - pos)
        self.parts.append(data[pos:pos + take] if take < n or pos else data)
        self.need -= take
        if self.need == 0:
            chunk = self.parts[0] if len(self.parts) == 1 else b"".join(self.parts)
            self.parts = []
            self.state = _CRLF
            self._chunk(chunk)
        return pos + take

    def _line(self, data: bytes, pos: int) -> int | None:
        """A chunk-size line, the CRLF after a chunk's data, or a trailer line (an empty one ends the
        response)."""
        i = data.find(b"\r\n", pos)
        if i < 0:
            self._keep(data[pos:], "a chunk line without its end")
            return None
        line, state = data[pos:i], self.state
        if state == _CRLF:
            if line:
                raise ValueError("a chunk without its CRLF")
            self.state = _SIZE
        elif state == _SIZE:
            size = _chunk_size(line)
            if size:
                self.state, self.need = _DATA, size
            else:
                self.state = _TRAILER
        elif not line:
            self.state = _DONE
        return i + 2

    def _length(self, data: bytes, pos: int) -> int:
        """A body of a known Content-Length (Triton's own JSON refusals)."""
        take = min(self.need, len(data) - pos)
        self.body.append(data[pos:pos + take])
        self.need -= take
        if self.need == 0:
            self.state = _DONE
        return pos + take

    def _head_bytes(self, data: bytes, pos: int) -> int | None:
        i = data.find(b"\r\n\r\n", pos)
        if i < 0:
            self._keep(data[pos:], "a response head over 64 KiB")
            return None
        self._head(data[pos:i])
        return i + 4

    # -- the response ------------------------------------------------------------------------------------
    def _head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise ValueError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        self.status = int(parts[1])
        chunked, length = False, None
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"content-length":
                length = int(value.strip())
            elif name == b"connection":
                self.keep_alive = b"close" not in value.lower()
        if parts[0] == b"HTTP/1.0":
            self.keep_alive = False
        if chunked:
            self.state = _SIZE
        elif length is not None:
            self.state, self.need = (_LENGTH, length) if length else (_DONE, 0)
        else:
            raise ValueError("a response without a length (the server closes to end it)")

    def _chunk(self, chunk: bytes) -> None:
        """A chunk of an event-stream body: complete `data:` events go to the stream."""
        if self.sse:
            chunk, self.sse = self.sse + chunk, b""
        if chunk.startswith(b"data:") and chunk.find(b"\n") == len(chunk) - 2 and chunk.endswith(b"\n\n"):
            stream = self.stream  # one event of one `data:` line (Triton's chunk of a response): _event's, here
            if stream is not None:
                stream._event(orjson.loads(chunk[5:-2]), self)
            return
        events = chunk.split(b"\n\n")
        self.sse = events.pop()
        for event in events:
            self._event(event)

    def _event(self, event: bytes) -> None:
        for line in event.split(b"\n") if b"\n" in event else (event,):
            if line.startswith(b"data:"):
                stream = self.stream
                if stream is not None:
                    stream._event(orjson.loads(line[5:]), self)

    def _complete(self, stream: "HttpEngineStream") -> None:
        if self.state == _LENGTH or self.body:  # a JSON body: Triton's own refusal
            raw = b"".join(self.body)
            try:
                text = orjson.loads(raw).get("error") or raw.decode(errors="replace")
            except Exception:  # noqa: BLE001
                text = raw.decode(errors="replace")
            stream._fail(http_error(text, self.status), self)
        elif self.sse.strip():
            self._event(self.sse)
        self.stream = None
        if self.status != 200 and not stream.ended:
            stream._fail(http_error(f"HTTP {self.status}", self.status), self)
        if not stream.ended:
            stream._end(self)
        keep = self.keep_alive and not self.closed
        self._reset()
        if keep:
            self.pool._release(self)
        else:
            self.transport.close()


def http_error(text: str, status: int | None) -> ServingError:
    """An error of the engine's HTTP stream as the error contract. Triton answers 400 for any error of
    a model's first response and 200 after output, so the status says nothing there (as gRPC's stream
    errors carry no code): the contract's prefix or Triton's message decide; a status Triton chose
    itself (404 for an unknown model, 500 for a body it cannot convert) only without them."""
    return from_transport(text, status if status not in (200, 400) else None)


class StepSink(Protocol):
    """Where an engine stream's steps can go as they are read (front/engine_direct.py, the SSE body)."""

    def take(self, step: EngineStep) -> bool: ...

    def flush(self) -> None: ...

    def lane(self):
        """A compiled lane (front/token_lane.py Lane) that takes this read's plain steps as `take` would, or None."""


class ItemQueue:
    """What a connection's reads hand one reader: items, then maybe the exception that ends them; `_push` in
    the read, `await next()` in the reader's task (an engine stream here, a lease operation:
    front/lease_socket.py)."""

    def __init__(self):
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None

    def _push(self, item) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next(self):
        """The next item, or raises the exception pushed in its place."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if isinstance(item, Exception):
            raise item
        return item


class HttpEngineStream(ItemQueue):
    """One request's generate_stream, read by its connection's protocol into a queue of (EngineStep or
    None, final): each event as (step, False), the body's normal end as (None, True). The stream's end
    carries no output (Triton's HTTP stream has no final flag), so `ends_without_event`: the empty-end rule
    reads the last event (front/engine_direct.py DirectEngine._engine)."""

    ends_without_event = True

    def __init__(self, client: "EngineHttpClient", model: str, body: bytes, request_id: str, prompt_len: int,
                 timeout_s: float, events: bool = False):
        """`events`: each response as its event's dict (another model's outputs), not as an EngineStep."""
        self.request_id, self.prompt_len, self._raw = request_id, prompt_len, events
        super().__init__()
        self._done: asyncio.Future = asyncio.get_running_loop().create_future()
        self._conn: _Connection | None = None
        self._cancelled = False
        # takes a step in the connection's read, without a task's wake-up, while the reader waits with
        # nothing queued (so in order): take(step) -> taken, else queued; flush() at each read's end
        self.sink: StepSink | None = None
        self._request = (f"POST /v2/models/{model}/generate_stream HTTP/1.1\r\nHost: {client._host_header}\r\n"
                         f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
        self._timer = asyncio.get_running_loop().call_later(
            timeout_s, self._fail, unavailable(f"gave no end within {timeout_s:g} s"), None)
        conn = client._take()
        if conn is not None:
            self._send(conn, client, retry=True)
        else:
            client._connect(self, retry=False)

    @property
    def ended(self) -> bool:
        """The stream's end has come (its body's end, an error, or the connection's): the caller may not
        have taken it from the queue yet."""
        return self._done.done()

    def _send(self, conn: _Connection, client: "EngineHttpClient", retry: bool) -> None:
        """`retry`: a kept-alive connection the server may have closed meanwhile; if it closes before any
        byte of the answer, the request goes once more on a new connection."""
        if self.ended:
            client._release(conn)
            return
        self._conn, self._retry, self._client = conn, retry, client
        conn.stream = self
        conn.transport.write(self._request)

    def _lost(self, conn: _Connection) -> None:
        if conn is not self._conn or self.ended:
            return
        self._conn = None
        if self._retry and not conn.got_any and not self._items:
            self._client._connect(self, retry=False)
            return
        self._fail(unavailable("closed before the end of the request"), None)

    def _event(self, event: dict, conn) -> None:
        if self._done.done():  # ended
            return
        if "error" in event:
            self._fail(http_error(str(event["error"]), conn.status if conn else None), conn)
            return
        if self._raw:
            self._push((event, False))
            return
        step = engine_step(event, self.prompt_len)
        sink = self.sink
        if sink is not None and step is not None and self._waiter is not None and not self._items \
                and sink.take(step):
            return
        self._push((step, False))

    def _end(self, conn) -> None:
        self._finish((None, True))

    def _fail(self, err: Exception, conn) -> None:
        if self.ended:
            return
        if conn is None and self._conn is not None:  # a timeout: the connection goes with the request
            c, self._conn = self._conn, None
            c.stream = None
            c.transport.abort()
        self._finish(err)

    def _finish(self, item) -> None:
        self._timer.cancel()
        self._push(item)
        self._done.set_result(not isinstance(item, StreamCancelled))

    async def drain(self, timeout_s: float) -> bool:
        """Read what is left until the stream ends (within timeout_s): True if it ended by itself."""
        try:
            ended_by_itself = await asyncio.wait_for(asyncio.shield(self._done), timeout_s)
        except asyncio.TimeoutError:
            return False
        self._items.clear()
        return ended_by_itself

    def cancel(self) -> None:
        """Close the connection (Triton cancels the request in the model); the reader gets StreamCancelled."""
        if self.ended:
            return
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.stream = None
            conn.transport.abort()
        self._finish(StreamCancelled())


class EngineHttpClient:
    """Keep-alive connections to one tritonserver's HTTP address, one stream each at a time; idle ones
    are kept for the next stream (at most `max_idle`)."""

    def __init__(self, address: str, timeout_s: float = 600.0, max_idle: int = 1024):
        address = address.split("://", 1)[-1].rstrip("/")
        host, _, port = address.rpartition(":")
        if not host or host.endswith(":") or address.endswith("]"):  # no port ("host", an IPv6 address)
            host, port = address, ""
        self.host, self.port = host.strip("[]"), int(port or 80)
        self._host_header = host if ":" not in host.strip("[]") else f"[{host.strip('[]')}]"
        self.timeout_s, self.max_idle = timeout_s, max_idle
        self._idle: list[_Connection] = []
        self._all: set[_Connection] = set()

    def stream(self, model: str, body: bytes, request_id: str, prompt_len: int = 0,
               events: bool = False) -> HttpEngineStream:
        return HttpEngineStream(self, model, body, request_id, prompt_len, self.timeout_s, events)

    def _take(self) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and not conn.transport.is_closing():
                return conn
        return None

    def _release(self, conn: _Connection) -> None:
        conn.stream = None
        if len(self._idle) < self.max_idle and not conn.closed:
            self._idle.append(conn)
        else:
            conn.transport.close()

    def _forget(self, conn: _Connection) -> None:
        self._all.discard(conn)
        if conn in self._idle:
            self._idle.remove(conn)

    def _connect(self, stream: HttpEngineStream, retry: bool) -> None:
        loop = asyncio.get_running_loop()

        async def connect():
            try:
                _, conn = await loop.create_connection(lambda: _Connection(self), self.host, self.port)
            except OSError as e:
                stream._fail(unavailable(f"could not be opened ({e})"), None)
                return
            self._all.add(conn)
            stream._send(conn, self, retry)

        task = loop.create_task(connect())
        stream._connecting = task  # held while it runs

    async def close(self) -> None:
        for conn in list(self._all):
            if conn.transport is not None:
                conn.transport.close()
        self._idle.clear()
        self._all.clear()
