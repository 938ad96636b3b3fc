"""A returning session's time to first token: kept in the KV pool by priority, kept in the host KV tier, or
computed again.

Through the whole stack (front, gateway sessions, CPU engine): a session's first turn is a ~2k-token
message; its second turn comes back at once (warm); then two other prompts put the pool under light
pressure (they need some of the session's blocks unless its priority keeps them) and the session returns;
then one prompt that needs the whole pool evicts everything and the session returns again. Three
configurations: the session at the default retention priority (35, as every other request) and no host
tier; at the gateway's session priority (`kv_priority` 80) without a host tier; and with a host tier
(`kv_cache_host_memory_bytes`). TTFT is the time to the first streamed chunk, median over the repeats.

    python -m benchmarks.session_kv_bench [--out benchmarks/results/<date>-session-kv.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import openai
import yaml

from gateway.tenants import hash_key
from launcher.local import LocalStack
from clients.prometheus import metric_value

KEY = "sk-bench-sessions"
POOL_TOKENS = 3072  # the engine's KV pool: a ~2k-token session and room for ~1k more
HOST_BYTES = 512 * 1024 * 1024
CONFIGS = (("default priority, no host tier", 35, 0), ("session priority 80, no host tier", 80, 0),
           ("session priority 80, host tier 512 MiB", 80, HOST_BYTES))


def gateway_config(priority: int) -> Path:
    path = Path(tempfile.mkdtemp(prefix="session-kv-")) / "gateway.yaml"
    path.write_text(yaml.safe_dump({"tenants": {"bench": {
        "tier": "enterprise", "api_key_sha256": [hash_key(KEY)],
        "limits": {"tokens_per_minute": 10_000_000, "requests_per_minute": 100_000},
        "sessions": {"ttl_s": 3600, "kv_priority": priority}}}}))
    return path


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


def run(name: str, priority: int, host_bytes: int, repeats: int) -> dict:
    overrides = {"max_tokens_in_paged_kv_cache": str(POOL_TOKENS), "kv_cache_host_memory_bytes": str(host_bytes),
                 "gateway_config": str(gateway_config(priority))}
    with LocalStack(overrides=overrides, front=True) as stack:
        client = openai.OpenAI(base_url=f"{stack.front_url}/v1", api_key=KEY, max_retries=0, timeout=900)

        def other(seed: int, words: int) -> None:
            client.chat.completions.create(model="auto", max_tokens=1, temperature=0, messages=[
                {"role": "user", "content": long_text(seed, words)}])

        turns = {"first": [], "warm_return": [], "return_after_light_pressure": [], "return_after_full_eviction": []}
        prompts = []
        for r in range(repeats):
            session = f"bench-{priority}-{host_bytes}-{r}"
            turns["first"].append(ttft_ms(client, session, long_text(r) + "\nWhat is this text about?", 8)[0])
            turns["warm_return"].append(ttft_ms(client, session, "Name one word from it.", 8)[0])
            for c in range(2):  # ~700 tokens each: the second needs blocks the pool holds cached
                other(1000 + 10 * r + c, 480)
            turns["return_after_light_pressure"].append(ttft_ms(client, session, "And another one?", 8)[0])
            other(2000 + r, 2300)  # ~2.85k tokens of the 3,072: (nearly) every cached block of the pool goes
            ms, n = ttft_ms(client, session, "And a third one?", 8)
            turns["return_after_full_eviction"].append(ms)
            prompts.append(n)
        text = stack.metrics()
        onboarded = metric_value(text, "cpu_engine_kv_host_tier_metrics", host_tier_metric="onboarded")
        offloaded = metric_value(text, "cpu_engine_kv_host_tier_metrics", host_tier_metric="offloaded")
    return {"config": name, "kv_priority": priority, "kv_cache_host_memory_bytes": host_bytes,
            "ttft_ms_median": {k: round(statistics.median(v), 1) for k, v in turns.items()},
            "ttft_ms_runs": {k: [round(x, 1) for x in v] for k, v in turns.items()},
            "last_prompt_tokens": prompts,
            "host_tier_blocks": {"offloaded": offloaded, "onboarded": onboarded}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    load_before = os.getloadavg()
    runs = [run(name, priority, host, args.repeats) for name, priority, host in CONFIGS]
    result = {
        "what": "TTFT of a returning ~2k-token session turn through the front (sessions) on the CPU engine: at once, "
                "after light pressure on the KV pool (the session's retention priority decides), and after a "
                "prompt that needs the whole pool (the host KV tier decides)",
        "host": {"machine": platform.machine(), "processor": platform.processor(), "python": platform.python_version()},
        "load_average_1m": {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2),
                            "cores": os.cpu_count()},  # a shared host: other work runs beside the bench
        "pool_tokens": POOL_TOKENS, "repeats": args.repeats,
        "runs": runs,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
