"""A Hugging Face Llama-family `config.json`, read once for everyone: the CPU engine's loader, the renderer
(the `max_seq_len` cap) and the GPU sizing tool all take the model's shape from here, so the rule for
missing keys (`num_key_value_heads`, `head_dim`, `max_position_embeddings`) and the KV-bytes formula
cannot drift between them. Pure Python: no numpy, safe to import from set-up code."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

# A checkpoint that names no context length gets Llama-1's; longer contexts are capped because the
# default KV cache (16,384 tokens) and a 2-core CPU make a longer single sequence impractical, and the
# GPU engine is built for the same cap (build/trtllm.py BuildArgs.max_seq_len).
DEFAULT_POSITIONS = 2048
MAX_SEQ_LEN_CAP = 8192


def read_config(path: Path | str) -> dict:
    """config.json of a checkpoint folder, or the file itself."""
    path = Path(path)
    return json.loads((path / "config.json" if path.is_dir() else path).read_text())


def max_seq_len(cfg: dict) -> int:
    """Prompt + output tokens of one sequence: the model's positions, capped."""
    return min(int(cfg.get("max_position_embeddings", DEFAULT_POSITIONS)), MAX_SEQ_LEN_CAP)


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, bytes_per_element: float, tp: int = 1) -> int:
    """K and V of every layer for one token; with tensor parallelism, one rank's share (each rank holds
    ceil(kv_heads / tp) heads, at least one)."""
    return int(2 * layers * max(1, math.ceil(kv_heads / tp)) * head_dim * bytes_per_element)


@dataclass
class LlamaConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, cfg: dict) -> "LlamaConfig":
        heads = cfg["num_attention_heads"]
        return cls(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", DEFAULT_POSITIONS)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """The CPU engine's cache: float32 K and V."""
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, 4)
