"""Noisy neighbours through the front (issue 29): does a third tenant's short request keep its latency
while one tenant floods and another runs long streams?

On a real stack (tritonserver + gateway + CPU engine + front, `launcher.local.LocalStack`):
1. idle: the victim (`globex`, standard tier) sends `--requests` chat requests of 8 output tokens, one
   after another: its baseline latency;
2. loaded: meanwhile
   - `hobbyist` (free tier) floods from 6 connections, none waiting between requests and none heeding
     Retry-After: 3 send `/v1/completions` prompts, 3 send `/v1/tokenize` bodies, each just under the
     front's 4 MiB body limit (before issue 29 each was tokenized for seconds, then refused uncounted);
   - `acme` (enterprise) keeps 12 streams of max_tokens 2048 (`ignore_eos`) going, each started again
     when it ends (after Retry-After when refused: a heavy tenant within its limits);
   the victim sends the same requests again after `--warmup-s`.
The engine's waiting queue and the gateway's KV held are sampled from Triton's metrics meanwhile.
Results: benchmarks/results/<date>-noisy-neighbour.json (+ .md); docs/benchmarks.md quotes them.

    .venv/bin/python benchmarks/noisy_neighbour_bench.py [--requests 30] [--warmup-s 15]
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import statistics
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gateway.tenants import hash_key  # noqa: E402
from clients.prometheus import metric_value  # noqa: E402

KEYS = {"acme": "sk-bench-acme", "globex": "sk-bench-globex", "hobbyist": "sk-bench-hobbyist"}
TIERS = {"acme": "enterprise", "globex": "standard", "hobbyist": "free"}
VICTIM_CHAT = [{"role": "user", "content": "Name one planet of the solar system."}]
FLOOD_BYTES = 4 * 1024 * 1024
LONG_STREAMS, LONG_MAX_TOKENS = 12, 2048


def tenants_config(path: Path, acme_kv_share: int | None = None) -> Path:
    import yaml

    tenants = {name: {"tier": TIERS[name], "api_key_sha256": [hash_key(key)]} for name, key in KEYS.items()}
    if acme_kv_share is not None:
        tenants["acme"]["limits"] = {"kv_share_percent": acme_kv_share}
    path.write_text(yaml.safe_dump({
        "routing": {"default_model": "tensorrt_llm", "models": {"tensorrt_llm": {"max_context_tokens": 8192}}},
        "tenants": tenants,
    }))
    return path


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


class Client:
    def __init__(self, port: int):
        self.port = port

    def post(self, path: str, body: bytes, key: str, timeout: float = 120) -> tuple[int, dict, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("POST", path, body=body, headers={"authorization": f"Bearer {key}",
                                                          "content-type": "application/json"})
            r = conn.getresponse()
            return r.status, dict(r.getheaders()), r.read()
        finally:
            conn.close()


def victim_latencies(client: Client, n: int, timeout_s: float = 120.0) -> tuple[list[float], list[int]]:
    """Latencies of n requests, one after another; one that gets no answer within timeout_s counts as
    timeout_s with status 0."""
    body = json.dumps({"model": "auto", "messages": VICTIM_CHAT, "max_tokens": 8, "temperature": 0,
                       "ignore_eos": True}).encode()
    out, statuses = [], []
    for _ in range(n):
        start = time.monotonic()
        try:
            status, _, _ = client.post("/v1/chat/completions", body, KEYS["globex"], timeout=timeout_s)
        except (OSError, http.client.HTTPException):
            status = 0
        out.append(time.monotonic() - start)
        statuses.append(status)
        time.sleep(0.2)
    return out, statuses


def flood(client: Client, path: str, stop: threading.Event, counts: dict, lock: threading.Lock) -> None:
    """A hostile loop: 4 MiB bodies, no pause, Retry-After ignored."""
    body = json.dumps({"prompt": "a " * ((FLOOD_BYTES - 1024) // 2), "max_tokens": 16}).encode()
    assert len(body) < FLOOD_BYTES  # under the front's 4 MiB body limit: only the tier's bound refuses it
    while not stop.is_set():
        try:
            status, _, _ = client.post(path, body, KEYS["hobbyist"], timeout=30)
            key = str(status)
        except (OSError, http.client.HTTPException) as e:  # refused before the body was read: the socket closes
            key = type(e).__name__
        with lock:
            counts[key] = counts.get(key, 0) + 1


def long_stream(client: Client, stop: threading.Event, stats: dict, lock: threading.Lock) -> None:
    """acme's stream: started again when it ends; after Retry-After when refused."""
    body = json.dumps({"model": "auto", "prompt": "Write a very long story about the sea.",
                       "max_tokens": LONG_MAX_TOKENS, "ignore_eos": True, "stream": True}).encode()
    while not stop.is_set():
        conn = http.client.HTTPConnection("127.0.0.1", client.port, timeout=600)
        try:
            conn.request("POST", "/v1/completions", body=body, headers={"authorization": f"Bearer {KEYS['acme']}"})
            r = conn.getresponse()
            with lock:
                stats["status"][str(r.status)] = stats["status"].get(str(r.status), 0) + 1
            if r.status != 200:
                r.read()
                time.sleep(float(r.getheader("retry-after") or 1))
                continue
            while not stop.is_set():
                line = r.readline()
                if not line:
                    break
                if line.startswith(b"data: {"):
                    with lock:
                        stats["chunks"] += 1
        except (OSError, http.client.HTTPException):
            time.sleep(0.5)
        finally:
            conn.close()


