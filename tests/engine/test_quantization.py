"""The int8 scheme (cpu_engine/quantization.py) and its onnxruntime graphs, on the integer GEMM kernels
this host runs (tests/engine/test_isa_paths.py runs this file again as an AVX2 CPU under qemu)."""
import logging
import os

import numpy as np
import pytest

from cpu_engine import checkpoint as checkpoint_module
from cpu_engine.checkpoint import load_checkpoint, resolve_weight_dtype
from cpu_engine.quantization import Matrix
from cpu_engine.onnx_graphs import _Graph, int8_gemm_is_exact, int8_weight_limit
from cpu_engine.quantization import linear_int8, quantize_rows, quantize_weight


def int8_matrix(rng, out_dim, in_dim, limit=None):
    """A random int8 Matrix at the weight limit the engine uses on this host (the self-check's)."""
    m = Matrix(rng.standard_normal((out_dim, in_dim), dtype=np.float32))
    m.q, m.scale = quantize_weight(m.f32, limit or int8_weight_limit())
    return m


def graph_linear(m):
    g = _Graph("linear")
    g.output(g.matmul(g.input("x", m.shape[1]), m, "w"), m.shape[0])
    session = g.session(2)
    return lambda x: session.run(None, {"x": np.ascontiguousarray(x, dtype=np.float32)})[0]


@pytest.mark.parametrize("limit", [127, 63])
def test_weights_round_trip_within_half_a_step_per_channel(limit):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((40, 96), dtype=np.float32) * rng.uniform(0.01, 10, (40, 1)).astype(np.float32)
    q, scale = quantize_weight(w, limit)
    assert q.dtype == np.int8 and np.abs(q).max() == limit  # each channel's largest weight uses the full range
    assert np.all(np.abs(q * scale[:, None] - w) <= scale[:, None] * 0.5001)


def test_the_self_check_picks_the_widest_weights_this_hosts_integer_gemm_sums_exactly():
    """127 wherever 8-bit weights are exact on this host's kernels (VNNI), else 63 (vpmaddubsw's saturating
    int16 pair sums: AVX2, AVX-512 without VNNI). LLM_EXPECT_INT8_LIMIT pins it where the ISA is known
    (the qemu Haswell run of test_isa_paths.py sets 63)."""
    limit = int8_weight_limit()
    assert limit in (127, 63), "no exact integer GEMM on this host: int8 would run as float32"
    assert int8_gemm_is_exact(limit)
    assert int8_gemm_is_exact(127) == (limit == 127)  # 63 only where 8 bits really break
    if os.environ.get("LLM_EXPECT_INT8_LIMIT"):
        assert limit == int(os.environ["LLM_EXPECT_INT8_LIMIT"])


def test_int8_becomes_float32_where_no_weight_width_is_exact(monkeypatch, caplog, tiny_dir):
    monkeypatch.setattr(checkpoint_module, "int8_weight_limit", lambda: None)
    with caplog.at_level(logging.WARNING, logger="cpu_engine"):
        assert resolve_weight_dtype("int8") == "float32" and resolve_weight_dtype("auto", "onnxruntime") in (
            "float32", "bfloat16")
    assert "self-check" in caplog.text
    weights = load_checkpoint(tiny_dir, "int8")  # an explicit int8 too: never wrong sums
    assert weights.weight_dtype == "float32" and weights.weight_bits == 32 and weights.layers[0].wqkv.q is None


def test_seven_bit_weights_are_reported_as_such(tiny_dir):
    weights = load_checkpoint(tiny_dir, "int8", int8_limit=63)
    assert weights.weight_bits == 7 and np.abs(weights.layers[0].wqkv.q).max() == 63
    assert "7-bit" in weights.precision and "saturating int16" in weights.precision
    assert load_checkpoint(tiny_dir, "int8", int8_limit=127).weight_bits == 8


def test_rows_quantize_on_their_own_scale_and_zero_rows_stay_zero():
    x = np.array([[0.5, -1.0, 0.25], [100.0, 3.0, -50.0], [0.0, 0.0, 0.0]], dtype=np.float32)
    xq, scale = quantize_rows(x)
    assert np.array_equal(xq[0], [64, -127, 32]) and np.array_equal(xq[1], [127, 4, -64])
    assert np.all(xq[2] == 0) and np.all(np.isfinite(scale))


def test_int8_linear_is_close_to_float32_and_each_row_is_independent_of_the_batch():
    rng = np.random.default_rng(1)
    m = int8_matrix(rng, 48, 64)
    x = rng.standard_normal((16, 64), dtype=np.float32)
    x[3] *= 1000.0  # one loud row must not coarsen the others' steps
    want = x @ m.f32.T
    for linear in (lambda a: linear_int8(a, m.q, m.scale), graph_linear(m)):
        got = linear(x)
        rel = np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1)
        assert rel.max() < 0.02, rel
        alone = np.concatenate([linear(x[i:i + 1]) for i in range(len(x))])
        np.testing.assert_array_equal(alone, got)  # exact: the integer sums do not depend on the other rows


def test_onnxruntime_int8_graph_is_the_numpy_reference():
    rng = np.random.default_rng(2)
    for in_dim in (64, 1536):  # 1536 x 127 x 127 overflows float32's exact integers; the sums are int32
        m = int8_matrix(rng, 72, in_dim)
        x = rng.standard_normal((9, in_dim), dtype=np.float32)
        np.testing.assert_allclose(graph_linear(m)(x), linear_int8(x, m.q, m.scale), rtol=1e-5, atol=1e-5)
