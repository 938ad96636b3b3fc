"""Load a Hugging Face Llama-family checkpoint folder into float32 numpy arrays, laid out for speed:
q/k/v fused into one matrix and gate/up into another, all kept [out, in] (HF's layout), because
OpenBLAS multiplies `W @ x.T` 20-25% faster than `x @ W.T` for the 2-64 rows of a decode step
(measured on the 2-core machine; see docs/engine.md)."""
from __future__ import annotations

import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cpu_engine.hf_config import LlamaConfig, read_config
from cpu_engine.onnx_graphs import int8_weight_limit
from cpu_engine.quantization import Matrix, cpu_flags, quantize_weight

log = logging.getLogger("cpu_engine")


@dataclass
class LayerWeights:
    attn_norm: np.ndarray  # [H]
    wqkv: Matrix  # [(heads + 2 * kv_heads) * head_dim, H]
    wo: Matrix  # [H, heads * head_dim]
    mlp_norm: np.ndarray  # [H]
    w_gate_up: Matrix  # [2 * I, H]
    w_down: Matrix  # [H, I]

    @property
    def matrices(self) -> tuple[Matrix, ...]:
        return self.wqkv, self.wo, self.w_gate_up, self.w_down


@dataclass
class LlamaWeights:
    config: LlamaConfig
    embed: np.ndarray  # [V, H] float32 (token lookup)
    layers: list[LayerWeights]
    final_norm: np.ndarray  # [H]
    lm_head: Matrix  # [V, H]: the embedding itself when tied (no copy)
    weight_dtype: str = "float32"
    int8_limit: int | None = None  # largest |q| of the int8 weights: 127 (8 bits) or 63 (7 bits)

    @property
    def weight_bits(self) -> int:
        """Bits per weight in the matmuls: 32, 16, or 8 / 7 for int8 (onnx_graphs.int8_weight_limit)."""
        if self.weight_dtype == "int8":
            return int(self.int8_limit).bit_length() + 1
        return 16 if self.weight_dtype == "bfloat16" else 32

    @property
    def precision(self) -> str:
        """The matmuls' precision in words, for the log."""
        if self.weight_dtype != "int8":
            return f"weight_dtype {self.weight_dtype}"
        why = "" if self.int8_limit == 127 else \
            ": this CPU's integer GEMM adds u8 x s8 pairs in saturating int16, exact only below 64 (self-check)"
        return f"weight_dtype int8 ({self.weight_bits}-bit weights{why})"


def cpu_has_bf16() -> bool:
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


WEIGHT_DTYPES = ("auto", "float32", "bfloat16", "int8")


def resolve_weight_dtype(requested: str, matmul_backend: str = "onnxruntime") -> str:
    """`auto`: bfloat16 matmuls (torch/oneDNN) where the CPU has native bf16 dot products (2.3-2.9x faster
    GEMMs for 4-16 rows on the AVX512-BF16 machine); else int8 matmuls where onnxruntime runs them
    (MLAS integer GEMMs: 2-2.7x faster than float32 for 1-512 rows on the 2-core EPYC; docs/engine.md,
    Precision, for what it costs in accuracy); else float32. int8, asked for or chosen, becomes float32
    where this CPU's integer GEMMs fail the self-check even with 7-bit weights
    (onnx_graphs.int8_weight_limit): slower, never wrong sums."""
    if requested not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {requested!r}")
    if requested == "auto":
        if cpu_has_bf16() and importlib.util.find_spec("torch") is not None:
            return "bfloat16"
        requested = "int8" if matmul_backend == "onnxruntime" else "float32"
    if requested == "int8" and int8_weight_limit() is None:
        log.warning("weight_dtype int8 refused by the self-check (no exact integer GEMM on this CPU): float32")
        return "float32"
    return requested


def _to_bf16(w: np.ndarray):
    import torch

    return torch.from_numpy(w).to(torch.bfloat16).contiguous()


SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Tensors of one .safetensors file as read-only numpy views of a memory map. Parsed here rather than
    with `safetensors`' numpy API, which cannot represent bfloat16 (most HF checkpoints): BF16 comes back
    as its raw uint16 bits and `_f32` widens it."""
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    header_len = int(raw[:8].view("<u8")[0])
    header = json.loads(bytes(raw[8:8 + header_len]))
    base = 8 + header_len
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(meta["dtype"])
        if dtype is None:
            raise ValueError(f"{path.name}: tensor {name} has unsupported dtype {meta['dtype']}")
        start, end = meta["data_offsets"]
        out[name] = raw[base + start: base + end].view(dtype).reshape(meta["shape"])
    return out


def _read_tensors(folder: Path) -> dict[str, np.ndarray]:
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
        else sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    out = {}
    for name in files:
        out.update(_read_safetensors(folder / name))
    return out


def _f32(a: np.ndarray) -> np.ndarray:
    if a.dtype == np.uint16:  # bfloat16 bits: the high half of a float32
        a = (a.astype(np.uint32) << 16).view(np.float32)
    return np.array(a, dtype=np.float32, order="C")  # always a private copy (the source is a memory map)


def load_checkpoint(folder: str | Path, weight_dtype: str = "float32", int8_limit: int | None = None) -> LlamaWeights:
    folder = Path(folder)
    weight_dtype = resolve_weight_dtype(weight_dtype)
    cfg = LlamaConfig.from_hf(read_config(folder))
    t = _read_tensors(folder)
    get = lambda k: _f32(t.pop(k))  # noqa: E731  (pop: free each source array once converted)
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        q, k, v = get(p + "self_attn.q_proj.weight"), get(p + "self_attn.k_proj.weight"), get(p + "self_attn.v_proj.weight")
        gate, up = get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")
        layers.append(LayerWeights(
            attn_norm=get(p + "input_layernorm.weight"),
            wqkv=Matrix(np.concatenate([q, k, v], axis=0)),
            wo=Matrix(get(p + "self_attn.o_proj.weight")),
            mlp_norm=get(p + "post_attention_layernorm.weight"),
            w_gate_up=Matrix(np.concatenate([gate, up], axis=0)),
            w_down=Matrix(get(p + "mlp.down_proj.weight")),
        ))
    embed = get("model.embed_tokens.weight")
    untied = "lm_head.weight" in t and not cfg.tie_word_embeddings
    lm_head = Matrix(get("lm_head.weight") if untied else embed)
    matrices = [lm_head] + [m for layer in layers for m in layer.matrices]  # norms and the lookup stay float32
    if weight_dtype == "bfloat16":
        for m in matrices:
            m.bf16 = _to_bf16(m.f32)
    if weight_dtype == "int8":
        int8_limit = int8_limit or int8_weight_limit()
        for m in matrices:
            m.q, m.scale = quantize_weight(m.f32, int8_limit)
    else:
        int8_limit = None
    return LlamaWeights(cfg, embed, layers, get("model.norm.weight"), lm_head, weight_dtype, int8_limit)
