"""LoRA adapters on the CPU engine (cpu_engine/lora.py): exact against merged weights, batch-invariant,
LRU pool, load errors, prefix-cache isolation."""
import json
import time

import numpy as np
import pytest

from build.make_demo_adapters import write_adapter
from cpu_engine import EngineConfig, LLMEngine, SamplingParams
from cpu_engine.checkpoint import load_checkpoint
from cpu_engine.quantization import Matrix
from cpu_engine.kv_cache_manager import ROOT_KEY, block_key
from cpu_engine.llama import LlamaModel
from cpu_engine.lora import (AdapterLoadError, AdapterNotFoundError, LoraPool, StepLora, load_adapter, task_id)

from tests.engine.conftest import run_all

ADAPTERS = {  # name -> (seed, rank, alpha, targets)
    "alpha": (1, 4, 8, ("q", "v")),
    "beta": (2, 8, 16, ("q", "k", "v", "o", "gate", "up", "down")),
    "gamma": (3, 2, 4, ("gate", "up", "down")),
}
PROMPTS = [[5, 17, 33, 2, 9, 100, 41], [7, 7, 1, 200, 13], [3, 44, 91, 12, 18, 250, 6, 2, 30], [60, 61, 62]]


@pytest.fixture(scope="module")
def lora_dir(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("loras")
    cfg = json.loads((tiny_dir / "config.json").read_text())
    for name, (seed, rank, alpha, targets) in ADAPTERS.items():
        write_adapter(out / name, cfg, seed, rank, alpha, targets, strength=1.0)
    return out


def greedy(n):
    return SamplingParams(max_new_tokens=n, temperature=0.0)


def engine(tiny_dir, lora_dir, **kw):
    kw.setdefault("max_tokens_in_paged_kv_cache", 2048)
    kw.setdefault("tokens_per_block", 4)
    kw.setdefault("max_num_tokens", 16)
    kw.setdefault("weight_dtype", "float32")
    return LLMEngine(EngineConfig(str(tiny_dir), lora_dir=str(lora_dir), **kw))


def run(eng, requests):
    """requests: id -> (prompt, adapter); greedy 12 tokens each, all submitted at once."""
    tokens, finals = {r: [] for r in requests}, {}

    def collector(rid):
        def on_output(out):
            tokens[rid].extend(out.new_token_ids)
            if out.finished:
                finals[rid] = out
        return on_output

    for rid, (prompt, adapter) in requests.items():
        eng.submit(rid, prompt, greedy(12), collector(rid), adapter=adapter)
    deadline = time.monotonic() + 60
    while len(finals) < len(requests):
        eng.step()
        assert time.monotonic() < deadline, "engine did not drain"
    for rid, out in finals.items():
        assert out.error is None, out.error
    return tokens


def merged_weights(tiny_dir, adapter):
    """The checkpoint with W + scale·B·A for every module the adapter touches."""
    w = load_checkpoint(tiny_dir, "float32")
    c = w.config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    for i, layer in enumerate(w.layers):
        def add(m, rows, name):
            d = adapter.delta_weight(i, name)
            if d is not None:
                m.f32[rows] += d
        add(layer.wqkv, slice(0, q), "q")
        add(layer.wqkv, slice(q, q + kv), "k")
        add(layer.wqkv, slice(q + kv, None), "v")
        add(layer.wo, slice(None), "o")
        add(layer.w_gate_up, slice(0, c.intermediate_size), "gate")
        add(layer.w_gate_up, slice(c.intermediate_size, None), "up")
        add(layer.w_down, slice(None), "down")
    return w


@pytest.mark.parametrize("backend", ["onnxruntime", "numpy"])
@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_greedy_output_equals_the_merged_model(tiny_dir, lora_dir, name, backend):
    eng = engine(tiny_dir, lora_dir, matmul_backend=backend)
    got = run(eng, {f"p{i}": (p, name) for i, p in enumerate(PROMPTS)})
    adapter = load_adapter(lora_dir / name, eng.weights.config, 64)
    merged = LLMEngine(EngineConfig(str(tiny_dir), max_tokens_in_paged_kv_cache=2048, tokens_per_block=4,
                                    max_num_tokens=16, weight_dtype="float32", matmul_backend=backend),
                       weights=merged_weights(tiny_dir, adapter))
    want = run(merged, {f"p{i}": (p, None) for i, p in enumerate(PROMPTS)})
    assert got == want
    base = run(engine(tiny_dir, lora_dir, matmul_backend=backend), {f"p{i}": (p, None) for i, p in enumerate(PROMPTS)})
    assert got != base, "the adapter changed nothing: the test could not tell"


def test_logits_match_the_merged_model_closely(tiny_dir, lora_dir):
    w = load_checkpoint(tiny_dir, "float32")
    adapter = load_adapter(lora_dir / "beta", w.config, 64)
    model = LlamaModel(w, 64)
    ids = PROMPTS[2]
    lora = StepLora([(adapter, np.arange(len(ids)))], len(ids))
    got = model.forward_reference(ids, lora)
    want = LlamaModel(merged_weights(tiny_dir, adapter), 64).forward_reference(ids)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert not np.allclose(got, model.forward_reference(ids), atol=1e-2)


@pytest.mark.parametrize("weight_dtype", ["float32", "int8"])
def test_fused_lora_graphs_match_the_numpy_lora_math(tiny_dir, lora_dir, weight_dtype):
    """The onnxruntime layer graphs with adapters against llama.py's numpy path, for a step mixing three
    adapters and base rows; with int8 weights both take x·A as an int8 product (StepLora)."""
    weights = load_checkpoint(tiny_dir, weight_dtype)
    adapters = [load_adapter(lora_dir / name, weights.config, 64) for name in ADAPTERS]
    numpy_model = LlamaModel(weights, 64)
    fused_model = LlamaModel(weights, 64, matmul_backend="onnxruntime", lora=True)
    assert fused_model.fused_lora is not None
    rows = 16
    groups = [(a, np.arange(i, rows, 4)) for i, a in enumerate(adapters)]  # rows 3, 7, 11, 15: the base model
    lora = StepLora(groups, rows, int8=weight_dtype == "int8")
    rng = np.random.default_rng(7)
    x = rng.standard_normal((rows, 64), dtype=np.float32)
    close = dict(rtol=1e-4, atol=1e-4)
    for got, want in zip(fused_model._start(x, lora), numpy_model._start(x, lora)):
        np.testing.assert_allclose(got, want, **close)
    for i in range(weights.config.num_layers):
        attn = rng.standard_normal((rows, 64), dtype=np.float32)
        got, want = fused_model._finish_layer(i, x, attn, lora), numpy_model._finish_layer(i, x, attn, lora)
        np.testing.assert_allclose(got[0], want[0], **close)
        if want[1] is not None:
            np.testing.assert_allclose(got[1], want[1], **close)
        base = numpy_model._finish_layer(i, x, attn)
        assert not np.allclose(want[0][:3], base[0][:3], atol=1e-3)  # the adapters' rows moved
        np.testing.assert_array_equal(want[0][3::4], base[0][3::4])  # the base rows did not


def test_int8_lora_stays_close_to_float32_lora(tiny_dir, lora_dir):
    """int8 x·A (quantized rows, one scale per A column) changes a delta by about what int8 changes the
    base matmul: a few percent of its size."""
    w = load_checkpoint(tiny_dir, "float32")
    adapter = load_adapter(lora_dir / "beta", w.config, 64)
    x = np.random.default_rng(3).standard_normal((8, 64), dtype=np.float32)
    rows = [(adapter, np.arange(8))]
    for module, width in (("q", 64), ("gate", w.config.intermediate_size)):
        exact = StepLora(rows, 8).delta(1, module, x, width)
        approx = StepLora(rows, 8, int8=True).delta(1, module, x, width)
        assert np.linalg.norm(approx - exact) < 0.03 * np.linalg.norm(exact)
        assert not np.array_equal(approx, exact)


@pytest.mark.parametrize("backend", ["onnxruntime", "numpy"])
def test_a_batch_mixing_three_adapters_and_the_base_equals_each_alone(tiny_dir, lora_dir, backend):
    mix = {"a": (PROMPTS[0], "alpha"), "b": (PROMPTS[1], "beta"), "g": (PROMPTS[2], "gamma"), "base": (PROMPTS[3], None),
           "b2": (PROMPTS[0], "beta"), "base2": (PROMPTS[2], None)}
    together = run(engine(tiny_dir, lora_dir, matmul_backend=backend, max_num_tokens=64), mix)
    for rid, req in mix.items():
        alone = run(engine(tiny_dir, lora_dir, matmul_backend=backend), {rid: req})
        assert together[rid] == alone[rid], rid
    assert len({tuple(together[r]) for r in ("a", "b2")}) == 2  # same-length prompts, other adapters differ


def test_an_evicted_and_reloaded_adapter_gives_the_same_output(tiny_dir, lora_dir):
    eng = engine(tiny_dir, lora_dir, max_loras=1)
    first = run(eng, {"x": (PROMPTS[0], "alpha")})
    run(eng, {"y": (PROMPTS[1], "beta")})  # the single slot goes to beta: alpha is evicted
    again = run(eng, {"z": (PROMPTS[0], "alpha")})
    assert again["z"] == first["x"]
    stats = eng.stats()
    assert stats["lora_loads"] == 3 and stats["lora_evictions"] == 2 and stats["lora_adapters_loaded"] == 1
    assert stats["lora_requests"] == {"alpha": 2, "beta": 1}


def test_with_one_slot_requests_for_two_adapters_all_finish(tiny_dir, lora_dir):
    """The second adapter waits until the first one's requests end and its slot is free."""
    eng = engine(tiny_dir, lora_dir, max_loras=1)
    got = run(eng, {"a": (PROMPTS[0], "alpha"), "b": (PROMPTS[1], "beta"), "n": (PROMPTS[2], None)})
    assert got == {**run(engine(tiny_dir, lora_dir), {"a": (PROMPTS[0], "alpha")}),
                   **run(engine(tiny_dir, lora_dir), {"b": (PROMPTS[1], "beta")}),
                   **run(engine(tiny_dir, lora_dir), {"n": (PROMPTS[2], None)})}


def test_base_requests_keep_running_while_an_adapter_loads(tiny_dir, lora_dir, monkeypatch):
    import cpu_engine.lora as lora_mod

    release = __import__("threading").Event()
    real = lora_mod.load_adapter

    def slow(*a, **k):
        release.wait(30)
        return real(*a, **k)

    monkeypatch.setattr(lora_mod, "load_adapter", slow)
    eng = engine(tiny_dir, lora_dir)
    done = {}
    eng.submit("lora", PROMPTS[0], greedy(4), lambda o: done.setdefault("lora", o) if o.finished else None,
               adapter="alpha")
    eng.submit("base", PROMPTS[1], greedy(4), lambda o: done.setdefault("base", o) if o.finished else None)
    for _ in range(50):
        eng.step()
    assert "base" in done and "lora" not in done  # the base request finished while the load was held
    release.set()
    deadline = time.monotonic() + 30
    while "lora" not in done:
        eng.step()
        assert time.monotonic() < deadline
    assert done["lora"].error is None


def test_unknown_adapter_is_a_not_found_error_naming_it(tiny_dir, lora_dir):
    eng = engine(tiny_dir, lora_dir)
    with pytest.raises(AdapterNotFoundError, match="'nope' not found.*available: alpha, beta, gamma"):
        eng.submit("x", PROMPTS[0], greedy(2), lambda o: None, adapter="nope")
    with pytest.raises(AdapterNotFoundError, match="lora_task_id 12345"):
        eng.submit("x", PROMPTS[0], greedy(2), lambda o: None, lora_task_id=12345)
    no_lora = LLMEngine(EngineConfig(str(tiny_dir), max_tokens_in_paged_kv_cache=2048, weight_dtype="float32"))
    with pytest.raises(AdapterNotFoundError, match="lora_dir is not set"):
        no_lora.submit("x", PROMPTS[0], greedy(2), lambda o: None, adapter="alpha")


def test_task_ids_map_back_to_folder_names(tiny_dir, lora_dir):
    eng = engine(tiny_dir, lora_dir)
    got = run(eng, {"by_id": (PROMPTS[0], None)})  # warm nothing; then by task id
    tokens, done = [], []
    eng.submit("t", PROMPTS[0], greedy(12), lambda o: (tokens.extend(o.new_token_ids), o.finished and done.append(o)),
               lora_task_id=task_id("beta"))
    deadline = time.monotonic() + 30
    while not done:
        eng.step()
        assert time.monotonic() < deadline
    assert tokens == run(engine(tiny_dir, lora_dir), {"n": (PROMPTS[0], "beta")})["n"] != got["by_id"]
    assert 0 <= task_id("beta") < 2 ** 63 and task_id("beta") != task_id("alpha")


def test_rank_above_the_limit_and_bad_shapes_fail_at_load_with_a_clear_error(tiny_dir, lora_dir, tmp_path):
    cfg = json.loads((tiny_dir / "config.json").read_text())
    write_adapter(tmp_path / "wide", cfg, 5, 16, 16, ("q",), 1.0)
    bad = write_adapter(tmp_path / "bad", cfg, 6, 4, 4, ("k",), 1.0)
    wrong = dict(cfg, hidden_size=cfg["hidden_size"] * 2)
    write_adapter(tmp_path / "other_model", wrong, 7, 4, 4, ("q",), 1.0)
    eng = engine(tiny_dir, tmp_path, max_lora_rank=8)
    outs = {}
    for name in ("wide", "other_model"):
        eng.submit(name, PROMPTS[0], greedy(2), lambda o, n=name: outs.setdefault(n, o) if o.finished else None,
                   adapter=name)
    deadline = time.monotonic() + 30
    while len(outs) < 2:
        eng.step()
        assert time.monotonic() < deadline
    assert "rank 16 is above max_lora_rank 8" in outs["wide"].error and outs["wide"].error_kind == "invalid_argument"
    assert "do not fit the model" in outs["other_model"].error
    assert eng.stats()["lora_adapters_loaded"] == 0
    with pytest.raises(AdapterLoadError, match="layer 0 self_attn.k_proj"):  # B's shape does not fit k
        import cpu_engine.checkpoint as ck
        (bad / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 4, "target_modules": ["k_proj"]}))
        t = ck._read_safetensors(bad / "adapter_model.safetensors")
        from build.make_demo_adapters import write_safetensors
        t = {k: np.array(v) for k, v in t.items()}
        t["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"] = np.zeros((3, 4), np.float32)
        write_safetensors(bad / "adapter_model.safetensors", t)
        load_adapter(bad, eng.weights.config, 8)


