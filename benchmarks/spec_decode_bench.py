"""Speculative decoding (prompt lookup, `decoding_mode lookahead`, or a draft model,
`draft_tokens_external`) against plain decoding, in-process.

    python benchmarks/spec_decode_bench.py [--streams 1,16] [--rounds 3] [--out benchmarks/results/spec_decode.json]
    python benchmarks/spec_decode_bench.py --decoding-mode draft_tokens_external --weight-dtype float32 \
        --draft-weight-dtype int8 [--draft-model-dir DIR]

One engine with `decoding_mode lookahead` or `draft_tokens_external` (prefix reuse off: every request prefills its whole prompt the
same way, as int8 prefill numerics depend on where a prefill starts) serves both arms: plain requests ask for (w, n, g) = (1, 1, 0),
speculating ones for the engine's (W, N, G), so both run in the same process and the same minutes (the
host is shared: ratios taken in one window are what this reports). Workloads, chat-templated for
SmolLM2-135M-Instruct, greedy, up to --new-tokens tokens (the end token ends a request earlier; greedy
output is the same in both arms, so both do the same work):
- `edit`: return a given paragraph with its typos fixed (the answer copies the text: lookup-friendly);
- `code`: return a given Python function with a docstring added (copies the code: lookup-friendly);
- `prose`: open-ended stories (little to look up).
At 1 stream each prompt runs once per arm, back to back (the arm that goes first alternates), and the
pair's ratio is one sample; at 16 streams each arm runs the level's requests at once (16 client threads,
the workload's 4 prompts 4 times), back to back, once per round. Reported per level: the median, min and
max of the per-pair speedups (speculative tok/s over plain tok/s, end to end: prefill included), the
speedup of the summed tokens over the summed time, the acceptance rate (accepted / verified draft
tokens), output tokens per engine step of each arm, the 1-minute load average at each run, and whether
both arms produced the same tokens (at 1 stream they must; at 16 int8 prefill chunks fall where the
concurrent requests put them, which changes int8 numerics in either arm alike).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import run_clients, write_json  # noqa: E402
from text.tokenization import TokenizerBundle  # noqa: E402
from build.render import DEFAULT_CHECKPOINT  # noqa: E402
from cpu_engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from contracts.measures import throughput  # noqa: E402

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

    steps = engine.iteration
    cpu = time.process_time()
    start, end = run_clients(client, streams)
    cpu = time.process_time() - cpu
    steps = engine.iteration - steps
    tokens = sum(len(g) for g, _ in outputs.values())
    drafted = sum(f.perf["total_draft_tokens"] for _, f in outputs.values())
    accepted = sum(f.perf["total_accepted_draft_tokens"] for _, f in outputs.values())
    return {"wall_s": round(end - start, 3), "cpu_s": round(cpu, 3), "steps": steps, "output_tokens": tokens,
            "tok_s": round(throughput(tokens, start, end), 2), "tok_per_cpu_s": round(throughput(tokens, 0, cpu), 2),
            "draft_tokens": drafted, "accepted_draft_tokens": accepted, "errors": errors,
            "_tokens": {i: g for i, (g, _) in outputs.items()}}


def summarize(workload: str, streams: int, pairs: list[dict]) -> dict:
    """One level's figures from its back-to-back pairs: the median of the per-pair speedups (each pair saw
    the same minute of the shared host), the speedup of the summed tokens over the summed time, the
    acceptance rate and the output tokens per engine step of each arm."""
    total = {arm: {k: sum(p[arm][k] for p in pairs) for k in ("output_tokens", "wall_s", "steps", "draft_tokens",
                                                               "accepted_draft_tokens")} for arm in ("plain", "lookahead")}
    ratios = [p["lookahead"]["tok_s"] / p["plain"]["tok_s"] for p in pairs]
    spec = total["lookahead"]
    return {
        "workload": workload, "lookup_friendly": workload in LOOKUP_FRIENDLY, "streams": streams,
        "pairs": len(pairs),
        "plain_tok_s_median": statistics.median(p["plain"]["tok_s"] for p in pairs),
        "lookahead_tok_s_median": statistics.median(p["lookahead"]["tok_s"] for p in pairs),
        "speedup_median": round(statistics.median(ratios), 3),
        "speedup_min": round(min(ratios), 3), "speedup_max": round(max(ratios), 3),
        "speedup_total": round((spec["output_tokens"] / spec["wall_s"])
                               / (total["plain"]["output_tokens"] / total["plain"]["wall_s"]), 3),
        "acceptance_rate": round(spec["accepted_draft_tokens"] / spec["draft_tokens"], 3) if spec["draft_tokens"] else 0.0,
        "draft_tokens": spec["draft_tokens"], "accepted_draft_tokens": spec["accepted_draft_tokens"],
        "tokens_per_step": {arm: round(t["output_tokens"] / t["steps"], 3) for arm, t in total.items()},
        "same_tokens_all_pairs": all(p["same_tokens"] for p in pairs),
        "runs": pairs,
    }


ARMS = ("plain", "lookahead")


def measure(workloads: dict[str, list], stream_levels: list[int], rounds: int, run, requests_per_stream: int = 0,
            label: str = "lookahead") -> list[dict]:
    """Every workload at every stream level: pairs of the two ARMS back to back (so both see the same load on
    the shared host; who goes first alternates), summarized per level. `run(arm, batch, streams, per_stream)`
    runs one arm and returns its figures with the produced tokens under "_tokens". At 1 stream each item is a
    pair of its own; at more, each arm runs all items at once, `requests_per_stream` each (0: enough for
    every item to run at least once)."""
    levels = []
    for workload, items in workloads.items():
        for streams in stream_levels:
            pairs = []
            for r in range(rounds):
                if streams == 1:
                    batches = [([item], 1) for item in items]
                else:
                    batches = [(items, requests_per_stream or -(-len(items) // streams))]
                for i, (batch, per_stream) in enumerate(batches):
                    got = {}
                    for arm in ARMS if (r + i) % 2 == 0 else ARMS[::-1]:
                        got[arm] = run(arm, batch, streams, per_stream)
                        got[arm]["loadavg_1m"] = round(os.getloadavg()[0], 2)
                    got["same_tokens"] = got["plain"].pop("_tokens") == got["lookahead"].pop("_tokens")
                    pairs.append(got)
                    print(f"{workload:6s} streams={streams:2d} round {r} #{i}: plain {got['plain']['tok_s']:7.2f} "
                          f"{label} {got['lookahead']['tok_s']:7.2f} tok/s  accepted "
                          f"{got['lookahead']['accepted_draft_tokens']}/{got['lookahead']['draft_tokens']}  "
                          f"load {got['lookahead']['loadavg_1m']}", flush=True)
            levels.append(summarize(workload, streams, pairs))
            lv = levels[-1]
            print(f"== {workload} x{streams}: speedup median {lv['speedup_median']} (total {lv['speedup_total']}) "
                  f"acceptance {lv['acceptance_rate']} tokens/step {lv['tokens_per_step']} "
                  f"same tokens {lv['same_tokens_all_pairs']}", flush=True)
    return levels


def table(results: dict) -> str:
    """The results file's levels as the markdown table docs/benchmarks.md quotes (tests/docs/test_figures.py)."""
    arm = results["engine"].get("speculating", "lookahead")  # the speculating arm's name in the header
    rows = [f"| workload | streams | plain tok/s | {arm} tok/s | speedup, median of pairs (min-max) | "
            f"speedup, total | acceptance | tokens/step plain, {arm} | same tokens |",
            "|---|---|---|---|---|---|---|---|---|"]
    for lv in results["levels"]:
        steps = lv["tokens_per_step"]
        rows.append(f"| {lv['workload']} | {lv['streams']} | {lv['plain_tok_s_median']:.1f} | "
                    f"{lv['lookahead_tok_s_median']:.1f} | {lv['speedup_median']:.2f}x ({lv['speedup_min']:.2f}-"
                    f"{lv['speedup_max']:.2f}) | {lv['speedup_total']:.2f}x | {lv['acceptance_rate']:.2f} | "
                    f"{steps['plain']:.2f}, {steps['lookahead']:.2f} | {'yes' if lv['same_tokens_all_pairs'] else 'no'} |")
    loads = [p[arm]["loadavg_1m"] for lv in results["levels"] for p in lv["runs"] for arm in ("plain", "lookahead")]
    return "\n".join(rows) + (f"\n\n{results['date']}, {results['machine']['cpu']} ({results['machine']['cores']} cores, "
                              f"{', '.join(results['machine']['cpu_flags'])}); 1-minute load average during the runs "
                              f"{min(loads):.1f}-{max(loads):.1f}; engine: {results['engine']['describe']}, "
                              f"num_threads {results['engine'].get('num_threads') or 'all'}.\n")


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
    ap.add_argument("--decoding-mode", default="lookahead", choices=("lookahead", "draft_tokens_external"),
                    help="where drafts come from: prompt lookup, or a draft model (the `lookahead` arm of the "
                         "results is the speculating one either way)")
    ap.add_argument("--draft-model-dir", default="", help="draft_tokens_external: the draft checkpoint (default: "
                                                         "the engine's own, at --draft-weight-dtype)")
    ap.add_argument("--draft-weight-dtype", default="int8")
    ap.add_argument("--draft-model-max-batch-size", type=int, default=1,
                    help="the engine's draft_model_max_batch_size (0: the draft model drafts at any batch)")
    ap.add_argument("--num-threads", type=int, default=None,
                    help="the engine's num_threads (default: all cores); 1 keeps a step's cost its own compute on a "
                         "busy shared host, where every thread hand-off waits for a time slice")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "spec_decode.json"))
    args = ap.parse_args()

    bundle = TokenizerBundle.load(args.checkpoint)
    engine = LLMEngine(EngineConfig(args.checkpoint, weight_dtype=args.weight_dtype, decoding_mode=args.decoding_mode,
                                    draft_model_dir=args.draft_model_dir, draft_weight_dtype=args.draft_weight_dtype,
                                    draft_model_max_batch_size=args.draft_model_max_batch_size,
                                    enable_kv_cache_reuse=False, lookahead_ngram_size=args.ngram_size,
                                    max_matching_ngram_size=args.max_matching_ngram_size,
                                    max_draft_tokens_per_step=args.max_draft_tokens_per_step,
                                    num_threads=args.num_threads))
    engine.start()
    params = SamplingParams(max_new_tokens=args.new_tokens, end_id=bundle.eos_id, temperature=0.0)
    plain = {"lookahead_window_size": 1, "lookahead_ngram_size": 1, "lookahead_verification_set_size": 0}
    arms = {"plain": plain, "lookahead": {}}
    prompts = {name: [bundle.encode(bundle.render_chat([{"role": "user", "content": text}])) for text in texts]
               for name, texts in WORKLOADS.items()}
    # warm up: compile paths and touch the KV pages once for both arms
    for arm in arms.values():
        run_arm(engine, prompts["edit"], 1, 1, SamplingParams(max_new_tokens=16, temperature=0.0), arm)

    levels = measure({w: prompts[w] for w in args.workloads.split(",")},
                     [int(s) for s in args.streams.split(",")], args.rounds,
                     lambda arm, batch, streams, per_stream: run_arm(engine, batch, streams, per_stream, params,
                                                                     arms[arm]),
                     args.requests_per_stream, label="draft" if args.decoding_mode != "lookahead" else "lookahead")
    engine.shutdown()
    what = {"lookahead": "prompt-lookup speculative decoding (decoding_mode lookahead)",
            "draft_tokens_external": "draft-model speculative decoding (decoding_mode draft_tokens_external; the "
                                     "`lookahead` arm is the drafted one)"}[args.decoding_mode]
    write_results(args, {
        "what": f"{what} vs plain, one engine, same window",
        "engine": {"describe": engine.describe(), "decoding_mode": args.decoding_mode,
                   "speculating": "draft model" if args.decoding_mode != "lookahead" else "lookahead",
                   "draft_model_max_batch_size": args.draft_model_max_batch_size,
                   "lookahead_ngram_size": args.ngram_size,
                   "max_matching_ngram_size": args.max_matching_ngram_size,
                   "max_draft_tokens_per_step": args.max_draft_tokens_per_step, "num_threads": args.num_threads,
                   "tokens_per_block":
                   engine.config.tokens_per_block, "max_num_tokens": engine.config.max_num_tokens},
        "levels": levels,
    })


def write_results(args, results: dict) -> None:
    """The results file (with the host and the command, benchmarks/report.py) and its table beside it."""
    out = write_json(args.out, results, args)
    md = out.with_suffix(".md")
    md.write_text(table(json.loads(out.read_text())))
    print(f"wrote {out} and {md}")


if __name__ == "__main__":
    main()
