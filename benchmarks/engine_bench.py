"""In-process engine benchmark: drives `LLMEngine` directly (no Triton), the llama.cpp peer's workload.

    python benchmarks/engine_bench.py [--streams 1,4,16] [--weight-dtype float32] [--out results.json]

Each of N client threads keeps one request in flight (submit, wait for the final output, submit the
next) until the level's request count is done: 64-token prompts that each start differently (no prefix
reuse), 128 new tokens forced (min_tokens = max_new_tokens), greedy. The engine runs its own loop thread,
as under Triton. Reports aggregate output tok/s, TTFT p50/p95 (submit -> first token), mean engine step
time, and the process's peak resident memory.
"""
from __future__ import annotations

import argparse
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import run_clients, write_json  # noqa: E402
from build.render import DEFAULT_CHECKPOINT  # noqa: E402
from cpu_engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from cpu_engine.checkpoint import WEIGHT_DTYPES  # noqa: E402
from cpu_engine.config import parameter_defaults  # noqa: E402
from cpu_engine.kernels import BACKENDS  # noqa: E402
from loadtest.matrix import MATRIX  # noqa: E402
from contracts.measures import percentile, throughput  # noqa: E402

REQUESTS = dict(MATRIX)  # the same levels as the Triton benchmark and the load tests
ENGINE_DEFAULTS = parameter_defaults()  # the engine's own knob defaults, as the repository renders them


def rss_mb() -> tuple[float, float]:
    """(current, peak) resident set of this process in MB."""
    current = 0.0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            current = int(line.split()[1]) / 1024
    return current, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class StepTimer:
    """Wraps engine.step to time the steps that ran a forward pass."""

    def __init__(self, engine: LLMEngine):
        self.engine, self.inner, self.times = engine, engine.step, []
        engine.step = self

    def __call__(self):
        before = self.engine.iteration
        t = time.perf_counter()
        self.inner()
        if self.engine.iteration != before:
            self.times.append(time.perf_counter() - t)


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab, length).tolist() for _ in range(n)]


