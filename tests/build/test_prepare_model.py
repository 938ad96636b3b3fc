"""GGUF -> Hugging Face conversion (build/prepare_model.py)."""
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from build import prepare_model as pm

FILES = pm.FILES + (pm.MARKER,)


@pytest.fixture(scope="session")
def prepared(tmp_path_factory) -> Path:
    """The repo's prepared checkpoint when complete, else one conversion into a temp folder."""
    gguf_path = pm.find_gguf()
    if pm.is_prepared(pm.DEFAULT_CHECKPOINT, gguf_path):
        return pm.DEFAULT_CHECKPOINT
    return pm.prepare(tmp_path_factory.mktemp("model") / "SmolLM2-135M-Instruct", gguf_path)


@pytest.fixture(scope="session")
def weights(prepared) -> dict:
    with safe_open(str(prepared / "model.safetensors"), "np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture(scope="session")
def config(prepared) -> dict:
    return json.loads((prepared / "config.json").read_text())


@pytest.fixture(scope="session")
def tokenizer(prepared):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(prepared / "tokenizer.json"))


# --- permutation -------------------------------------------------------------------------------
def test_permutation_round_trip():
    rng = np.random.default_rng(0)
    for heads, head_dim, cols in [(1, 4, 1), (2, 8, 3), (9, 64, 5), (3, 64, 576)]:
        w = rng.standard_normal((heads * head_dim, cols)).astype(np.float32)
        assert np.array_equal(pm.unpermute_rows(pm.permute_rows(w, heads), heads), w)
        assert np.array_equal(pm.permute_rows(pm.unpermute_rows(w, heads), heads), w)
        if head_dim > 2:
            assert not np.array_equal(pm.permute_rows(w, heads), w)
    # one head of dim 4: HF rows [a0 a1 | b0 b1] (halves) <-> llama.cpp rows [a0 b0 a1 b1] (pairs)
    head = np.arange(4, dtype=np.float32)[:, None]
    assert pm.permute_rows(head, 1).ravel().tolist() == [0, 2, 1, 3]
    # two heads of dim 4: each head permuted on its own
    two = np.arange(8, dtype=np.float32)[:, None]
    assert pm.permute_rows(two, 2).ravel().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert pm.unpermute_rows(two, 2).ravel().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


# --- files and config --------------------------------------------------------------------------
def test_files_exist_and_parse(prepared):
    for name in FILES:
        assert (prepared / name).is_file(), name
        if name.endswith(".json"):
            json.loads((prepared / name).read_text())
    marker = json.loads((prepared / pm.MARKER).read_text())
    assert len(marker["sha256"]) == 64 and marker["converter_version"] == pm.CONVERTER_VERSION


def test_config_matches_smollm2(config):
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"], config["head_dim"]) == (576, 30, 9, 3, 1536, 64)
    assert config["tie_word_embeddings"] is True and config["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == 1e-5 and config["max_position_embeddings"] == 8192
    assert config["vocab_size"] == 49152 and config["torch_dtype"] == "float32"
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)


def test_tensor_names_and_shapes_match_config(weights, config):
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d = config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    want = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        want.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
    assert {k: w.shape for k, w in weights.items()} == want  # no lm_head: tied
    assert all(w.dtype == np.float32 for w in weights.values())


def test_weights_equal_gguf_dequantization_after_unpermutation(weights):
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(pm.find_gguf()))
    raw = {t.name: t for t in reader.tensors}

    def deq(name, shape):
        t = raw[name]
        return dequantize(t.data, t.tensor_type).reshape(shape)

    q, k = weights["model.layers.3.self_attn.q_proj.weight"], weights["model.layers.3.self_attn.k_proj.weight"]
    gq, gk = deq("blk.3.attn_q.weight", q.shape), deq("blk.3.attn_k.weight", k.shape)
    assert np.array_equal(q, pm.unpermute_rows(gq, 9)) and np.array_equal(pm.permute_rows(q, 9), gq)
    assert np.array_equal(k, pm.unpermute_rows(gk, 3)) and np.array_equal(pm.permute_rows(k, 3), gk)
    for gname, hname in [("blk.3.attn_v.weight", "model.layers.3.self_attn.v_proj.weight"),
                         ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),
                         ("token_embd.weight", "model.embed_tokens.weight")]:
        assert np.array_equal(weights[hname], deq(gname, weights[hname].shape)), gname


