"""DirectBody (front/connections.py): a streamed response's bytes written straight to its connection beside
ASGI's `send`, on a real uvicorn server with the front's protocol and raw sockets as clients: framed as the
chunks of an HTTP/1.1 body, the connection kept alive for the next request; never for an HTTP/1.0 client
(its body goes unframed, ended by the close, so the app keeps to `send`), nor before the response starts or after it
ends."""
import asyncio

import uvicorn

from front.connections import DIRECT_BODY, BoundedHttpToolsProtocol

EVENTS = b"data: 1\n\ndata: 2\n\ndata: 3\n\n"


async def serve(seen):
    async def app(scope, receive, send):
        body = scope["extensions"][DIRECT_BODY]
        before = body.writable()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        during = body.writable()
        if during:
            body.add(b"data: 1\n\n")
            body.add(b"data: 2\n\n")
            body.flush()
            body.flush()  # nothing gathered: nothing written
        else:
            await send({"type": "http.response.body", "body": b"data: 1\n\ndata: 2\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"data: 3\n\n", "more_body": False})
        seen.append((before, during, body.writable()))

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, http=BoundedHttpToolsProtocol, lifespan="off",
                                           log_level="warning"))
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    return server, task, server.servers[0].sockets[0].getsockname()[1]


def dechunk(data: bytes) -> tuple[bytes, list[int], bytes]:
    """(the body, its chunks' sizes, what follows the last chunk)."""
    out, sizes = b"", []
    while True:
        line, _, data = data.partition(b"\r\n")
        size = int(line, 16)
        sizes.append(size)
        if size == 0:
            assert data.startswith(b"\r\n")
            return out, sizes, data[2:]
        out += data[:size]
        assert data[size:size + 2] == b"\r\n"
        data = data[size + 2:]


def test_an_http11_response_is_written_as_its_chunks_and_the_connection_serves_the_next():
    async def main():
        seen = []
        server, task, port = await serve(seen)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        bodies = []
        for _ in range(2):  # one kept-alive connection: the parser's state is whole after a DirectBody response
            writer.write(b"GET /events HTTP/1.1\r\nHost: x\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
            raw = b""
            while not raw.endswith(b"0\r\n\r\n"):
                raw += await asyncio.wait_for(reader.read(65536), 10)
            bodies.append(dechunk(raw))
        writer.close()
        server.should_exit = True
        await task
        return seen, bodies
    seen, bodies = asyncio.run(main())
    assert seen == [(False, True, False)] * 2
    for body, sizes, rest in bodies:
        assert body == EVENTS and rest == b""
        assert sizes == [18, 9, 0]  # the two gathered events as one chunk, then send's


def test_an_http10_client_gets_its_body_through_send_unframed():
    async def main():
        seen = []
        server, task, port = await serve(seen)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /events HTTP/1.0\r\n\r\n")
        raw = await asyncio.wait_for(reader.read(-1), 10)  # the body ends with the connection
        writer.close()
        server.should_exit = True
        await task
        return seen, raw
    seen, raw = asyncio.run(main())
    assert seen == [(False, False, False)]
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in head.lower() and body == EVENTS
