"""The front's Python per streamed token on its fast lane, alone: one engine response read by the engine
connection's protocol (front/engine_http.py) and written as the SSE event to the client's connection
(front/app.py _SseText, front/connections.py DirectBody), in one process with nothing else running.

    python benchmarks/fast_lane_bench.py [--tokens 200000] [--repeat 7] [--lane compiled,python] [--out FILE]

Each token is one read of Triton's generate_stream framing (one chunk, one `data:` event of a single
output id, as Triton 2.51 sends a streamed step), `data_received` of the real protocol, on a real
HttpEngineStream with the real sinks, the SmolLM2 detokenizer and the simulated engine's text
(cpu_engine/simulated_gpu.py); the client's and Triton's transports are stand-ins that keep what is written.
Reported: µs per token, the best of --repeat rounds (hot caches: in the served front each token arrives
after a context switch and costs several times more, docs/benchmarks.md), and the Python calls per token
(cProfile), for each lane asked (--lane: front/token_lane.py's compiled Lane, the Python path). Before it
times anything it checks that the client got every token's text, in order, as SSE
events, so a faster path that drops or garbles text fails here (tests/front/test_fast_lane_bench.py).
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import orjson  # noqa: E402

from benchmarks.report import machine, write_json  # noqa: E402
from front import token_lane  # noqa: E402
from front.app import _SseText  # noqa: E402
from front.choices import Choices  # noqa: E402
from front.connections import DirectBody  # noqa: E402
from front.engine_direct import _Answer, _EmptyEnd, _Live, _TakeText  # noqa: E402
from front.engine_http import _Connection  # noqa: E402
from front.openai_schema import GatewayCall, ResponseBuilder  # noqa: E402
from text.detokenize import Detokenizer  # noqa: E402

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


class _Transport:
    """A transport that keeps what is written to it."""

    def __init__(self):
        self.chunks: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.chunks.append(data)

    def is_closing(self) -> bool:
        return False

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Flow:
    write_paused = False


class _ClientProtocol:
    """What DirectBody reads of uvicorn's protocol: its transport and flow control."""

    def __init__(self):
        self.transport, self.flow = _Transport(), _Flow()


class _Cycle:
    """What DirectBody reads of a request's cycle: a chunked response under way."""
    response_started, response_complete, disconnected, chunked_encoding = True, False, False, True


class _Client:
    """An EngineHttpClient with one kept-alive connection: the stream takes it and writes its request."""

    _host_header = "127.0.0.1"

    def __init__(self, conn: _Connection):
        self.conn = conn

    def _take(self):
        conn, self.conn = self.conn, None
        return conn


def engine_read(token: int) -> bytes:
    """One streamed step as Triton's HTTP server writes it: a chunk holding one SSE event."""
    event = b"data: " + orjson.dumps({"model_name": "tensorrt_llm", "model_version": "1", "output_ids": token,
                                      "sequence_length": 1}) + b"\n\n"
    return b"%x\r\n%b\r\n" % (len(event), event)


def sse_texts(written: bytes) -> list[str]:
    """The text of each SSE event in a chunked body."""
    texts, pos = [], 0
    while pos < len(written):
        i = written.index(b"\r\n", pos)
        size = int(written[pos:i], 16)
        for line in written[i + 2:i + 2 + size].split(b"\n"):
            if line.startswith(b"data: "):
                texts.append(orjson.loads(line[6:])["choices"][0]["text"])
        pos = i + 4 + size
    return texts


