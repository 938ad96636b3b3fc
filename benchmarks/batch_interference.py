"""Interactive latency while a batch runs (issue 16): TTFT p95 of 4 interactive streams through the front,
without and then with a 200-line batch running at the batch tier.

    python benchmarks/batch_interference.py [--streams 4] [--requests 20] [--lines 200] [--out FILE]

Starts its own stack (CPU repository, front, SQLite ledger in a temp data directory). Phase 1: --streams
clients each send --requests streamed chat completions one after another (max_tokens 24); TTFT is the time
to the first content chunk, measured by the client. Phase 2: a --lines batch (chat, max_tokens 16) is
submitted, and once the worker has finished its first line the same interactive load runs again. Then it
waits for the batch to complete, checks one result per line, and runs the interactive load once more
without the batch (phase 3). The baseline is phases 1 and 3 pooled, so a drift of the machine's load
(a shared machine) does not count for or against the batch. Prints and writes one JSON object; the
target is ttft_p95 with the batch <= 1.5 x without.
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import openai  # noqa: E402
import yaml  # noqa: E402

from gateway.tenants import hash_key  # noqa: E402
from build.render import DEFAULT_CHECKPOINT, render  # noqa: E402
from launcher.stack import Stack, StackConfig  # noqa: E402
from contracts.measures import percentile  # noqa: E402

TENANTS = {
    "routing": {"default_model": "tensorrt_llm", "models": {"tensorrt_llm": {"max_context_tokens": 2048}}},
    "tenants": {
        "web": {"tier": "enterprise", "api_key_sha256": [hash_key("k-web")],
                "limits": {"requests_per_minute": 10_000, "tokens_per_minute": 10_000_000}},
        "nightly": {"tier": "standard", "api_key_sha256": [hash_key("k-nightly")],
                    "limits": {"requests_per_minute": 10_000, "tokens_per_minute": 10_000_000}},
    },
}
QUESTIONS = ["What is the capital of France?", "Name three colors.", "Why is the sky blue?",
             "Write a haiku about rain.", "What is 12 times 12?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def interactive(url: str, streams: int, requests: int) -> list[float]:
    ttfts: list[float] = []
    lock = threading.Lock()

    def client(k: int):
        c = openai.OpenAI(base_url=url, api_key="k-web", max_retries=0, timeout=120)
        for i in range(requests):
            t0 = time.perf_counter()
            first = None
            for chunk in c.chat.completions.create(
                    model="auto", max_tokens=24, temperature=0, stream=True,
                    messages=[{"role": "user", "content": QUESTIONS[(k + i) % len(QUESTIONS)]}]):
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - t0
            with lock:
                ttfts.append(first)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ttfts


def summary(ttfts: list[float]) -> dict:
    ms = [t * 1000 for t in ttfts if t is not None]
    return {"n": len(ms), "ttft_p50_ms": round(percentile(ms, 50), 1), "ttft_p95_ms": round(percentile(ms, 95), 1),
            "ttft_max_ms": round(max(ms), 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--requests", type=int, default=20, help="per stream, per phase")
    p.add_argument("--lines", type=int, default=200)
    p.add_argument("--when-busy", type=int, default=None,
                   help="gateway_batch_inflight_when_busy (default: the render default)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "batch_interference.json")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="batch-bench-"))
    (work / "tenants.yaml").write_text(yaml.safe_dump(TENANTS))
    knobs = {"gateway_config": str(work / "tenants.yaml")}
    if args.when_busy is not None:
        knobs["gateway_batch_inflight_when_busy"] = str(args.when_busy)
    render("cpu", work / "repo", knobs, DEFAULT_CHECKPOINT)
    cfg = StackConfig(repo=work / "repo", port=free_port(), http_port=free_port(), grpc_port=free_port(),
                      metrics_port=free_port(), front_metrics_port=free_port(), data_dir=work / "data",
                      log_path=work / "server.log")
    with Stack(cfg) as stack:
        url = f"{stack.front_url}/v1"
        interactive(url, args.streams, 2)  # warm-up
        before_ttfts = interactive(url, args.streams, args.requests)
        print(f"without the batch: {summary(before_ttfts)}", file=sys.stderr, flush=True)
        nightly = openai.OpenAI(base_url=url, api_key="k-nightly", max_retries=2, timeout=60)
        lines = [{"custom_id": f"n-{i}", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "auto", "max_tokens": 16, "temperature": 0,
                           "messages": [{"role": "user", "content": f"Summarize item {i}: {QUESTIONS[i % 5]}"}]}}
                 for i in range(args.lines)]
        fid = nightly.files.create(file=("nightly.jsonl", "\n".join(map(json.dumps, lines)).encode()),
                                   purpose="batch").id
        t_batch = time.perf_counter()
        batch = nightly.batches.create(input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h")
        while nightly.batches.retrieve(batch.id).request_counts.completed < 1:
            time.sleep(0.1)
        before = nightly.batches.retrieve(batch.id).request_counts.completed
        loaded_ttfts = interactive(url, args.streams, args.requests)
        loaded = summary(loaded_ttfts)
        during = nightly.batches.retrieve(batch.id).request_counts.completed - before
        print(f"with the batch: {loaded} ({during} batch lines done meanwhile)", file=sys.stderr, flush=True)
        while (b := nightly.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
            time.sleep(0.5)
        batch_s = time.perf_counter() - t_batch
        out = [json.loads(x) for x in nightly.files.content(b.output_file_id).text.splitlines()] \
            if b.output_file_id else []
        after_ttfts = interactive(url, args.streams, args.requests)
        print(f"without the batch, after it: {summary(after_ttfts)}", file=sys.stderr, flush=True)
    base = summary(before_ttfts + after_ttfts)
    result = {
        "what": f"interactive TTFT at {args.streams} streams (front, streamed chat, max_tokens 24) without and "
                f"with a {args.lines}-line batch (max_tokens 16) running at the batch tier",
        "machine_cores": __import__("os").cpu_count(),
        "gateway_batch_inflight_when_busy": args.when_busy if args.when_busy is not None else "default",
        "without_batch": base, "with_batch": loaded,
        "without_batch_before": summary(before_ttfts), "without_batch_after": summary(after_ttfts),
        "ttft_p95_ratio": round(loaded["ttft_p95_ms"] / base["ttft_p95_ms"], 2),
        "target_ratio": 1.5,
        "batch": {"lines": args.lines, "status": b.status, "completed": b.request_counts.completed,
                  "failed": b.request_counts.failed, "output_lines": len(out),
                  "distinct_custom_ids": len({o["custom_id"] for o in out}),
                  "lines_done_during_interactive_phase": during, "wall_s": round(batch_s, 1)},
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0 if result["ttft_p95_ratio"] <= 1.5 and len(out) == args.lines else 1


if __name__ == "__main__":
    sys.exit(main())
