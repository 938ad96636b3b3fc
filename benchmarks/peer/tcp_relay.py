"""A TCP relay, the floor peer of the front's cost per streamed token: each client connection gets its own
connection to the target, and bytes are copied both ways as they arrive, with nothing parsed, in one uvloop
process (the front's event loop). A token the engine streams through it costs the relay one wake-up, one
read and one write, which is what any process between the engine and a client pays per token, the front
included; what the front spends beyond it is its own work (parsing, detokenizing, the SSE event).

    python benchmarks/peer/tcp_relay.py --listen 127.0.0.1:PORT --to 127.0.0.1:TRITON_HTTP_PORT

benchmarks/capacity_bench.py runs it as the `engine_relay` layer (Triton's generate_stream through it).
Backpressure is passed on: a side whose writes back up pauses the reading of the other.

`--fast-lane LANE` (a diagnostic): each read from the target that is one streamed token (one chunk of one
`data:` event) also goes through the front's fast lane on a stand-in stream (benchmarks/fast_lane_bench.py:
the real protocol, sinks and detokenizer, its SSE event written nowhere), so the relay's CPU per token with
and without it is what that path costs in a serving process, where each token arrives after a wake-up.
LANE is the front's `--token-lane` choice (front/token_lane.py: `auto`, the compiled lane where it is
built, as in the front; `python`, its Python path).

`--nap-ms MS` (a diagnostic): after each turn of its loop the relay sleeps MS instead of waiting in epoll for
the next read, so it is woken by its own timer and takes the tokens that came meanwhile together: against
the plain relay, what the wake-ups by the engine's writes cost it (benchmarks/wakeup_bench.py measures one
alone). It delays each token by up to MS and holds the loop meanwhile: a measurement, not a way to serve.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time


_lane = None  # --fast-lane: the stand-in stream's data_received


class _Side(asyncio.Protocol):
    """One connection of a pair: what it reads goes to its peer's transport."""

    def __init__(self, peer: "_Side | None" = None):
        self.peer, self.transport, self.early = peer, None, []

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.write(data)
        else:  # the target's connection is still opening
            self.early.append(data)
        if _lane is not None and data.endswith(b"\n\n\r\n") and data.count(b"data:") == 1 \
                and b"output_ids" in data and b"HTTP/" not in data:
            _lane(data)

    def connection_lost(self, exc) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()

    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()


class _ClientSide(_Side):
    def __init__(self, host: str, port: int):
        super().__init__()
        self.host, self.port = host, port

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        asyncio.ensure_future(self._open())

    async def _open(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, target = await loop.create_connection(lambda: _Side(self), self.host, self.port)
        except OSError:
            self.transport.close()
            return
        if self.transport.is_closing():
            target.transport.close()
            return
        self.peer = target
        for data in self.early:
            target.transport.write(data)
        self.early = []


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


async def _fast_lane(choice: str):
    """The front's fast lane (`choice`: its --token-lane) on a stand-in stream (benchmarks/fast_lane_bench.py),
    its writes dropped."""
    global _lane
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks.fast_lane_bench import fast_lane, text_ids
    from front import token_lane

    conn, client, _, task = await fast_lane(*text_ids(), token_lane.resolve(choice))
    client.write = lambda data: None
    _lane = conn.data_received
    return task


def _nap_each_turn(loop, seconds: float) -> None:
    """--nap-ms: a callback always ready, so the loop polls without waiting, and it sleeps `seconds`."""
    def nap():
        time.sleep(seconds)
        loop.call_soon(nap)
    loop.call_soon(nap)


async def serve(listen: tuple[str, int], to: tuple[str, int], ready=None, fast_lane: str | None = None,
                nap_ms: float = 0.0) -> None:
    lane = await _fast_lane(fast_lane) if fast_lane else None  # noqa: F841 - the stand-in's reader, held
    server = await asyncio.get_running_loop().create_server(lambda: _ClientSide(*to), *listen)
    if nap_ms > 0:
        _nap_each_turn(asyncio.get_running_loop(), nap_ms / 1000)
    if ready is not None:
        ready()
    async with server:
        await server.serve_forever()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--listen", required=True, help="host:port to accept clients on")
    ap.add_argument("--to", required=True, help="host:port of the target")
    ap.add_argument("--fast-lane", metavar="LANE",
                    help="run each streamed token's read through the front's fast lane too (a diagnostic), "
                         "LANE as the front's --token-lane")
    ap.add_argument("--nap-ms", type=float, default=0.0,
                    help="sleep this long after each turn of the loop instead of waiting for a read (a diagnostic: "
                         "what the wake-ups cost)")
    args = ap.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # a borrowed host's Python without it (benchmarks/device/capacity.sh)
        print("[relay] uvloop is not installed: asyncio's own loop (the front's is uvloop)", file=sys.stderr)
    try:
        asyncio.run(serve(_address(args.listen), _address(args.to),
                          lambda: print(f"[relay] {args.listen} -> {args.to}", file=sys.stderr, flush=True),
                          args.fast_lane, args.nap_ms))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
