"""Demo LoRA adapters for a Llama-family checkpoint, in the PEFT format, from a fixed seed (no downloads).

    python build/make_demo_adapters.py --checkpoint .cache/models/SmolLM2-135M-Instruct --out runtime/loras

writes `<out>/<name>/adapter_config.json` + `adapter_model.safetensors` for each of DEMO_ADAPTERS. They
are random low-rank deltas, not fine-tunes: big enough to change what the model answers (so a test can
tell an adapter was applied), small in size (rank 8: ~1-3 MB each for SmolLM2-135M). The same seed
gives the same bytes, so a re-run leaves existing adapters as they are.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PEFT_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
# name -> (seed, rank, alpha, target modules, strength: std of B relative to 1/sqrt(rank))
DEMO_ADAPTERS = {
    "demo-support": (20, 8, 16, ("q", "v"), 0.5),
    "demo-legal": (21, 8, 16, ("q", "k", "v", "o"), 0.4),
    "demo-medical": (22, 8, 16, ("gate", "up", "down"), 0.4),
    "demo-finance": (23, 4, 8, ("q", "k", "v", "o", "gate", "up", "down"), 0.3),
}


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """float32 tensors as a .safetensors file (the format: 8-byte header length, JSON header, raw data)."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        raw = np.ascontiguousarray(tensors[name], dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    _atomic_write(path, len(head).to_bytes(8, "little") + head + b"".join(blobs))


def _atomic_write(path: Path, data: bytes) -> None:
    """Whole or not at all: a server reading the folder while it is (re)written never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def module_dims(cfg: dict) -> dict[str, tuple[int, int]]:
    """module -> (in, out) features from a HF config.json."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    d = cfg.get("head_dim") or h // heads
    q, kv = heads * d, cfg.get("num_key_value_heads", heads) * d
    return {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "gate": (h, i), "up": (h, i), "down": (i, h)}


def write_adapter(folder: Path, cfg: dict, seed: int, rank: int, alpha: float, targets, strength: float,
                  base_model: str = "") -> Path:
    """One random PEFT LoRA adapter for the model of `cfg` (a HF config.json dict)."""
    rng = np.random.default_rng(seed)
    dims = module_dims(cfg)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for m in targets:
            d_in, d_out = dims[m]
            key = f"base_model.model.model.layers.{layer}.{PEFT_MODULES[m]}"
            tensors[f"{key}.lora_A.weight"] = rng.normal(0, 1 / np.sqrt(d_in), (rank, d_in))
            tensors[f"{key}.lora_B.weight"] = rng.normal(0, strength / np.sqrt(rank), (d_out, rank))
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(folder / "adapter_model.safetensors", tensors)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": rank,
              "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
              "target_modules": [PEFT_MODULES[m].split(".")[1] for m in targets]}
    _atomic_write(folder / "adapter_config.json", (json.dumps(config, indent=1) + "\n").encode())
    return folder


def make_demo_adapters(checkpoint: Path, out: Path) -> list[Path]:
    cfg = json.loads((Path(checkpoint) / "config.json").read_text())
    return [write_adapter(Path(out) / name, cfg, seed, rank, alpha, targets, strength, Path(checkpoint).name)
            for name, (seed, rank, alpha, targets, strength) in DEMO_ADAPTERS.items()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    from build.prepare_model import DEFAULT_CHECKPOINT

    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--out", default=str(ROOT / "runtime" / "loras"))
    args = ap.parse_args(argv)
    for folder in make_demo_adapters(Path(args.checkpoint), Path(args.out)):
        print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
