"""Headless load-test runner: runs locust with a traffic profile (or the fixed benchmark matrix) against
a server it starts or one you name, and writes a report folder: JSON, CSV, a markdown summary and
PNG plots.

    python -m loadtest.run --duration 30 --users 8                # profile mode, starts its own server
    python -m loadtest.run --grpc 127.0.0.1:8001 --http 127.0.0.1:8000 --duration 60
    python -m loadtest.run --matrix [--peer http://127.0.0.1:8080]  # concurrency 1/4/16, 64->128 tokens
Traffic goes to loopback unless you pass URLs; every run is bounded by --duration and request caps.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadtest.metrics import Record, by_tenant, summarize  # noqa: E402
from loadtest.workload import DEFAULT_PROFILE, Profile  # noqa: E402


def run_locust(grpc_url: str, http_url: str, profile: Path, users: int, duration: int, out: Path) -> list[Record]:
    records_path = out / "records.jsonl"
    records_path.unlink(missing_ok=True)
    env = {**os.environ, "LLM_GRPC_URL": grpc_url, "LLM_HTTP_URL": http_url, "LOADTEST_PROFILE": str(profile),
           "LOADTEST_RECORDS": str(records_path), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "locustfile.py"), "--headless",
           "-u", str(users), "-r", str(users), "-t", f"{duration}s", "--stop-timeout", "30",
           "--csv", str(out / "locust"), "--only-summary"]
    print(f"[loadtest] locust: {users} users for {duration} s ...", file=sys.stderr, flush=True)
    subprocess.run(cmd, env=env, check=False, timeout=duration + 120, stdout=subprocess.DEVNULL)
    if not records_path.exists():
        raise RuntimeError("locust recorded no request: is the server reachable?")
    return [Record(**json.loads(line)) for line in records_path.read_text().splitlines() if line.strip()]


def write_report(out: Path, summary: dict, records: list[Record], matrix: list | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    with open(out / "requests.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["tenant", "kind", "ok", "ttft_s", "itl_s", "latency_s", "output_tokens", "error"])
        for r in records:
            w.writerow([r.tenant, r.kind, r.ok, r.ttft, r.itl, r.latency, r.output_tokens, r.error or ""])
    lines = ["| tenant | requests | errors | output tok/s | TTFT p50 / p95 (s) | ITL p50 / p95 (ms) | latency p95 (s) | goodput (req/s) |",
             "|---|---|---|---|---|---|---|---|"]
    for tenant, s in summary["tenants"].items():
        if "ttft_s" not in s:
            lines.append(f"| {tenant} | {s['requests']} | {s['errors']} | - | - | - | - | - |")
            continue
        itl = s["itl_s"] or {"p50": float("nan"), "p95": float("nan")}
        lines.append(f"| {tenant} | {s['requests']} | {s['errors']} | {s['output_token_throughput']:.1f} | "
                     f"{s['ttft_s']['p50']:.2f} / {s['ttft_s']['p95']:.2f} | {itl['p50'] * 1000:.0f} / "
                     f"{itl['p95'] * 1000:.0f} | {s['latency_s']['p95']:.2f} | "
                     f"{s.get('goodput_rps', float('nan')):.2f} |")
    t = summary["total"]
    lines.append("")
    lines.append(f"All: {t['requests']} requests, {t['errors']} errors, {t.get('output_token_throughput', 0):.1f} "
                 f"output tok/s over {t.get('duration_s', 0):.1f} s.")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    plot(out, summary, records, matrix)


def plot(out: Path, summary: dict, records: list[Record], matrix: list | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tenants = [t for t, s in summary["tenants"].items() if "latency_s" in s]
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, p in enumerate(("p50", "p90", "p95", "p99")):
        ax.bar([x + i * 0.2 for x in range(len(tenants))], [summary["tenants"][t]["latency_s"][p] for t in tenants],
               width=0.2, label=p)
    ax.set_xticks([x + 0.3 for x in range(len(tenants))], tenants)
    ax.set_ylabel("request latency (s)")
    ax.set_title("Latency percentiles per tenant")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "latency_percentiles.png")
    fig, ax = plt.subplots(figsize=(7, 4))
    for t in tenants:
        ax.hist([r.ttft for r in records if r.tenant == t and r.ttft is not None], bins=20, alpha=0.6, label=t)
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("requests")
    ax.set_title("TTFT distribution per tenant")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ttft_distribution.png")
    if matrix:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([m["concurrency"] for m in matrix], [m["output_tok_s"] for m in matrix], "o-", label="this stack")
        if any("peer_tok_s" in m for m in matrix):
            ax.plot([m["concurrency"] for m in matrix], [m.get("peer_tok_s") for m in matrix], "s--", label="peer")
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("output tokens / s")
        ax.set_title("Throughput vs concurrency")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "throughput_vs_concurrency.png")
    plt.close("all")


def peer_stream(url: str, prompt: str, max_tokens: int) -> tuple[float, float | None, float]:
    """One streaming completion on an OpenAI-compatible or llama.cpp server: (start, first, end)."""
    import urllib.request

    base = url.rstrip("/")
    llama = not base.endswith("/v1")
    path = "/completion" if llama else "/completions"
    body = {"prompt": prompt, "stream": True, "temperature": 0}
    body |= {"n_predict": max_tokens, "ignore_eos": True, "cache_prompt": False} if llama else {"max_tokens": max_tokens}
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json"})
    start, first = time.perf_counter(), None
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            if raw.startswith(b"data: ") and first is None and raw.strip() != b"data: [DONE]":
                first = time.perf_counter()
    return start, first, time.perf_counter()


def run_matrix(grpc_url: str, peer: str | None) -> list[dict]:
    from concurrent.futures import ThreadPoolExecutor

    from tokenizers import Tokenizer

    from benchmarks.triton_bench import MATRIX, OUTPUT_TOKENS, make_prompts, run_level
    from build.render import DEFAULT_CHECKPOINT

    tok = Tokenizer.from_file(str(DEFAULT_CHECKPOINT / "tokenizer.json"))
    results, offset = [], 0
    for conc, n in MATRIX:
        prompts = make_prompts(tok, offset + n)[offset:]
        offset += n
        row = run_level(grpc_url, prompts, conc)
        if peer:
            with ThreadPoolExecutor(conc) as pool:
                timings = list(pool.map(lambda p: peer_stream(peer, p, OUTPUT_TOKENS), prompts))
            span = max(t[2] for t in timings) - min(t[0] for t in timings)
            row["peer_tok_s"] = n * OUTPUT_TOKENS / span
            row["ratio"] = row["output_tok_s"] / row["peer_tok_s"]
        results.append(row)
        print(f"[loadtest] concurrency {conc}: {row['output_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grpc", help="gRPC host:port (default: start a server)")
    ap.add_argument("--http", help="HTTP host:port (default: start a server)")
    ap.add_argument("--profile", type=Path, default=DEFAULT_PROFILE)
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--duration", type=int, default=30, help="seconds (bounded)")
    ap.add_argument("--matrix", action="store_true", help="the fixed benchmark matrix instead of the profile")
    ap.add_argument("--peer", help="with --matrix: a peer OpenAI-compatible (…/v1) or llama.cpp server URL")
    ap.add_argument("--out", type=Path, default=ROOT / "loadtest" / "reports" / time.strftime("%Y%m%d-%H%M%S"))
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    server = None
    if not args.grpc:
        from tests.support.server import TritonServer

        server = TritonServer().start()
        args.grpc, args.http = server.grpc_url, server.http_url
    try:
        matrix = None
        if args.matrix:
            matrix = run_matrix(args.grpc, args.peer)
            records = []
            summary = {"matrix": matrix, "tenants": {}, "total": {"requests": sum(m["requests"] for m in matrix),
                                                                  "errors": 0}}
        else:
            profile = Profile.load(args.profile)
            records = run_locust(args.grpc, args.http or "127.0.0.1:8000", args.profile, args.users,
                                 args.duration, args.out)
            summary = {"tenants": by_tenant(records, profile.slos()), "total": summarize(records)}
        write_report(args.out, summary, records, matrix)
    finally:
        if server:
            server.stop()
    print((args.out / "summary.md").read_text())
    if matrix:
        for m in matrix:
            ratio = f" ({m['ratio']:.2f}x the peer's {m['peer_tok_s']:.1f})" if "ratio" in m else ""
            print(f"concurrency {m['concurrency']}: {m['output_tok_s']:.1f} tok/s{ratio}")
    print(f"report: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
