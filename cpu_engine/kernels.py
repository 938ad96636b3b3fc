"""numba kernels behind the model math, each kept only for a measured reason (docs/engine.md); the
matmuls' compiled form is in onnx_graphs.py.

- `decode_attention`: every single-token decode of a step in one kernel that reads K/V straight from
  the paged cache through each sequence's slots (no gather copy), one sequence per task, compiled per
  head shape: ~0.4 ms a layer in a step of 16 sequences x 160 positions instead of ~3 ms for the
  numpy version, whose time goes to ~100 tiny batched GEMMs a layer. Its softmax takes exp as a
  polynomial times 2^n (within 1.4 ulp of float64 exp, checked over [-87, 0]), which vectorizes, where
  numba (no SVML) calls libm's expf once per score: ~1 ms less a 16-stream step (30 layers 8.1 -> 7.2 ms).
- `rope_store`: RoPE of q and k and the K/V cache write in one serial pass over the step's rows: 0.016 ms
  a layer at 16 rows vs 0.050 ms for numpy's split, concatenate, multiply and scatter copies. Serial on
  purpose: a parallel region costs more to open than the work (0.057 ms at 16 rows, and slower at every
  size up to 512 rows), and waking numba's threads 30 more times a step also slowed the matmuls that
  follow; a 16-stream step went from ~49 to ~43 ms.
- `decode_rope_attention`: a step of only decodes (the steady state under load) does both in the
  attention kernel's tasks: one kernel call and one parallel region a layer; the 30 layers' RoPE +
  attention of 16 decodes x 129 positions, cache cold: 7.4 ms vs 7.8 (9.8 vs 10.7 in a slow spell).

Both are optional: `resolve` falls back to numpy when a package is missing, and the numpy versions in
`llama.py` stay the reference the tests compare these against.
"""
from __future__ import annotations

import importlib.util
import os

import numpy as np

# numba's parallel kernels run on GNU OpenMP, whose idle threads spin by default and then steal the
# cores from the next MLAS matmul (measured: a 16-stream step takes 72 ms with spinning, 62 without).
# Read once, when libgomp loads: set before numba is imported (an explicit setting wins).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

BACKENDS = {"matmul_backend": ("auto", "numpy", "onnxruntime"), "attention_backend": ("auto", "numpy", "numba")}


def resolve(knob: str, value: str) -> str:
    """`auto` -> the compiled backend when its package imports, else numpy; an explicit choice is
    checked so a missing package is a clear error at load, not a slow server."""
    compiled = BACKENDS[knob][2]
    available = importlib.util.find_spec(compiled) is not None
    if value == "auto":
        return compiled if available else "numpy"
    if value == compiled and not available:
        raise ImportError(f"{knob}={compiled} needs the {compiled} package (requirements.txt), which is not installed")
    return value


# -- RoPE + cache write, and decode attention ---------------------------------------------------------
def _compile_rope_row():
    import numba as nb

    # No fastmath here nor in any kernel that calls it: bit-identical to numpy's rope (inlined into a
    # fastmath kernel, LLVM fused its multiply-adds and cache rows differed in the last bit).
    @nb.njit(nogil=True, cache=True)
    def rope_row(src, c, s, heads, kv_heads, q_out, kc, vc, slot):  # pragma: no cover (compiled)
        """One row of fused q/k/v -> RoPE'd q into q_out [heads, D]; RoPE'd k and v into the cache at slot."""
        dim = q_out.shape[1]
        half = dim // 2
        for h in range(heads + kv_heads):  # q heads, then k heads: rotate_half
            base = h * dim
            dst = q_out[h] if h < heads else kc[slot, h - heads]
            for d in range(half):
                x1, x2 = src[base + d], src[base + half + d]
                dst[d] = x1 * c[d] - x2 * s[d]
                dst[half + d] = x2 * c[half + d] + x1 * s[half + d]
        base = (heads + kv_heads) * dim
        for h in range(kv_heads):
            for d in range(dim):
                vc[slot, h, d] = src[base + h * dim + d]

    return rope_row


_kernels: dict = {}


def _compiled(name: str, *shape):
    """The kernel `name` (rope_store | attention | rope_attention) for a head shape, compiled once."""
    key = (name, *shape)
    if key not in _kernels:
        if "rope_row" not in _kernels:
            _kernels["rope_row"] = _compile_rope_row()
        rope_row = _kernels["rope_row"]
        if name == "rope_store":
            _kernels[key] = _compile_rope_store(rope_row)
        else:  # the two decode kernels share their compiled pieces
            _kernels[("attention", *shape)], _kernels[("rope_attention", *shape)] = \
                _compile_decode_kernels(rope_row, *shape)
    return _kernels[key]


