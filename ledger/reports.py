"""Usage reports from ledger rows: requests, tokens in/out, cost, TTFT and latency p50/p95 per group."""
from __future__ import annotations

import calendar
import csv
import io
import json
import time
from datetime import date, datetime, timedelta

from contracts.measures import percentile

GROUPS = {"day": ("tenant", "day"), "model": ("tenant", "model"), "day_model": ("tenant", "day", "model"),
          "provider": ("tenant", "provider", "model")}  # provider: "local" or an upstream's name
COLUMNS = ("requests", "errors", "cancelled", "prompt_tokens", "completion_tokens", "cost",
           "ttft_p50_ms", "ttft_p95_ms", "latency_p50_ms", "latency_p95_ms")


class ReportError(ValueError):
    pass


def pct(values: list[float], p: float) -> float | None:
    """The project's one percentile (contracts/measures.py: linear, as genai-perf); None for no values."""
    return percentile(values, p) if values else None


def parse_day(value: str | None, name: str) -> date | None:
    if value is None or value == "":
        return None
    try:
        return datetime.strptime(value, "%Y-%m-%d").date()
    except ValueError:
        raise ReportError(f"{name}: must be a date YYYY-MM-DD, got {value!r}") from None


def window(start: str | None, end: str | None, default_days: int = 30) -> tuple[float, float, str, str]:
    """[start, end] inclusive UTC days -> (start_ts, end_ts exclusive, start, end)."""
    e = parse_day(end, "end") or datetime.utcnow().date()
    if e >= date.max:  # its exclusive end, the day after, is no date
        raise ReportError(f"end: must be before {date.max}, got {end!r}")
    try:
        s = parse_day(start, "start") or e - timedelta(days=default_days - 1)
    except OverflowError:
        raise ReportError(f"end: too early for a {default_days}-day window, got {end!r}") from None
    if s > e:
        raise ReportError(f"start ({s}) is after end ({e})")
    if (e - s).days > 366:
        raise ReportError("the window is over 366 days")
    start_ts = calendar.timegm(s.timetuple())
    end_ts = calendar.timegm((e + timedelta(days=1)).timetuple())
    return start_ts, end_ts, s.isoformat(), e.isoformat()


def aggregate(rows: list[dict], by: str = "day") -> list[dict]:
    if by not in GROUPS:
        raise ReportError(f"by: must be one of {', '.join(GROUPS)}, got {by!r}")
    keys = GROUPS[by]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    out = []
    for key in sorted(groups):
        rs = groups[key]
        ttft = [r["ttft_ms"] for r in rs if r["ttft_ms"] is not None]
        lat = [r["latency_ms"] for r in rs]
        out.append({**dict(zip(keys, key)),
                    "requests": len(rs),
                    "errors": sum(r["outcome"] == "error" for r in rs),
                    "cancelled": sum(r["outcome"] == "cancelled" for r in rs),
                    "prompt_tokens": sum(r["prompt_tokens"] for r in rs),
                    "completion_tokens": sum(r["completion_tokens"] for r in rs),
                    "cost": round(sum(r["cost"] for r in rs), 6),
                    "ttft_p50_ms": _round(pct(ttft, 50)), "ttft_p95_ms": _round(pct(ttft, 95)),
                    "latency_p50_ms": _round(pct(lat, 50)), "latency_p95_ms": _round(pct(lat, 95))})
    return out


def _round(v):
    return None if v is None else round(v, 1)


def render(rows: list[dict], fmt: str) -> str:
    if not rows:
        header = []
    else:
        header = list(rows[0])
    if fmt == "json":
        return json.dumps(rows, indent=2)
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=header or ["tenant"] + list(COLUMNS), lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
        return buf.getvalue()
    if fmt != "table":
        raise ReportError(f"format: must be table, csv or json, got {fmt!r}")
    if not rows:
        return "(no usage in this window)"
    cells = [[("" if row[h] is None else f"{row[h]:.4f}" if h == "cost" else str(row[h])) for h in header]
             for row in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def now_day() -> str:
    return time.strftime("%Y-%m-%d", time.gmtime())
