"""The front's engine reader over Triton's HTTP generate_stream (front/engine_http.py) and DirectEngine over
it, against a fake Triton that answers as tritonserver 2.51 does (measured, front/engine_http.py's
docstring): one `data:` event per response with single values as scalars, the chunked body's end as the
stream's end (no final flag, no event for an empty final response), errors as `data: {"error": ...}` (400
first, 200 after output) or Triton's own JSON body (404), `id` the request id that the engine's `stop` names.
The same contract against the real server: the front's test set with FRONT_ENGINE_PROTOCOL=http."""
import asyncio
import json
import re
from pathlib import Path

import orjson
import pytest
from tritonclient.utils import InferenceServerException

from contracts.errors import ServingError
from front.engine_direct import DirectEngine, _engine_error
from front.engine_http import EngineHttpClient, engine_body, engine_step
from front.gateway_client import Piece, to_serving_error
from front.openai_schema import GatewayCall
from text.detokenize import Detokenizer


class FakeTriton:
    """Keep-alive HTTP/1.1; `script(body)` -> async generator of (kind, value) for one request: ("head", status),
    ("event", dict or raw bytes), ("json", (status, dict)): a whole JSON response. Stops end `running[id]`."""

    def __init__(self, script, close_after=False):
        self.script, self.bodies, self.running, self.connections = script, [], {}, 0
        self.close_after = close_after  # close each connection once its response is out (keep-alive ends)

    async def start(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader, writer):
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                body = json.loads(await reader.readexactly(int(re.search(rb"Content-Length: (\d+)", head)[1])))
                self.bodies.append(body)
                if body.get("stop"):
                    if body["id"] in self.running:
                        self.running[body["id"]].set()
                    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")  # no event
                    continue
                started = False
                async for kind, value in self.script(self, body):
                    if kind == "json":
                        status, obj = value
                        data = json.dumps(obj).encode()
                        writer.write(b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                                     % (status, len(data), data))
                        break
                    if not started:
                        status = value if kind == "head" else 200
                        writer.write(b"HTTP/1.1 %d X\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
                                     b"Transfer-Encoding: chunked\r\n\r\n" % status)
                        started = True
                    if kind == "event":
                        data = b"data: " + (value if isinstance(value, bytes) else json.dumps(value).encode()) + b"\n\n"
                        writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                    await writer.drain()
                else:
                    if not started:
                        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                    writer.write(b"0\r\n\r\n")
                await writer.drain()
                if self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def tokens(*ids, **extra):
    async def script(fake, body):
        for i in ids:
            yield "event", {"model_name": "m", "model_version": "1", "output_ids": i, "sequence_length": 1, **extra}
    return script


async def read_all(stream):
    out = []
    while True:
        item = await stream.next()
        out.append(item)
        if item is None or item[1]:
            return out


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_a_stream_ends_with_its_body_and_its_connection_serves_the_next():
    async def main():
        fake = FakeTriton(tokens(5, 6, 7))
        client = EngineHttpClient(await fake.start())
        for _ in range(3):
            items = await read_all(client.stream("m", engine_body({"input_ids": [[1, 2]]}, "r", {}), "r"))
            assert [(s.ids if s else None, final) for s, final in items] == [([5], False), ([6], False), ([7], False),
                                                                             (None, True)]
        assert fake.connections == 1 and fake.bodies[0] == {"input_ids": [1, 2], "id": "r"}
        await client.close()
    run(main())


def test_the_body_is_the_inputs_without_their_batch_dimension():
    body = json.loads(engine_body({"input_ids": [[1, 2, 3]], "input_lengths": [[3]], "streaming": [[True]],
                                   "stop_words_list": [[[5, 6], [2, -1]]], "guided_decoding_guide": [["{}"]]},
                                  "lease-1", {"cache_salt": "s"}))
    assert body == {"input_ids": [1, 2, 3], "input_lengths": 3, "streaming": True, "stop_words_list": [5, 6, 2, -1],
                    "guided_decoding_guide": "{}", "cache_salt": "s", "id": "lease-1"}


