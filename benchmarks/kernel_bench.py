"""The CPU engine's compiled pieces against their numpy versions, in one process (docs/engine.md, Kernels).

    python benchmarks/kernel_bench.py [--checkpoint .cache/models/SmolLM2-135M-Instruct] [--out results.json]

Times `LlamaModel` with both backends on the same weights, and the compiled one with int8 layer matmuls
(`weight_dtype` int8): the layers' work around attention (1, 4, 16 and 512 rows), the LM head, decode
attention and RoPE + cache write for one layer, and a whole 16-stream decode step. Milliseconds per
call, best-effort on a shared VM: compare columns of one run.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import write_json  # noqa: E402
from build.render import DEFAULT_CHECKPOINT  # noqa: E402
from cpu_engine.checkpoint import load_checkpoint  # noqa: E402
from cpu_engine.llama import KVCache, LlamaModel, StepBatch  # noqa: E402


def per_call_ms(fn, calls: int) -> float:
    fn()
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--context", type=int, default=128, help="positions each decode attends to")
    ap.add_argument("--out", help="also write the table as JSON here (benchmarks/results/...)")
    args = ap.parse_args()
    weights = load_checkpoint(args.checkpoint, "float32")
    c = weights.config
    int8_weights = load_checkpoint(args.checkpoint, "int8")
    models = {"numpy": LlamaModel(weights, c.max_position_embeddings),
              "compiled": LlamaModel(weights, c.max_position_embeddings, "onnxruntime", "numba"),
              "int8": LlamaModel(int8_weights, c.max_position_embeddings, "onnxruntime", "numba")}
    rng = np.random.default_rng(0)
    q_dim = c.num_heads * c.head_dim

    def layers(model, rows):
        x = weights.embed[rng.integers(0, c.vocab_size, rows)]
        attn = rng.standard_normal((rows, q_dim), dtype=np.float32) * 0.1

        def run():
            h, _ = model._start(x)
            for i in range(c.num_layers):
                h, _ = model._finish_layer(i, h, attn)
        return run

    B, ctx = 16, args.context
    kv = KVCache(c.num_layers, B * (ctx + 1), c.num_kv_heads, c.head_dim)
    kv.k[:] = rng.standard_normal(kv.k.shape, dtype=np.float32) * 0.3
    kv.v[:] = rng.standard_normal(kv.v.shape, dtype=np.float32) * 0.3
    slots = np.arange(B * (ctx + 1), dtype=np.int64).reshape(B, ctx + 1)
    lens = np.full(B, ctx + 1)
    pad_bias = np.zeros((B, 1, 1, ctx + 1), np.float32)
    q = rng.standard_normal((B, c.num_heads, c.head_dim), dtype=np.float32)
    qkv = rng.standard_normal((B, q_dim + 2 * c.num_kv_heads * c.head_dim), dtype=np.float32)
    x = rng.standard_normal((B, c.hidden_size), dtype=np.float32)
    step = StepBatch(tokens=rng.integers(0, c.vocab_size, B), positions=np.full(B, ctx), write_slots=slots[:, ctx].copy(),
                     decode_rows=np.arange(B), decode_slots=slots, decode_lens=lens, sample_rows=np.arange(B))
    cases = {
        "layers around attention, 512 rows": lambda m: (layers(m, 512), 2),
        "layers around attention, 16 rows": lambda m: (layers(m, 16), 10),
        "layers around attention, 4 rows": lambda m: (layers(m, 4), 10),
        "layers around attention, 1 row": lambda m: (layers(m, 1), 10),
        "LM head, 16 rows": lambda m: (lambda: m.logits(x), 10),
        f"decode attention, 16 x {ctx + 1}, one layer": lambda m: (
            lambda: m._decode_attention(q, kv.k[0], kv.v[0], slots, None if m.numba_kernels else pad_bias, lens), 100),
        "RoPE + cache write, 16 rows, one layer": lambda m: (
            lambda: m._rope_store(qkv, step.positions, kv.k[0], kv.v[0], step.write_slots), 100),
        f"decode step, 16 x {ctx + 1}": lambda m: (lambda: m.forward(step, kv), 5),
    }
    print(f"{'ms per call':45s}" + "".join(f"{name:>10s}" for name in models))
    table = {}
    for name, case in cases.items():
        times = [per_call_ms(*case(model)) for model in models.values()]
        table[name] = {m: round(t, 4) for m, t in zip(models, times)}
        print(f"{name:45s}" + "".join(f"{t:10.3f}" for t in times))
    if args.out:
        write_json(args.out, {"unit": "ms per call", "cases": table}, args)


if __name__ == "__main__":
    main()
