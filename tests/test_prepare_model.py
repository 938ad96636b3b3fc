"""GGUF -> Hugging Face conversion (build/prepare_model.py)."""
import json
import time

import numpy as np
import pytest
from safetensors import safe_open

from build import prepare_model as pm


def test_permutation_round_trip():
    w = np.arange(2 * 8 * 3, dtype=np.float32).reshape(16, 3)
    assert np.array_equal(pm.unpermute_rows(pm.permute_rows(w, 2), 2), w)
    assert not np.array_equal(pm.permute_rows(w, 2), w)
    # one head of dim 4: HF rows [a0 a1 b0 b1] (halves) <-> llama.cpp rows [a0 b0 a1 b1] (pairs)
    head = np.array([[0], [1], [2], [3]], dtype=np.float32)
    assert pm.permute_rows(head, 1).ravel().tolist() == [0, 2, 1, 3]


def test_config_matches_smollm2(checkpoint):
    cfg = json.loads((checkpoint / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["intermediate_size"]) == (576, 30, 9, 3, 1536)
    assert cfg["tie_word_embeddings"] is True and cfg["rope_theta"] == 100000.0


def test_weights_have_hf_names_shapes_and_unpermuted_q(checkpoint):
    import gguf
    from gguf.quants import dequantize

    cfg = json.loads((checkpoint / "config.json").read_text())
    with safe_open(str(checkpoint / "model.safetensors"), "np") as f:
        keys = set(f.keys())
        assert "lm_head.weight" not in keys  # tied
        assert len(keys) == 2 + 9 * cfg["num_hidden_layers"]
        q = f.get_tensor("model.layers.3.self_attn.q_proj.weight")
        k = f.get_tensor("model.layers.3.self_attn.k_proj.weight")
        assert q.shape == (576, 576) and k.shape == (192, 576) and q.dtype == np.float32
    reader = gguf.GGUFReader(str(pm.find_gguf()))
    raw = {t.name: t for t in reader.tensors}
    gq = dequantize(raw["blk.3.attn_q.weight"].data, raw["blk.3.attn_q.weight"].tensor_type)
    gk = dequantize(raw["blk.3.attn_k.weight"].data, raw["blk.3.attn_k.weight"].tensor_type)
    assert np.array_equal(pm.permute_rows(q, 9), gq.reshape(q.shape))
    assert np.array_equal(pm.permute_rows(k, 3), gk.reshape(k.shape))


def test_tokenizer_files(checkpoint):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    tcfg = json.loads((checkpoint / "tokenizer_config.json").read_text())
    assert tcfg["eos_token"] == "<|im_end|>" and "<|im_start|>" in tcfg["chat_template"]
    for text in ["Hello world 12345!", "  spaces\n\nand\ttabs", "café 東京 🚀", "<|im_start|>user\nhi<|im_end|>"]:
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    assert tok.encode("<|im_start|>").ids == [1]
    assert tok.encode("2024").ids == [tok.token_to_id(c) for c in "2024"]  # digits split one by one


def test_second_run_is_a_fast_no_op(checkpoint, capsys):
    before = (checkpoint / "model.safetensors").stat().st_mtime_ns
    t0 = time.monotonic()
    pm.prepare(checkpoint)
    assert time.monotonic() - t0 < 2.0
    assert (checkpoint / "model.safetensors").stat().st_mtime_ns == before
    assert "already prepared" in capsys.readouterr().err


def test_missing_gguf_is_a_clear_error(tmp_path):
    with pytest.raises(pm.PrepareError, match="not found"):
        pm.prepare(tmp_path / "out", gguf_path=tmp_path / "missing.gguf")
