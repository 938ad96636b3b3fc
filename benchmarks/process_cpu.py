"""Cores used by each process of this machine over a window of a running benchmark: waits until the
benchmark's log shows its loaded phase (`idle:` printed), 5 s more, then samples /proc for 15 s.

    python benchmarks/process_cpu.py BENCH.log   (beside `noisy_neighbour_bench.py ... > BENCH.log 2>&1`)
"""
from __future__ import annotations

import os
import sys
import time


def snapshot() -> dict[str, tuple[int, str]]:
    """pid -> (user + system clock ticks so far, command line)."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline") as f:
                cmd = f.read().replace("\0", " ")[:90]
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[pid] = (int(fields[11]) + int(fields[12]), cmd)
    return out


def main(log: str, delay_s: float = 5.0, window_s: float = 15.0, top: int = 12) -> None:
    while "idle:" not in open(log).read():
        time.sleep(0.5)
    time.sleep(delay_s)
    ticks = os.sysconf("SC_CLK_TCK")
    before, started = snapshot(), time.monotonic()
    time.sleep(window_s)
    after, elapsed = snapshot(), time.monotonic() - started
    rows = sorted((((t - before.get(pid, (0,))[0]) / ticks / elapsed, cmd) for pid, (t, cmd) in after.items()),
                  reverse=True)
    for cores, cmd in rows[:top]:
        print(f"{cores:5.2f} {cmd}")


if __name__ == "__main__":
    main(sys.argv[1])
