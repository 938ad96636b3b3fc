"""KV-cache sizing for a TensorRT-LLM deployment (pure Python; `docs/sizing.md` works examples).

    python -m clients.sizing --config path/to/config.json --gpu-mem-gb 85.5 --weights fp8 --kv fp8 \
        --seq-len 4096 --batch 64 [--tp 1] [--fraction 0.9] [--tokens-per-block 32]

KV bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element (per GPU: the KV
heads are split over tensor-parallel ranks). The cache gets `kv_cache_free_gpu_mem_fraction` of the
memory left after the weights (and an activation reserve), in blocks of `tokens_per_block` tokens; a
sequence of L tokens holds ceil(L / tokens_per_block) blocks.

Weights: FP8 quantization (ModelOpt, `--qformat fp8`) quantizes the transformer layers' linear weights;
the token embedding and the LM head keep the checkpoint's 16-bit dtype unless `--quantize_lm_head` is
given (build/upstream facts, quantization). With tensor parallelism the layers and the LM head are
split across ranks; the embedding is counted whole on every rank (the conservative case). GB = 1e9
bytes: an "80 GB" H100 has 85.5e9 (81,559 MiB).
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cpu_engine.hf_config import LlamaConfig, read_config  # noqa: E402
from cpu_engine.hf_config import kv_bytes_per_token as hf_kv_bytes_per_token  # noqa: E402

BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1, "int4": 0.5}
GB = 1e9


@dataclass
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    params: float  # parameter count
    layer_params: float = 0.0  # the transformer layers (what FP8 quantizes), norms included
    embed_params: float = 0.0  # token embedding
    lm_head_params: float = 0.0  # 0 when tied to the embedding

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelShape":
        c = LlamaConfig.from_hf(cfg)
        h, heads, kv, hd = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        layers, inter, vocab = c.num_layers, c.intermediate_size, c.vocab_size
        per_layer = h * (heads * hd) + 2 * h * (kv * hd) + (heads * hd) * h + 3 * h * inter + 2 * h
        embed = vocab * h
        lm_head = 0 if c.tie_word_embeddings else vocab * h
        layer_params = layers * per_layer + h  # + the final norm
        return cls(layers, h, heads, kv, hd, layer_params + embed + lm_head, layer_params, embed, lm_head)

    def weight_bytes(self, weights: str, tp: int = 1, quantize_lm_head: bool = False) -> float:
        """Bytes of weights on one GPU. With FP8/INT8/INT4 weights only the layers are quantized: the
        embedding and the LM head stay 16-bit (unless quantize_lm_head)."""
        quantized = weights in ("fp8", "int8", "int4")
        layer = self.layer_params * BYTES[weights] / tp
        embed = self.embed_params * (2 if quantized else BYTES[weights])  # whole on every rank
        head_dtype = weights if (not quantized or quantize_lm_head) else "bf16"
        head = self.lm_head_params * BYTES[head_dtype] / tp
        return layer + embed + head


@dataclass
class Plan:
    kv_bytes_per_token: int
    weights_gb: float
    kv_cache_gb: float
    tokens: int
    blocks: int
    blocks_per_sequence: int
    max_sequences: int
    fits: bool

    def describe(self, seq_len: int, batch: int) -> str:
        verdict = "fits" if self.fits else f"does NOT fit: only {self.max_sequences} sequences of {seq_len} tokens"
        return (f"weights {self.weights_gb:.1f} GB, KV cache {self.kv_cache_gb:.1f} GB = {self.tokens:,} tokens "
                f"({self.blocks:,} blocks, {self.kv_bytes_per_token:,} B/token); {batch} x {seq_len} tokens: {verdict}")


def kv_bytes_per_token(shape: ModelShape, kv_dtype: str, tp: int = 1) -> int:
    """Per GPU: each tensor-parallel rank holds ceil(kv_heads / tp) KV heads (at least one)."""
    return hf_kv_bytes_per_token(shape.layers, shape.kv_heads, shape.head_dim, BYTES[kv_dtype], tp)


def plan(shape: ModelShape, gpu_mem_gb: float, weights: str, kv: str, seq_len: int, batch: int,
         fraction: float = 0.9, tokens_per_block: int = 32, reserve_gb: float = 2.0, tp: int = 1,
         quantize_lm_head: bool = False) -> Plan:
    """One GPU's plan (with tp > 1: each rank's share of weights and KV heads)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"kv_cache_free_gpu_mem_fraction must be in (0, 1], got {fraction}")
    weights_gb = shape.weight_bytes(weights, tp, quantize_lm_head) / GB
    free_gb = gpu_mem_gb - weights_gb - reserve_gb  # activations, CUDA context, workspace
    per_token = kv_bytes_per_token(shape, kv, tp)
    kv_gb = max(0.0, free_gb * fraction)
    tokens = int(kv_gb * GB // per_token)
    blocks = tokens // tokens_per_block
    per_seq = math.ceil(seq_len / tokens_per_block)
    max_seqs = blocks // per_seq
    return Plan(per_token, weights_gb, kv_gb, tokens, blocks, per_seq, max_seqs, max_seqs >= batch)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="HF config.json (or a checkpoint folder)")
    p.add_argument("--gpu-mem-gb", type=float, default=85.5, help="GPU memory in 1e9 bytes (H100 80GB: 85.5)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (the plan is per GPU)")
    p.add_argument("--weights", choices=BYTES, default="fp8")
    p.add_argument("--kv", choices=BYTES, default="fp8")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--fraction", type=float, default=0.9)
    p.add_argument("--tokens-per-block", type=int, default=32)
    args = p.parse_args(argv)
    cfg = read_config(args.config)
    result = plan(ModelShape.from_hf_config(cfg), args.gpu_mem_gb, args.weights, args.kv, args.seq_len, args.batch,
                  args.fraction, args.tokens_per_block, tp=args.tp)
    print(result.describe(args.seq_len, args.batch))
    if not result.fits:
        print("warning: the configured batch cannot fit; lower max_batch_size or max_seq_len, or use FP8 KV",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