def test_events_read_as_the_grpc_tensors_do():
    step = engine_step({"output_ids": [4, 5, 9], "sequence_length": 2, "sequence_index": 1,
                        "output_log_probs": [-0.5, -1.0, 0.0], "generation_logits": [0.0] * 8,
                        "context_logits": [1.0] * 12}, prompt_len=3)
    assert step.ids == [4, 5] and step.sequence_index == 1 and step.log_probs.tolist() == [-0.5, -1.0]
    assert step.generation_logits.shape == (2, 4) and step.context_logits.shape == (3, 4)
    assert engine_step({"output_ids": [], "sequence_length": 0}, 3).ids == []
    assert engine_step({"model_name": "m"}, 3) is None


GRPC_STREAM_ERROR = lambda text: to_serving_error(InferenceServerException(msg=text))  # noqa: E731 - no status


@pytest.mark.parametrize("text", [
    "[kind=invalid_argument status=400 field=temperature] temperature: must be a finite number",
    "[kind=queue_full status=503 retry_after=1.000] the engine queue is full",
    "Stub process 'tensorrt_llm_0_0' is not healthy.",
    "[kind=internal status=500] the engine failed",
])
@pytest.mark.parametrize("after_output", [False, True])
def test_an_engine_error_is_the_error_the_grpc_stream_gives(text, after_output):
    """First response (Triton answers 400 whatever the error) or mid-stream (200): the same kind, status and
    field as the same text over the gRPC stream, which carries no code."""
    async def script(fake, body):
        if after_output:
            yield "event", {"output_ids": 3, "sequence_length": 1}
        else:
            yield "head", 400
        yield "event", {"error": text}

    async def main():
        client = EngineHttpClient(await FakeTriton(script).start())
        stream = client.stream("m", engine_body({"input_ids": [[1]]}, "r", {}), "r")
        if after_output:
            assert (await stream.next())[0].ids == [3]
        with pytest.raises(ServingError) as e:
            await stream.next()
        return e.value
    got, want = to_serving_error(run(main())), GRPC_STREAM_ERROR(text)
    assert (got.kind, got.status, got.field) == (want.kind, want.status, want.field)


def test_an_unknown_model_is_unavailable_while_it_reloads_as_over_grpc():
    async def script(fake, body):
        yield "json", (404, {"error": "Request for unknown model: 'tensorrt_llm' has no available versions"})

    async def main():
        client = EngineHttpClient(await FakeTriton(script).start())
        with pytest.raises(ServingError) as e:
            await client.stream("tensorrt_llm", b"{}", "r").next()
        return _engine_error(to_serving_error(e.value), "tensorrt_llm")
    assert run(main()).status == 503


def test_a_connection_closed_mid_stream_is_unavailable():
    async def script(fake, body):
        yield "event", {"output_ids": 3, "sequence_length": 1}
        raise ConnectionError  # the server goes away without ending the body

    async def main():
        client = EngineHttpClient(await FakeTriton(script).start())
        stream = client.stream("m", b"{}", "r")
        await stream.next()
        with pytest.raises(ServingError) as e:
            await stream.next()
        return e.value
    assert run(main()).kind == "unavailable"


# -- DirectEngine over HTTP ---------------------------------------------------------------------------------
class FakeGateway:
    """The lease operations DirectEngine calls: settle records its report; engine_check answers `alive`."""
    timeout_s = 30.0
    client = None

    def __init__(self, alive=True):
        self.settled, self.checks, self.alive = [], 0, alive

    async def call(self, call, api_key, operation, parameters=None):
        lease = json.loads(parameters.get("lease", "null"))
        if operation == "settle":  # the settles that queued up, one request (front/grouped_settles.py)
            self.settled.extend(lease["leases"])
            return Piece(text=json.dumps({"settled": [{"finish_reason": "length"} for _ in lease["leases"]]}),
                         final=True)
        if operation == "engine_check":
            self.checks += 1
            if not self.alive:
                raise ServingError("unavailable", "the engine restarted")
        return Piece(text="{}", final=True)


