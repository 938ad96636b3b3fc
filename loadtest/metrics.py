"""genai-perf's definitions, on per-request timelines.

- TTFT: first send to the first non-empty chunk.
- ITL (inter-token latency) per request: (latency - TTFT) / (output tokens - 1).
- Output tokens: the text re-tokenized with the model's tokenizer (not chunk counts).
- Throughput: total output tokens / (last receive - first send) over the run.
- Goodput: requests per second that met every SLO (TTFT, ITL, latency bounds).
Non-streamed requests have no TTFT or ITL (as in genai-perf); they count in latency and throughput.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from contracts.measures import percentile, throughput

PERCENTILES = (50, 90, 95, 99)


@dataclass
class Record:
    tenant: str
    kind: str  # grpc-gateway | grpc-ensemble | http-ensemble ...
    start: float  # seconds, any monotonic clock
    first_chunk: float | None  # time of the first non-empty chunk
    end: float
    output_tokens: int
    ok: bool = True
    error: str | None = None
    streaming: bool = True

    @property
    def ttft(self) -> float | None:
        if not self.streaming or self.first_chunk is None:
            return None
        return self.first_chunk - self.start

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def itl(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def percentiles(values) -> dict[str, float]:
    vals = [v for v in values if v is not None]
    if not vals:
        return {}
    out = {f"p{p}": percentile(vals, p) for p in PERCENTILES}
    out["mean"] = float(np.mean(vals))
    return out


def summarize(records: list[Record], slo: dict | None = None) -> dict:
    ok = [r for r in records if r.ok]
    if not ok:
        return {"requests": len(records), "errors": len(records)}
    t0, t1 = min(r.start for r in ok), max(r.end for r in ok)
    span = max(t1 - t0, 1e-9)  # what throughput() divides by
    tokens = sum(r.output_tokens for r in ok)
    out = {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "output_tokens": tokens,
        "duration_s": span,
        "output_token_throughput": throughput(tokens, t0, t1),
        "request_throughput": throughput(len(ok), t0, t1),
        "ttft_s": percentiles(r.ttft for r in ok),
        "itl_s": percentiles(r.itl for r in ok),
        "latency_s": percentiles(r.latency for r in ok),
    }
    if slo:
        def good(r):  # a non-streamed request is judged on its latency only
            return ((slo.get("ttft_s") is None or not r.streaming or (r.ttft is not None and r.ttft <= slo["ttft_s"]))
                    and (slo.get("itl_s") is None or r.itl is None or r.itl <= slo["itl_s"])
                    and (slo.get("latency_s") is None or r.latency <= slo["latency_s"]))
        out["goodput_rps"] = throughput(sum(1 for r in ok if good(r)), t0, t1)
        out["slo"] = slo
    return out


def by_tenant(records: list[Record], slos: dict | None = None) -> dict[str, dict]:
    tenants = sorted({r.tenant for r in records})
    return {t: summarize([r for r in records if r.tenant == t], (slos or {}).get(t)) for t in tenants}
