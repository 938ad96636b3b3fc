"""The Python a request costs the front's HTTP/1.1 protocol, alone: a chat request's head and body in one read,
the app's streamed answer (its head, one SSE event, the end) through uvicorn's `send`, on one kept-alive
connection, in one process with nothing else running. Peers: uvicorn's own h11 and httptools protocols,
unbounded; `--protocol FILE.py:Class` adds another (a former front's, from `git show REV:front/connections.py`).

    python benchmarks/protocol_bench.py [--requests 20000] [--repeat 5] [--protocol F.py:C] [--out F.json]

Reported per protocol: µs per request, the best of --repeat rounds with the loop's own turns taken out (hot
caches: served, a request costs several times more, docs/benchmarks.md), and the Python calls per request
(cProfile). Before it times anything it checks that each request was answered once, whole and in order.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import importlib.util
import json
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from uvicorn.config import Config  # noqa: E402
from uvicorn.protocols.http.h11_impl import H11Protocol  # noqa: E402
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # noqa: E402
from uvicorn.server import ServerState  # noqa: E402

from benchmarks.report import machine, write_json  # noqa: E402
from front.connections import BoundedHttpToolsProtocol  # noqa: E402

BODY = json.dumps({"model": "smollm2", "stream": True, "max_tokens": 16,
                   "messages": [{"role": "user", "content": "Say hello."}]}).encode()
REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:9000\r\naccept-encoding: gzip, deflate\r\n"
           b"connection: keep-alive\r\naccept: application/json\r\ncontent-type: application/json\r\n"
           b"user-agent: OpenAI/Python 3.54.0\r\nauthorization: Bearer sk-bench-0123456789abcdef\r\n"
           b"x-stainless-lang: python\r\ncontent-length: %d\r\n\r\n%b" % (len(BODY), BODY))
EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"Hello"}}]}\n\n'
TURNS = 6  # loop turns a request takes here (the app's task start, its receive, its sends): timed alone too


class _Transport:
    """A client's connection that keeps the size of what is written to it."""

    def __init__(self):
        self.written = bytearray()

    def write(self, data: bytes) -> None:
        self.written += data

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 9000)}.get(name, default)

    def is_closing(self) -> bool:
        return False

    def can_write_eof(self) -> bool:
        return True

    def close(self) -> None:
        raise AssertionError("the kept-alive connection was closed")

    pause_reading = resume_reading = write_eof = lambda self: None


async def app(scope, receive, send):
    message = await receive()
    assert message["body"] == BODY and not message["more_body"], message
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                            (b"x-request-id", b"chatcmpl-bench")]})
    await send({"type": "http.response.body", "body": EVENT, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def load(spec: str) -> type:
    """`FILE.py:Class` -> the class (FILE is loaded as a module of its own)."""
    path, _, name = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location(Path(path).stem + "_bench", path)
    module = sys.modules[module_spec.name] = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return getattr(module, name)


async def _served(protocol_class: type, requests: int, repeat: int) -> dict:
    loop = asyncio.get_running_loop()
    config = Config(app, lifespan="off", log_level="critical", access_log=False, ws="none")
    config.load()
    state = ServerState()
    protocol = protocol_class(config, state, {}, loop)
    transport = _Transport()
    protocol.connection_made(transport)

    async def one():
        protocol.data_received(REQUEST)
        for _ in range(TURNS):
            await asyncio.sleep(0)

    for _ in range(100):  # warm, and the check: each answered once, whole, in order
        await one()
    answers = bytes(transport.written).split(b"HTTP/1.1 200 OK\r\n")[1:]
    assert state.total_requests == 100 and len(answers) == 100, (state.total_requests, len(answers))
    assert all(EVENT in a and a.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n") for a in answers), answers[0]
    best = float("inf")
    for _ in range(repeat):
        transport.written.clear()
        t0 = time.perf_counter()
        for _ in range(requests):
            await one()
        served = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(requests):
            for _ in range(TURNS):
                await asyncio.sleep(0)
        best = min(best, (served - (time.perf_counter() - t0)) / requests)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(2000):
        await one()
    profile.disable()
    return {"us_per_request": round(best * 1e6, 2), "python_calls_per_request": round(
        (pstats.Stats(profile).total_calls - 2000 * TURNS * 2) / 2000, 1)}  # minus sleep(0)'s own calls


def measure(protocol_class: type, requests: int, repeat: int) -> dict:
    try:
        import uvloop
        return uvloop.run(_served(protocol_class, requests, repeat))
    except ImportError:
        return asyncio.run(_served(protocol_class, requests, repeat))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20_000, help="requests per round")
    ap.add_argument("--repeat", type=int, default=5, help="rounds; the best is reported")
    ap.add_argument("--protocol", action="append", default=[], metavar="FILE.py:Class",
                    help="another protocol to measure beside the front's and uvicorn's (repeatable)")
    ap.add_argument("--out", type=Path, help="the report (.json)")
    args = ap.parse_args(argv)
    protocols = {"front (BoundedHttpToolsProtocol)": BoundedHttpToolsProtocol, "uvicorn h11": H11Protocol,
                 "uvicorn httptools": HttpToolsProtocol, **{spec: load(spec) for spec in args.protocol}}
    results = {}
    for name, protocol_class in protocols.items():
        results[name] = measure(protocol_class, args.requests, args.repeat)
        print(f"{name}: {results[name]['us_per_request']} µs and {results[name]['python_calls_per_request']} "
              f"Python calls a request")
    report = {"command": "python benchmarks/protocol_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "requests": args.requests, "repeat": args.repeat, "protocols": results}
    if args.out:
        write_json(args.out, report, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
