"""What every benchmark writes beside its figures: the machine, the time, the arguments, so each number
in README.md and docs/ can be traced to a committed file under benchmarks/results/ (tests/docs/test_figures.py)."""
from __future__ import annotations

import json
import os
import platform
import threading
import time
from pathlib import Path

import numpy as np

CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8")


def machine() -> dict:
    info = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), platform.processor())
    flags = next((line for line in info if line.startswith("flags")), "")
    have = set(flags.split(":", 1)[-1].split())
    return {"cpu": cpu, "cores": os.cpu_count(), "avx2": "avx2" in have, "avx512f": "avx512f" in have,
            "cpu_flags": [f for f in CPU_FLAGS if f in have],
            "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "python": platform.python_version(), "numpy": np.__version__}


def write_json(path: Path | str, results: dict, args=None) -> Path:
    """`results` with the date, the machine and the arguments of the run, as indented JSON."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
               "args": {k: v for k, v in vars(args).items() if k != "out"} if args is not None else None, **results}
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def run_clients(client, streams: int) -> tuple[float, float]:
    """`client(i)` in `streams` threads at once, until all return -> (start, end) perf_counter times."""
    threads = [threading.Thread(target=client, args=(c,)) for c in range(streams)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return start, time.perf_counter()