GRANT = {"lease": "lease-7", "model": "tensorrt_llm", "cache_salt": "salt", "num_input_tokens": 2, "ttl_s": 60,
         "max_tokens": 3, "inputs": {"input_ids": [[1, 2]], "input_lengths": [[2]], "request_output_len": [[3]]}}


def direct(address, gateway, stops=None):
    detok = Detokenizer([bytes([97 + i % 26]) for i in range(64)])
    return DirectEngine(gateway, "fk", detok, engine_http=EngineHttpClient(address),
                        on_stop=(stops.append if stops is not None else None))


async def pieces(engine, n=None):
    out = []
    gen = engine.from_engine(GRANT, GatewayCall(max_tokens=3, stream=True), 0.0)
    async for piece in gen:
        out.append(piece)
        if n is not None and len(out) == n:
            await gen.aclose()
            break
    return out


def test_a_stream_over_http_settles_as_a_success_without_an_engine_check():
    async def main():
        fake, gw = FakeTriton(tokens(0, 1, 2)), FakeGateway()
        got = await pieces(direct(await fake.start(), gw))
        assert fake.bodies[0]["id"] == "lease-7" and fake.bodies[0]["cache_salt"] == "salt"
        return got, gw
    got, gw = run(main())
    assert "".join(p.text for p in got) == "abc" and got[-1].final and got[-1].completion_tokens == 3
    assert [(s["outcome"], s["num_output_tokens"]) for s in gw.settled] == [("success", 3)] and gw.checks == 0


def test_a_stream_closed_after_its_final_piece_settles_its_lease_once():
    """The app stops reading at the final piece and closes the generator (aclosing): the lease settled at the
    final piece is not settled again as cancelled (it was, every request: a second report the gateway refused
    as an unknown lease, its traceback kept in a reference cycle until the collector found it)."""
    async def main():
        fake, gw = FakeTriton(tokens(0, 1, 2)), FakeGateway()
        engine = direct(await fake.start(), gw)
        got = await pieces(engine, n=4)  # three tokens' text, then the final piece
        await asyncio.sleep(0.05)  # a settle after the close would run in the background
        return got, gw, engine
    got, gw, engine = run(main())
    assert got[-1].final and got[-1].completion_tokens == 3
    assert [(s["outcome"], s["num_output_tokens"]) for s in gw.settled] == [("success", 3)] and engine.live == {}


@pytest.mark.parametrize("alive", [True, False])
def test_an_empty_end_is_a_success_only_if_the_engine_lives(alive):
    """No event at all (what a flags-only final response gives over HTTP): the gateway is asked."""
    async def main():
        gw = FakeGateway(alive)
        engine = direct(await FakeTriton(tokens()).start(), gw)
        if alive:
            return await pieces(engine), gw
        with pytest.raises(ServingError) as e:
            await pieces(engine)
        await asyncio.sleep(0.05)  # the settle of a failed stream runs in the background
        return e.value, gw
    got, gw = run(main())
    assert gw.checks == 1
    if alive:
        assert got[-1].final and gw.settled[0]["outcome"] == "success"
    else:
        assert got.kind == "unavailable" and gw.settled[0]["outcome"] == "error"


async def endless(fake, body):
    """Tokens every 10 ms until the engine's `stop` for the request arrives."""
    stopped = fake.running.setdefault(body["id"], asyncio.Event())
    i = 0
    while not stopped.is_set():
        yield "event", {"output_ids": i % 20, "sequence_length": 1}
        i += 1
        await asyncio.sleep(0.01)
    yield "event", {"output_ids": [], "sequence_length": 0}  # the engine's own end of a stopped request