def _compile_decode_kernels(rope_row, kv_heads: int, group: int, dim: int):
    """Two kernels per head shape (kv heads, GQA group and head dim are compile-time constants, so the
    dot products and the P @ V accumulation unroll and vectorize), one task per sequence each:
    `attention` for q already RoPE'd, and `rope_attention`, which first does the row's RoPE and cache
    write (`rope_row`) in the same task: a step of only decodes opens one parallel region a layer
    instead of a serial pass plus a region. Each task reads each slot's K (and V) row for all kv heads,
    contiguous in the cache: measured at 16 sequences x 160 positions with the cache cold (as it is in a
    step, after the layer's matmuls), 0.37 ms a layer vs 0.64 for one task per (sequence, kv head),
    which reads every row in 256-byte pieces."""
    import numba as nb

    heads = kv_heads * group

    @nb.njit(fastmath=True, nogil=True, cache=True)
    def attend(qs, kc, vc, slots, length, out):  # pragma: no cover (compiled)
        # qs [KV, G, D] pre-scaled query of one sequence; kc, vc [S, KV, D]; slots [>= length]; out [H, D]
        s = np.empty((kv_heads, group, length), dtype=np.float32)
        bits = np.empty(length, dtype=np.int32)
        scales = bits.view(np.float32)  # 2^n, built from its exponent bits
        for pos in range(length):
            k = kc[slots[pos]]
            for kh in range(kv_heads):
                for g in range(group):
                    acc = np.float32(0.0)
                    for d in range(dim):
                        acc += qs[kh, g, d] * k[kh, d]
                    s[kh, g, pos] = acc
        for kh in range(kv_heads):  # softmax, normalized before P @ V
            for g in range(group):
                top = s[kh, g, 0]
                for pos in range(1, length):
                    top = max(top, s[kh, g, pos])
                for pos in range(length):  # exp(t), t <= 0, as p(r) * 2^n: vectorizes, unlike libm's expf
                    t = max(s[kh, g, pos] - top, np.float32(-87.0))
                    n = np.floor(t * np.float32(1.4426950408889634) + np.float32(0.5))
                    r = t - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)
                    p = np.float32(1.9875691500e-4)
                    p = p * r + np.float32(1.3981999507e-3)
                    p = p * r + np.float32(8.3334519073e-3)
                    p = p * r + np.float32(4.1665795894e-2)
                    p = p * r + np.float32(1.6666665459e-1)
                    p = p * r + np.float32(5.0000001201e-1)
                    s[kh, g, pos] = (p * r * r + r) + np.float32(1.0)
                    bits[pos] = (np.int32(n) + np.int32(127)) << np.int32(23)
                total = np.float32(0.0)
                for pos in range(length):
                    e = s[kh, g, pos] * scales[pos]
                    s[kh, g, pos] = e
                    total += e
                inv = np.float32(1.0) / total
                for pos in range(length):
                    s[kh, g, pos] *= inv
        o = np.zeros((kv_heads, group, dim), dtype=np.float32)
        for pos in range(length):
            v = vc[slots[pos]]
            for kh in range(kv_heads):
                for g in range(group):
                    p = s[kh, g, pos]
                    for d in range(dim):
                        o[kh, g, d] += p * v[kh, d]
        for kh in range(kv_heads):
            for g in range(group):
                for d in range(dim):
                    out[kh * group + g, d] = o[kh, g, d]

    @nb.njit(fastmath=True, nogil=True, cache=True)
    def scaled(q, scale):  # pragma: no cover (compiled)
        qs = np.empty((kv_heads, group, dim), dtype=np.float32)
        for kh in range(kv_heads):
            for g in range(group):
                for d in range(dim):
                    qs[kh, g, d] = q[kh * group + g, d] * scale
        return qs

    @nb.njit(parallel=True, fastmath=True, nogil=True, cache=True)
    def attention(q, kc, vc, slots, lens, scale, out):  # pragma: no cover (compiled)
        # q [B, H, D]; slots [B, Lmax]; lens [B]; out [B, H, D]
        for b in nb.prange(q.shape[0]):
            attend(scaled(q[b], scale), kc, vc, slots[b], lens[b], out[b])

    @nb.njit(parallel=True, nogil=True, cache=True)  # strict for rope_row; `attend` keeps its fastmath
    def rope_attention(qkv, positions, cos, sin, kc, vc, write_slots, slots, lens, scale, out):  # pragma: no cover
        # qkv [B, (H + 2 KV) * D] of B decodes; the rest as `attention`
        for b in nb.prange(qkv.shape[0]):
            q = np.empty((heads, dim), dtype=np.float32)
            rope_row(qkv[b], cos[positions[b]], sin[positions[b]], heads, kv_heads, q, kc, vc, write_slots[b])
            attend(scaled(q, scale), kc, vc, slots[b], lens[b], out[b])

    return attention, rope_attention


