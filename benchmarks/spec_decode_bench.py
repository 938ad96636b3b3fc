"""Speculative decoding (prompt lookup, `decoding_mode lookahead`) against plain decoding, in-process.

    python benchmarks/spec_decode_bench.py [--streams 1,16] [--rounds 3] [--out benchmarks/results/spec_decode.json]

One engine with `decoding_mode lookahead` (prefix reuse off: every request prefills its whole prompt the
same way, as int8 prefill numerics depend on where a prefill starts) serves both arms: plain requests ask for (w, n, g) = (1, 1, 0),
speculating ones for the engine's (W, N, G), so both run in the same process and the same minutes (the
host is shared: ratios taken in one window are what this reports). Workloads, chat-templated for
SmolLM2-135M-Instruct, greedy, up to --new-tokens tokens (the end token ends a request earlier; greedy
output is the same in both arms, so both do the same work):
- `edit`: return a given paragraph with its typos fixed (the answer copies the text: lookup-friendly);
- `code`: return a given Python function with a docstring added (copies the code: lookup-friendly);
- `prose`: open-ended stories (little to look up).
At each level `streams` client threads keep one request in flight until each has run --requests-per-stream
(default: enough that the level runs each of the workload's 4 prompts);
the arms alternate within each round, --rounds rounds. Reports output tok/s per run, the median and the
speculative/plain ratio per round, the acceptance rate (accepted / verified draft tokens) and the mean
tokens per step of a speculating request (acceptance length, TensorRT-LLM's IterationStats name), and
checks that both arms produced the same tokens.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import write_json  # noqa: E402
from bls.text.tokenization import TokenizerBundle  # noqa: E402
from build.render import DEFAULT_CHECKPOINT  # noqa: E402
from cpu_engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from loadtest.metrics import throughput  # noqa: E402

PARAGRAPHS = [
    "The city council met on tuesday to discuss the new park. Several residents said that the park shoud have more "
    "trees and a playground for children. The mayor promised to publish the plans next month and to hold a public "
    "meeting before any construction begins.",
    "Our team finished the migration to the new database last week. The main problems were slow queries on the "
    "orders table and a missing index on the customer id. After adding the index, the reports run in under a secnd "
    "and the nightly backup takes half as long.",
    "The museum will open a new exhibition about the history of flight in the spring. Visitors can see early gliders, "
    "a replica of the first powered airplane, and an interactive display that explains how wings create lift. "
    "Tickets go on sale in febuary.",
    "Rivers carry water from the mountains to the sea. Along the way they shape valleys, feed farms and give homes to "
    "fish and birds. When too much water is taken for cities, the river can shrink, and the animals that depend on "
    "it must move or dissapear.",
]
FUNCTIONS = [
    "def moving_average(values, window):\n    result = []\n    total = 0\n    for i, value in enumerate(values):\n"
    "        total += value\n        if i >= window:\n            total -= values[i - window]\n"
    "        if i >= window - 1:\n            result.append(total / window)\n    return result\n",
    "def merge_sorted(left, right):\n    merged = []\n    i = j = 0\n    while i < len(left) and j < len(right):\n"
    "        if left[i] <= right[j]:\n            merged.append(left[i])\n            i += 1\n        else:\n"
    "            merged.append(right[j])\n            j += 1\n    merged.extend(left[i:])\n    merged.extend(right[j:])\n"
    "    return merged\n",
    "def word_counts(text):\n    counts = {}\n    for word in text.lower().split():\n        word = word.strip('.,!?')\n"
    "        if word:\n            counts[word] = counts.get(word, 0) + 1\n    return counts\n",
    "def parse_config(lines):\n    config = {}\n    for line in lines:\n        line = line.strip()\n"
    "        if not line or line.startswith('#'):\n            continue\n        key, _, value = line.partition('=')\n"
    "        config[key.strip()] = value.strip()\n    return config\n",
]
TOPICS = ["a dragon who learns to cook", "a lighthouse keeper's strangest night", "two robots who open a bakery",
          "a girl who finds a map in her grandmother's attic"]
WORKLOADS = {
    "edit": [f"Fix the spelling mistakes in this text and write the whole corrected text:\n\n{p}" for p in PARAGRAPHS],
    "code": [f"Add a docstring to this Python function and return the complete function:\n\n{f}" for f in FUNCTIONS],
    "prose": [f"Write a short story about {t}." for t in TOPICS],
}
LOOKUP_FRIENDLY = ("edit", "code")


def run_arm(engine: LLMEngine, prompts: list[list[int]], streams: int, per_stream: int, params: SamplingParams,
            lookahead: dict) -> dict:
    """`streams` threads, each running `per_stream` requests one after another (prompt i cycles)."""
    lock = threading.Lock()
    outputs, errors = {}, []
    tag = time.monotonic_ns()

    def client(cid: int):
        for k in range(per_stream):
            index = cid * per_stream + k
            done = threading.Event()
            got: list[int] = []
            final = []

            def on_output(out, got=got, final=final, done=done):
                got.extend(out.new_token_ids)
                if out.finished:
                    final.append(out)
                    done.set()

            try:
                engine.submit(f"{tag}-{cid}-{k}", prompts[index % len(prompts)], params, on_output,
                              lookahead=lookahead)
            except Exception as e:  # noqa: BLE001 (reported, not raised, so the other threads finish)
                errors.append(repr(e))
                return
            done.wait()
            with lock:
                outputs[index] = (got, final[0])

    threads = [threading.Thread(target=client, args=(c,)) for c in range(streams)]
    steps = engine.iteration
    cpu = time.process_time()
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    end = time.perf_counter()
    cpu = time.process_time() - cpu
    steps = engine.iteration - steps
    tokens = sum(len(g) for g, _ in outputs.values())
    drafted = sum(f.perf["total_draft_tokens"] for _, f in outputs.values())
    accepted = sum(f.perf["total_accepted_draft_tokens"] for _, f in outputs.values())
    return {"wall_s": round(end - start, 3), "cpu_s": round(cpu, 3), "steps": steps, "output_tokens": tokens,
            "tok_s": round(throughput(tokens, start, end), 2), "tok_per_cpu_s": round(throughput(tokens, 0, cpu), 2),
            "draft_tokens": drafted, "accepted_draft_tokens": accepted, "errors": errors,
            "_tokens": {i: g for i, (g, _) in outputs.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests-per-stream", type=int, default=0,
                    help="0: enough for every stream level to run each of the workload's 4 prompts at least once")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--ngram-size", type=int, default=8, help="the engine's lookahead_ngram_size N (N - 1 drafts)")
    ap.add_argument("--max-matching-ngram-size", type=int, default=3)
    ap.add_argument("--max-draft-tokens-per-step", type=int, default=16)
    ap.add_argument("--weight-dtype", default="auto")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "spec_decode.json"))
    args = ap.parse_args()

    bundle = TokenizerBundle.load(args.checkpoint)
    engine = LLMEngine(EngineConfig(args.checkpoint, weight_dtype=args.weight_dtype, decoding_mode="lookahead",
                                    enable_kv_cache_reuse=False, lookahead_ngram_size=args.ngram_size,
                                    max_matching_ngram_size=args.max_matching_ngram_size,
                                    max_draft_tokens_per_step=args.max_draft_tokens_per_step))
    engine.start()
    params = SamplingParams(max_new_tokens=args.new_tokens, end_id=bundle.eos_id, temperature=0.0)
    plain = {"lookahead_window_size": 1, "lookahead_ngram_size": 1, "lookahead_verification_set_size": 0}
    arms = {"plain": plain, "lookahead": {}}
    prompts = {name: [bundle.encode(bundle.render_chat([{"role": "user", "content": text}])) for text in texts]
               for name, texts in WORKLOADS.items()}
    # warm up: compile paths and touch the KV pages once for both arms
    for arm in arms.values():
        run_arm(engine, prompts["edit"], 1, 1, SamplingParams(max_new_tokens=16, temperature=0.0), arm)

    levels = []
    for workload in args.workloads.split(","):
        for streams in [int(s) for s in args.streams.split(",")]:
            runs = {arm: [] for arm in arms}
            same_tokens = True
            for r in range(args.rounds):
                order = list(arms) if r % 2 == 0 else list(reversed(arms))  # alternate who goes first
                got = {}
                for arm in order:
                    per_stream = args.requests_per_stream or -(-len(prompts[workload]) // streams)
                    got[arm] = run_arm(engine, prompts[workload], streams, per_stream, params, arms[arm])
                    print(f"{workload:6s} streams={streams:2d} round {r} {arm:9s} {got[arm]['tok_s']:8.2f} tok/s  "
                          f"drafted {got[arm]['draft_tokens']} accepted {got[arm]['accepted_draft_tokens']}",
                          flush=True)
                same_tokens &= got["plain"].pop("_tokens") == got["lookahead"].pop("_tokens")
                for arm in arms:
                    runs[arm].append(got[arm])
            spec = runs["lookahead"]
            drafted = sum(x["draft_tokens"] for x in spec)
            accepted = sum(x["accepted_draft_tokens"] for x in spec)
            ratios = [s["tok_s"] / p["tok_s"] for s, p in zip(spec, runs["plain"])]
            levels.append({
                "workload": workload, "lookup_friendly": workload in LOOKUP_FRIENDLY, "streams": streams,
                "plain_tok_s_median": statistics.median(x["tok_s"] for x in runs["plain"]),
                "lookahead_tok_s_median": statistics.median(x["tok_s"] for x in spec),
                "speedup_per_round": [round(x, 3) for x in ratios],
                "speedup_median": round(statistics.median(ratios), 3),
                "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
                "draft_tokens": drafted, "accepted_draft_tokens": accepted,
                "same_tokens_both_arms": same_tokens,
                "runs": runs,
            })
            print(f"== {workload} x{streams}: speedup median {levels[-1]['speedup_median']} "
                  f"acceptance {levels[-1]['acceptance_rate']} same tokens {same_tokens}", flush=True)
    engine.shutdown()
    out = write_json(args.out, {
        "what": "prompt-lookup speculative decoding (decoding_mode lookahead) vs plain, one engine, same window",
        "engine": {"describe": engine.describe(), "lookahead_ngram_size": args.ngram_size,
                   "max_matching_ngram_size": args.max_matching_ngram_size,
                   "max_draft_tokens_per_step": args.max_draft_tokens_per_step, "tokens_per_block":
                   engine.config.tokens_per_block, "max_num_tokens": engine.config.max_num_tokens},
        "levels": levels,
    }, args)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