def test_prefix_cache_reuse_never_crosses_adapters(tiny_dir, lora_dir):
    eng = engine(tiny_dir, lora_dir, enable_kv_cache_reuse=True)
    prompt = list(range(10, 30))  # 5 full blocks of 4
    reused = {}

    def collect(rid):
        return lambda o: reused.setdefault(rid, o.kv_cache_reused_blocks) if o.finished else None

    def one(rid, adapter):
        eng.submit(rid, prompt, greedy(3), collect(rid), adapter=adapter)
        while rid not in reused:
            eng.step()

    one("base", None)
    one("alpha1", "alpha")
    one("beta1", "beta")
    one("alpha2", "alpha")
    one("base2", None)
    assert reused == {"base": 0, "alpha1": 0, "beta1": 0, "alpha2": 4, "base2": 4}
    # the adapter's identity (name + content digest) is part of the SHA-256 block key
    k = block_key(ROOT_KEY, "salt", [1, 2, 3, 4])
    assert len({k, block_key(ROOT_KEY, ("salt", "alpha@x"), [1, 2, 3, 4]),
                block_key(ROOT_KEY, ("salt", "alpha@y"), [1, 2, 3, 4]),
                block_key(ROOT_KEY, (None, "alpha@x"), [1, 2, 3, 4])}) == 4


def test_pool_lru_keeps_pinned_adapters(tiny_dir, lora_dir):
    cfg = load_checkpoint(tiny_dir, "float32").config
    pool = LoraPool(lora_dir, 2, 64, cfg)

    def get(name):
        deadline = time.monotonic() + 10
        while (a := pool.acquire(name)) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        return a

    a, b = get("alpha"), get("beta")
    assert pool.acquire("gamma") is None and not pool.loading  # both pinned: no slot, no load
    pool.release(a)
    g = get("gamma")  # alpha (unpinned, least recently used) makes room
    assert list(pool.loaded) == ["beta", "gamma"] and pool.evictions == 1
    pool.release(b), pool.release(g)
    assert pool.names() == ["alpha", "beta", "gamma"]
    assert pool.resolve(lora_task_id=task_id("gamma")) == "gamma"
    assert isinstance(Matrix, type)
