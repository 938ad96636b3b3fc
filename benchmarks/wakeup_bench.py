"""What a wake-up costs a process on this host, apart from any serving code: two processes hand one byte back
and forth over two pipes, each asleep in `read` until the other writes, as a relay or the front sleeps in
epoll until the engine's next token and then wakes the client with it.

    python benchmarks/wakeup_bench.py [--round-trips 20000] [--repeat 3] [--lane compiled,python] [--out FILE]

Placements: `one_core`, both processes pinned to one CPU (each hand-off is a switch on that core), and
`two_cores`, pinned to two (each hand-off crosses cores: an inter-processor interrupt, and on a virtual
machine the resume of a halted vCPU). Each is run with the other cores idle and `busy` (a SCHED_IDLE spinner
on each CPU used, so no CPU halts while it waits, and any runnable process takes the core from it at once):
a cost that stays when no CPU halts is the interrupt's, not the halt's. The work each side does after each
wake: `none`; `token`, a small piece of a token's work (an orjson parse of a Triton event and a table
lookup); with `--lane`, `lane compiled` and `lane python`, the front's own per-token path (one engine read
through its fast lane to the client's SSE event, benchmarks/fast_lane_bench.py's stand-in stream, the
SmolLM2 detokenizer). Each work's hot cost, in a loop with nothing between, is reported beside
(`work_hot_us`), so what a wake does to the work after it shows: the served cost of the front's per-token
path, apart from the full stack's noise.

Reported per run: wall µs per round trip and each side's CPU µs (user and system) per round trip. Each side
is woken once and wakes the other once per round trip, as a relay does per streamed token (woken by the
engine's write, it wakes the client with its own): one side's CPU per round trip is the floor of a process
between two others per message, before any TCP (docs/benchmarks.md compares it with the relay's and the
front's CPU per token and their wake-ups per token, capacity_bench.py's `wakeups_per_token`).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import resource
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import orjson  # noqa: E402

from benchmarks.report import write_json  # noqa: E402

EVENTS = [orjson.dumps({"model_name": "tensorrt_llm", "model_version": "1", "output_ids": [i % 49152],
                        "sequence_length": [i]}) for i in range(1024)]
TABLE = [b"tok%d" % i for i in range(49152)]  # a vocabulary's byte table, as the detokenizer's


def token_work():
    """A small piece of what the front does for a token: parse the engine's event, look its text up, frame it."""
    def work(i: int) -> bytes:
        event = orjson.loads(EVENTS[i & 1023])
        return b"data: %b\n\n" % TABLE[event["output_ids"][0]]
    return work


def lane_work(lane: str):
    """The front's per-token path: engine read i through the fast lane (`lane` as the front's --token-lane) of
    a stand-in stream, its SSE event kept by a stand-in client transport (cleared now and then)."""
    import asyncio

    from benchmarks.fast_lane_bench import fast_lane, text_ids
    from front import token_lane

    loop = asyncio.new_event_loop()  # open until close(): the stream's reader task waits on it
    conn, client, reads, reader = loop.run_until_complete(fast_lane(*text_ids(), token_lane.resolve(lane)))
    feed, chunks, k = conn.data_received, client.chunks, len(reads)

    def work(i: int) -> None:
        feed(reads[i % k])
        if len(chunks) > 1024:
            chunks.clear()

    def close() -> None:
        reader.cancel()
        loop.run_until_complete(asyncio.gather(reader, return_exceptions=True))
        loop.close()

    work.written, work.close = chunks, close  # what the client got since the last clear; the stream's end
    return work


def hot_us(work, n: int = 100_000) -> float:
    start = time.perf_counter()
    for i in range(n):
        work(i)
    return (time.perf_counter() - start) / n * 1e6


def _cpu(who: int) -> tuple[float, float]:
    r = resource.getrusage(who)
    return r.ru_utime, r.ru_stime


def ping_pong(round_trips: int, cpus: tuple[int, int], work=None) -> dict:
    """The parent on cpus[0] writes a byte and waits for the child's, the child on cpus[1] answers each; each
    side's CPU over its own loop (the child sends its own back), after one round trip that puts both to
    sleep in `read` as measured."""
    from_parent, to_child = os.pipe()  # (read end, write end)
    from_child, to_parent = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: woken by each byte, answers it
        try:
            os.sched_setaffinity(0, {cpus[1]})
            os.read(from_parent, 1)
            os.write(to_parent, b"y")
            before = _cpu(resource.RUSAGE_SELF)
            for i in range(round_trips):
                os.read(from_parent, 1)
                if work is not None:
                    work(i)
                os.write(to_parent, b"y")
            after = _cpu(resource.RUSAGE_SELF)
            os.write(to_parent, struct.pack("dd", after[0] - before[0], after[1] - before[1]))
        finally:
            os._exit(0)
    mask = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpus[0]})
    try:
        os.write(to_child, b"x")
        os.read(from_child, 1)
        before, start = _cpu(resource.RUSAGE_SELF), time.perf_counter()
        for i in range(round_trips):
            os.write(to_child, b"x")
            os.read(from_child, 1)
            if work is not None:
                work(i)
        wall = time.perf_counter() - start
        after = _cpu(resource.RUSAGE_SELF)
        child_user, child_system = struct.unpack("dd", _read_exactly(from_child, 16))
        os.waitpid(pid, 0)
    finally:
        os.sched_setaffinity(0, mask)
        for fd in (to_child, from_parent, from_child, to_parent):
            os.close(fd)
    us = lambda seconds: round(seconds / round_trips * 1e6, 2)  # noqa: E731
    parent = {"user": us(after[0] - before[0]), "system": us(after[1] - before[1])}
    child = {"user": us(child_user), "system": us(child_system)}
    return {"wall_us": us(wall), "parent_cpu_us": parent, "child_cpu_us": child,
            "cpu_us_per_side": round((sum(parent.values()) + sum(child.values())) / 2, 2)}