def test_an_abandoned_stream_is_ended_by_the_engines_stop_and_its_lease_settled():
    async def main():
        fake, gw, stops = FakeTriton(endless), FakeGateway(), []
        engine = direct(await fake.start(), gw, stops)
        got = await pieces(engine, n=2)
        for _ in range(200):
            if stops and gw.settled:
                break
            await asyncio.sleep(0.01)
        return got, fake, gw, stops, engine
    got, fake, gw, stops, engine = run(main())
    assert len(got) == 2
    assert [b for b in fake.bodies if b.get("stop")] == [{"input_ids": 0, "input_lengths": 1, "request_output_len": 1,
                                                          "stop": True, "id": "lease-7"}]
    assert stops == ["stop"]  # read to its end, not cancelled
    assert [s["outcome"] for s in gw.settled] == ["cancelled"] and engine.live == {}


def test_the_watchdog_fails_a_silent_stream_whose_engine_is_gone():
    """A stub that dies leaves its HTTP stream open (as over gRPC): the engine check fails it unavailable."""
    async def silent(fake, body):
        yield "event", {"output_ids": 1, "sequence_length": 1}
        await asyncio.sleep(30)

    async def main():
        gw = FakeGateway(alive=False)
        engine = direct(await FakeTriton(silent).start(), gw)
        engine.check_after_s = 0.2
        with pytest.raises(ServingError) as e:
            await pieces(engine)
        return e.value
    assert run(main()).kind == "unavailable"


def test_an_engine_model_being_reloaded_is_unavailable_to_the_client_not_unknown():
    """Triton answers 404 while the launcher reloads a model whose stub died: the gateway routed the request
    there, so the client gets 503 with a Retry-After, as over gRPC (a killed stub in test_lifecycle)."""
    async def script(fake, body):
        yield "json", (404, {"error": "Request for unknown model: 'tensorrt_llm' has no available versions"})

    async def main():
        gw = FakeGateway()
        engine = direct(await FakeTriton(script).start(), gw)
        with pytest.raises(ServingError) as e:
            await pieces(engine)
        await asyncio.sleep(0.05)
        return e.value, gw
    err, gw = run(main())
    assert err.kind == "unavailable" and err.status == 503 and err.retry_after
    assert [s["outcome"] for s in gw.settled] == ["error"]


# -- the text sink: an answer's text straight from the engine's read (front/app.py's SSE fast lane) -------------
class Sink:
    """A TextSink that logs what it is given: ("text", t) per write, "flush" per read of the engine."""

    def __init__(self, log, ready=True):
        self.log, self.ready_now = log, ready

    def ready(self):
        return self.ready_now

    def write(self, text):
        self.log.append(("text", text))

    def flush(self):
        self.log.append("flush")


def spaced(n, gap_s):
    async def script(fake, body):
        for i in range(n):
            yield "event", {"output_ids": i, "sequence_length": 1}
            await asyncio.sleep(gap_s)
    return script


async def sunk(engine, sink, log, n_tokens, pause_after_first_s=0.0, stop_after=None):
    """from_engine's pieces into `log` as ("piece", text), the sink's writes beside them, in the order each
    lane gave them; `stop_after`: pieces after which the consumer leaves."""
    grant = {**GRANT, "max_tokens": n_tokens, "inputs": {**GRANT["inputs"], "request_output_len": [[n_tokens]]}}
    gen = engine.from_engine(grant, GatewayCall(max_tokens=n_tokens, stream=True), 0.0, sink)
    got = 0
    async for piece in gen:
        log.append(("piece", piece.text))
        got += 1
        if got == stop_after:
            await gen.aclose()
            return
        if got == 1 and pause_after_first_s:
            await asyncio.sleep(pause_after_first_s)


def texts(log, lane=None):
    return "".join(item[1] for item in log if item != "flush" and (lane is None or item[0] == lane))


