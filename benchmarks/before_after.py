"""One summary of alternated before/after runs of the capacity benchmark's `front` layer: each run's front CPU
µs per token and its ratio to tritonserver's in the same run (whose work a change to the front does not
touch, so the ratio takes out most of the host's drift between runs), then the means per output length and
stream count, and the change.

    python benchmarks/before_after.py PREFIX --purpose TEXT --before REV --after REV --command TEXT [--date D]

reads benchmarks/results/PREFIX-{N}-tokens-{before,after}-{k}.json (capacity_bench.py reports) and writes
benchmarks/results/PREFIX.json; docs/benchmarks.md quotes it (tests/docs/test_figures.py holds the two).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import machine, write_json  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
NOTE = ("front_over_tritonserver: the front's CPU per token over tritonserver's in the same run, whose work the "
        "change does not touch: it takes out most of the host's drift between runs")


def pairs(prefix: str, results: Path = RESULTS) -> list[dict]:
    rows = []
    for path in sorted(results.glob(f"{prefix}-*-tokens-*-*.json")):
        match = re.fullmatch(re.escape(prefix) + r"-(\d+)-tokens-(before|after)-(\d+)\.json", path.name)
        if not match:
            continue
        for run in json.loads(path.read_text())["runs"]:
            cpu = run["cpu_us_per_token"]
            rows.append({"file": path.name, "output_tokens": int(match[1]), "pair": int(match[3]),
                         "code": match[2], "streams": run["streams"], "tok_s": run["tok_s"],
                         "front_us_per_token": cpu["front"], "tritonserver_us_per_token": cpu["tritonserver"],
                         "front_over_tritonserver": round(cpu["front"] / cpu["tritonserver"], 3),
                         "errors": run["errors"], **_gateway_and_gc(run)})
    return sorted(rows, key=lambda r: (r["output_tokens"], r["pair"], r["code"] != "before", r["streams"]))


def _gateway_and_gc(run: dict) -> dict:
    """Reports that count the front's collector passes (front_gc, since 2026-11-28) also say what the gateway
    spent per token (its admits and settles) and how many passes of each generation the window had (and, since
    llm_front_gc_pause_seconds, the ms they stalled the loop)."""
    if "front_gc" not in run:
        return {}
    cpu = run["cpu_us_per_token"]
    return {"gateway_us_per_token": round(sum(v for k, v in cpu.items() if k.startswith("gateway")), 1),
            "front_gc_passes": run["front_gc"]["passes"],
            **({"front_gc_pause_ms": run["front_gc"]["pause_ms"]} if "pause_ms" in run["front_gc"] else {})}


def means(rows: list[dict]) -> dict:
    out = {}
    for n, streams in sorted({(r["output_tokens"], r["streams"]) for r in rows}):
        side = {}
        for code in ("before", "after"):
            xs = [r for r in rows if (r["output_tokens"], r["streams"], r["code"]) == (n, streams, code)]
            side[code] = {"front_us_per_token": round(sum(r["front_us_per_token"] for r in xs) / len(xs), 1),
                          "front_over_tritonserver": round(sum(r["front_over_tritonserver"] for r in xs) / len(xs),
                                                           3)}
        b, a = side["before"], side["after"]
        out[f"{n} tokens, {streams} streams"] = {
            **side, "change_percent": round(100 * (a["front_us_per_token"] / b["front_us_per_token"] - 1), 1),
            "change_percent_over_tritonserver": round(
                100 * (a["front_over_tritonserver"] / b["front_over_tritonserver"] - 1), 1)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prefix")
    ap.add_argument("--purpose", required=True)
    ap.add_argument("--before", required=True, help="the code measured before (a revision, and how it ran)")
    ap.add_argument("--after", required=True)
    ap.add_argument("--command", required=True, help="the capacity_bench command the runs used")
    ap.add_argument("--date", help="when the runs were (default: now)")
    args = ap.parse_args(argv)
    rows = pairs(args.prefix)
    if not rows:
        raise SystemExit(f"no {args.prefix}-N-tokens-(before|after)-K.json in {RESULTS}")
    write_json(RESULTS / f"{args.prefix}.json",
               {**({"date": args.date} if args.date else {}), "purpose": args.purpose,
                "code": {"before": args.before, "after": args.after}, "command": args.command, "note": NOTE,
                "means": means(rows), "pairs": rows})
    print(json.dumps(means(rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
