"""The model's matmul work as onnxruntime graphs (MLAS sgemm, every weight a constant packed once).

numpy's OpenBLAS repacks the weight on every call, which dominates the small-M GEMMs of a decode step;
MLAS packs a constant weight once at load (a weight fed as an input, not a constant, is packed per call
again and gains nothing).

- `PackedLinear`, one matrix per session: the LM head, and any single matmul. With one row a step is a
  memory-bound pass over the weights, so packing helps the batched steps, not the lone stream.
- `FusedLayers`, one session for everything between two attentions: o-projection, residual add,
  RMSNorm, gate/up, SiLU*up, down, residual add, the next layer's RMSNorm and q/k/v projection. 31
  calls a step instead of ~120 matmul calls plus ~90 numpy element-wise passes, each of which would
  cross into Python and back.

With int8 weights (`weight_dtype` int8), each matmul (the layers' and the LM head's) is an integer GEMM:
the rows of x are quantized on the fly, symmetric, one scale per row (`QuantizeLinear`, zero point 128 as
uint8), multiplied by the weight's int8 matrix (one scale per output channel) into exact int32 sums, and
scaled back to float32 in the same op (`MatMulIntegerToFloat`). MLAS's u8 x s8 kernels move a quarter of
the bytes and do 4x the multiply-adds per instruction. Per-row scales keep every row's result independent
of the others in the step, as float32 is. `benchmarks/kernel_bench.py --out` times every graph against
numpy on the machine at hand; earlier sessions' figures are in docs/engine-log.md.

The math is `llama.py`'s; the tests compare the two (tests/engine/test_kernels.py).
Costs: onnxruntime keeps its own copy of each weight next to the packed one, so the caller drops its
float32 arrays once the sessions exist (`release_numpy_copies` in llama.py).
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import os

import numpy as np

from cpu_engine.quantization import ACTIVATION_LIMIT, ACTIVATION_ZERO_POINT, TINY, Matrix, linear_int8

log = logging.getLogger("cpu_engine")


class _Graph:
    """A small ONNX graph under construction whose weights are handed to onnxruntime as OrtValues
    (declared as external data: no serialized copy of them is ever made)."""

    def __init__(self, name: str):
        self.name, self.nodes, self.inputs, self.outputs, self.weights, self.count = name, [], [], [], {}, 0
        self.constants: dict[str, np.ndarray] = {}  # non-float32 or small initializers, kept in the graph
        self.row_zero_points: str | None = None
        self.quantized: dict[str, tuple[str, str]] = {}  # input -> its quantized rows and their scales

    def input(self, name: str, width, rows="rows", dtype: str = "FLOAT") -> str:
        """A graph input [rows, width] (`dtype`: an onnx TensorProto type name); rows=None: [width]."""
        from onnx import TensorProto, helper

        shape = [width] if rows is None else [rows, width]
        self.inputs.append(helper.make_tensor_value_info(name, getattr(TensorProto, dtype), shape))
        return name

    def lora(self, base: str, x: str, module: str, d_in: int, d_out: int) -> str:
        """base + ((x · {module}_A) ∘ {module}_mask) · {module}_B: the step's LoRA deltas (cpu_engine/lora.py,
        StepLora.feeds), fed per step as inputs: A [in, R], B [R, out], mask [rows, R]. Where the base
        matmul was an integer GEMM, x·A is one too, on the same quantized rows of x: A as int8
        `{module}_Aq` [in, R] with one scale per column, `{module}_Ascale` [R]."""
        r = f"R_{module}"
        if x in self.quantized:
            xq, row_scale = self.quantized[x]
            a, a_scale = self.input(f"{module}_Aq", r, d_in, "INT8"), self.input(f"{module}_Ascale", r, None)
            low = self.op("MatMulIntegerToFloat", [xq, a, row_scale, a_scale, "zero_point"], domain="com.microsoft")
        else:
            low = self.op("MatMul", [x, self.input(f"{module}_A", r, d_in)])
        low = self.op("Mul", [low, self.input(f"{module}_mask", r)])
        return self.op("Gemm", [low, self.input(f"{module}_B", d_out, r), base])  # low · B + base in one op

    def output(self, value: str, width: int) -> None:
        from onnx import TensorProto, helper

        self.outputs.append(helper.make_tensor_value_info(value, TensorProto.FLOAT, ["rows", width]))

    def weight(self, name: str, array: np.ndarray) -> str:
        self.weights[name] = np.ascontiguousarray(array, dtype=np.float32)
        return name

    def constant(self, name: str, value) -> str:
        self.constants.setdefault(name, np.asarray(value))
        return name

    def matmul(self, x: str, m, name: str, out_rows: slice = slice(None)) -> str:
        """x [rows, in] times the Matrix m [out, in] (its `out_rows` channels) -> [rows, out] float32: float32
        MatMul, or an integer GEMM where m has its int8 form (module docstring; `quantization.linear_int8`
        is the same math; x is quantized once however many matrices it multiplies)."""
        if m.q is None:
            return self.op("MatMul", [x, self.weight(name, m.f32[out_rows].T)])
        self.constant(name, np.ascontiguousarray(m.q[out_rows].T))  # [in, out]
        self.constant(name + "_scale", m.scale[out_rows])
        if x not in self.quantized:
            self.quantized[x] = self._quantize_rows(x)
        xq, row_scale = self.quantized[x]
        return self.op("MatMulIntegerToFloat", [xq, name, row_scale, name + "_scale", "zero_point"], domain="com.microsoft")

    def _quantize_rows(self, x: str) -> tuple[str, str]:
        """x [rows, in] float32 -> (uint8 x_q around 128, float32 row scale [rows, 1])."""
        zero_point = self.constant("zero_point", np.uint8(ACTIVATION_ZERO_POINT))
        if self.row_zero_points is None:  # QuantizeLinear's per-row zero points: [rows] of 128
            self.row_zero_points = self.op("Expand", [zero_point, self.op("Shape", [x], end=1)])
        absmax = self.op("ReduceMax", [self.op("Abs", [x]), self.constant("axis1", np.array([1], np.int64))], keepdims=1)
        row_scale = self.op("Mul", [self.op("Max", [absmax, self.constant("tiny", np.float32(TINY))]),
                                    self.constant("inv_limit", np.float32(1.0 / ACTIVATION_LIMIT))])
        flat_scale = self.op("Reshape", [row_scale, self.constant("flat", np.array([-1], np.int64))])
        return self.op("QuantizeLinear", [x, flat_scale, self.row_zero_points], axis=0), row_scale

    def op(self, op_type: str, inputs: list[str], outputs: int = 1, domain: str = "", **attrs):
        from onnx import helper

        names = [f"{op_type}_{self.count}_{i}" for i in range(outputs)]
        self.count += 1
        self.nodes.append(helper.make_node(op_type, inputs, names, domain=domain, **attrs))
        return names if outputs > 1 else names[0]

    def session(self, threads: int | None):
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper

        initializers = []
        for name, array in self.weights.items():
            t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(array.shape),
                            data_location=TensorProto.EXTERNAL)
            for key, value in (("location", name), ("offset", "0"), ("length", str(array.nbytes))):
                t.external_data.add(key=key, value=value)
            initializers.append(t)
        initializers += [numpy_helper.from_array(v, k) for k, v in self.constants.items()]
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                        helper.make_opsetid("com.microsoft", 1)])
        model.ir_version = 8  # readable by every onnxruntime this project pins
        opts = ort.SessionOptions()
        values = [ort.OrtValue.ortvalue_from_numpy(a) for a in self.weights.values()]
        opts.add_external_initializers(list(self.weights), values)  # must outlive the session's creation
        opts.intra_op_num_threads = threads or os.cpu_count() or 1
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.log_severity_level = 3
        # No arena: each of the ~32 sessions would grow its own to its largest step's intermediates and
        # keep it for the process's life, while plain allocations cost no measurable step time.
        opts.enable_cpu_mem_arena = False
        # A pool thread spins between the ops of one Run (no futex wake-up per op) and stops spinning when
        # the Run ends, so the ~32 sessions never spin at once and nothing spins during attention or
        # while responses go out. Sleeping between ops would cost a wake-up per op; spinning that outlives
        # the Run would make the sessions' pools fight for the cores.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1")
        opts.add_session_config_entry("session.force_spinning_stop", "1")
        session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        self.weights.clear()
        self.constants.clear()
        return session


class PackedLinear:
    """x [N, in] -> x @ W.T [N, out] float32 for the Matrix W [out, in] (float32, or int8 where it has its
    int8 form), packed once."""

    def __init__(self, m, threads: int | None = None):
        out_dim, in_dim = m.shape
        g = _Graph("linear")
        g.output(g.matmul(g.input("x", in_dim), m, "w"), out_dim)
        self.session = g.session(threads)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.session.run(None, {"x": np.ascontiguousarray(x, dtype=np.float32)})[0]


class FusedLayers:
    """The per-layer work around attention, one onnxruntime session per gap between two attentions.

    `start(x)` -> (x, qkv of layer 0); `finish_layer(i, x, attn)` -> (x after layer i, qkv of layer
    i + 1, or None after the last layer): the same contract as LlamaModel's numpy versions."""

    def __init__(self, weights, threads: int | None = None, lora: bool = False):
        """`lora`: every matmul also adds the step's LoRA deltas (`_Graph.lora`; inputs from
        lora.StepLora.feeds). A separate set of sessions, used only for steps that carry adapters, so a
        step without any runs the plain graphs at their full speed."""
        c = weights.config
        hidden, eps = c.hidden_size, c.rms_norm_eps
        self.lora = lora
        self.sessions = []
        for i in range(c.num_layers + 1):  # graph i: the end of layer i - 1, the start of layer i
            g = _Graph(f"layer{i}")
            x = g.input("x", hidden)
            if i > 0:
                prev = weights.layers[i - 1]
                attn = g.input("attn", prev.wo.shape[1])
                o = g.matmul(attn, prev.wo, "wo")
                if lora:
                    o = g.lora(o, attn, "o", prev.wo.shape[1], hidden)
                # SkipSimplifiedLayerNormalization: (x + skip) and RMSNorm of it, in one pass
                h, _, _, x = g.op("SkipSimplifiedLayerNormalization", [x, o, g.weight("mlp_norm", prev.mlp_norm)],
                                  4, domain="com.microsoft", epsilon=eps)
                # gate and up as two matmuls of h (quantized once) rather than a Split of one product, which
                # copies; alternating A/Bs of the two shapes came out even, and two matmuls are simpler
                half = prev.w_gate_up.shape[0] // 2
                gate = g.matmul(h, prev.w_gate_up, "w_gate", slice(0, half))
                up = g.matmul(h, prev.w_gate_up, "w_up", slice(half, None))
                if lora:
                    gate, up = g.lora(gate, h, "gate", hidden, half), g.lora(up, h, "up", hidden, half)
                act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])  # SiLU(gate) * up
                down = g.matmul(act, prev.w_down, "w_down")
                if lora:
                    down = g.lora(down, act, "down", half, hidden)
            if i == c.num_layers:
                g.output(g.op("Add", [x, down]), hidden)
            else:
                layer = weights.layers[i]
                norm = g.weight("attn_norm", layer.attn_norm)
                if i == 0:  # x itself is unchanged: only the q/k/v are an output
                    h = g.op("SimplifiedLayerNormalization", [x, norm], axis=-1, epsilon=eps)
                else:
                    h, _, _, x = g.op("SkipSimplifiedLayerNormalization", [x, down, norm], 4,
                                      domain="com.microsoft", epsilon=eps)
                    g.output(x, hidden)
                qkv = g.matmul(h, layer.wqkv, "wqkv")
                if lora:
                    qkv = g.lora(qkv, h, "qkv", hidden, layer.wqkv.shape[0])
                g.output(qkv, layer.wqkv.shape[0])
            self.sessions.append(g.session(threads))

    def start(self, x: np.ndarray, lora_feeds: dict | None = None):
        feeds = {"x": np.ascontiguousarray(x, dtype=np.float32), **(lora_feeds or {})}
        return x, self.sessions[0].run(None, feeds)[0]

    def finish_layer(self, i: int, x: np.ndarray, attn: np.ndarray, lora_feeds: dict | None = None):
        out = self.sessions[i + 1].run(None, {"x": x, "attn": attn, **(lora_feeds or {})})
        return (out[0], out[1]) if len(out) == 2 else (out[0], None)


