"""The front's compiled token lane (front/token_lane.c) against its Python path, which stays the reference:
the same engine reads, split anywhere, through both give the client the same bytes and leave the same
state in the answer, the choice, the stream and its queue. Read by read, for plain steps, steps the lane
must leave to Python (log probs, several sequences, errors, odd lengths, ids that are not ints), text
cut inside a UTF-8 character, stop strings, and a client that stops being writable."""
import asyncio
import random
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from benchmarks.fast_lane_bench import HEAD, _Client, _ClientProtocol, _Cycle, _Transport
from build import token_lane as build_lane
from front import token_lane
from front.app import _SseText
from front.choices import Choices
from front.connections import DirectBody
from front.engine_direct import _Answer, _EmptyEnd, _Live, _TakeText
from front.engine_http import HttpEngineStream, _Connection
from front.openai_schema import GatewayCall, ResponseBuilder
from text.detokenize import Detokenizer, incomplete_tail

ROOT = Path(__file__).resolve().parents[2]
Lane = token_lane.Lane
# only where it cannot be built (test_the_lane_is_built_wherever_it_can_be fails a host that could and did not)
needs_lane = pytest.mark.skipif(Lane is None, reason=f"the token lane is not in use here: {token_lane.WHY_NOT}")


@pytest.fixture(scope="module")
def detok(checkpoint):
    from text.tokenization import TokenizerBundle

    return Detokenizer.from_tokenizer(TokenizerBundle.load(checkpoint).tokenizer)


def test_the_lane_is_built_wherever_it_can_be():
    """make setup compiles it; where a compiler and Python's headers are, a lane silently not built is a slower front."""
    if build_lane.missing():
        pytest.skip(build_lane.missing())
    assert Lane is not None, "front/token_lane.c is not built: run `python build/token_lane.py`"


def test_the_choice_of_lane_is_checked_at_start(monkeypatch):
    assert token_lane.resolve("python") is None
    assert token_lane.resolve("auto") is Lane
    with pytest.raises(ValueError, match="must be one of"):
        token_lane.resolve("fast")
    monkeypatch.setattr(token_lane, "Lane", None)
    monkeypatch.setattr(token_lane, "WHY_NOT", "not built (make setup ...)")
    assert token_lane.resolve("auto") is None
    with pytest.raises(ValueError, match="not built"):
        token_lane.resolve("compiled")


@needs_lane
def test_a_utf8_tail_is_cut_where_the_detokenizer_cuts_it():
    from front._token_lane import incomplete_tail as c_tail

    interesting = [0x00, 0x41, 0x7F, 0x80, 0xBF, 0xC2, 0xDF, 0xE0, 0xEF, 0xF0, 0xF4, 0xF7, 0xF8, 0xFF]
    cases = [b""] + [bytes([a]) for a in interesting] + [bytes([a, b]) for a in interesting for b in interesting] \
        + [bytes([a, b, c]) for a in interesting for b in interesting for c in interesting]
    rng = random.Random(7)
    cases += [bytes(rng.choice(interesting) for _ in range(rng.randint(4, 9))) for _ in range(3000)]
    for data in cases:
        assert c_tail(data) == incomplete_tail(data), data


