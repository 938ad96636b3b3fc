"""What a wake-up costs a process on this host, apart from any serving code: two processes hand one byte back
and forth over two pipes, each asleep in `read` until the other writes, as a relay or the front sleeps in
epoll until the engine's next token and then wakes the client with it.

    python benchmarks/wakeup_bench.py [--round-trips 20000] [--repeat 3] [--out FILE]

Placements: `one_core`, both processes pinned to one CPU (each hand-off is a switch on that core), and
`two_cores`, pinned to two (each hand-off crosses cores: an inter-processor interrupt, and on a virtual
machine the resume of a halted vCPU). Each is run with the other cores idle and `busy` (a SCHED_IDLE spinner
on each CPU used, so no CPU halts while it waits, and any runnable process takes the core from it at once):
a cost that stays when no CPU halts is the interrupt's, not the halt's. With `work`, the woken side does a
small piece of a token's work after each wake (an orjson parse of a Triton event and a table lookup: the
`work_hot_us` in a loop with nothing between), so what a wake does to the work after it shows as well.

Reported per run: wall µs per round trip and each side's CPU µs (user and system) per round trip. Each side
is woken once and wakes the other once per round trip, as a relay does per streamed token (woken by the
engine's write, it wakes the client with its own): one side's CPU per round trip is the floor of a process
between two others per message, before any TCP (docs/benchmarks.md compares it with the relay's and the
front's CPU per token and their wake-ups per token, capacity_bench.py's `wakeups_per_token`).
"""
from __future__ import annotations

import argparse
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


def token_work(i: int) -> bytes:
    """A small piece of what the front does for a token: parse the engine's event, look its text up, frame it."""
    event = orjson.loads(EVENTS[i & 1023])
    return b"data: %b\n\n" % TABLE[event["output_ids"][0]]


def work_hot_us(n: int = 200_000) -> float:
    start = time.perf_counter()
    for i in range(n):
        token_work(i)
    return (time.perf_counter() - start) / n * 1e6


def _cpu(who: int) -> tuple[float, float]:
    r = resource.getrusage(who)
    return r.ru_utime, r.ru_stime


def ping_pong(round_trips: int, cpus: tuple[int, int], work: bool) -> dict:
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
                if work:
                    token_work(i)
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
            if work:
                token_work(i)
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
        code = "import os\nos.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\nwhile True:\n    pass\n"
        self.procs = [subprocess.Popen(["taskset", "-c", str(c), sys.executable, "-c", code]) for c in sorted(cpus)]
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
    ap.add_argument("--out", default=None, help="a JSON report (with the machine, the time and the arguments)")
    args = ap.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    placements = {"one_core": (cpus[0], cpus[0])}
    if len(cpus) > 1:
        placements["two_cores"] = (cpus[0], cpus[1])
    else:
        print("[wakeup] one CPU only: the two_cores placement is left out", file=sys.stderr)
    hot = round(min(work_hot_us() for _ in range(3)), 3)
    runs = []
    for rnd in range(args.repeat):
        for others in ("idle", "busy"):
            for name, pair in placements.items():
                for work in (False, True):
                    if others == "busy":
                        with Spinners(set(pair)):
                            r = ping_pong(args.round_trips, pair, work)
                    else:
                        r = ping_pong(args.round_trips, pair, work)
                    runs.append({"round": rnd + 1, "placement": name, "others": others, "work": work, **r})
                    print(f"[wakeup] round {rnd + 1} {name:9s} {others:4s} work={str(work):5s} wall "
                          f"{r['wall_us']:7.2f} µs, CPU a side {r['cpu_us_per_side']:6.2f} µs a round trip",
                          file=sys.stderr)
    cpuinfo = Path("/proc/cpuinfo").read_text()
    report = {"work_hot_us": hot, "hypervisor": " hypervisor" in cpuinfo, "kernel": os.uname().release,
              "runs": runs}
    print(markdown(report))
    if args.out:
        write_json(args.out, report, args)
    return 0


def medians(report: dict) -> dict:
    """(placement, others, work) -> the median over rounds of the CPU a side and the wall per round trip."""
    groups: dict = {}
    for r in report["runs"]:
        groups.setdefault((r["placement"], r["others"], r["work"]), []).append(r)
    mid = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {k: {"cpu_us_per_side": mid([r["cpu_us_per_side"] for r in rs]), "wall_us": mid([r["wall_us"] for r in rs]),
                "rounds": [r["cpu_us_per_side"] for r in rs]} for k, rs in groups.items()}


def markdown(report: dict) -> str:
    rows = [f"The woken side's work, hot: {report['work_hot_us']} µs.", "",
            "| placement | other cores | work after each wake | CPU a side per round trip (µs), rounds | median | "
            "wall per round trip (µs) |", "|---|---|---|---|---|---|"]
    for (placement, others, work), m in medians(report).items():
        rows.append(f"| {placement} | {others} | {'yes' if work else 'no'} | {', '.join(map(str, m['rounds']))} | "
                    f"{m['cpu_us_per_side']} | {m['wall_us']} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.exit(main())