def test_after_the_first_text_the_answer_goes_to_the_text_sink_in_the_read_and_is_settled_whole():
    async def main():
        fake, gw, log = FakeTriton(spaced(5, 0.03)), FakeGateway(), []
        await sunk(direct(await fake.start(), gw), Sink(log), log, 5)
        return log, gw
    log, gw = run(main())
    # the first text as a piece (the SSE body's first chunk names the role), the rest from the reads, each
    # read flushed, then the end as the final piece
    assert [item for item in log if item != "flush"] == [("piece", "a"), ("text", "b"), ("text", "c"), ("text", "d"),
                                                         ("text", "e"), ("piece", "")]
    assert log[log.index(("text", "b")) + 1] == "flush"
    assert [(s["outcome"], s["num_output_tokens"]) for s in gw.settled] == [("success", 5)]
    assert gw.checks == 0  # the empty-end rule saw the tokens the sink took


def test_a_sink_that_is_not_ready_leaves_every_text_to_the_pieces():
    async def main():
        fake, gw, log = FakeTriton(spaced(4, 0.02)), FakeGateway(), []
        await sunk(direct(await fake.start(), gw), Sink(log, ready=False), log, 4)
        return log, gw
    log, gw = run(main())
    assert [item for item in log if item != "flush"] == [("piece", t) for t in ("a", "b", "c", "d", "")]
    assert [(s["outcome"], s["num_output_tokens"]) for s in gw.settled] == [("success", 4)]


def test_steps_queued_while_the_consumer_is_busy_come_first_as_pieces_then_the_sink_takes_the_rest_in_order():
    """The sink takes a step only while the consumer waits with nothing queued: a consumer busy elsewhere
    (a client's slow write) gets what queued meanwhile as pieces, in order, before any later text is sunk."""
    async def main():
        fake, gw, log = FakeTriton(spaced(16, 0.02)), FakeGateway(), []
        await sunk(direct(await fake.start(), gw), Sink(log), log, 16, pause_after_first_s=0.15)
        return log, gw
    log, gw = run(main())
    assert texts(log) == "abcdefghijklmnop"
    lanes = [item[0] for item in log if item != "flush"]
    assert lanes.count("piece") >= 3 and lanes.count("text") >= 3
    # once the sink took one, only the final piece follows as a piece
    assert "piece" not in lanes[lanes.index("text"):-1]
    assert [(s["outcome"], s["num_output_tokens"]) for s in gw.settled] == [("success", 16)]


def test_a_consumer_that_leaves_stops_the_sink_and_settles_what_both_lanes_carried():
    async def main():
        fake, gw, log, stops = FakeTriton(endless), FakeGateway(), [], []
        engine = direct(await fake.start(), gw, stops)
        sink = Sink(log)
        task = asyncio.ensure_future(sunk(engine, sink, log, 1000))
        await asyncio.sleep(0.2)  # the first piece, then the sink's texts
        task.cancel()  # the client leaves: the generator is closed where it waits
        with pytest.raises(asyncio.CancelledError):
            await task
        written = len([item for item in log if item != "flush"])
        for _ in range(200):
            if stops and gw.settled:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # the engine's stream drains: nothing more reaches the sink
        return log, written, gw, stops
    log, written, gw, stops = run(main())
    carried = [item for item in log if item != "flush"]
    assert len(carried) == written and len(carried) >= 3 and carried[0][0] == "piece"
    assert stops == ["stop"]
    assert [(s["outcome"], s["num_output_tokens"]) for s in gw.settled] == [("cancelled", len(carried))]