def _lane_in(out_dir, code: str) -> str:
    """`code` run in a Python that finds the project but not its own build (as in the GPU image, whose
    build is on the virtualenv's path): what it prints."""
    prelude = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; sys.modules['front._token_lane'] = None; "
               "from front import token_lane; ")
    run = subprocess.run([sys.executable, "-c", prelude + code, str(ROOT), str(out_dir)], capture_output=True,
                         text=True, cwd=out_dir)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_an_image_style_build_runs_only_if_built_from_the_projects_source(tmp_path):
    """deploy/Dockerfile.trtllm: the script and the source copied apart, built into the front's virtualenv;
    the front runs it while the mounted project's source is the one it was built from."""
    if build_lane.missing():
        pytest.skip(build_lane.missing())
    apart = tmp_path / "lane"
    apart.mkdir()
    shutil.copy(ROOT / "build" / "token_lane.py", apart)
    shutil.copy(ROOT / "front" / "token_lane.c", apart)
    site = tmp_path / "site"
    run = subprocess.run([sys.executable, str(apart / "token_lane.py"), "--require", "--source",
                          str(apart / "token_lane.c"), "--out-dir", str(site)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    built = build_lane.target(site)
    assert built.exists()
    assert _lane_in(site, "print(token_lane.Lane is sys.modules['_token_lane'].Lane, "
                          "sys.modules['_token_lane'].__file__.startswith(sys.argv[2]))") == "True True"
    # unchanged: not built again
    at = built.stat().st_mtime_ns
    assert build_lane.build(source=apart / "token_lane.c", out_dir=site) == built and built.stat().st_mtime_ns == at
    # built from another source (an image older than the project): not run, and `compiled` refuses to start
    (apart / "token_lane.c").write_text((apart / "token_lane.c").read_text() + "\n/* another version */\n")
    assert build_lane.build(source=apart / "token_lane.c", out_dir=site, force=True) == built
    assert _lane_in(site, "print(token_lane.Lane, 'another source' in token_lane.WHY_NOT)") == "None True"
    assert "another source" in _lane_in(site, "\nfrom front.__main__ import main\ntry:\n    main(['--token-lane', "
                                              "'compiled'])\nexcept SystemExit as e:\n    print(e)")


def test_without_a_compiler_the_build_says_so_and_the_front_keeps_python(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CC", "")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert build_lane.build(out_dir=tmp_path) is None
    assert "no C compiler" in capsys.readouterr().err
    assert build_lane.main(["--out-dir", str(tmp_path), "--require"]) == 1  # an image's build fails instead


# -- the two lanes on the same reads -------------------------------------------------------------------

class _Side:
    """One stream in the fast lane's state (its reader waiting, its first text out), on one of the lanes."""

    PARTS = ResponseBuilder(False).text_event_parts("m")  # one response id for both lanes' events

    def __init__(self, detok: Detokenizer, lane_type, stops: list[str], keep: bool):
        self.conn = _Connection(pool=_Pool())
        self.conn.connection_made(_Transport())
        self.stream = HttpEngineStream(_Client(self.conn), "tensorrt_llm", b"{}", "s", 8, 600.0)
        self.client = _ClientProtocol()
        self.cycle = _Cycle()
        self.sse = _SseText(DirectBody(self.client, self.cycle))
        self.choices = Choices(GatewayCall(stream=True, stop=stops))
        self.state = self.choices.state(0)
        self.state.started = True
        self.sse.bind(self.choices, self.state, self.PARTS)
        self.answer = _Answer(detok, 1 << 20, keep=keep)
        self.end = _EmptyEnd(True)
        self.live = _Live("s", "tensorrt_llm", 0.0)
        self.stream.sink = _TakeText(self.answer, self.sse, self.end, self.live, lane_type)
        self.queued: list = []
        self.task = asyncio.ensure_future(self._reader())

    async def _reader(self):
        """from_engine's part: what comes through the queue goes into the answer and the choice."""
        while True:
            try:
                item = await self.stream.next()
            except Exception as e:  # noqa: BLE001 - the stream's end by error, recorded
                self.queued.append(("error", type(e).__name__, str(e)))
                return
            step, final = item
            self.queued.append(("step", None if step is None else (list(step.ids), step.sequence_index), final))
            if step is not None:
                text = self.answer.add(step)
                if text:
                    self.choices.text(self.state, text)
            if final:
                return

    def seen(self) -> dict:
        a = self.answer
        return {"client": b"".join(self.client.transport.chunks), "queued": list(self.queued),
                "counts": dict(a.counts.by_sequence), "pending": a.detok.pending, "kept": a.kept,
                "first_at": a.first_at is not None, "last_at": a.last_at is not None, "live_last": self.live.last > 0,
                "end": (self.end.produced, self.end.last_had_output), "parts": list(self.state.parts),
                "sent": self.state.sent, "events": self.sse.events, "stop": (self.state.stop.held, self.state.stop.stopped),
                "ended": self.stream.ended}


class _Pool:
    """The connection's pool at the body's end: kept alive, released."""

    def _release(self, conn) -> None:
        conn.stream = None

    def _forget(self, conn) -> None:
        pass


def _chunk(event: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(event), event)


def _event(fields: dict) -> bytes:
    return _chunk(b"data: " + orjson.dumps(fields) + b"\n\n")


def _random_event(rng: random.Random, vocab: int) -> bytes:
    """Mostly plain steps (as Triton sends them), some the lane must leave to the Python path."""
    ids = [rng.randrange(vocab) for _ in range(rng.choice((1, 1, 1, 1, 2, 3)))]
    if rng.random() < 0.05:
        ids.append(rng.choice((-1, vocab, vocab + 7, 2 ** 64 - 1)))  # out of the table: no bytes
    fields = {"model_name": "tensorrt_llm", "model_version": "1", "output_ids": ids if len(ids) > 1 or rng.random() < 0.5
              else ids[0], "sequence_length": len(ids)}
    roll = rng.random()
    if roll < 0.05:
        fields["sequence_length"] = [len(ids)]
    elif roll < 0.08:
        fields["sequence_length"] = rng.randint(0, len(ids) + 2)  # a cut, none left, or beyond the ids
    elif roll < 0.10:
        del fields["sequence_length"]
    elif roll < 0.13:
        fields["sequence_index"] = rng.choice((0, 1, [0], [1], -1, "0"))  # the first choice's is plain
    elif roll < 0.15:
        fields["output_log_probs"] = [-0.5] * len(ids)
    elif roll < 0.16:
        fields["output_ids"] = []
    elif roll < 0.17:
        fields["output_ids"] = [1.5]  # not an int: the Python path's error
    elif roll < 0.18:
        fields = {"model_name": "tensorrt_llm"}  # no output_ids: a step of nothing, queued
    if rng.random() < 0.03:  # several events in one chunk, or `data:` without its space
        return _chunk(b"data: " + orjson.dumps(fields) + b"\n\ndata:" + orjson.dumps(fields) + b"\n\n")
    return _event(fields)


def _reads(stream: bytes, rng: random.Random) -> list[bytes]:
    """The stream split anywhere: inside a size line, a chunk, its CRLF; several chunks in one read."""
    reads, pos = [], 0
    while pos < len(stream):
        step = rng.choice((rng.randint(1, 12), rng.randint(20, 120), rng.randint(100, 600)))
        reads.append(stream[pos:pos + step])
        pos += step
    return reads


async def _both(detok, reads: list[bytes], stops: list[str], keep: bool, unwritable_at: set[int] = frozenset()):
    sides = [_Side(detok, Lane, stops, keep), _Side(detok, None, stops, keep)]
    await asyncio.sleep(0)
    first = _event({"output_ids": 28, "sequence_length": 1})  # "A" (SmolLM2): the answer's first text, queued
    for side in sides:
        side.conn.data_received(HEAD + first)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert side.answer.first_at is not None
    for k, data in enumerate(reads):
        for side in sides:
            side.client.flow.write_paused = k in unwritable_at
            side.conn.data_received(data)
        for _ in range(3):
            await asyncio.sleep(0)
        compiled, python = (side.seen() for side in sides)
        assert compiled == python, f"read {k}: {data!r}"
    for side in sides:
        side.task.cancel()
    return sides


@needs_lane
@pytest.mark.parametrize("seed", range(12))
def test_random_reads_give_the_client_the_same_bytes_and_leave_the_same_state(detok, seed):
    rng = random.Random(seed)
    vocab = len(detok.table)
    events = [_random_event(rng, vocab) for _ in range(rng.randint(40, 160))]
    stream = b"".join(events) + (b"0\r\n\r\n" if seed % 3 else _event({"error": "engine failed"}) + b"0\r\n\r\n")
    stops = ([], ["\n\n", "the", "é"], [], ["e"], [], ["xyz", ". "])[seed % 6]  # none; rare; one that ends it; held tails
    unwritable = {rng.randrange(60) for _ in range(seed % 4)}
    sides = asyncio.run(_both(detok, _reads(stream, rng), stops, keep=seed % 4 == 1, unwritable_at=unwritable))
    compiled, python = sides
    assert compiled.seen()["ended"]


ODD_VALUES = [0, -1, 2 ** 31, 2 ** 64 - 1, 1.5, True, None, "x", "", [], [1], [[1]], {}, {"a": 1}, [1, "x"], [None],
              [28, 28], [-5]]


def _odd_event(rng: random.Random, vocab: int) -> bytes:
    """An event whose fields may be anything JSON holds, or bytes mangled on the way."""
    fields = {}
    for key, p in (("output_ids", 0.9), ("sequence_length", 0.3), ("sequence_index", 0.3), ("output_log_probs", 0.1),
                   ("error", 0.05), ("model_name", 0.3)):
        if rng.random() < p:
            fields[key] = [rng.randrange(-3, vocab + 3) for _ in range(rng.randint(0, 3))] \
                if key == "output_ids" and rng.random() < 0.5 else rng.choice(ODD_VALUES)
    event = bytearray(_event(fields))
    for _ in range(rng.choice((0, 0, 1, 2))):  # a byte changed, lost or added
        at = rng.randrange(len(event))
        op = rng.random()
        if op < 0.4:
            event[at] = rng.randrange(256)
        elif op < 0.7:
            del event[at]
        else:
            event.insert(at, rng.choice(b"\r\n:{}[]\",0123456789abcdef "))
    return bytes(event)


@needs_lane
@pytest.mark.parametrize("seed", range(8))
def test_whatever_the_engine_sends_both_lanes_end_the_same_way(detok, seed):
    """Fields of any JSON type and mangled bytes among plain steps: the lane leaves what it does not know to
    the Python path, so the client, the answer and the stream's end (its error, if any) are the same."""
    rng = random.Random(1000 + seed)
    vocab = len(detok.table)
    events = [_odd_event(rng, vocab) if rng.random() < 0.4 else _event({"output_ids": rng.randrange(vocab),
                                                                          "sequence_length": 1})
              for _ in range(rng.randint(10, 60))]
    stream = b"".join(events) + b"0\r\n\r\n"
    asyncio.run(_both(detok, _reads(stream, rng), [] if seed % 2 else ["ab", "\n"], keep=seed % 3 == 0))


@needs_lane
def test_plain_steps_go_through_the_lane_and_odd_ones_through_python(detok, monkeypatch):
    """The differential test above would pass with a lane that takes nothing: this one counts what it took."""
    taken = []

    class Counting:
        def __init__(self, *args):
            self.lane = Lane(*args)

        def feed(self, data, pos):
            end = self.lane.feed(data, pos)
            taken.append(data[pos:end].count(b"data:"))
            return end

    plain = [_event({"output_ids": i, "sequence_length": 1}) for i in (504, 314, 1311, 2823)]
    odd = _event({"output_ids": [314], "sequence_length": 1, "output_log_probs": [-1.0]})

    async def run():
        side = _Side(detok, Counting, [], keep=False)
        await asyncio.sleep(0)
        side.conn.data_received(HEAD + _event({"output_ids": 28, "sequence_length": 1}))
        for _ in range(3):
            await asyncio.sleep(0)
        side.conn.data_received(b"".join(plain))  # all four in one call
        side.conn.data_received(plain[0] + odd + plain[1])  # the lane stops at the odd one: Python takes the rest
        for _ in range(3):
            await asyncio.sleep(0)
        side.task.cancel()
        return side

    side = asyncio.run(run())
    assert taken == [4, 1]
    assert side.sse.events == 7 and side.answer.counts.by_sequence == {0: 8}
    assert [q[1] for q in side.queued] == [([28], 0)]  # the odd step was taken by the Python path's sink


@needs_lane
def test_the_lane_holds_no_reference_cycle_once_the_stream_drops_its_sink(detok):
    """A request's objects are freed by reference counting as it ends (docs/benchmarks.md): with the lane
    too, once from_engine's end drops the stream's sink (the stream, its _Live and the sink refer to each
    other while it runs, as on the Python path)."""
    import gc
    import weakref

    async def run():
        side = _Side(detok, Lane, [], keep=False)
        side.live.call = side.stream  # as from_engine holds it
        await asyncio.sleep(0)
        side.conn.data_received(HEAD + _event({"output_ids": 28, "sequence_length": 1}))
        for _ in range(3):
            await asyncio.sleep(0)
        side.conn.data_received(_event({"output_ids": 504, "sequence_length": 1}) + b"0\r\n\r\n")
        for _ in range(3):
            await asyncio.sleep(0)
        assert side.stream.sink._lane is not None and side.sse.events == 1
        side.stream.sink = None  # as from_engine's end does
        side.task.cancel()
        await asyncio.gather(side.task, return_exceptions=True)
        side.task = None
        return weakref.ref(side.live), weakref.ref(side.stream)

    gc.collect()
    gc.disable()
    try:
        live, stream = asyncio.run(run())
        assert live() is None and stream() is None
    finally:
        gc.enable()
