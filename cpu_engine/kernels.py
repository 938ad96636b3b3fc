"""numba kernels behind the model math, each kept only for a measured reason (docs/engine.md); the
matmuls' compiled form is in onnx_graphs.py.

- `decode_attention`: every single-token decode of a step in one kernel that reads K/V straight from
  the paged cache through each sequence's slots (no gather copy), one sequence per task, compiled per
  head shape: ~0.4 ms a layer in a step of 16 sequences x 160 positions instead of ~3 ms for the
  numpy version, whose time goes to ~100 tiny batched GEMMs a layer. Below `SERIAL_BELOW` sequences it
  runs on one thread. Its softmax computes exp itself (a polynomial times 2^n in the exponent bits),
  which vectorizes where libm's expf is a call per score.
  `prefill_attention` runs the same kernel over a prefill's rows, so a row's numbers never depend on
  how many rows its step has.
- `rope_store`: RoPE of q and k and the K/V cache write in one serial pass over the step's rows: 0.016 ms
  a layer at 16 rows vs 0.050 ms for numpy's split, concatenate, multiply and scatter copies. Serial on
  purpose: a parallel region costs more to open than the work (0.057 ms at 16 rows, and slower at every
  size up to 512 rows), and waking numba's threads 30 more times a step also slowed the matmuls that
  follow; a 16-stream step went from ~49 to ~43 ms.

Both are optional: `resolve` falls back to numpy when a package is missing, and the numpy versions in
`llama.py` stay the reference the tests compare these against.
"""
from __future__ import annotations

import contextlib
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


# -- decode attention ---------------------------------------------------------------------------------
_decode_kernels: dict = {}
# Steps with fewer decodes run the kernel on the calling thread alone: opening the parallel region (waking
# the other thread) costs several times the whole work of one sequence.
SERIAL_BELOW = 8


def _compile_decode_kernel(kv_heads: int, group: int, dim: int):
    """One kernel per head shape: kv heads, GQA group and head dim are compile-time constants, so the
    dot products and the P @ V accumulation unroll and vectorize. One task per sequence reads each
    slot's K (and V) row for all kv heads, contiguous in the cache: measured at 16 sequences x 160
    positions with the cache cold (as it is in a step, after the layer's matmuls), 0.37 ms a layer vs
    0.64 for one task per (sequence, kv head), which reads every row in 256-byte pieces."""
    import numba as nb

    @nb.njit(parallel=True, fastmath=True, nogil=True, cache=True)
    def kernel(q, kc, vc, slots, lens, scale, out):  # pragma: no cover (compiled)
        # q [B, H, D]; kc, vc [S, KV, D] (one layer); slots [B, Lmax]; lens [B]; out [B, H, D]
        for b in nb.prange(q.shape[0]):
            length = lens[b]
            qs = np.empty((kv_heads, group, dim), dtype=np.float32)  # pre-scaled queries
            for kh in range(kv_heads):
                for g in range(group):
                    for d in range(dim):
                        qs[kh, g, d] = q[b, kh * group + g, d] * scale
            s = np.empty((kv_heads, group, length), dtype=np.float32)
            for pos in range(length):
                k = kc[slots[b, pos]]
                for kh in range(kv_heads):
                    for g in range(group):
                        acc = np.float32(0.0)
                        for d in range(dim):
                            acc += qs[kh, g, d] * k[kh, d]
                        s[kh, g, pos] = acc
            # softmax, normalized before P @ V; exp(x) = 2^n * 2^f with 2^f a polynomial and 2^n built
            # in the float's exponent bits, so the loops vectorize (libm's expf is one call per score)
            bits = np.empty(length, dtype=np.int32)
            pow2n = bits.view(np.float32)
            for kh in range(kv_heads):
                for g in range(group):
                    row = s[kh, g]
                    top = row[0]
                    for pos in range(1, length):
                        top = max(top, row[pos])
                    for pos in range(length):
                        y = max(row[pos] - top, np.float32(-87.0)) * np.float32(1.4426950408889634)  # log2(e)
                        n = np.floor(y)
                        f = y - n
                        row[pos] = np.float32(1.0) + f * (np.float32(0.693146824836731) + f * (
                            np.float32(0.24023109674453735) + f * (np.float32(0.055478911846876144) + f * (
                                np.float32(0.009686185978353024) + f * (np.float32(0.001238241558894515)
                                                                        + f * np.float32(0.000218712622881867))))))
                        bits[pos] = (np.int32(n) + np.int32(127)) << 23
                    total = np.float32(0.0)
                    for pos in range(length):
                        e = row[pos] * pow2n[pos]
                        row[pos] = e
                        total += e
                    inv = np.float32(1.0) / total
                    for pos in range(length):
                        row[pos] *= inv
            o = np.zeros((kv_heads, group, dim), dtype=np.float32)
            for pos in range(length):
                v = vc[slots[b, pos]]
                for kh in range(kv_heads):
                    for g in range(group):
                        p = s[kh, g, pos]
                        for d in range(dim):
                            o[kh, g, d] += p * v[kh, d]
            for kh in range(kv_heads):
                for g in range(group):
                    for d in range(dim):
                        out[b, kh * group + g, d] = o[kh, g, d]

    return kernel


