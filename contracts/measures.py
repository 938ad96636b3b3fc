"""The project's measurement definitions, genai-perf's: every report (load tests, benchmarks, the usage
ledger's reports) takes its percentiles and throughputs from here, so no two figures disagree by method."""
from __future__ import annotations

import numpy as np


def percentile(values, q: float) -> float:
    """The q-th percentile with linear interpolation (numpy's default, as genai-perf); NaN when empty.
    The one definition every report here uses: load tests, the Triton benchmark and the engine benchmark."""
    vals = list(values)
    return float(np.percentile(vals, q)) if vals else float("nan")


def throughput(count: float, start: float, end: float) -> float:
    """genai-perf's throughput: what was produced (tokens, requests) over first send to last receive."""
    return count / max(end - start, 1e-9)
