import json

import numpy as np
import pytest

from cpu_engine import EngineConfig, LLMEngine


def bf16_round(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (round half to even), still as float32."""
    bits = np.asarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32)


def save_safetensors(path, tensors: dict, dtype: str = "F32") -> None:
    """A .safetensors file written by hand, so that BF16 (which safetensors' numpy API lacks) works too."""
    blobs, header, offset = [], {}, 0
    for name, a in tensors.items():
        a = np.asarray(a, dtype=np.float32)
        if dtype == "BF16":
            raw = (bf16_round(a).view(np.uint32) >> 16).astype("<u2").tobytes()
        elif dtype == "F16":
            raw = a.astype("<f2").tobytes()
        else:
            raw = a.astype("<f4").tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head + b"".join(blobs))


def tiny_weights(tied=True, seed=0, layers=2, hidden=64, heads=4, kv_heads=2, inter=128, vocab=256, head_dim=None):
    rng = np.random.default_rng(seed)
    hd = head_dim or hidden // heads
    w = {"model.embed_tokens.weight": rng.normal(0, 1, (vocab, hidden)),
         "model.norm.weight": 1 + 0.1 * rng.normal(size=hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        w |= {
            p + "self_attn.q_proj.weight": rng.normal(0, 0.2, (heads * hd, hidden)),
            p + "self_attn.k_proj.weight": rng.normal(0, 0.2, (kv_heads * hd, hidden)),
            p + "self_attn.v_proj.weight": rng.normal(0, 0.2, (kv_heads * hd, hidden)),
            p + "self_attn.o_proj.weight": rng.normal(0, 0.2, (hidden, heads * hd)),
            p + "mlp.gate_proj.weight": rng.normal(0, 0.2, (inter, hidden)),
            p + "mlp.up_proj.weight": rng.normal(0, 0.2, (inter, hidden)),
            p + "mlp.down_proj.weight": rng.normal(0, 0.2, (hidden, inter)),
            p + "input_layernorm.weight": 1 + 0.1 * rng.normal(size=hidden),
            p + "post_attention_layernorm.weight": 1 + 0.1 * rng.normal(size=hidden),
        }
    if not tied:
        w["lm_head.weight"] = rng.normal(0, 0.5, (vocab, hidden))
    config = {
        "model_type": "llama", "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": vocab,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512,
        "tie_word_embeddings": tied}
    if head_dim:
        config["head_dim"] = head_dim
    return {k: np.asarray(v, dtype=np.float32) for k, v in w.items()}, config


def write_tiny_checkpoint(path, tied=True, seed=0, dtype="F32", shards=1, **shape):
    """A random tiny Llama as a HF folder; `shards` > 1 splits it with a model.safetensors.index.json."""
    weights, config = tiny_weights(tied=tied, seed=seed, **shape)
    path.mkdir(parents=True, exist_ok=True)
    if shards == 1:
        save_safetensors(path / "model.safetensors", weights, dtype)
    else:
        names = sorted(weights)
        weight_map = {}
        for s in range(shards):
            file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: weights[n] for n in names[s::shards]}
            save_safetensors(path / file, part, dtype)
            weight_map |= {n: file for n in part}
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_untied_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_untied"), tied=False, seed=1)


@pytest.fixture
def make_engine(tiny_dir):
    def make(**kw):
        kw.setdefault("max_tokens_in_paged_kv_cache", 2048)
        kw.setdefault("tokens_per_block", 4)
        kw.setdefault("max_num_tokens", 16)
        # exactness tests need one precision for every step: bf16 matmuls are used only for steps of
        # >= BF16_MIN_ROWS rows, so their numerics depend on the batch (tested separately)
        kw.setdefault("weight_dtype", "float32")
        return LLMEngine(EngineConfig(str(kw.pop("checkpoint_dir", tiny_dir)), **kw))
    return make


def run_all(engine, requests, arrivals=None, cancel_at=None):
    """Submit requests (id -> (prompt, params, salt)) at given steps; step until idle.
    Returns id -> (tokens, final output)."""
    arrivals = arrivals or {rid: 0 for rid in requests}
    cancel_at = cancel_at or {}
    tokens = {rid: [] for rid in requests}
    finals = {}
    step = 0

    def collector(rid):
        def on_output(out):
            assert rid not in finals, f"{rid} settled twice"
            tokens[rid].extend(out.new_token_ids)
            if out.finished:
                finals[rid] = out
        return on_output

    pending = dict(requests)
    while pending or engine.has_work():
        for rid in [r for r in pending if arrivals[r] <= step]:
            prompt, params, salt = pending.pop(rid)
            engine.submit(rid, prompt, params, collector(rid), cache_salt=salt)
        for rid, at in cancel_at.items():
            if at == step:
                engine.cancel(rid)
        engine.step()
        step += 1
        assert step < 10_000, "engine did not drain"
    return {rid: (tokens[rid], finals.get(rid)) for rid in requests}
