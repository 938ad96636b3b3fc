"""A returning session's time to first token, with the engine's host KV tier and without it.

Through the whole stack (front, gateway sessions, CPU engine): a session's first turn is a ~2k-token
message; its second turn comes back at once (its prefix still in the KV pool: warm); then other requests
fill the pool and evict every block of the session; then its third turn comes back. Without the host tier
(`kv_cache_host_memory_bytes` 0) the third turn computes the whole conversation again; with it, the
evicted blocks are copied back from the tier. TTFT is the time to the first streamed chunk, per turn,
median over the repeats; the engine's own counters say how many blocks were onboarded.

    python -m benchmarks.session_kv_bench [--out benchmarks/results/<date>-session-kv.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import openai

from launcher.local import LocalStack
from clients.prometheus import metric_value

KEY = "sk-demo-acme-enterprise"  # deploy/gateway.example.yaml: sessions on by default
POOL_TOKENS = 4096  # the engine's KV pool, small enough for two other 2k prompts to evict a session
HOST_BYTES = 512 * 1024 * 1024


def long_text(seed: int, words: int = 1700) -> str:
    """Distinct text per seed (no shared prefix between sessions or with the churn)."""
    vocab = ["river", "stone", "window", "garden", "signal", "harbor", "lantern", "meadow", "copper", "violet",
             "engine", "orchard", "canyon", "ember", "glacier", "mosaic", "pepper", "quartz", "saddle", "tundra"]
    out, x = [], seed * 7919 + 13
    for i in range(words):
        x = (x * 1103515245 + 12345) % (2 ** 31)
        out.append(vocab[x % len(vocab)] + (f" {seed}-{i}." if i % 50 == 0 else ""))
    return " ".join(out)


def ttft_ms(client, session: str, content: str, max_tokens: int) -> tuple[float, int]:
    t = time.perf_counter()
    stream = client.chat.completions.create(model="auto", messages=[{"role": "user", "content": content}],
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"session_id": session})
    first, prompt_tokens = None, 0
    for chunk in stream:
        if first is None:
            first = (time.perf_counter() - t) * 1000
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
    return first, prompt_tokens


def run(host_bytes: int, repeats: int) -> dict:
    overrides = {"max_tokens_in_paged_kv_cache": str(POOL_TOKENS), "kv_cache_host_memory_bytes": str(host_bytes)}
    with LocalStack(overrides=overrides, front=True) as stack:
        client = openai.OpenAI(base_url=f"{stack.front_url}/v1", api_key=KEY, max_retries=0, timeout=600)
        turns = {"first": [], "warm_return": [], "return_after_eviction": []}
        prompts = []
        for r in range(repeats):
            session = f"bench-{host_bytes}-{r}"
            turns["first"].append(ttft_ms(client, session, long_text(r) + "\nWhat is this text about?", 8)[0])
            turns["warm_return"].append(ttft_ms(client, session, "Name one word from it.", 8)[0])
            for c in range(2):  # other traffic fills the pool: every block of the session is evicted
                client.chat.completions.create(model="auto", max_tokens=1, temperature=0, messages=[
                    {"role": "user", "content": long_text(1000 + 10 * r + c)}])
            ms, n = ttft_ms(client, session, "And another one?", 8)
            turns["return_after_eviction"].append(ms)
            prompts.append(n)
        text = stack.metrics()
        onboarded = metric_value(text, "cpu_engine_kv_host_tier_metrics", host_tier_metric="onboarded")
        offloaded = metric_value(text, "cpu_engine_kv_host_tier_metrics", host_tier_metric="offloaded")
    return {"kv_cache_host_memory_bytes": host_bytes,
            "ttft_ms_median": {k: round(statistics.median(v), 1) for k, v in turns.items()},
            "ttft_ms_runs": {k: [round(x, 1) for x in v] for k, v in turns.items()},
            "returning_prompt_tokens": prompts,
            "host_tier_blocks": {"offloaded": offloaded, "onboarded": onboarded}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    load_before = os.getloadavg()
    runs = [run(0, args.repeats), run(HOST_BYTES, args.repeats)]
    cold = runs[0]["ttft_ms_median"]["return_after_eviction"]
    kept = runs[1]["ttft_ms_median"]["return_after_eviction"]
    result = {
        "what": "TTFT of a returning ~2k-token session turn through the front (sessions) on the CPU engine: "
                "warm (prefix still in the KV pool), and after other traffic evicted it, without the host KV tier "
                "(recomputed) and with it (onboarded from float16 copies)",
        "host": {"machine": platform.machine(), "processor": platform.processor(), "python": platform.python_version()},
        "load_average_1m": {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2),
                            "cores": os.cpu_count()},  # a shared host: other work runs beside the bench
        "pool_tokens": POOL_TOKENS, "repeats": args.repeats,
        "runs": runs,
        "return_after_eviction_ms": {"without_host_tier": cold, "with_host_tier": kept,
                                     "speedup": round(cold / kept, 2) if kept else None},
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
