"""The front's client connections (front/connections.py BoundedHttpToolsProtocol) on a real uvicorn server
with raw sockets as clients: a head too large, a request llhttp refuses, a head or body too slow, an answer
given before its body ended, pipelined requests and a WebSocket upgrade are each answered as a client expects,
and every connection closed at a limit is counted under its reason."""
import asyncio
import json

import pytest
import uvicorn

from front import connections
from front.connections import PROTOCOL, ConnectionLimits

LIMITS = ConnectionLimits(header_timeout_s=0.5, body_timeout_s=0.5, max_per_client=4, idle_timeout_s=5.0,
                          max_head_bytes=4096)


async def app(scope, receive, send):
    """Answers /early at once, without reading its body; otherwise reads the whole body and echoes its size."""
    if scope["path"] != "/early":
        size, more = 0, True
        while more:
            message = await receive()
            size, more = size + len(message.get("body", b"")), message.get("more_body", False)
        body = json.dumps({"path": scope["path"], "bytes": size}).encode()
        status = 200
    else:
        body, status = b'{"error": "refused unread"}', 413
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
def closed():
    reasons = []
    connections.configure(LIMITS, reasons.append)
    yield reasons
    connections.configure(ConnectionLimits())


def serve_and(client):
    """Runs the server and `client(port)` on one loop; returns what client returns."""
    async def main():
        config = uvicorn.Config(app, host="127.0.0.1", port=0, http=PROTOCOL, ws="none", lifespan="off",
                                log_level="critical")
        server = uvicorn.Server(config)
        task = asyncio.ensure_future(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            return await client(server.servers[0].sockets[0].getsockname()[1])
        finally:
            server.should_exit = True
            await task
    return asyncio.run(main())


async def exchange(port, data: bytes, read_until_close=True, timeout=10.0) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    try:
        if read_until_close:
            return await asyncio.wait_for(reader.read(-1), timeout)
        return await asyncio.wait_for(reader.readuntil(b"}"), timeout)
    finally:
        writer.close()


def status_of(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


def test_a_head_over_the_bound_gets_a_431_and_is_closed(closed):
    head = b"GET / HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * 5000 + b"\r\n\r\n"
    raw = serve_and(lambda port: exchange(port, head))
    assert status_of(raw) == 431
    assert json.loads(raw.partition(b"\r\n\r\n")[2])["error"]["code"] == "head_too_large"
    assert closed == ["head_too_large"]


def test_a_head_under_the_bound_and_a_large_body_are_served(closed):
    body = b"b" * 100_000  # a body is not a head: only the head's bytes count against max_head_bytes
    request = (b"POST /upload HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * 3000 +
               b"\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body)
    raw = serve_and(lambda port: exchange(port, request))
    assert status_of(raw) == 200 and json.loads(raw.partition(b"\r\n\r\n")[2]) == {"path": "/upload", "bytes": 100_000}
    assert closed == []


def test_a_request_llhttp_refuses_is_a_400_and_counted(closed):
    async def client(port):  # a request line that is not HTTP; a DEL in a header value (RFC 9110: not a VCHAR);
        # a body framed twice, the request smuggler's head (RFC 9112 6.1: a server may reject it)
        return [await exchange(port, b"NOT HTTP AT ALL\r\n\r\n"),
                await exchange(port, b"GET / HTTP/1.1\r\nhost: x\r\nauthorization: Bearer \x7f\r\n\r\n"),
                await exchange(port, b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n"
                                     b"transfer-encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\n\r\n")]
    for raw in serve_and(client):
        assert status_of(raw) == 400 and b"/smuggled" not in raw
        assert json.loads(raw.partition(b"\r\n\r\n")[2])["error"]["code"] == "invalid_http"
    assert closed == ["invalid_http"] * 3


def test_a_slow_head_and_a_slow_body_get_a_408_each_under_its_reason(closed):
    async def client(port):
        head = await exchange(port, b"GET / HTTP/1.1\r\nhost: x\r\n")
        body = await exchange(port, b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\nabc")
        return head, body
    head, body = serve_and(client)
    assert status_of(head) == 408 and status_of(body) == 408
    assert closed == ["header_timeout", "body_timeout"]


def test_a_kept_alive_connections_late_second_head_is_closed_without_an_answer(closed):
    """The first request is answered; the second's head never ends: the connection closes header_timeout_s
    after its first bytes, with no 408 a client could take for that request's answer."""
    async def client(port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /one HTTP/1.1\r\nhost: x\r\n\r\n")
        first = await asyncio.wait_for(reader.readuntil(b"}"), 10)
        writer.write(b"GET /two HTTP/1.1\r\nhost: x\r\n")
        rest = await asyncio.wait_for(reader.read(-1), 10)
        writer.close()
        return first, rest
    first, rest = serve_and(client)
    assert status_of(first) == 200 and rest == b""
    assert closed == ["header_timeout"]


def test_a_head_and_a_body_in_pieces_within_the_bounds_are_served(closed):
    connections.configure(ConnectionLimits(header_timeout_s=5.0, body_timeout_s=5.0, max_head_bytes=4096))

    async def client(port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for piece in (b"POST /pieces HTTP/1.1\r\nhost: x\r\n", b"content-length: 6\r\n\r\nabc", b"def"):
            writer.write(piece)
            await asyncio.sleep(0.05)
        raw = await asyncio.wait_for(reader.readuntil(b"}"), 10)
        writer.close()
        return raw
    raw = serve_and(client)
    assert status_of(raw) == 200 and json.loads(raw.split(b"\r\n\r\n", 1)[1]) == {"path": "/pieces", "bytes": 6}
    assert closed == []


def test_an_answer_before_the_body_ended_lingers_then_closes(closed):
    """The 413 comes first; then the server closes its side and drops the rest of the body the client still
    sends (no reset the client would see instead of the answer); the connection is not reused."""
    async def client(port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /early HTTP/1.1\r\nhost: x\r\ncontent-length: 1000000\r\n\r\n" + b"x" * 1000)
        raw = await asyncio.wait_for(reader.read(-1), 10)  # the answer, then EOF: the write side closed
        for _ in range(10):  # the rest of the body is still read (and dropped)
            writer.write(b"x" * 10_000)
            await writer.drain()
        writer.close()
        return raw
    raw = serve_and(client)
    assert status_of(raw) == 413 and raw.endswith(b"refused unread\"}")
    assert closed == []


def test_pipelined_requests_are_answered_in_order_on_one_connection(closed):
    async def client(port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /one HTTP/1.1\r\nhost: x\r\n\r\nPOST /two HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\n"
                     b"abcGET /three HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        raw = await asyncio.wait_for(reader.read(-1), 10)
        writer.close()
        return raw
    raw = serve_and(client)
    bodies = [json.loads(part.split(b"\r\n\r\n", 1)[1]) for part in raw.split(b"HTTP/1.1 ")[1:]]
    assert bodies == [{"path": "/one", "bytes": 0}, {"path": "/two", "bytes": 3}, {"path": "/three", "bytes": 0}]
    assert closed == []


def test_a_websocket_upgrade_is_served_as_plain_http(closed):
    request = (b"GET /ws HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: websocket\r\n"
               b"sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
    raw = serve_and(lambda port: exchange(port, request, read_until_close=False))
    assert status_of(raw) == 200 and json.loads(raw.split(b"\r\n\r\n", 1)[1]) == {"path": "/ws", "bytes": 0}


def test_connections_over_the_per_client_bound_get_a_429(closed):
    async def client(port):
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
        raw = await exchange(port, b"")
        for _, writer in held:
            writer.close()
        return raw
    raw = serve_and(client)
    assert status_of(raw) == 429
    assert json.loads(raw.partition(b"\r\n\r\n")[2])["error"]["code"] == "too_many_connections"
    assert closed == ["too_many_connections"]


def test_requests_on_a_kept_alive_connection_leave_no_reference_cycles(closed):
    """A request's cycle, its DirectBody and its lingering transport are freed when its response ends, not
    by the cyclic collector: at a few thousand requests a second their cycles filled the old generation, and
    each full collection over the front's heap stalled every stream for tens of ms."""
    import gc

    request = b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhi"

    async def client(port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(request)
            await reader.readuntil(b"}")  # a first request: what is made once per connection is made
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                for _ in range(20):
                    writer.write(request)
                    await reader.readuntil(b"}")
                await asyncio.sleep(0.05)
                gc.collect()
                return sorted({type(o).__name__ for o in gc.garbage})
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
        finally:
            writer.close()
    assert serve_and(client) == []
