"""The int8 scheme of the matmuls (`weight_dtype` int8), in numpy: the reference that the
onnxruntime graphs (onnx_graphs.py) are tested against, and the numpy backend's path.

Weights: symmetric, one float32 scale per output channel, quantized once at load. Activations: symmetric,
one scale per row, quantized in every matmul, so a row's result never depends on the other rows of the
step. The int8 products are summed exactly (integers), then scaled by row scale x channel scale.
"""
from __future__ import annotations

import numpy as np

ACTIVATION_LIMIT = 127  # |x_q| <= 127, stored as uint8 around ACTIVATION_ZERO_POINT for MLAS's u8 x s8 GEMMs
ACTIVATION_ZERO_POINT = 128
TINY = 1e-30  # floor of a row's (and a channel's) absolute maximum: an all-zero row quantizes to zeros


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo; empty where it cannot be read)."""
    try:
        return set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split())
    except (OSError, StopIteration):
        return set()


def quantize_weight(w: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] float32 -> (int8 q [out, in], float32 scale [out]) with w ~= q * scale[:, None]."""
    scale = (np.maximum(np.abs(w).max(axis=1), np.float32(TINY)) / np.float32(limit)).astype(np.float32)
    return np.clip(np.rint(w / scale[:, None]), -limit, limit).astype(np.int8), scale


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [rows, in] float32 -> (integer-valued float64 x_q [rows, in], float32 scale [rows, 1])."""
    scale = np.maximum(np.abs(x).max(axis=1, keepdims=True), np.float32(TINY)) * np.float32(1.0 / ACTIVATION_LIMIT)
    return np.clip(np.rint(x / scale), -ACTIVATION_LIMIT, ACTIVATION_LIMIT).astype(np.float64), scale


def linear_int8(x: np.ndarray, q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """x [rows, in] times the int8 matrix (q [out, in], scale [out]) -> [rows, out] float32. The sums run
    in float64, exact for any realistic width (|sum| < 2^53), as MLAS's int32 sums are."""
    xq, row_scale = quantize_rows(x)
    acc = (xq @ q.T.astype(np.float64)).astype(np.float32)
    return acc * (row_scale * scale[None, :])


class Matrix:
    """A weight [out, in] in float32 numpy, plus a bfloat16 torch copy where bf16 matmuls are enabled, or
    an int8 copy (`q`, one float32 `scale` per output channel) where int8 matmuls are.

    Measured on the 2-core AVX512-BF16 machine, from the engine's loop thread: bf16 (oneDNN) is
    2-3x faster than float32 OpenBLAS for 4-64 rows, but slower for 1-2 rows (a memory-bound GEMV
    where torch's per-call and threading overheads dominate), so small steps keep float32."""

    __slots__ = ("f32", "bf16", "q", "scale", "shape")

    def __init__(self, f32: np.ndarray, bf16=None):
        self.f32, self.bf16, self.q, self.scale, self.shape = f32, bf16, None, None, f32.shape