@pytest.mark.parametrize("pause_s", [0.05, 0.0])
def test_a_connection_the_server_closed_while_idle_is_not_reused(pause_s):
    """Triton may close a kept-alive connection between streams: the next stream opens another (at once:
    the request may go out on the closing connection first, and is sent again on a new one)."""
    async def script(fake, body):
        yield "event", {"output_ids": 1, "sequence_length": 1}

    async def main():
        fake = FakeTriton(script, close_after=True)
        client = EngineHttpClient(await fake.start())
        for _ in range(3):
            items = await read_all(client.stream("m", b"{}", "r"))
            assert [final for _, final in items] == [False, True]
            await asyncio.sleep(pause_s)
        return fake.connections
    assert run(main()) == 3


def test_the_front_lifts_its_open_files_limit_to_the_hard_one():
    """Each stream holds its client's socket and, over HTTP, its own connection to the engine. Run in a
    child that first sets limits of (256, 512) (lowering is always allowed), so it runs on any host."""
    import subprocess
    import sys

    code = ("import resource\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (256, 512))\n"
            "from front.__main__ import raise_open_files_limit\n"
            "raise_open_files_limit()\n"
            "print(*resource.getrlimit(resource.RLIMIT_NOFILE))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["512", "512"]


@pytest.mark.parametrize("address,host,port", [
    ("127.0.0.1:8000", "127.0.0.1", 8000), ("http://localhost:8001/", "localhost", 8001),
    ("[::1]:8000", "::1", 8000), ("[::1]", "::1", 80), ("triton", "triton", 80)])
def test_the_engine_address_is_read_as_the_front_is_given_it(address, host, port):
    client = EngineHttpClient(address)
    assert (client.host, client.port) == (host, port)


EVENTS = [{"output_ids": [i, i + 1], "sequence_length": 2} for i in range(3)]
SSE = [b"data: " + orjson.dumps(e) + b"\n\n" for e in EVENTS]
BODY = b"".join(SSE)


@pytest.mark.parametrize("chunks", [
    [BODY[:9], BODY[9:60], BODY[60:]],  # chunk boundaries inside events
    SSE,  # one event a chunk: Triton's own, read in the chunk's read
    [b": a comment\n" + SSE[0], b"event: x\n" + SSE[1] + SSE[2]],  # other SSE lines, two events in a chunk
    [SSE[0][:-1], SSE[0][-1:] + SSE[1], SSE[2]],  # an event's end in the next chunk, then one whole
    [SSE[0][:-1], SSE[1], SSE[2]],  # a line held when a whole event's chunk comes: in its order
], ids=["cut-inside", "one-per-chunk", "other-lines", "end-in-next", "held-line"])
def test_a_response_split_anywhere_parses_as_the_whole(chunks):
    """TCP may cut a response at any byte (inside the head, a chunk-size line, an event, the CRLFs), and the
    server may chunk its events as it likes: every split of every layout gives the same events and one end as
    the response delivered at once."""
    from front.engine_http import _Connection

    class Pool:
        def _release(self, conn):
            pass

        def _forget(self, conn):
            pass

    class Stream:
        ended = False
        sink = None

        def __init__(self):
            self.events, self.ends, self.failures = [], 0, []

        def _event(self, event, conn):
            self.events.append(event)

        def _end(self, conn):
            self.ends += 1

        def _fail(self, err, conn):
            self.failures.append(err)

    class Transport:
        def abort(self):
            raise AssertionError("the parser gave up on a valid response")

        close = abort

    events = EVENTS
    wire = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n")

    def feed(pieces):
        conn, stream = _Connection(Pool()), Stream()
        conn.connection_made(Transport())
        conn.stream = stream
        for p in pieces:
            conn.data_received(p)
        return stream

    whole = feed([wire])
    assert whole.events == events and whole.ends == 1 and not whole.failures
    for cut in range(1, len(wire)):
        got = feed([wire[:cut], wire[cut:]])
        assert (got.events, got.ends, got.failures) == (events, 1, []), cut
    got = feed([wire[i:i + 1] for i in range(len(wire))])
    assert (got.events, got.ends, got.failures) == (events, 1, [])
