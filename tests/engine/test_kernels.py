"""The compiled kernels against the numpy math they replace (cpu_engine/kernels.py, onnx_graphs.py)."""
import numpy as np
import pytest

from cpu_engine import EngineConfig, kernels, onnx_graphs
from cpu_engine.checkpoint import load_checkpoint, resolve_weight_dtype
from cpu_engine.quantization import Matrix
from cpu_engine.config import ConfigError
from cpu_engine.llama import KVCache, LlamaModel


@pytest.mark.parametrize("rows", [1, 3, 16, 70])
def test_packed_linear_matches_numpy(rows):
    rng = np.random.default_rng(rows)
    w = rng.standard_normal((96, 40), dtype=np.float32)
    x = rng.standard_normal((rows, 40), dtype=np.float32)
    packed = onnx_graphs.PackedLinear(Matrix(w), threads=2)
    np.testing.assert_allclose(packed(x), x @ w.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(packed(x[::2]), x[::2] @ w.T, rtol=1e-5, atol=1e-5)  # strided input


def numpy_decode_attention(q, kc, vc, slots, lens, scale):
    B, H, D = q.shape
    G = H // kc.shape[1]
    out = np.empty((B, H, D), np.float32)
    for b in range(B):
        ctx = slots[b, :lens[b]]
        for h in range(H):
            s = (kc[ctx, h // G] @ q[b, h]) * scale
            p = np.exp(s - s.max())
            out[b, h] = (p / p.sum()) @ vc[ctx, h // G]
    return out.reshape(B, H * D)


def test_decode_attention_reads_each_context_through_its_slots():
    rng = np.random.default_rng(0)
    kv = KVCache(1, 64, 2, 8)
    kv.k[0], kv.v[0] = rng.standard_normal((2, 64, 2, 8), dtype=np.float32)
    lens = np.array([1, 5, 17])
    slots = np.zeros((3, 17), dtype=np.int64)  # padded rows; scattered, non-contiguous slots
    for b, n in enumerate(lens):
        slots[b, :n] = rng.permutation(64)[:n]
    q = rng.standard_normal((3, 6, 8), dtype=np.float32)  # 6 heads over 2 kv heads (GQA groups of 3)
    got = kernels.decode_attention(q, kv.k[0], kv.v[0], slots, lens, np.float32(8 ** -0.5))
    want = numpy_decode_attention(q, kv.k[0], kv.v[0], slots, lens, np.float32(8 ** -0.5))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_decode_attention_gives_the_same_bits_on_one_thread_and_on_all(monkeypatch):
    """Few sequences run the parallel kernel on the calling thread alone (SERIAL_BELOW); the result may not
    depend on which, and the caller's numba thread count comes back."""
    import numba

    rng = np.random.default_rng(3)
    kv = KVCache(1, 128, 2, 8)
    kv.k[0], kv.v[0] = rng.standard_normal((2, 128, 2, 8), dtype=np.float32)
    lens = rng.integers(1, 40, 12)
    slots = np.stack([rng.permutation(128)[:40] for _ in lens]).astype(np.int64)
    q = rng.standard_normal((12, 4, 8), dtype=np.float32)
    before = numba.get_num_threads()
    outs = []
    for serial_below in (0, 100):
        monkeypatch.setattr(kernels, "SERIAL_BELOW", serial_below)
        outs.append(kernels.decode_attention(q, kv.k[0], kv.v[0], slots, lens, np.float32(0.3)))
        assert numba.get_num_threads() == before
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_allclose(outs[0], numpy_decode_attention(q, kv.k[0], kv.v[0], slots, lens, np.float32(0.3)),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spread", [0.01, 1.0, 30.0, 400.0])
def test_decode_attention_softmax_holds_from_flat_to_one_hot_scores(spread):
    """The kernel's own exp (a polynomial times 2^n, kernels.py) across score ranges: near-uniform, normal,
    sharp, and gaps beyond float32's exp range (those weights must come out 0, the top one 1)."""
    rng = np.random.default_rng(int(spread * 10))
    kv = KVCache(1, 300, 1, 16)
    kv.k[0], kv.v[0] = rng.standard_normal((2, 300, 1, 16), dtype=np.float32)
    lens = np.array([300, 7])
    slots = np.stack([rng.permutation(300), rng.permutation(300)]).astype(np.int64)
    q = (rng.standard_normal((2, 2, 16)) * spread).astype(np.float32)
    got = kernels.decode_attention(q, kv.k[0], kv.v[0], slots, lens, np.float32(0.25))
    want = numpy_decode_attention(q, kv.k[0], kv.v[0], slots, lens, np.float32(0.25))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("weight_dtype", ["float32", "int8"])
@pytest.mark.parametrize("rows", [1, 16])
def test_fused_layer_graphs_match_the_numpy_layer_math(tiny_dir, rows, weight_dtype):
    weights = load_checkpoint(tiny_dir, weight_dtype)
    numpy_model, fused_model = LlamaModel(weights, 64), LlamaModel(weights, 64, matmul_backend="onnxruntime")
    assert fused_model.fused is not None and numpy_model.fused is None
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 64), dtype=np.float32)
    close = dict(rtol=1e-4, atol=1e-4)
    for got, want in zip(fused_model._start(x), numpy_model._start(x)):
        np.testing.assert_allclose(got, want, **close)
    for i in range(weights.config.num_layers):  # the last layer has no next q/k/v
        attn = rng.standard_normal((rows, 64), dtype=np.float32)
        (x_got, qkv_got), (x_want, qkv_want) = fused_model._finish_layer(i, x, attn), numpy_model._finish_layer(i, x, attn)
        np.testing.assert_allclose(x_got, x_want, **close)
        assert (qkv_got is None) == (qkv_want is None) == (i == weights.config.num_layers - 1)
        if qkv_want is not None:
            np.testing.assert_allclose(qkv_got, qkv_want, **close)


def test_rope_store_is_the_numpy_rope_and_cache_write(tiny_dir):
    weights = load_checkpoint(tiny_dir, "float32")
    numpy_model, numba_model = LlamaModel(weights, 64), LlamaModel(weights, 64, attention_backend="numba")
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((5, 128), dtype=np.float32)  # 4 q heads + 2 k + 2 v heads of 16
    positions, slots = np.array([0, 7, 8, 9, 63]), np.array([3, 40, 41, 12, 0])
    caches = [KVCache(1, 48, 2, 16) for _ in range(2)]
    q_want = numpy_model._rope_store(qkv, positions, caches[0].k[0], caches[0].v[0], slots)
    q_got = numba_model._rope_store(qkv, positions, caches[1].k[0], caches[1].v[0], slots)
    np.testing.assert_array_equal(q_got, q_want)  # same float32 operations in the same order
    np.testing.assert_array_equal(caches[1].k, caches[0].k)
    np.testing.assert_array_equal(caches[1].v, caches[0].v)
    assert np.count_nonzero(np.abs(caches[1].k[0]).sum(axis=(1, 2))) == len(slots)  # nothing else written


def test_backend_knobs_resolve_and_fail_clearly(tiny_dir, monkeypatch):
    assert kernels.resolve("matmul_backend", "auto") == "onnxruntime"  # installed by requirements.txt
    assert kernels.resolve("attention_backend", "numpy") == "numpy"
    monkeypatch.setattr(kernels.importlib.util, "find_spec", lambda name: None)
    assert kernels.resolve("attention_backend", "auto") == "numpy"  # a missing package: numpy, still correct
    with pytest.raises(ImportError, match="attention_backend=numba needs the numba package"):
        kernels.resolve("attention_backend", "numba")
    with pytest.raises(ConfigError, match="matmul_backend must be one of auto, numpy, onnxruntime"):
        EngineConfig(str(tiny_dir), matmul_backend="mkl")
    if resolve_weight_dtype("auto") != "bfloat16":  # no torch with native bf16 here: int8 needs onnxruntime
        assert resolve_weight_dtype("auto", "onnxruntime") == "int8" and resolve_weight_dtype("auto", "numpy") == "float32"
    with pytest.raises(ConfigError, match="weight_dtype must be one of auto, float32, bfloat16, int8, got 'fp8'"):
        EngineConfig(str(tiny_dir), weight_dtype="fp8")


@pytest.mark.parametrize("weight_dtype", ["float32", "int8"])
def test_engine_releases_its_numpy_copies_once_packed(make_engine, weight_dtype):
    engine = make_engine(weight_dtype=weight_dtype)  # loads its own weights: the packed copies are the only ones kept
    layer = engine.weights.layers[0]
    assert engine.matmul_backend == "onnxruntime" and layer.wqkv.shape[1] == 64  # the shape stays known
    assert engine.model.fused is not None  # float32 or int8 weights: whole layers fused into one graph each
    assert all(m.f32 is None and m.q is None for m in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down))
    assert engine.weights.embed is not None  # the token lookup stays