def decode_attention(q: np.ndarray, kc: np.ndarray, vc: np.ndarray, slots: np.ndarray, lens: np.ndarray,
                     scale: np.float32) -> np.ndarray:
    """q [B, heads, D] of single-token decodes; kc/vc [slots, kv_heads, D]; slots [B, Lmax] (row b's
    context is slots[b, :lens[b]]) -> [B, heads * D]."""
    key = (kc.shape[1], q.shape[1] // kc.shape[1], q.shape[2])
    kernel = _decode_kernels.get(key)
    if kernel is None:
        kernel = _decode_kernels[key] = _compile_decode_kernel(*key)
    out = np.empty(q.shape, dtype=np.float32)
    args = (np.ascontiguousarray(q), kc, vc, slots, lens, np.float32(scale), out)
    if q.shape[0] < SERIAL_BELOW:
        with _one_thread():
            kernel(*args)
    else:
        kernel(*args)
    return out.reshape(q.shape[0], -1)


def prefill_attention(q: np.ndarray, kc: np.ndarray, vc: np.ndarray, ctx_slots: np.ndarray, positions: np.ndarray,
                      scale: np.float32) -> np.ndarray:
    """One sequence's prefill rows, causal: q [T, heads, D] at `positions`, its context's slots
    `ctx_slots` (position order) -> [T, heads * D]. The decode kernel with one task per row (row t reads
    slots[:positions[t] + 1]), so each row is computed exactly as it would be alone or as a decode: a
    prompt gives the same numbers however it is split (prefix reuse, chunked prefill, speculative
    verification). numpy's batched GEMMs do not: OpenBLAS picks its kernels by the number of rows, and
    a row's last bits change with it, which int8 activations can round into another greedy token
    (docs/engine.md). It reads only each row's causal context, and is faster than numpy's full
    T x L products (10.6 against 27.9 ms a layer at 512 x 512, 2 cores)."""
    slots = np.broadcast_to(ctx_slots, (q.shape[0], ctx_slots.shape[0]))  # one row of slots, read by every row
    return decode_attention(q, kc, vc, slots, positions.astype(np.int64) + 1, scale)


@contextlib.contextmanager
def _one_thread():
    """numba's thread count for the calling thread, 1 inside the block (SERIAL_BELOW)."""
    import numba

    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        yield
    finally:
        numba.set_num_threads(threads)


# -- RoPE and the cache write -------------------------------------------------------------------------
_rope_store_kernel = None


def _compile_rope_store_kernel():
    import numba as nb

    @nb.njit(nogil=True, cache=True)  # serial (see the module docstring); no fastmath: bit-identical to numpy
    def kernel(qkv, positions, cos, sin, heads, kv_heads, kc, vc, write_slots, q_out):  # pragma: no cover
        dim = q_out.shape[2]
        half = dim // 2
        for row in range(qkv.shape[0]):
            c, s = cos[positions[row]], sin[positions[row]]
            slot = write_slots[row]
            for h in range(heads + kv_heads):  # q heads, then k heads: rotate_half
                base = h * dim
                dst = q_out[row, h] if h < heads else kc[slot, h - heads]
                for d in range(half):
                    x1, x2 = qkv[row, base + d], qkv[row, base + half + d]
                    dst[d] = x1 * c[d] - x2 * s[d]
                    dst[half + d] = x2 * c[half + d] + x1 * s[half + d]
            base = (heads + kv_heads) * dim
            for h in range(kv_heads):
                for d in range(dim):
                    vc[slot, h, d] = qkv[row, base + h * dim + d]

    return kernel


def rope_store(qkv: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, heads: int,
               kc: np.ndarray, vc: np.ndarray, write_slots: np.ndarray) -> np.ndarray:
    """The fused q/k/v rows [N, (heads + 2 kv) * D] -> RoPE'd q [N, heads, D]; RoPE'd k and v written to
    the cache (kc/vc [slots, kv_heads, D], one layer) at write_slots: one pass instead of numpy's ~8."""
    global _rope_store_kernel
    if _rope_store_kernel is None:
        _rope_store_kernel = _compile_rope_store_kernel()
    kv_heads, dim = kc.shape[1], kc.shape[2]
    q = np.empty((qkv.shape[0], heads, dim), dtype=np.float32)
    _rope_store_kernel(qkv, positions, cos, sin, heads, kv_heads, kc, vc, write_slots, q)
    return q


def warm_up(heads: int, kv_heads: int, dim: int) -> None:
    """Compile both kernels for this head shape now, at model load, rather than on the first request:
    ~6 s cold; numba's on-disk cache (cache=True, next to this file) makes later loads ~0.4 s."""
    slots = np.zeros((1, 1), dtype=np.int64)
    cache = np.zeros((1, kv_heads, dim), dtype=np.float32)
    table = np.ones((1, dim), dtype=np.float32)
    q = rope_store(np.zeros((1, (heads + 2 * kv_heads) * dim), dtype=np.float32), slots[0], table, table, heads,
                   cache, cache, slots[0])
    decode_attention(q, cache, cache, slots, np.ones(1, dtype=np.int64), np.float32(1))
    prefill_attention(q, cache, cache, slots[0], np.zeros(1, dtype=np.int64), np.float32(1))  # broadcast slots


def set_numba_threads(n: int) -> None:
    import numba

    numba.set_num_threads(min(int(n), numba.config.NUMBA_NUM_THREADS))