def decode_attention(q: np.ndarray, kc: np.ndarray, vc: np.ndarray, slots: np.ndarray, lens: np.ndarray,
                     scale: np.float32) -> np.ndarray:
    """q [B, heads, D] of single-token decodes; kc/vc [slots, kv_heads, D]; slots [B, Lmax] (row b's
    context is slots[b, :lens[b]]) -> [B, heads * D]."""
    kernel = _compiled("attention", kc.shape[1], q.shape[1] // kc.shape[1], q.shape[2])
    out = np.empty(q.shape, dtype=np.float32)
    kernel(np.ascontiguousarray(q), kc, vc, slots, lens, np.float32(scale), out)
    return out.reshape(q.shape[0], -1)


def decode_rope_attention(qkv: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, heads: int,
                          kc: np.ndarray, vc: np.ndarray, write_slots: np.ndarray, slots: np.ndarray,
                          lens: np.ndarray, scale: np.float32) -> np.ndarray:
    """A step of only decodes: `rope_store` and `decode_attention` in one kernel (row b is decode b)."""
    kv_heads, dim = kc.shape[1], kc.shape[2]
    kernel = _compiled("rope_attention", kv_heads, heads // kv_heads, dim)
    out = np.empty((qkv.shape[0], heads, dim), dtype=np.float32)
    kernel(qkv, positions, cos, sin, kc, vc, write_slots, slots, lens, np.float32(scale), out)
    return out.reshape(qkv.shape[0], -1)


def _compile_rope_store(rope_row):
    import numba as nb

    @nb.njit(nogil=True, cache=True)  # serial (see the module docstring)
    def kernel(qkv, positions, cos, sin, heads, kv_heads, kc, vc, write_slots, q_out):  # pragma: no cover
        for row in range(qkv.shape[0]):
            rope_row(qkv[row], cos[positions[row]], sin[positions[row]], heads, kv_heads, q_out[row], kc, vc,
                     write_slots[row])

    return kernel


def rope_store(qkv: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, heads: int,
               kc: np.ndarray, vc: np.ndarray, write_slots: np.ndarray) -> np.ndarray:
    """The fused q/k/v rows [N, (heads + 2 kv) * D] -> RoPE'd q [N, heads, D]; RoPE'd k and v written to
    the cache (kc/vc [slots, kv_heads, D], one layer) at write_slots: one pass instead of numpy's ~8."""
    kv_heads, dim = kc.shape[1], kc.shape[2]
    q = np.empty((qkv.shape[0], heads, dim), dtype=np.float32)
    _compiled("rope_store")(qkv, positions, cos, sin, heads, kv_heads, kc, vc, write_slots, q)
    return q


def warm_up(heads: int, kv_heads: int, dim: int) -> None:
    """Compile the kernels for this head shape now, at model load, rather than on the first request:
    ~6 s cold; numba's on-disk cache (cache=True, next to this file) makes later loads ~0.4 s."""
    slots, lens = np.zeros((1, 1), dtype=np.int64), np.ones(1, dtype=np.int64)
    cache = np.zeros((1, kv_heads, dim), dtype=np.float32)
    table = np.ones((1, dim), dtype=np.float32)
    qkv = np.zeros((1, (heads + 2 * kv_heads) * dim), dtype=np.float32)
    q = rope_store(qkv, slots[0], table, table, heads, cache, cache, slots[0])
    decode_attention(q, cache, cache, slots, lens, np.float32(1))
    decode_rope_attention(qkv, slots[0], table, table, heads, cache, cache, slots[0], slots, lens, np.float32(1))


def set_numba_threads(n: int) -> None:
    import numba

    numba.set_num_threads(min(int(n), numba.config.NUMBA_NUM_THREADS))