# --- tokenizer ---------------------------------------------------------------------------------
ROUND_TRIP = [
    "Hello world 12345!", "  spaces   inside\n\nand\ttabs \n", "It's the user's (café) — naïve, résumé?",
    "東京タワー 中文字符 한국어", "emoji 🚀🎉 👩‍👩‍👧 ok", "x=3.14159; y = [1,2,3]\n\tdef f(): return {'a': 1}",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "",
]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_tokenizer_round_trips(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text


def test_special_tokens_encode_as_single_ids(tokenizer):
    assert tokenizer.encode("<|im_start|>").ids == [1]
    assert tokenizer.encode("<|im_end|>").ids == [2]
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2 and ids.count(1) == 1 and ids.count(2) == 1
    assert tokenizer.encode("hi").ids[0] != 1  # no BOS added
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_pre_tokenizer_matches_llama_cpp_smollm_rules(tokenizer):
    # llama.cpp "smollm" (llama-vocab.cpp): split every \p{N} alone, then the GPT-2 regex, where
    # `\s+(?!\S)` leaves the last blank of a run to the next piece. Byte-level: Ġ = space, Ċ = newline.
    pieces = [p for p, _ in tokenizer.pre_tokenizer.pre_tokenize_str("Hello, world! In 2024 it's  ok\n\nyes")]
    assert pieces == ["Hello", ",", "Ġworld", "!", "ĠIn", "Ġ", "2", "0", "2", "4", "Ġit", "'s", "Ġ", "Ġok",
                      "Ċ", "Ċ", "yes"]
    assert tokenizer.encode("2024").ids == [tokenizer.token_to_id(c) for c in "2024"]
    assert tokenizer.encode(" Paris").tokens == ["ĠParis"]


def test_tokenizer_config_and_chat_template(prepared):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    tcfg = json.loads((prepared / "tokenizer_config.json").read_text())
    smap = json.loads((prepared / "special_tokens_map.json").read_text())
    gen = json.loads((prepared / "generation_config.json").read_text())
    assert (tcfg["bos_token"], tcfg["eos_token"], tcfg["pad_token"], tcfg["unk_token"]) == \
        ("<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    assert tcfg["add_bos_token"] is False and tcfg["add_eos_token"] is False
    assert tcfg["model_max_length"] == 8192
    assert tcfg["added_tokens_decoder"]["2"]["content"] == "<|im_end|>" and tcfg["added_tokens_decoder"]["2"]["special"]
    assert smap["eos_token"] == "<|im_end|>" and gen["eos_token_id"] == 2
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    text = env.from_string(tcfg["chat_template"]).render(
        messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


# --- numerics: a minimal pure-numpy Llama forward ----------------------------------------------
def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, theta):  # x [T, heads, D]; HF rotate_half: pairs (i, i + D/2)
    t, d = x.shape[0], x.shape[-1]
    ang = np.arange(t)[:, None] * theta ** (-np.arange(0, d, 2) / d)[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
    return x * cos + np.concatenate([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


def _logits(w, cfg, ids):
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    t = len(ids)
    x = w["model.embed_tokens.weight"][ids].astype(np.float64)
    mask = np.triu(np.full((t, t), -np.inf), 1)
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        q = _rope((h @ w[p + "self_attn.q_proj.weight"].T).reshape(t, nh, d), theta)
        k = _rope((h @ w[p + "self_attn.k_proj.weight"].T).reshape(t, nkv, d), theta)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(t, nkv, d)
        k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)  # GQA
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(d) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", s, v).reshape(t, nh * d) @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        g, u = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ w[p + "mlp.down_proj.weight"].T
    x = _rms(x[-1], w["model.norm.weight"], eps)
    return x @ w["model.embed_tokens.weight"].T  # tied lm_head


def _greedy(w, cfg, ids, n):
    ids = list(ids)
    for _ in range(n):
        ids.append(int(np.argmax(_logits(w, cfg, ids))))
    return ids


def test_numpy_forward_continues_capital_of_france_with_paris(weights, config, tokenizer):
    prompt = tokenizer.encode("The capital of France is").ids
    out = _greedy(weights, config, prompt, 3)
    continuation = tokenizer.decode(out[len(prompt):])
    assert continuation.startswith(" Paris"), continuation  # llama.cpp: " Paris.\n\nThe United States has"


def test_forward_with_llama_cpp_row_order_is_wrong(weights, config, tokenizer):
    """Control: leaving q/k in llama.cpp's permuted order changes the logits a lot (the check has teeth)."""
    prompt = tokenizer.encode("The capital of France is").ids
    wrong = dict(weights)
    for n in range(config["num_hidden_layers"]):
        for proj, heads in (("q_proj", config["num_attention_heads"]), ("k_proj", config["num_key_value_heads"])):
            key = f"model.layers.{n}.self_attn.{proj}.weight"
            wrong[key] = pm.permute_rows(weights[key], heads)
    good, bad = _logits(weights, config, prompt), _logits(wrong, config, prompt)
    assert np.abs(good - bad).max() > 1.0


# --- idempotency, atomicity, errors ------------------------------------------------------------
def test_second_run_is_a_fast_no_op(prepared, capsys):
    before = (prepared / "model.safetensors").stat().st_mtime_ns
    t0 = time.monotonic()
    assert pm.prepare(prepared) == prepared
    assert time.monotonic() - t0 < 1.0
    assert (prepared / "model.safetensors").stat().st_mtime_ns == before
    assert "already prepared" in capsys.readouterr().err


def test_is_prepared_needs_every_file_and_a_matching_marker(prepared, tmp_path):
    gguf_path = pm.find_gguf()
    for name in FILES:
        os.symlink(prepared / name, tmp_path / name)
    assert pm.is_prepared(tmp_path, gguf_path)
    (tmp_path / "tokenizer.json").unlink()
    assert not pm.is_prepared(tmp_path, gguf_path)
    os.symlink(prepared / "tokenizer.json", tmp_path / "tokenizer.json")
    marker = json.loads((prepared / pm.MARKER).read_text())
    (tmp_path / pm.MARKER).unlink()
    (tmp_path / pm.MARKER).write_text(json.dumps({**marker, "converter_version": -1}))
    assert not pm.is_prepared(tmp_path, gguf_path)
    (tmp_path / pm.MARKER).write_text(json.dumps({**marker, "size": marker["size"] + 1}))
    assert not pm.is_prepared(tmp_path, gguf_path)


def test_interrupted_run_leaves_no_folder(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(pm, "convert_weights", boom)
    with pytest.raises(KeyboardInterrupt):
        pm.prepare(tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_missing_gguf_is_a_clear_error(tmp_path):
    with pytest.raises(pm.PrepareError, match="not found"):
        pm.prepare(tmp_path / "out", gguf_path=tmp_path / "missing.gguf")
    assert pm.main(["--gguf", str(tmp_path / "missing.gguf"), "--out", str(tmp_path / "out")]) == 1


def test_not_a_gguf_is_a_clear_error(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(pm.PrepareError, match="not a readable GGUF"):
        pm.prepare(tmp_path / "out", gguf_path=bogus)


def test_unsupported_quant_type_is_a_clear_error(monkeypatch):
    import gguf.quants
    from types import SimpleNamespace

    def no(*a, **k):
        raise NotImplementedError

    monkeypatch.setattr(gguf.quants, "dequantize", no)
    fake = SimpleNamespace(tensors=[SimpleNamespace(name="blk.0.attn_q.weight", data=None,
                                                    tensor_type=gguf.GGMLQuantizationType.IQ2_XXS)])
    with pytest.raises(pm.PrepareError, match="IQ2_XXS is not supported"):
        pm.convert_weights(fake, {"num_hidden_layers": 1, "num_attention_heads": 9, "num_key_value_heads": 3})
