"""Llama-family model math in numpy: RMSNorm, RoPE (rotate_half), grouped-query attention, SwiGLU.

`forward` runs one engine step: a ragged batch that packs decode tokens and prefill chunks of many
sequences, reading and writing the paged KV cache through slot indices (block id * block size +
offset). `forward_reference` is the plain one-sequence forward with no cache, the tests' ground truth.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from cpu_engine import kernels, onnx_graphs
from cpu_engine.checkpoint import LlamaWeights
from cpu_engine.quantization import Matrix
from cpu_engine.quantization import linear_int8


@dataclass
class PrefillSegment:
    rows: slice  # this chunk's rows in the packed batch
    start_pos: int  # position of the chunk's first token
    ctx_slots: np.ndarray  # KV slots of positions [0, start_pos + chunk length)


@dataclass
class StepBatch:
    tokens: np.ndarray  # [N] token ids, decode rows first
    positions: np.ndarray  # [N]
    write_slots: np.ndarray  # [N] where each row's K/V go
    decode_rows: np.ndarray | None = None  # rows that are single-token decodes
    decode_slots: np.ndarray | None = None  # [B, Lmax] context slots, padded
    decode_lens: np.ndarray | None = None  # [B] context lengths (including the new token)
    prefills: list[PrefillSegment] = field(default_factory=list)
    sample_rows: np.ndarray | None = None  # rows whose logits are needed
    lora: object | None = None  # lora.StepLora: the adapters of this step's rows (None: base model only)


class KVCache:
    """K and V for every layer: [layers, slots, kv_heads, head_dim] float32 (pages touched lazily)."""

    def __init__(self, num_layers: int, num_slots: int, kv_heads: int, head_dim: int):
        self.k = np.zeros((num_layers, num_slots, kv_heads, head_dim), dtype=np.float32)
        self.v = np.zeros_like(self.k)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    var = np.einsum("ij,ij->i", x, x)[:, None] / x.shape[1]
    return x * (1.0 / np.sqrt(var + eps)) * w


BF16_MIN_ROWS = 3  # below this, float32 numpy is faster (see checkpoint.Matrix)


def linear(x: np.ndarray, w: Matrix, wide: bool = False, packed=None) -> np.ndarray:
    """x [N, in] times w [out, in] -> [N, out] float32. bf16 (oneDNN, fp32 accumulation) when the matrix
    has a bf16 copy and the step is big enough; else `packed` (onnx_graphs.PackedLinear: MLAS with the
    weight packed once, float32 or int8) when the model has one for this matrix; else numpy: int8
    (`quantization.linear_int8`) where the matrix has its int8 form, or float32 OpenBLAS, where `W @ x.T`
    is the faster order for few rows, except for the wide LM head (`x @ W.T`); measured, see
    checkpoint.py and onnx_graphs.py."""
    if w.bf16 is not None and x.shape[0] >= BF16_MIN_ROWS:
        import torch

        xb = torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16)
        return torch.nn.functional.linear(xb, w.bf16).float().numpy()
    if packed is not None:
        return packed(x)
    if w.q is not None:
        return linear_int8(x, w.q, w.scale)
    return x @ w.f32.T if wide else (w.f32 @ x.T).T


def _split_widths(c, modules: tuple[str, ...]) -> list[int]:
    """Output widths of the modules a stacked matrix holds (q/k/v, gate/up, or one)."""
    width = {"q": c.num_heads * c.head_dim, "k": c.num_kv_heads * c.head_dim, "v": c.num_kv_heads * c.head_dim,
             "o": c.hidden_size, "gate": c.intermediate_size, "up": c.intermediate_size, "down": c.hidden_size}
    return [width[m] for m in modules]


def silu_mul(gate_up: np.ndarray) -> np.ndarray:
    half = gate_up.shape[1] // 2
    g, u = gate_up[:, :half], gate_up[:, half:]
    return g / (1.0 + np.exp(-g)) * u


def _softmax_inplace(s: np.ndarray) -> np.ndarray:
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s


class LlamaModel:
    def __init__(self, weights: LlamaWeights, max_positions: int, matmul_backend: str = "numpy",
                 attention_backend: str = "numpy", num_threads: int | None = None, release_numpy_copies: bool = False,
                 lora: bool = False):
        """`matmul_backend`: numpy | onnxruntime (every float32 or int8 matrix packed once, kept here per
        model: whole layers fused into one graph each, or matrix by matrix where bf16 copies take the big steps);
        `attention_backend`: numpy | numba (decode attention, RoPE and the cache write); see
        onnx_graphs.py and kernels.py for why. `release_numpy_copies` drops the numpy copies (float32
        and int8) of the packed matrices (the engine does when it owns the weights). `lora`: steps may
        carry LoRA adapters (StepBatch.lora); with fused layers this builds a second set of graphs that
        add the adapters' deltas, used only by steps that have any."""
        self.w = weights
        c = weights.config
        self.c = c
        self.fused: onnx_graphs.FusedLayers | None = None
        self.fused_lora: onnx_graphs.FusedLayers | None = None
        self.packed: dict[int, onnx_graphs.PackedLinear] = {}  # id(Matrix) -> its packed form
        if matmul_backend == "onnxruntime":
            layer_mats = [m for layer in weights.layers for m in layer.matrices]
            if weights.weight_dtype in ("float32", "int8"):
                self.fused = onnx_graphs.FusedLayers(weights, num_threads)
                if lora:
                    self.fused_lora = onnx_graphs.FusedLayers(weights, num_threads, lora=True)
                to_pack = [weights.lm_head]
            else:
                to_pack = layer_mats + [weights.lm_head]
            for m in to_pack:
                self.packed[id(m)] = onnx_graphs.PackedLinear(m, num_threads)
            if release_numpy_copies:
                for m in layer_mats + [weights.lm_head]:
                    m.q = m.scale = None
                    if m.f32 is not weights.embed:
                        m.f32 = None
        self.numba_kernels = attention_backend == "numba"
        if self.numba_kernels:
            kernels.warm_up(c.num_heads, c.num_kv_heads, c.head_dim)

        self.group = c.num_heads // c.num_kv_heads
        self.q_dim, self.kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.scale = np.float32(1.0 / np.sqrt(c.head_dim))
        inv = c.rope_theta ** (-np.arange(0, c.head_dim, 2, dtype=np.float64) / c.head_dim)
        ang = np.outer(np.arange(max_positions, dtype=np.float64), inv)
        self.cos = np.cos(np.concatenate([ang, ang], axis=1)).astype(np.float32)
        self.sin = np.sin(np.concatenate([ang, ang], axis=1)).astype(np.float32)

    def _linear(self, x: np.ndarray, w: Matrix, wide: bool = False) -> np.ndarray:
        return linear(x, w, wide, self.packed.get(id(w)))

    # -- shared pieces ----------------------------------------------------------------------------
    def _rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """x: [N, heads, D]; HF convention: rotate the two halves of each head."""
        half = x.shape[-1] // 2
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos + rotated * sin

    def _split_rope(self, qkv, positions):
        c = self.c
        q = qkv[:, : self.q_dim].reshape(-1, c.num_heads, c.head_dim)
        k = qkv[:, self.q_dim: self.q_dim + self.kv_dim].reshape(-1, c.num_kv_heads, c.head_dim)
        v = qkv[:, self.q_dim + self.kv_dim:].reshape(-1, c.num_kv_heads, c.head_dim)
        return self._rope(q, positions), self._rope(k, positions), v

    def _rope_store(self, qkv, positions, kc, vc, write_slots):
        """RoPE'd q [N, heads, D]; RoPE'd k and v written to the layer's cache at write_slots."""
        if self.numba_kernels:
            return kernels.rope_store(qkv, positions, self.cos, self.sin, self.c.num_heads, kc, vc, write_slots)
        q, k, v = self._split_rope(qkv, positions)
        kc[write_slots] = k
        vc[write_slots] = v
        return q

    def _proj(self, x, w: Matrix, i: int, modules: tuple[str, ...], lora) -> np.ndarray:
        """x · Wᵀ plus, for the rows of each adapter, that adapter's low-rank delta of the `modules` whose
        outputs W stacks (q/k/v, gate/up): x·Aᵀ·(scale·B)ᵀ beside the base matmul, never merged."""
        y = self._linear(x, w)
        if lora is not None:
            start = 0
            for m, width in zip(modules, _split_widths(self.c, modules)):
                d = lora.delta(i, m, x, width)
                if d is not None:
                    y[:, start:start + width] += d
                start += width
        return y

    def _layer_qkv(self, i, x, lora=None):
        layer = self.w.layers[i]
        return self._proj(rms_norm(x, layer.attn_norm, self.c.rms_norm_eps), layer.wqkv, i, ("q", "k", "v"), lora)

    def _start(self, x, lora=None):
        """-> (x, the q/k/v rows of layer 0)."""
        if self.fused and lora is not None:
            return self.fused_lora.start(x, lora.feeds(0, self.c))
        return self.fused.start(x) if self.fused else (x, self._layer_qkv(0, x, lora))

    def _finish_layer(self, i, x, attn, lora=None):
        """Everything after layer i's attention up to layer i + 1's: o-projection and residual, the MLP
        block, the next RMSNorm and q/k/v projection -> (x, q/k/v rows of layer i + 1, or None)."""
        if self.fused and lora is not None:
            return self.fused_lora.finish_layer(i, x, attn, lora.feeds(i + 1, self.c))
        if self.fused:
            return self.fused.finish_layer(i, x, attn)
        layer = self.w.layers[i]
        x = self._mlp_block(layer, x + self._proj(attn, layer.wo, i, ("o",), lora), i, lora)
        return x, (self._layer_qkv(i + 1, x, lora) if i + 1 < self.c.num_layers else None)

    def _attend(self, q, k, v, q_pos):
        """q [T, heads, D], k/v [L, kv_heads, D] (positions 0..L-1) -> [T, heads * D], causal."""
        c = self.c
        T, L = q.shape[0], k.shape[0]
        qg = q.reshape(T, c.num_kv_heads, self.group, c.head_dim).transpose(1, 2, 0, 3)  # [kv, g, T, D]
        s = np.matmul(qg, k.transpose(1, 2, 0)[:, None]) * self.scale  # [kv, g, T, L]
        future = np.arange(L)[None, :] > q_pos[:, None]  # [T, L]
        s[..., future] = -np.inf
        p = _softmax_inplace(s)
        o = np.matmul(p, v.transpose(1, 0, 2)[:, None])  # [kv, g, T, D]
        return o.transpose(2, 0, 1, 3).reshape(T, self.q_dim)

    def _mlp_block(self, layer, x, i=0, lora=None):
        h = rms_norm(x, layer.mlp_norm, self.c.rms_norm_eps)
        act = silu_mul(self._proj(h, layer.w_gate_up, i, ("gate", "up"), lora))
        return x + self._proj(act, layer.w_down, i, ("down",), lora)

    def logits(self, x: np.ndarray) -> np.ndarray:
        return self._linear(rms_norm(x, self.w.final_norm, self.c.rms_norm_eps), self.w.lm_head, wide=True)

    # -- the engine step --------------------------------------------------------------------------
    def forward(self, batch: StepBatch, kv: KVCache) -> np.ndarray:
        """One ragged step; returns logits [len(sample_rows), V]."""
        c = self.c
        x = self.w.embed[batch.tokens]
        drows = batch.decode_rows
        nd = 0 if drows is None else len(drows)
        only_decodes = nd == len(batch.tokens)
        dbias = None
        if nd and not self.numba_kernels:  # additive mask: 0 inside each context, -inf on the padding
            pad = np.arange(batch.decode_slots.shape[1])[None, :] >= batch.decode_lens[:, None]  # [B, L]
            dbias = np.where(pad, np.float32(-np.inf), np.float32(0))[:, None, None, :]
        lora = batch.lora
        x, qkv = self._start(x, lora)
        for li in range(c.num_layers):
            kc, vc = kv.k[li], kv.v[li]
            q = self._rope_store(qkv, batch.positions, kc, vc, batch.write_slots)
            if only_decodes:
                attn = self._decode_attention(q, kc, vc, batch.decode_slots, dbias, batch.decode_lens)
            else:
                attn = np.empty((x.shape[0], self.q_dim), dtype=np.float32)
            if nd and not only_decodes:
                attn[drows] = self._decode_attention(q[drows], kc, vc, batch.decode_slots, dbias, batch.decode_lens)
            for seg in batch.prefills:
                pos = batch.positions[seg.rows]
                if self.numba_kernels:  # row by row: the same numbers however the prompt is split
                    attn[seg.rows] = kernels.prefill_attention(q[seg.rows], kc, vc, seg.ctx_slots, pos, self.scale)
                else:
                    attn[seg.rows] = self._attend(q[seg.rows], kc[seg.ctx_slots], vc[seg.ctx_slots], pos)
            x, qkv = self._finish_layer(li, x, attn, lora)
        rows = batch.sample_rows
        return self.logits(x[rows]) if rows is not None and len(rows) else np.empty((0, c.vocab_size), np.float32)

    def _decode_attention(self, q, kc, vc, slots, bias, lens):
        """All single-token decodes at once: q [B, heads, D], contexts gathered as [B, L, kv, D]
        (or read in place by the numba kernel)."""
        if self.numba_kernels:
            return kernels.decode_attention(q, kc, vc, slots, lens, self.scale)
        c = self.c
        B = q.shape[0]
        K, V = kc[slots], vc[slots]  # [B, L, kv, D]
        qg = q.reshape(B, c.num_kv_heads, self.group, c.head_dim)  # [B, kv, g, D]
        s = np.matmul(qg, K.transpose(0, 2, 3, 1)) * self.scale  # [B, kv, g, L]
        s += bias
        p = _softmax_inplace(s)
        o = np.matmul(p, V.transpose(0, 2, 1, 3))  # [B, kv, g, D]
        return o.reshape(B, self.q_dim)

    # -- ground truth -----------------------------------------------------------------------------
    def forward_reference(self, token_ids, lora=None) -> np.ndarray:
        """Plain forward of one sequence, no cache, no batching: logits [T, V] (`lora`: a StepLora)."""
        c = self.c
        ids = np.asarray(token_ids, dtype=np.int64)
        pos = np.arange(len(ids))
        x, qkv = self._start(self.w.embed[ids], lora)
        for li in range(c.num_layers):
            q, k, v = self._split_rope(qkv, pos)
            x, qkv = self._finish_layer(li, x, self._attend(q, k, v, pos), lora)
        return self.logits(x)