def run_level(engine: LLMEngine, timer: StepTimer, streams: int, requests: int, prompt_len: int,
              new_tokens: int, seed: int, adapters: tuple[str, ...] = ()) -> dict:
    """One level: `streams` client threads, each keeping one request in flight until `requests` are done.
    `adapters`: request i runs adapters[i % len(adapters)] (lora_bench.py); () for the base model."""
    prompts = make_prompts(requests, prompt_len, engine.weights.config.vocab_size, seed)
    params = SamplingParams(max_new_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0)
    lock = threading.Lock()
    next_index = [0]
    records, errors = [], []
    run_id = time.monotonic_ns()  # request ids stay unique when one engine runs several levels

    def client(cid: int):
        while True:
            with lock:
                i = next_index[0]
                if i >= requests:
                    return
                next_index[0] += 1
            done = threading.Event()
            rec = {"tokens": 0, "first": None}

            def on_output(out, rec=rec, done=done):
                if out.new_token_ids and rec["first"] is None:
                    rec["first"] = time.perf_counter()
                rec["tokens"] += len(out.new_token_ids)
                if out.finished:
                    rec["end"], rec["reason"] = time.perf_counter(), out.finish_reason
                    if out.error:
                        errors.append(out.error)
                    done.set()

            rec["start"] = time.perf_counter()
            engine.submit(f"{run_id}-s{streams}-{i}", prompts[i], params, on_output,
                          adapter=adapters[i % len(adapters)] if adapters else None)
            done.wait()
            with lock:
                records.append(rec)

    timer.times.clear()
    t0, t1 = run_clients(client, streams)
    wall = t1 - t0
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed: {errors[0]}")
    tokens = sum(r["tokens"] for r in records)
    ttft = [r["first"] - r["start"] for r in records if r["first"] is not None]
    steps = timer.times
    return {
        "streams": streams,
        "requests": requests,
        "output_tokens": tokens,
        "wall_s": round(wall, 3),
        "tok_s": round(throughput(tokens, t0, t0 + wall), 1),
        "ttft_p50_s": round(percentile(ttft, 50), 3),
        "ttft_p95_s": round(percentile(ttft, 95), 3),
        "latency_mean_s": round(statistics.mean(r["end"] - r["start"] for r in records), 3),
        "steps": len(steps),
        "step_ms_mean": round(1000 * statistics.mean(steps), 2) if steps else None,
        "step_ms_p50": round(1000 * percentile(steps, 50), 2) if steps else None,
        "finish_reasons": sorted({r["reason"] for r in records}),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--streams", default="1,4,16", help="comma-separated concurrency levels")
    ap.add_argument("--requests", type=int, default=None, help="requests per level (default 8/12/48 for 1/4/16)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--weight-dtype", default="auto", choices=WEIGHT_DTYPES)
    ap.add_argument("--matmul-backend", default="auto", choices=BACKENDS["matmul_backend"])
    ap.add_argument("--attention-backend", default="auto", choices=BACKENDS["attention_backend"])
    ap.add_argument("--max-num-tokens", type=int, default=int(ENGINE_DEFAULTS["max_num_tokens"]))
    ap.add_argument("--tokens-per-block", type=int, default=int(ENGINE_DEFAULTS["tokens_per_block"]))
    ap.add_argument("--kv-tokens", type=int, default=int(ENGINE_DEFAULTS["max_tokens_in_paged_kv_cache"]),
                    help="max_tokens_in_paged_kv_cache")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)

    if not (Path(args.checkpoint) / "config.json").is_file():
        print(f"no checkpoint at {args.checkpoint} (run build/prepare_model.py)", file=sys.stderr)
        return 2
    t = time.perf_counter()
    engine = LLMEngine(EngineConfig(args.checkpoint, max_num_tokens=args.max_num_tokens,
                                    tokens_per_block=args.tokens_per_block,
                                    max_tokens_in_paged_kv_cache=args.kv_tokens, weight_dtype=args.weight_dtype,
                                    matmul_backend=args.matmul_backend, attention_backend=args.attention_backend))
    load_s = time.perf_counter() - t
    timer = StepTimer(engine)
    engine.start()
    try:
        engine.generate(list(range(100, 100 + args.prompt_len)), SamplingParams(max_new_tokens=8, temperature=0.0))
        levels = []
        for streams in (int(s) for s in args.streams.split(",")):
            requests = args.requests or REQUESTS.get(streams, 3 * streams)
            res = run_level(engine, timer, streams, requests, args.prompt_len, args.new_tokens, args.seed + streams)
            levels.append(res)
            print(f"streams {res['streams']:>3}  requests {res['requests']:>3}  {res['tok_s']:7.1f} tok/s  "
                  f"TTFT p50 {res['ttft_p50_s']:.3f} s  p95 {res['ttft_p95_s']:.3f} s  "
                  f"step {res['step_ms_mean']} ms (p50 {res['step_ms_p50']})", flush=True)
    finally:
        engine.shutdown()
    rss, peak = rss_mb()
    print(f"resident memory: {rss:.0f} MB now, {peak:.0f} MB peak; load {load_s:.1f} s; "
          f"weights {engine.weights.weight_dtype}, matmuls {engine.matmul_backend}, attention {engine.attention_backend}")
    result = {
        "levels": levels,
        "rss_mb": round(rss), "peak_rss_mb": round(peak), "load_s": round(load_s, 2),
        "config": {"weight_dtype": engine.weights.weight_dtype, "matmul_backend": engine.matmul_backend,
                   "attention_backend": engine.attention_backend, "max_num_tokens": args.max_num_tokens,
                   "tokens_per_block": args.tokens_per_block, "kv_tokens": args.kv_tokens,
                   "prompt_len": args.prompt_len, "new_tokens": args.new_tokens},
    }
    if args.out:
        write_json(args.out, result, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
