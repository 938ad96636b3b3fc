"""What int8 matmuls cost in accuracy: next-token distributions of `weight_dtype` int8 against float32.

    python benchmarks/precision_bench.py [--checkpoint .cache/models/SmolLM2-135M-Instruct] [--tokens 60] [--int8-limit 63] [--out results.json]

For each prompt, float32 continues greedily for --tokens tokens; both precisions then score that same
text (teacher forcing, `LlamaModel.forward_reference`), and the script reports, per prompt, the share of
positions where their top-1 tokens agree, the mean and max KL(float32 || int8) in nats, and after how
many tokens int8's own greedy continuation parts from float32's (docs/engine.md, Precision).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import write_json  # noqa: E402
from build.render import DEFAULT_CHECKPOINT  # noqa: E402
from cpu_engine.checkpoint import load_checkpoint  # noqa: E402
from cpu_engine.llama import LlamaModel  # noqa: E402

PROMPTS = {
    "chat": "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "poem": "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "explain": "<|im_start|>user\nExplain photosynthesis to a child.<|im_end|>\n<|im_start|>assistant\n",
    "prose": "The history of the city is long and full of surprises: merchants, artists and engineers came "
             "from every corner",
    "code": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
}


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits - logits.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def greedy(model: LlamaModel, ids: list[int], n: int) -> list[int]:
    ids = list(ids)
    for _ in range(n):
        ids.append(int(np.argmax(model.forward_reference(ids)[-1])))
    return ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--tokens", type=int, default=60, help="greedy tokens scored per prompt")
    ap.add_argument("--int8-limit", type=int, choices=(127, 63),
                    help="largest |int8 weight|: 63 measures the 7-bit weights of CPUs without VNNI on any host "
                         "(default: what this host's self-check picks, onnx_graphs.int8_weight_limit)")
    ap.add_argument("--out", help="also write the table as JSON here (benchmarks/results/...)")
    args = ap.parse_args()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(args.checkpoint) / "tokenizer.json"))
    weights = {dtype: load_checkpoint(args.checkpoint, dtype, args.int8_limit) for dtype in ("float32", "int8")}
    bits = weights["int8"].weight_bits
    print(f"int8 with {bits}-bit weights")
    models = {dtype: LlamaModel(w, 4096, "onnxruntime", "numba") for dtype, w in weights.items()}
    print(f"{'prompt':10s} {'top-1 agree':>12s} {'KL mean':>9s} {'KL max':>8s} {'greedy same for':>16s}")
    rows = {}
    for name, text in PROMPTS.items():
        prompt = tok.encode(text).ids
        want = greedy(models["float32"], prompt, args.tokens)
        a, b = (models[d].forward_reference(want)[len(prompt) - 1:-1] for d in ("float32", "int8"))
        la, lb = log_softmax(a), log_softmax(b)
        kl = (np.exp(la) * (la - lb)).sum(axis=1)
        got = greedy(models["int8"], prompt, args.tokens)[len(prompt):]
        same = next((i for i, (x, y) in enumerate(zip(want[len(prompt):], got)) if x != y), args.tokens)
        agree = float((a.argmax(1) == b.argmax(1)).mean())
        rows[name] = {"top1_agree": round(agree, 3), "kl_mean_nats": round(float(kl.mean()), 4),
                      "kl_max_nats": round(float(kl.max()), 3), "greedy_same_tokens": same}
        print(f"{name:10s} {agree:12.3f} {kl.mean():9.4f} {kl.max():8.3f} {same:>10d} / {args.tokens}")
    if args.out:
        write_json(args.out, {"compared": "int8 against float32 (weight_dtype)", "int8_weight_bits": bits, "prompts": rows}, args)


if __name__ == "__main__":
    main()