def _read_exactly(fd: int, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = os.read(fd, n - len(data))
        if not part:
            raise EOFError("the child ended before its report")
        data += part
    return data


class Spinners:
    """A SCHED_IDLE busy loop on each of `cpus`: no CPU halts, and any runnable process preempts them."""

    def __init__(self, cpus: set[int]):
        code = ("import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\n"
                "os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\nwhile True:\n    pass\n")
        self.procs = [subprocess.Popen([sys.executable, "-c", code, str(c)]) for c in sorted(cpus)]
        time.sleep(0.5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.send_signal(signal.SIGKILL)
            p.wait()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--round-trips", type=int, default=20_000)
    ap.add_argument("--repeat", type=int, default=3, help="rounds of every run, alternated")
    ap.add_argument("--lane", default="", help="the front's per-token path as work too, comma-separated lanes: "
                                               "compiled, python (front/token_lane.py; needs the model's tokenizer)")
    ap.add_argument("--out", default=None, help="a JSON report (with the machine, the time and the arguments)")
    args = ap.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    placements = {"one_core": (cpus[0], cpus[0])}
    if len(cpus) > 1:
        placements["two_cores"] = (cpus[0], cpus[1])
    else:
        print("[wakeup] one CPU only: the two_cores placement is left out", file=sys.stderr)
    works = {"none": None, "token": token_work(),
             **{f"lane {lane}": lane_work(lane) for lane in filter(None, args.lane.split(","))}}
    hot = {name: round(min(hot_us(w) for _ in range(3)), 3) for name, w in works.items() if w is not None}
    runs = []
    for rnd in range(args.repeat):
        for others in ("idle", "busy"):
            for name, pair in placements.items():
                for work, fn in works.items():
                    with Spinners(set(pair)) if others == "busy" else contextlib.nullcontext():
                        r = ping_pong(args.round_trips, pair, fn)
                    runs.append({"round": rnd + 1, "placement": name, "others": others, "work": work, **r})
                    print(f"[wakeup] round {rnd + 1} {name:9s} {others:4s} {work:13s} wall {r['wall_us']:7.2f} µs, "
                          f"CPU a side {r['cpu_us_per_side']:6.2f} µs a round trip", file=sys.stderr)
    for fn in works.values():
        getattr(fn, "close", lambda: None)()
    cpuinfo = Path("/proc/cpuinfo").read_text()
    report = {"work_hot_us": hot, "hypervisor": " hypervisor" in cpuinfo, "kernel": os.uname().release,
              "runs": runs}
    print(markdown(report))
    if args.out:
        write_json(args.out, report, args)
    return 0


def medians(report: dict) -> dict:
    """"placement/others/work" -> the medians over rounds of each side's CPU, its user part and the wall per
    round trip, and the rounds' CPU a side."""
    groups: dict = {}
    for r in report["runs"]:
        groups.setdefault(f"{r['placement']}/{r['others']}/{r['work']}", []).append(r)
    mid = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    user = lambda r: round((r["parent_cpu_us"]["user"] + r["child_cpu_us"]["user"]) / 2, 2)  # noqa: E731
    return {k: {"cpu_us_per_side": mid([r["cpu_us_per_side"] for r in rs]), "user_us_per_side": mid([user(r) for r in rs]),
                "wall_us": mid([r["wall_us"] for r in rs]), "rounds": [r["cpu_us_per_side"] for r in rs]}
            for k, rs in groups.items()}


def markdown(report: dict) -> str:
    rows = ["Each work's cost hot: " + ", ".join(f"{k} {v} µs" for k, v in report["work_hot_us"].items()) + ".", "",
            "| placement | other cores | work after each wake | CPU a side per round trip (µs), rounds | median | "
            "of which user | wall per round trip (µs) |", "|---|---|---|---|---|---|---|"]
    for key, m in medians(report).items():
        placement, others, work = key.split("/")
        rows.append(f"| {placement} | {others} | {work} | {', '.join(map(str, m['rounds']))} | {m['cpu_us_per_side']} | "
                    f"{m['user_us_per_side']} | {m['wall_us']} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.exit(main())
