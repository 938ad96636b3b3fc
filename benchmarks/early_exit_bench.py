"""Would the model's own first layers make a draft model? Top-1 agreement of an early exit with the full model.

    python benchmarks/early_exit_bench.py [--layers 6,10,15,20,25] [--out benchmarks/results/early-exit.json]

The cheapest draft model for speculative decoding on this engine would be SmolLM2 itself cut after its
first L of 30 layers (the final norm and LM head on layer L's output): no second set of weights, and its
K/V for layers < L are the target's own, so it needs no cache of its own. A draft token is accepted when
it is what the full model picks, so the measure here is teacher-forced: for each prompt of
benchmarks/spec_decode_bench.py's workloads, the greedy answer (up to --new-tokens tokens), then at every
answer position whether the exit after L layers has the same argmax as the full model. A draft of one
token costs about L/30 of a step plus an LM head, so an exit pays only where agreement is well above L/30.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import write_json  # noqa: E402
from benchmarks.spec_decode_bench import WORKLOADS  # noqa: E402
from text.tokenization import TokenizerBundle  # noqa: E402
from build.render import DEFAULT_CHECKPOINT  # noqa: E402
from cpu_engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402


def exits(model, ids: list[int], layers: list[int]) -> dict[int, np.ndarray]:
    """Hidden states after each layer count in `layers` (and after all), for every position of `ids`."""
    pos = np.arange(len(ids))
    x, qkv = model._start(model.w.embed[np.asarray(ids)])
    out = {}
    for li in range(model.c.num_layers):
        q, k, v = model._split_rope(qkv, pos)
        x, qkv = model._finish_layer(li, x, model._attend(q, k, v, pos))
        if li + 1 in layers or li + 1 == model.c.num_layers:
            out[li + 1] = x
    return out


def table(results: dict) -> str:
    layers = results["layers"]
    rows = ["| workload | " + " | ".join(f"exit after {n} of {results['num_layers']} layers" for n in layers) + " |",
            "|---|" + "---|" * len(layers)]
    for name, w in results["workloads"].items():
        rows.append(f"| {name} | " + " | ".join(f"{w['agreement'][str(n)]:.3f}" for n in layers) + " |")
    return "\n".join(rows) + f"\n\n{results['date']}, {results['positions']} answer positions, {results['engine']}.\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--layers", default="6,10,15,20,25")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "early-exit.json"))
    args = ap.parse_args()
    layers = [int(v) for v in args.layers.split(",")]
    bundle = TokenizerBundle.load(args.checkpoint)
    engine = LLMEngine(EngineConfig(args.checkpoint, enable_kv_cache_reuse=False))
    model = engine.model
    workloads, positions = {}, 0
    for name, texts in WORKLOADS.items():
        same = {n: 0 for n in layers}
        count = 0
        for text in texts:
            prompt = bundle.encode(bundle.render_chat([{"role": "user", "content": text}]))
            answer = engine.generate(prompt, SamplingParams(args.new_tokens, end_id=bundle.eos_id,
                                                             temperature=0.0)).new_token_ids
            ids = prompt + answer
            hidden = exits(model, ids, layers)
            rows = slice(len(prompt) - 1, len(ids) - 1)  # the positions whose next token is an answer token
            full = np.argmax(model.logits(hidden[model.c.num_layers][rows]), axis=1)
            for n in layers:
                same[n] += int((np.argmax(model.logits(hidden[n][rows]), axis=1) == full).sum())
            count += len(full)
        workloads[name] = {"positions": count, "agreement": {str(n): round(same[n] / count, 4) for n in layers}}
        positions += count
        print(name, workloads[name], flush=True)
    out = write_json(args.out, {"what": "top-1 agreement of an early exit with the full model (teacher-forced)",
                                "engine": engine.describe(), "num_layers": model.c.num_layers, "layers": layers,
                                "positions": positions, "workloads": workloads}, args)
    md = out.with_suffix(".md")
    md.write_text(table(json.loads(out.read_text())))
    print(f"wrote {out} and {md}")


if __name__ == "__main__":
    main()
