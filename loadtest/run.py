"""Headless load-test runner: runs locust with a traffic profile (or the fixed benchmark matrix) against
a server it starts or one you name, and writes a report folder: JSON, CSV, a markdown summary and
PNG plots.

    python -m loadtest.run --duration 30 --users 8                # profile mode, starts its own server
    python -m loadtest.run --grpc 127.0.0.1:8001 --http 127.0.0.1:8000 --duration 60
    python -m loadtest.run --matrix [--peer http://127.0.0.1:8080]  # concurrency 1/4/16, 64->128 tokens
    python -m loadtest.run --matrix --peer front    # the same matrix through this stack's OpenAI front
Traffic goes to loopback unless you pass URLs; every run is bounded by --duration and request caps.
A server this runner starts includes the OpenAI-compatible front (the profile's `front_chat` users and
`--peer front` use it); for a running stack, name the front with --front.
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
from loadtest.sse import StreamTimeline  # noqa: E402
from loadtest.workload import DEFAULT_PROFILE, Profile  # noqa: E402


def run_locust(grpc_url: str, http_url: str, profile: Path, users: int, duration: int, out: Path,
               max_requests: int = 2000, front_url: str | None = None) -> list[Record]:
    records_path = out / "records.jsonl"
    records_path.unlink(missing_ok=True)
    env = {**os.environ, "LLM_GRPC_URL": grpc_url, "LLM_HTTP_URL": http_url, "LOADTEST_PROFILE": str(profile),
           "LOADTEST_RECORDS": str(records_path), "LOADTEST_MAX_REQUESTS": str(max_requests),
           "PYTHONPATH": str(ROOT)}
    env.pop("LLM_FRONT_URL", None)  # front users only where this run names a front
    if front_url:
        env["LLM_FRONT_URL"] = front_url
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
    def pct(s, metric, p, scale=1.0, digits=2):
        v = (s.get(metric) or {}).get(p)
        return "-" if v is None else f"{v * scale:.{digits}f}"

    lines = ["| tenant | tier | requests | errors | output tok/s | TTFT p50 / p95 (s) | ITL p50 / p95 (ms) | "
             "latency p50 / p95 / p99 (s) | goodput (req/s) |", "|---|---|---|---|---|---|---|---|---|"]
    for tenant, s in summary["tenants"].items():
        tput = f"{s['output_token_throughput']:.1f}" if "output_token_throughput" in s else "-"
        good = f"{s['goodput_rps']:.2f}" if "goodput_rps" in s else "-"
        lines.append(f"| {tenant} | {s.get('tier', '-')} | {s['requests']} | {s['errors']} | {tput} | "
                     f"{pct(s, 'ttft_s', 'p50')} / {pct(s, 'ttft_s', 'p95')} | "
                     f"{pct(s, 'itl_s', 'p50', 1000, 0)} / {pct(s, 'itl_s', 'p95', 1000, 0)} | "
                     f"{pct(s, 'latency_s', 'p50')} / {pct(s, 'latency_s', 'p95')} / {pct(s, 'latency_s', 'p99')} | "
                     f"{good} |")
    t = summary["total"]
    if matrix:
        lines = [matrix_markdown(matrix), "Per level (and peer), genai-perf definitions:", "", *lines]
    if summary.get("kinds"):
        lines += ["", "Per kind of user (the path the requests took):", "",
                  "| kind | requests | errors | output tok/s | TTFT p50 / p95 (s) | ITL p50 / p95 (ms) | "
                  "latency p50 / p95 / p99 (s) |", "|---|---|---|---|---|---|---|"]
        for kind, s in summary["kinds"].items():
            tput = f"{s['output_token_throughput']:.1f}" if "output_token_throughput" in s else "-"
            lines.append(f"| {kind} | {s['requests']} | {s['errors']} | {tput} | "
                         f"{pct(s, 'ttft_s', 'p50')} / {pct(s, 'ttft_s', 'p95')} | "
                         f"{pct(s, 'itl_s', 'p50', 1000, 0)} / {pct(s, 'itl_s', 'p95', 1000, 0)} | "
                         f"{pct(s, 'latency_s', 'p50')} / {pct(s, 'latency_s', 'p95')} / "
                         f"{pct(s, 'latency_s', 'p99')} |")
    lines.append("")
    lines.append(f"All{' (the ensemble rows, not the peer)' if matrix else ''}: {t['requests']} requests, "
                 f"{t['errors']} errors, {t.get('output_token_throughput', 0):.1f} "
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
    ax.set_title("Latency percentiles per " + ("concurrency level" if matrix else "tenant"))
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "latency_percentiles.png")
    fig, ax = plt.subplots(figsize=(7, 4))
    import numpy as np

    all_ttft = [r.ttft for r in records if r.ttft is not None]
    bins = np.histogram_bin_edges(all_ttft, bins=20) if all_ttft else 20  # shared bins: comparable bars
    for t in tenants:
        ax.hist([r.ttft for r in records if r.tenant == t and r.ttft is not None], bins=bins, alpha=0.6, label=t)
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("requests")
    ax.set_title("TTFT distribution per " + ("concurrency level" if matrix else "tenant"))
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ttft_distribution.png")
    if matrix:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([m["concurrency"] for m in matrix], [m["output_tok_s"] for m in matrix], "o-", label="ensemble")
        if any("peer_tok_s" in m for m in matrix):
            ax.plot([m["concurrency"] for m in matrix], [m.get("peer_tok_s") for m in matrix], "s--",
                    label=matrix[0].get("peer_name", "peer"))
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("output tokens / s")
        ax.set_title("Throughput vs concurrency")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "throughput_vs_concurrency.png")
    plt.close("all")


def peer_stream(url: str, prompt: str, max_tokens: int, timeout_s: float = 600, api_key: str | None = None) -> dict:
    """One streaming completion on a peer: llama.cpp's `/completion` (URL without /v1) or an
    OpenAI-compatible `/v1/completions` (this stack's front too: `api_key` goes in `authorization: Bearer`).
    Same workload: greedy, exactly `max_tokens` tokens, no prompt cache. Returns the timeline and text;
    TTFT is the first event with non-empty text. An error event in the stream raises StreamError."""
    import urllib.request

    base = url.rstrip("/")
    llama = not base.endswith("/v1")
    body = {"prompt": prompt, "stream": True, "temperature": 0}
    body |= ({"n_predict": max_tokens, "ignore_eos": True, "cache_prompt": False} if llama else
             {"max_tokens": max_tokens, "min_tokens": max_tokens, "ignore_eos": True})
    headers = {"content-type": "application/json"}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(base + ("/completion" if llama else "/completions"),
                                 data=json.dumps(body).encode(), method="POST", headers=headers)
    timeline = StreamTimeline()
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        for raw in resp:
            timeline.feed(raw)
    return {"start": timeline.start, "first": timeline.first, "end": time.perf_counter(), "text": timeline.text}


def run_matrix(grpc_url: str, peer: str | None, levels=(1, 4, 16), requests: int | None = None,
               output_tokens: int | None = None, deadline_s: float = 1800, peer_key: str | None = None,
               peer_name: str = "peer") -> tuple[list[dict], list[Record]]:
    """The fixed matrix (loadtest/matrix.py: 64-token prompts, 128 output tokens forced, greedy)
    at each concurrency, then the same prompts on the peer (`peer_name` names its rows, "front" for this
    stack's front; `peer_key` is the key it gets). Bounded: requests per level (8/12/48 unless
    `requests`), a per-request timeout, and no new level after `deadline_s`."""
    from concurrent.futures import ThreadPoolExecutor

    from tokenizers import Tokenizer

    from loadtest.matrix import MATRIX, OUTPUT_TOKENS, make_prompts, one_request, run_level
    from build.render import DEFAULT_CHECKPOINT

    tok = Tokenizer.from_file(str(DEFAULT_CHECKPOINT / "tokenizer.json"))
    count = lambda text: len(tok.encode(text, add_special_tokens=False).ids) if text else 0  # noqa: E731
    n_out = output_tokens or OUTPUT_TOKENS
    t_end = time.monotonic() + deadline_s
    one_request(grpc_url, "warm up", 4)
    if peer:
        peer_stream(peer, "warm up", 4, api_key=peer_key)
    results, records, offset = [], [], 0
    for conc, n in MATRIX:
        if conc not in levels:
            continue
        if time.monotonic() > t_end:
            print(f"[loadtest] deadline reached: skipping concurrency {conc}", file=sys.stderr)
            break
        n = requests or n
        prompts = make_prompts(tok, offset + n)[offset:]
        offset += n
        runs: list[dict] = []
        row = run_level(grpc_url, prompts, conc, per_request=runs, tokenizer=tok, output_tokens=n_out)
        records += [Record(f"c={conc}", "grpc-ensemble", r["start"], r["start"] + r["ttft"], r["end"],
                           count(r["text"])) for r in runs]
        if peer:
            with ThreadPoolExecutor(conc) as pool:
                timings = list(pool.map(lambda p: peer_stream(peer, p, n_out, api_key=peer_key), prompts))
            peer_tok_s = n * n_out / (max(t["end"] for t in timings) - min(t["start"] for t in timings))
            peer_recs = [Record(f"{peer_name} c={conc}", "peer", t["start"], t["first"], t["end"], count(t["text"]))
                         for t in timings]
            records += peer_recs
            ps = summarize(peer_recs)
            row.update(peer_name=peer_name, peer_tok_s=peer_tok_s, peer_ttft_p50=ps["ttft_s"].get("p50"),
                       peer_ttft_p95=ps["ttft_s"].get("p95"), peer_latency_mean=ps["latency_s"]["mean"],
                       ratio=row["output_tok_s"] / peer_tok_s)
        results.append(row)
        print(f"[loadtest] concurrency {conc}: {row['output_tok_s']:.1f} tok/s"
              + (f", {peer_name} {row['peer_tok_s']:.1f} tok/s ({row['ratio']:.2f}x)" if peer else ""),
              file=sys.stderr, flush=True)
    return results, records


def matrix_markdown(matrix: list[dict]) -> str:
    peer = any("peer_tok_s" in m for m in matrix)
    name = next((m["peer_name"] for m in matrix if "peer_name" in m), "peer")
    head = "| streams | requests | output tok/s | TTFT p50 / p95 (s) | latency mean (s) | ms / output token |"
    if peer:  # ratio: the ensemble's tok/s over the peer's
        head += f" {name} tok/s | ratio (ensemble / {name}) | {name} TTFT p95 (s) |"
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for m in matrix:
        line = (f"| {m['concurrency']} | {m['requests']} | {m['output_tok_s']:.1f} | {m['ttft_p50']:.2f} / "
                f"{m['ttft_p95']:.2f} | {m['latency_mean']:.2f} | {m['time_per_output_token_ms']:.1f} |")
        if peer:
            line += f" {m['peer_tok_s']:.1f} | {m['ratio']:.2f}x | {m['peer_ttft_p95'] or float('nan'):.2f} |"
        lines.append(line)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grpc", help="gRPC host:port (default: start a server)")
    ap.add_argument("--http", help="HTTP host:port (default: start a server)")
    ap.add_argument("--profile", type=Path, default=DEFAULT_PROFILE)
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--duration", type=int, default=30,
                    help="profile mode: seconds of load; matrix mode: no new level after this many minutes")
    ap.add_argument("--matrix", action="store_true", help="the fixed benchmark matrix instead of the profile")
    ap.add_argument("--peer", help="with --matrix: a peer OpenAI-compatible (…/v1) or llama.cpp server URL, or "
                                   "`front`: this stack's OpenAI-compatible front (/v1/completions, with --api-key)")
    ap.add_argument("--front", help="the OpenAI-compatible front's base URL (http://host:port) of a running stack "
                                    "(default: the front of the stack this runner starts)")
    ap.add_argument("--api-key", help="the key the peer gets in `authorization: Bearer` (`--peer front`: default "
                                      "the profile's first tenant's; other peers: none unless given)")
    ap.add_argument("--levels", default="1,4,16", help="with --matrix: concurrency levels")
    ap.add_argument("--requests", type=int, help="with --matrix: requests per level (default 8/12/48)")
    ap.add_argument("--output-tokens", type=int, help="with --matrix: output tokens (default 128; for smoke runs)")
    ap.add_argument("--max-requests", type=int, default=2000, help="profile mode: stop after this many requests")
    ap.add_argument("--out", type=Path, default=ROOT / "loadtest" / "reports" / time.strftime("%Y%m%d-%H%M%S"))
    args = ap.parse_args(argv)
    if args.peer == "front" and not args.matrix:
        ap.error("--peer front needs --matrix")
    if args.peer == "front" and args.grpc and not args.front:
        ap.error("--peer front against a running stack (--grpc) needs --front http://host:port")
    args.out.mkdir(parents=True, exist_ok=True)
    server = None
    if not args.grpc:
        from launcher.local import LocalStack

        server = LocalStack(front=True).start()
        args.grpc, args.http = server.grpc_url, server.http_url
        args.front = args.front or server.front_url
    try:
        matrix = None
        if args.matrix:
            peer, peer_key, peer_name = args.peer, args.api_key, "peer"
            if args.peer == "front":  # same prompts and forced length, through front -> gateway -> ensemble
                peer, peer_name = args.front.rstrip("/") + "/v1", "front"
                peer_key = args.api_key or Profile.load(args.profile).tenants[0]["api_key"]
            matrix, records = run_matrix(args.grpc, peer, {int(x) for x in args.levels.split(",")},
                                         args.requests, args.output_tokens, deadline_s=args.duration * 60,
                                         peer_key=peer_key, peer_name=peer_name)
            summary = {"mode": "matrix", "matrix": matrix, "tenants": by_tenant(records),
                       "total": summarize([r for r in records if r.kind != "peer"])}
        else:
            profile = Profile.load(args.profile)
            records = run_locust(args.grpc, args.http or "127.0.0.1:8000", args.profile, args.users,
                                 args.duration, args.out, args.max_requests, front_url=args.front)
            summary = {"mode": "profile", "tenants": by_tenant(records, profile.slos()), "total": summarize(records),
                       "kinds": {k: summarize([r for r in records if r.kind == k])
                                 for k in sorted({r.kind for r in records})}}
            for t in profile.tenants:
                if t["name"] in summary["tenants"] and t.get("tier"):
                    summary["tenants"][t["name"]]["tier"] = t["tier"]
        write_report(args.out, summary, records, matrix)
    finally:
        if server:
            server.stop()
    print((args.out / "summary.md").read_text())
    print(f"report: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
