"""Compiled kernels behind the model math, each kept only for a measured reason (docs/engine.md).

- `PackedLinear`: y = x @ W.T through onnxruntime's MLAS sgemm with W as a constant, so MLAS packs it
  once at load. numpy's OpenBLAS repacks the weight on every call, which dominates the small-M GEMMs of
  a decode step: measured on the 2-core AVX2 EPYC, all 30 layers' matmuls at 16 rows take ~30 ms
  instead of ~46 ms, the LM head ~7 ms instead of ~17 ms (1 row: the same, a memory-bound pass).
  A weight fed as an input (not a constant) gains nothing: the packing is the difference.
- `decode_attention`: every single-token decode of a step in one numba kernel that reads K/V straight
  from the paged cache through each sequence's slots (no gather copy), one (sequence, kv head) per
  task: ~0.3 ms a layer at 16 sequences x 128 positions instead of ~3 ms for the numpy version, whose
  time goes to ~100 tiny batched GEMMs a layer.

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


# -- matmuls ------------------------------------------------------------------------------------------
class PackedLinear:
    """x [N, in] -> x @ W.T [N, out] float32, W [out, in] packed once by onnxruntime (MLAS)."""

    def __init__(self, w: np.ndarray, threads: int | None = None):
        import onnxruntime as ort
        from onnx import TensorProto, helper

        out_dim, in_dim = w.shape
        # The weight is declared as external data and handed over as an OrtValue: onnxruntime copies it
        # once (no serialized copy) and packs it; measured, it keeps that copy, so this costs 2x the
        # float32 bytes (the caller may drop its own array afterwards).
        w_t = TensorProto(name="w_t", data_type=TensorProto.FLOAT, dims=[in_dim, out_dim],
                          data_location=TensorProto.EXTERNAL)
        for key, value in (("location", "w_t.bin"), ("offset", "0"), ("length", str(in_dim * out_dim * 4))):
            w_t.external_data.add(key=key, value=value)
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["x", "w_t"], ["y"])], "linear",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", in_dim])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", out_dim])], [w_t])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8  # readable by every onnxruntime this project pins
        opts = ort.SessionOptions()
        weight = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(w.T, dtype=np.float32))
        opts.add_external_initializers(["w_t"], [weight])  # must outlive the session's creation
        opts.intra_op_num_threads = threads or os.cpu_count() or 1
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.log_severity_level = 3
        # Many small sessions share the cores: idle pool threads must sleep, not spin (measured: spinning
        # pools of ~120 sessions run 40x slower).
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        del weight

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.session.run(None, {"x": np.ascontiguousarray(x, dtype=np.float32)})[0]


# -- decode attention ---------------------------------------------------------------------------------
_decode_kernel = None


def _compile_decode_kernel():
    import numba as nb

    @nb.njit(parallel=True, fastmath=True, cache=True, nogil=True)
    def kernel(q, kc, vc, slots, lens, scale, out):  # pragma: no cover (compiled)
        # q [B, H, D]; kc, vc [S, KV, D] (one layer); slots [B, Lmax]; lens [B]; out [B, H, D]
        batch, heads, dim = q.shape
        kv_heads = kc.shape[1]
        group = heads // kv_heads
        for task in nb.prange(batch * kv_heads):
            b, kh = task // kv_heads, task % kv_heads
            length = lens[b]
            s = np.empty((group, length), dtype=np.float32)
            for pos in range(length):
                k = kc[slots[b, pos], kh]
                for g in range(group):
                    qh = q[b, kh * group + g]
                    acc = np.float32(0.0)
                    for d in range(dim):
                        acc += qh[d] * k[d]
                    s[g, pos] = acc * scale
            for g in range(group):
                top = s[g, 0]
                for pos in range(1, length):
                    top = max(top, s[g, pos])
                total = np.float32(0.0)
                for pos in range(length):
                    e = np.exp(s[g, pos] - top)
                    s[g, pos] = e
                    total += e
                o = out[b, kh * group + g]
                o[:] = 0.0
                for pos in range(length):
                    p = s[g, pos] / total
                    v = vc[slots[b, pos], kh]
                    for d in range(dim):
                        o[d] += p * v[d]

    return kernel


def decode_attention(q: np.ndarray, kc: np.ndarray, vc: np.ndarray, slots: np.ndarray, lens: np.ndarray,
                     scale: np.float32) -> np.ndarray:
    """q [B, heads, D] of single-token decodes; kc/vc [slots, kv_heads, D]; slots [B, Lmax] (row b's
    context is slots[b, :lens[b]]) -> [B, heads * D]."""
    global _decode_kernel
    if _decode_kernel is None:
        _decode_kernel = _compile_decode_kernel()
    out = np.empty(q.shape, dtype=np.float32)
    _decode_kernel(np.ascontiguousarray(q), kc, vc, slots, lens, np.float32(scale), out)
    return out.reshape(q.shape[0], -1)


def set_numba_threads(n: int) -> None:
    import numba

    numba.set_num_threads(min(int(n), numba.config.NUMBA_NUM_THREADS))