@functools.cache
def int8_weight_limit() -> int | None:
    """The largest |int8 weight| whose products this process's integer GEMM (MLAS, `MatMulIntegerToFloat`)
    sums exactly, found once per process by running it against exact sums (`int8_gemm_is_exact`):

    - 127 (8-bit weights) where u8 x s8 products go straight into int32 (AVX-512 VNNI, AVX-VNNI, AMX);
    - 63 (7-bit) where the kernel first adds pairs of them in saturating int16 (vpmaddubsw: plain AVX2,
      AVX-512 without VNNI): 2 x 255 x 127 overflows int16 and the sums come out wrong (garbage text),
      2 x 255 x 63 fits;
    - None where neither is exact: the engine then runs float32 (checkpoint.resolve_weight_dtype).

    The kernels are asked, not /proc/cpuinfo: MLAS picks them from CPUID and the state the OS enables,
    which the flags need not match (qemu-user shows the host's flags to an emulated Haswell). Without
    onnxruntime the int8 path is numpy's float64 sums, exact at 127."""
    if importlib.util.find_spec("onnxruntime") is None:
        return 127
    for limit in (127, 63):
        if int8_gemm_is_exact(limit):
            return limit
    log.warning("int8 self-check: this CPU's integer GEMMs are not exact even with 7-bit weights")
    return None