def sample_metrics(stack, stop: threading.Event, samples: list) -> None:
    while not stop.wait(0.5):
        try:
            text = stack.metrics()
        except OSError:
            continue
        samples.append({
            "engine_waiting": metric_value(text, "nv_trt_llm_request_metrics", request_type="waiting") or 0.0,
            "engine_active": metric_value(text, "nv_trt_llm_request_metrics", request_type="active") or 0.0,
            "gateway_kv_held": metric_value(text, "gateway_kv_held_tokens") or 0.0,
            "gateway_queued": metric_value(text, "gateway_admission_queue_depth") or 0.0,
        })


def summary(latencies: list[float]) -> dict:
    return {"n": len(latencies), "p50_s": round(statistics.median(latencies), 4),
            "p95_s": round(percentile(latencies, 95), 4), "max_s": round(max(latencies), 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=30, help="the victim's requests per phase")
    ap.add_argument("--warmup-s", type=float, default=15.0, help="load before the victim's loaded phase")
    ap.add_argument("--streams", type=int, default=LONG_STREAMS, help="acme's long streams (0: none)")
    ap.add_argument("--flood-connections", type=int, default=6,
                    help="hobbyist's flooding connections, half to each path (0: no flood)")
    ap.add_argument("--acme-kv-share", type=int, default=None,
                    help="acme's kv_share_percent (default: its tier's, gateway/tenants.py)")
    ap.add_argument("--decode-context-share-tokens", type=int, default=None,
                    help="the engine's decode_context_share_tokens (default: the rendered default, build/render.py)")
    ap.add_argument("--victim-timeout-s", type=float, default=120.0,
                    help="a victim request unanswered this long counts as this long, status 0")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"
                                           / f"{datetime.now(timezone.utc):%Y-%m-%d}-noisy-neighbour.json"))
    args = ap.parse_args(argv)
    from launcher.local import LocalStack

    stack = LocalStack(front=True)
    stack.overrides["gateway_config"] = str(tenants_config(stack.workdir / "bench-tenants.yaml", args.acme_kv_share))
    if args.decode_context_share_tokens is not None:
        stack.overrides["decode_context_share_tokens"] = str(args.decode_context_share_tokens)
    from build.render import TARGET_DEFAULTS
    share = stack.overrides.get("decode_context_share_tokens", TARGET_DEFAULTS["cpu"]["decode_context_share_tokens"])
    print("[noisy] starting the stack ...", file=sys.stderr, flush=True)
    stack.start()
    try:
        client = Client(stack.front_port)
        victim_latencies(client, 3)  # warm: first requests pay one-time costs
        idle, idle_status = victim_latencies(client, args.requests)
        print(f"[noisy] idle: {summary(idle)}", file=sys.stderr, flush=True)
        stop, lock = threading.Event(), threading.Lock()
        flood_counts = {"/v1/completions": {}, "/v1/tokenize": {}}
        acme = {"status": {}, "chunks": 0}
        samples: list = []
        paths = ("/v1/completions", "/v1/tokenize")
        threads = [threading.Thread(target=flood, args=(client, paths[i % 2], stop, flood_counts[paths[i % 2]], lock),
                                    daemon=True) for i in range(args.flood_connections)]
        threads += [threading.Thread(target=long_stream, args=(client, stop, acme, lock), daemon=True)
                    for _ in range(args.streams)]
        threads.append(threading.Thread(target=sample_metrics, args=(stack, stop, samples), daemon=True))
        started = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(args.warmup_s)
        loaded, loaded_status = victim_latencies(client, args.requests, args.victim_timeout_s)
        elapsed = time.monotonic() - started
        stop.set()
        print(f"[noisy] loaded: {summary(loaded)}", file=sys.stderr, flush=True)
    finally:
        stack.stop()
    for t in threads:
        t.join(10)
    result = {
        "benchmark": "noisy_neighbour", "command": "benchmarks/noisy_neighbour_bench.py " + " ".join(argv or sys.argv[1:]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "processor": platform.processor()},
        "victim": {"tenant": "globex", "tier": "standard", "request": "chat, max_tokens 8, ignore_eos",
                   "idle": summary(idle), "loaded": summary(loaded),
                   "idle_statuses": sorted(set(idle_status)), "loaded_statuses": sorted(set(loaded_status)),
                   "p95_loaded_over_idle": round(percentile(loaded, 95) / percentile(idle, 95), 3),
                   "p50_loaded_over_idle": round(statistics.median(loaded) / statistics.median(idle), 3)},
        "flood": {"tenant": "hobbyist", "tier": "free", "connections": args.flood_connections, "body_bytes": FLOOD_BYTES,
                  "answers": flood_counts,
                  "per_second": round(sum(sum(c.values()) for c in flood_counts.values()) / elapsed, 1)},
        "long_streams": {"tenant": "acme", "tier": "enterprise", "streams": args.streams,
                         "kv_share_percent": args.acme_kv_share or "tier default",
                         "max_tokens": LONG_MAX_TOKENS, "statuses": acme["status"],
                         "tokens_per_s": round(acme["chunks"] / elapsed, 1)},
        "engine": {"decode_context_share_tokens": int(share), "samples": len(samples),
                   "waiting_max": max((s["engine_waiting"] for s in samples), default=None),
                   "waiting_mean": round(statistics.fmean(s["engine_waiting"] for s in samples), 3) if samples else None,
                   "active_max": max((s["engine_active"] for s in samples), default=None),
                   "gateway_kv_held_max": max((s["gateway_kv_held"] for s in samples), default=None),
                   "gateway_queued_max": max((s["gateway_queued"] for s in samples), default=None)},
        "loaded_seconds": round(elapsed, 1),
    }
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=2) + "\n")
    v = result["victim"]
    out.with_suffix(".md").write_text(
        f"# Noisy neighbours ({result['date']})\n\n`{result['command']}`\n\n"
        f"| victim (globex, 8 tokens) | p50 s | p95 s | max s |\n|---|---|---|---|\n"
        f"| idle | {v['idle']['p50_s']} | {v['idle']['p95_s']} | {v['idle']['max_s']} |\n"
        f"| loaded | {v['loaded']['p50_s']} | {v['loaded']['p95_s']} | {v['loaded']['max_s']} |\n\n"
        f"p95 loaded / idle: {v['p95_loaded_over_idle']}x (p50 {v['p50_loaded_over_idle']}x). Flood answers: "
        f"{json.dumps(flood_counts)} ({result['flood']['per_second']}/s). acme's 12 streams: "
        f"{json.dumps(acme['status'])}, {result['long_streams']['tokens_per_s']} tok/s. Engine waiting queue: max "
        f"{result['engine']['waiting_max']}, mean {result['engine']['waiting_mean']}; gateway KV held max "
        f"{result['engine']['gateway_kv_held_max']} tokens, queued max {result['engine']['gateway_queued_max']}.\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
