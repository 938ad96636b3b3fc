"""LoRA on the CPU engine, in process: tokens/s with adapters against the base model in the same run.

    python benchmarks/lora_bench.py [--streams 1,16] [--rounds 2] [--out benchmarks/results/lora.json]

One engine with the demo adapters (build/make_demo_adapters.py) runs, per round and per level, the base
model (no request has an adapter) and then the LoRA workload (request i uses adapter i mod 4: at 16
streams, 4 distinct adapters among the 16 in flight, so every step mixes 4 adapter groups), interleaved
so that both see the same machine; with `--plain-engine`, a second engine without any adapter folder runs
the base workload too (what the engine did before LoRA existed). The workload is engine_bench.py's: N client threads
each keep one request in flight, 64-token prompts that each start differently, 128 new tokens forced,
greedy. Reports the median over rounds of output tok/s and step time per (engine, workload, level), and
the LoRA slowdown against the base model on the same engine: the median of the rounds' own slowdowns
(`lora_slowdown_pct`; the order of the two alternates every round), and for reference the slowdown of
the median tok/s.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.engine_bench import REQUESTS, StepTimer, rss_mb, run_level  # noqa: E402
from benchmarks.report import write_json  # noqa: E402
from build.make_demo_adapters import DEMO_ADAPTERS  # noqa: E402
from build.render import DEFAULT_CHECKPOINT, default_lora_dir, ensure_demo_adapters  # noqa: E402
from cpu_engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from cpu_engine.checkpoint import WEIGHT_DTYPES  # noqa: E402

ADAPTERS = tuple(DEMO_ADAPTERS)[:4]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=None, help="requests per level (default 8 / 48 for 1 / 16)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--weight-dtype", default="auto", choices=WEIGHT_DTYPES)
    ap.add_argument("--plain-engine", action="store_true",
                    help="also run the base workload on a second engine without an adapter folder (two engines in one "
                         "process share the 2 cores' thread pools, which skews both)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    lora_dir = default_lora_dir(Path(args.checkpoint))
    ensure_demo_adapters(Path(args.checkpoint), lora_dir)
    engines = {"lora_engine": LLMEngine(EngineConfig(args.checkpoint, lora_dir=str(lora_dir),
                                                     weight_dtype=args.weight_dtype))}
    if args.plain_engine:
        engines["plain_engine"] = LLMEngine(EngineConfig(args.checkpoint, weight_dtype=args.weight_dtype))
    timers = {name: StepTimer(e) for name, e in engines.items()}
    for e in engines.values():
        e.start()
    warm = list(range(100, 100 + args.prompt_len))
    for a in ADAPTERS:  # load the adapters: the benchmark measures steps, not first loads
        engines["lora_engine"].generate(warm, SamplingParams(max_new_tokens=2, temperature=0.0), adapter=a)
    if "plain_engine" in engines:
        engines["plain_engine"].generate(warm, SamplingParams(max_new_tokens=2, temperature=0.0))
    runs: dict[tuple, list] = {}
    try:
        for r in range(args.rounds):
            for streams in (int(s) for s in args.streams.split(",")):
                requests = args.requests or REQUESTS.get(streams, 3 * streams)
                plan = [("lora_engine", "base", ()), ("lora_engine", "lora", ADAPTERS)]
                if "plain_engine" in engines:
                    plan.insert(0, ("plain_engine", "base", ()))
                if r % 2:  # alternate which workload goes first, so a drift within a round favours neither
                    plan.reverse()
                for engine_name, workload, adapters in plan:
                    res = run_level(engines[engine_name], timers[engine_name], streams, requests, args.prompt_len,
                                    args.new_tokens, seed=1000 * r + streams, adapters=adapters)
                    runs.setdefault((engine_name, workload, streams), []).append(res)
                    print(f"round {r}  {engine_name:<12} {workload:<4} streams {streams:>2}  {res['tok_s']:7.1f} tok/s  "
                          f"step {res['step_ms_mean']:.1f} ms", flush=True)
    finally:
        for e in engines.values():
            e.shutdown()
    levels = []
    for (engine_name, workload, streams), rs in runs.items():
        levels.append({"engine": engine_name, "workload": workload, "streams": streams,
                       "adapters": list(ADAPTERS) if workload == "lora" else [],
                       "tok_s": round(statistics.median(x["tok_s"] for x in rs), 1),
                       "tok_s_rounds": [round(x["tok_s"], 1) for x in rs],
                       "step_ms": round(statistics.median(x["step_ms_mean"] for x in rs), 2)})
    by = {(x["engine"], x["workload"], x["streams"]): x for x in levels}
    slowdown, of_medians = {}, {}
    for streams in sorted({x["streams"] for x in levels}):
        base, lora = by[("lora_engine", "base", streams)], by[("lora_engine", "lora", streams)]
        # each round's base and LoRA runs are back to back: their ratio cancels the machine's drift between
        # rounds (this VM's rounds differ by up to 2x), which a ratio of two medians does not
        per_round = [1 - lo / b for lo, b in zip(lora["tok_s_rounds"], base["tok_s_rounds"])]
        slowdown[str(streams)] = round(100 * statistics.median(per_round), 1)
        of_medians[str(streams)] = round(100 * (1 - lora["tok_s"] / base["tok_s"]), 1)
        print(f"streams {streams:>2}: LoRA {lora['tok_s']} vs base {base['tok_s']} tok/s (medians); per round "
              f"{', '.join(f'{100 * x:.1f}%' for x in per_round)} slower -> {slowdown[str(streams)]}%", flush=True)
    rss, peak = rss_mb()
    e = engines["lora_engine"]
    result = {"levels": levels, "lora_slowdown_pct": slowdown, "slowdown_of_median_tok_s_pct": of_medians,
              "target_pct_at_16": 15,
              "rss_mb": round(rss), "peak_rss_mb": round(peak),
              "config": {"weight_dtype": e.weights.weight_dtype, "matmul_backend": e.matmul_backend,
                         "attention_backend": e.attention_backend, "prompt_len": args.prompt_len,
                         "new_tokens": args.new_tokens, "adapters": {a: {"rank": DEMO_ADAPTERS[a][1],
                                                                         "targets": list(DEMO_ADAPTERS[a][3])}
                                                                     for a in ADAPTERS}},
              "command": "python benchmarks/lora_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    if args.out:
        write_json(args.out, result, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