def int8_gemm_is_exact(limit: int) -> bool:
    """Whether the integer GEMM of `_Graph.matmul` equals `quantization.linear_int8` with weights up to
    `limit`: on rows that quantize to +-127 everywhere (uint8 255 and 1, the largest pair sums) against
    columns of +-limit, and on random rows and weights, for 1, 4, 17 and 64 rows (MLAS has row-count kernels)
    and a depth that is not a multiple of the kernels' steps."""
    rng = np.random.default_rng(0)
    depth, width = 300, 48
    q = rng.integers(-limit, limit + 1, (width, depth)).astype(np.int8)
    q[:8], q[8:16] = limit, -limit  # every product of a loud row at its extreme, both signs
    m = Matrix(np.zeros((width, depth), np.float32))
    m.q, m.scale = q, np.ones(width, np.float32)
    g = _Graph("int8_self_check")
    g.output(g.matmul(g.input("x", depth), m, "w"), width)
    session = g.session(1)
    for rows in (1, 4, 17, 64):
        x = rng.standard_normal((rows, depth)).astype(np.float32)
        x[0] = 1.0
        if rows > 1:
            x[1] = -1.0
        got = session.run(None, {"x": x})[0]
        want = linear_int8(x, m.q, m.scale)
        if not np.allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max())):
            return False
    return True
