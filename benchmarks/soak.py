"""Soak: the whole stack (front -> gateway -> engine) at 2x saturation for N minutes, then idle checks.

    .venv/bin/python benchmarks/soak.py [--minutes 20] [--out benchmarks/results/soak.json]

Saturation is the gateway's engine slots (`gateway_max_inflight`: the rendered default, the CPU
engine's batch, or `--slots`): the soak keeps twice that many streaming requests in flight through the
OpenAI-compatible front, each asking for a random 16-128 tokens, a tenth of them abandoned midway
(client disconnects) and a twentieth invalid. It counts requests by outcome, flags any that hang (no end
within the timeout) or end in a success with no text, and after the load stops waits for the stack to go
idle, then reads every counter that must return to zero: engine active requests and used KV blocks, the
gateway's slots and reserved tokens. The server's RSS (tritonserver and its stubs, and the front) is read
at the start, every minute (`rss_by_minute`: whether it levels off) and at the end.
Not a CI test: run it on a quiet machine; the figures go to docs/benchmarks.md from the results file.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import aiohttp
import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.tenants import hash_key  # noqa: E402
from clients.prometheus import metric_value  # noqa: E402
from launcher.local import LocalStack  # noqa: E402

KEY = "k-soak"
PROMPTS = ["The capital of France is", "Write a short poem about the sea:", "List three colours:",
           "Explain in one sentence why the sky is blue."]


def tenants_config(path: Path) -> Path:
    limits = {"requests_per_minute": 1_000_000, "tokens_per_minute": 100_000_000, "max_concurrent": 10_000,
              "max_output_tokens": 4096}
    path.write_text(yaml.safe_dump({"tenants": {"soak": {"tier": "enterprise", "api_key_sha256": [hash_key(KEY)],
                                                         "limits": limits}}}))
    return path


def tree_rss_mb(pid: int) -> float:
    try:
        proc = psutil.Process(pid)
        procs = [proc] + proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0.0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 1e6


async def one(session: aiohttp.ClientSession, url: str, rng: random.Random, timeout: float) -> str:
    kind = rng.random()
    body = {"model": "auto", "prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(16, 128), "stream": True,
            "temperature": 0.7, "stream_options": {"include_usage": True}}
    if kind < 0.05:
        body["temperature"] = -1  # invalid: a 400 naming temperature
    abandon = 0.05 <= kind < 0.15
    try:
        async with asyncio.timeout(timeout):
            async with session.post(url, json=body, headers={"authorization": f"Bearer {KEY}"}) as resp:
                if resp.status != 200:  # http_<status>_<OpenAI error code>: 503s say which bound refused
                    try:
                        code = (await resp.json(content_type=None))["error"]["code"]
                    except (ValueError, KeyError, TypeError):
                        code = None
                    return f"http_{resp.status}" + (f"_{code}" if code else "")
                text, pieces, usage = "", 0, None
                async for line in resp.content:
                    if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                        continue
                    data = json.loads(line[6:])
                    if "error" in data:
                        return "stream_error"
                    text += "".join(c.get("text", "") for c in data.get("choices", []))
                    usage = data.get("usage") or usage
                    pieces += 1
                    if abandon and pieces >= 3:
                        return "abandoned"
                # a success must say what it produced: no usage, or tokens counted but no text, is a loss
                if usage is None or (usage["completion_tokens"] > 0 and not text):
                    return "empty_success"
                return "ok" if text else "ok_no_tokens"  # the model ended at once (end token first)
    except TimeoutError:
        return "hung"
    except aiohttp.ClientError as e:
        return f"client_error:{type(e).__name__}"


async def drive(url: str, concurrency: int, seconds: float, timeout: float, seed: int) -> Counter:
    outcomes, rng = Counter(), random.Random(seed)
    deadline = time.monotonic() + seconds
    conn = aiohttp.TCPConnector(limit=concurrency * 2)
    async with aiohttp.ClientSession(connector=conn) as session:
        async def worker():
            while time.monotonic() < deadline:
                outcomes[await one(session, url, rng, timeout)] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes


def idle_state(server: LocalStack) -> dict:
    m = server.metrics()
    return {
        "engine_active_requests": metric_value(m, "nv_trt_llm_request_metrics", request_type="active") or 0.0,
        "engine_used_kv_blocks": metric_value(m, "nv_trt_llm_kv_cache_block_metrics",
                                              kv_cache_block_type="used") or 0.0,
        "gateway_inflight_requests": metric_value(m, "gateway_inflight_requests") or 0.0,
        "gateway_reserved_tokens": metric_value(m, "gateway_reserved_tokens") or 0.0,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--slots", type=int, default=None,
                   help="gateway_max_inflight (default: the rendered default); the soak runs 2x this")
    p.add_argument("--timeout-s", type=float, default=120.0, help="a request with no end by then is hung")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "soak.json")
    args = p.parse_args(argv)
    cfg = tenants_config(Path(tempfile.mkdtemp(prefix="soak-")) / "tenants.yaml")
    slots = {"gateway_max_inflight": str(args.slots)} if args.slots else {}
    server = LocalStack(overrides={"gateway_config": str(cfg), **slots}, front=True).start()
    try:
        args.slots = int(json.loads((server.repo / "render.json").read_text())["admission"]["gateway_max_inflight"])
        front_pid = server.stack.front.pid
        rss_start = {"triton_mb": tree_rss_mb(server.proc.pid), "front_mb": tree_rss_mb(front_pid)}
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        t0 = time.monotonic()
        print(f"soak: {2 * args.slots} streams for {args.minutes:g} min through {server.front_url}", flush=True)
        by_minute, done = [], threading.Event()

        def sample():
            while not done.wait(60.0):
                by_minute.append({"triton_mb": round(tree_rss_mb(server.proc.pid)),
                                  "front_mb": round(tree_rss_mb(front_pid))})
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            outcomes = asyncio.run(drive(f"{server.front_url}/v1/completions", 2 * args.slots, args.minutes * 60,
                                         args.timeout_s, args.seed))
        finally:
            done.set()
        elapsed = time.monotonic() - t0
        waited, state = time.monotonic(), idle_state(server)
        while any(state.values()) and time.monotonic() - waited < 30:
            time.sleep(0.2)
            state = idle_state(server)
        idle_after = time.monotonic() - waited
        rss_end = {"triton_mb": tree_rss_mb(server.proc.pid), "front_mb": tree_rss_mb(front_pid)}
    finally:
        server.stop()
    result = {
        "command": "benchmarks/soak.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "started": started, "seconds": round(elapsed, 1), "streams": 2 * args.slots, "slots": args.slots,
        "cpu": platform.processor() or platform.machine(), "cores": psutil.cpu_count(),
        "requests": sum(outcomes.values()), "outcomes": dict(outcomes),
        "lost_or_hung": sum(v for k, v in outcomes.items() if k in ("hung", "empty_success")
                            or k.startswith("client_error")),
        "idle_after_s": round(idle_after, 2), "counters_after": state,
        "rss_start": rss_start, "rss_end": rss_end, "rss_by_minute": by_minute,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0 if result["lost_or_hung"] == 0 and not any(state.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