async def fast_lane(detok: Detokenizer, ids: list[int], lane_type=None):
    """A stream in the state the front's fast lane serves: its first text out, the reader waiting. Returns
    (the engine connection, the client's transport, [the bytes of each token's read], the reader's task)."""
    from front.engine_http import HttpEngineStream

    conn = _Connection(pool=None)
    conn.connection_made(_Transport())
    stream = HttpEngineStream(_Client(conn), "tensorrt_llm", b"{}", "bench", 64, 600.0)
    protocol = _ClientProtocol()
    sse = _SseText(DirectBody(protocol, _Cycle()))
    call = GatewayCall(stream=True)
    choices = Choices(call)
    state = choices.state(0)
    state.started = True
    sse.bind(choices, state, ResponseBuilder(False).text_event_parts("bench"))
    answer = _Answer(detok, 1 << 30, keep=False)
    stream.sink = _TakeText(answer, sse, _EmptyEnd(True), _Live("bench", "tensorrt_llm", time.monotonic()), lane_type)
    reads = [engine_read(i) for i in ids]

    async def reader():  # from_engine's part: the first step through the queue, then it waits
        step, _ = await stream.next()
        answer.add(step)
        await stream.next()

    task = asyncio.ensure_future(reader())
    await asyncio.sleep(0)
    conn.data_received(HEAD + reads[0])
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert answer.first_at is not None and not stream._items, "the first step did not reach the reader"
    return conn, protocol.transport, reads, task


def text_ids() -> tuple[Detokenizer, list[int]]:
    """The served front's detokenizer (SmolLM2's) and the simulated engine's text as its token ids."""
    from build.prepare_model import DEFAULT_CHECKPOINT
    from cpu_engine.simulated_gpu import TEXT
    from text.tokenization import TokenizerBundle

    tokenizer = TokenizerBundle.load(DEFAULT_CHECKPOINT).tokenizer
    return Detokenizer.from_tokenizer(tokenizer), tokenizer.encode(TEXT, add_special_tokens=False).ids


def check(detok: Detokenizer, ids: list[int], n: int, lane_type=None) -> None:
    """n tokens through the fast lane: the client's events hold their text, in order, and nothing else."""
    async def run():
        conn, client, reads, task = await fast_lane(detok, ids, lane_type)
        for i in range(1, n):
            conn.data_received(reads[i % len(reads)])
        task.cancel()
        return b"".join(client.chunks)

    written = asyncio.run(run())
    want = detok.decode([ids[i % len(ids)] for i in range(1, n)])
    got = sse_texts(written)
    assert "".join(got) == want and len(got) == n - 1, (len(got), n - 1)


def measure(detok: Detokenizer, ids: list[int], tokens: int, repeat: int, lane_type=None) -> dict:
    async def run():
        conn, client, reads, task = await fast_lane(detok, ids, lane_type)
        k = len(reads)
        feed = conn.data_received
        best = float("inf")
        for _ in range(repeat):
            client.chunks.clear()
            t0 = time.perf_counter()
            for i in range(tokens):
                feed(reads[i % k])
            best = min(best, (time.perf_counter() - t0) / tokens)
        client.chunks.clear()
        profile = cProfile.Profile()
        profile.enable()
        for i in range(20000):
            feed(reads[i % k])
        profile.disable()
        task.cancel()
        return best, pstats.Stats(profile).total_calls / 20000

    best, calls = asyncio.run(run())
    return {"us_per_token": round(best * 1e6, 3), "python_calls_per_token": round(calls, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=200_000, help="tokens per round")
    ap.add_argument("--repeat", type=int, default=7, help="rounds; the best is reported")
    ap.add_argument("--lane", default="python", help="the lanes to measure, comma-separated: compiled (front/"
                    "token_lane.c, built by make setup), python")
    ap.add_argument("--out", type=Path, help="the report (.json)")
    args = ap.parse_args(argv)
    detok, ids = text_ids()
    lanes = {}
    for name in args.lane.split(","):
        lane_type = token_lane.resolve(name)
        check(detok, ids, 1000, lane_type)
        lanes[name] = result = measure(detok, ids, args.tokens, args.repeat, lane_type)
        print(f"fast lane, {name}: {result['us_per_token']} µs and {result['python_calls_per_token']} Python calls "
              f"per token (best of {args.repeat} rounds of {args.tokens:,} tokens)")
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
              "command": "python benchmarks/fast_lane_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "tokens": args.tokens, "repeat": args.repeat, "lanes": lanes}
    if args.out:
        write_json(args.out, report, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
