"""Render `model_repository/` templates for a target (`cpu` or `trtllm`) into a deployable repository.

Templates are NVIDIA `fill_template`-style `config.pbtxt` files with `${name}` placeholders. Tensor
blocks (`${inputs}`, `${outputs}`, `${ensemble_scheduling}`) come from `bls/contracts.py`, engine
parameters from the target's table below. Rendering fails if any placeholder is left, and every
rendered config is parsed with `tritonclient.grpc.model_config_pb2` before it is written.

    python build/render.py --target cpu --out runtime/model_repository [--set key=value ...]
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import string
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bls import contracts  # noqa: E402

TEMPLATES = ROOT / "model_repository"
DEFAULT_CHECKPOINT = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
TARGETS = ("cpu", "trtllm")
MODELS = ("preprocessing", "tensorrt_llm", "postprocessing", "ensemble", "gateway")

# Knobs shared by both targets. Every knob is documented in docs/knobs.md.
COMMON = {
    "triton_max_batch_size": "64",
    "preprocessing_instance_count": "1",
    "postprocessing_instance_count": "1",
    "decoupled_mode": "true",
    "skip_special_tokens": "true",
    "engine_model_name": "tensorrt_llm",
    "max_seq_len": None,  # from the checkpoint: min(max_position_embeddings, 8192)
    "max_output_len": None,  # defaults to max_seq_len
    "tokenizer_dir": None,  # the HF checkpoint folder
    # engine knobs with TensorRT-LLM's names
    "batch_scheduler_policy": "guaranteed_no_evict",
    "enable_kv_cache_reuse": "true",
    "enable_chunked_context": "true",
    "max_queue_size": "256",
    "max_tokens_in_paged_kv_cache": "16384",
    "exclude_input_in_output": "true",
    # gateway (bls/gateway.py; docs/gateway.md)
    "gateway_config": str(ROOT / "deploy" / "gateway.example.yaml"),
    "gateway_redis_url": "",  # empty: rate-limit state in the gateway process
    "gateway_fail_policy": "fail_open",  # when Redis is unreachable: fail_open | fail_closed
    "gateway_max_inflight": "16",  # engine requests in flight per engine model before queueing
    "gateway_max_queue": "256",
    "gateway_max_queue_wait_s": "30",
}
TARGET_DEFAULTS = {
    "cpu": {
        "triton_backend": "python",
        "gpt_model_path": None,  # the HF checkpoint folder the CPU engine loads
        "max_num_tokens": "512",
        "tokens_per_block": "32",
        "kv_cache_free_mem_fraction": "0.1",
        "weight_dtype": "auto",  # auto: bf16 where torch + native bf16, else int8 layer matmuls (docs/engine.md)
        "matmul_backend": "auto",  # auto: onnxruntime (MLAS, weights packed once) when installed, else numpy
        "attention_backend": "auto",  # auto: the numba decode-attention kernel when installed, else numpy
        "num_threads": "",  # empty: all cores
        "stream_interval": "1",  # streaming: tokens per response after the first (bls/engine_io.py)
        "output_threads": "2",  # threads that send a step's responses and poll cancellation (cpu_engine/engine.py)
        "max_engine_batch_size": "64",
        "stats_check_period_ms": "100",
    },
    "trtllm": {
        "triton_backend": "tensorrtllm",
        "gpt_model_path": "/engines/engine",  # the trtllm-build output, mounted into the container
        "gpt_model_type": "inflight_fused_batching",
        "kv_cache_free_gpu_mem_fraction": "0.9",
        "max_tokens_in_paged_kv_cache": "",  # empty: bounded by the memory fraction only
        "encoder_input_features_data_type": "TYPE_FP16",
        "logits_datatype": "TYPE_FP32",
        "prompt_embedding_table_data_type": "TYPE_FP16",
        "stats_check_period_ms": "100",
        "cancellation_check_period_ms": "100",
    },
}
# Which knobs become `parameters { }` of the engine model, per target.
ENGINE_PARAMETERS = {
    "cpu": (
        "gpt_model_path", "batch_scheduler_policy", "enable_kv_cache_reuse", "enable_chunked_context",
        "max_queue_size", "max_tokens_in_paged_kv_cache", "kv_cache_free_mem_fraction", "max_num_tokens",
        "tokens_per_block", "max_seq_len", "max_engine_batch_size", "exclude_input_in_output",
        "tokenizer_dir", "stats_check_period_ms", "weight_dtype", "matmul_backend", "attention_backend",
        "num_threads", "stream_interval", "output_threads",
    ),
    "trtllm": (
        "gpt_model_path", "gpt_model_type", "batch_scheduler_policy", "enable_kv_cache_reuse",
        "enable_chunked_context", "max_queue_size", "max_tokens_in_paged_kv_cache",
        "kv_cache_free_gpu_mem_fraction", "exclude_input_in_output", "encoder_input_features_data_type",
        "logits_datatype", "prompt_embedding_table_data_type", "stats_check_period_ms",
        "cancellation_check_period_ms",
    ),
}
PLACEHOLDER = re.compile(r"\$\{([^}]*)\}")


class RenderError(Exception):
    pass


def checkpoint_limits(checkpoint: Path) -> dict[str, str]:
    cfg_path = checkpoint / "config.json"
    if not cfg_path.is_file():
        return {}
    cfg = json.loads(cfg_path.read_text())
    return {"max_seq_len": str(min(int(cfg.get("max_position_embeddings", 2048)), 8192))}


def resolve_values(target: str, overrides: dict[str, str], checkpoint: Path) -> dict[str, str]:
    if target not in TARGETS:
        raise RenderError(f"unknown target {target!r}: choose one of {', '.join(TARGETS)}")
    values = {**COMMON, **TARGET_DEFAULTS[target]}
    unknown = set(overrides) - set(values)
    if unknown:
        raise RenderError(f"unknown knob(s) for target {target}: {', '.join(sorted(unknown))}")
    values.update(checkpoint_limits(checkpoint))
    values["tokenizer_dir"] = str(checkpoint)
    if target == "cpu":
        values["gpt_model_path"] = str(checkpoint)
    values.update(overrides)
    if values.get("max_output_len") is None:
        values["max_output_len"] = values.get("max_seq_len")
    missing = sorted(k for k, v in values.items() if v is None)
    if missing:
        raise RenderError(
            f"no value for {', '.join(missing)}: is {checkpoint} a prepared checkpoint (config.json)?"
        )
    return values


def engine_parameters_block(target: str, values: dict[str, str]) -> str:
    lines = []
    for key in ENGINE_PARAMETERS[target]:
        value = values[key]
        lines.append(f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}')
    return "\n".join(lines)


def render_config(model: str, target: str, values: dict[str, str]) -> str:
    template = (TEMPLATES / model / "config.pbtxt").read_text()
    blocks = dict(contracts.CONTRACTS[model].pbtxt())
    if model == "ensemble":
        blocks["ensemble_scheduling"] = contracts.ensemble_scheduling_pbtxt(values["engine_model_name"])
    if model == "tensorrt_llm":
        blocks["engine_parameters"] = engine_parameters_block(target, values)
    text = string.Template(template).safe_substitute({**values, **blocks})
    text = string.Template(text).safe_substitute(values)  # placeholders inside generated blocks
    left = sorted(set(PLACEHOLDER.findall(text)))
    if left:
        raise RenderError(f"{model}/config.pbtxt: placeholder(s) left unfilled: {', '.join(left)}")
    validate_config(model, text)
    return text


def validate_config(model: str, text: str):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    try:
        return text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as e:
        raise RenderError(f"{model}/config.pbtxt does not parse as a Triton ModelConfig: {e}") from None


def render(target: str, out: Path, overrides: dict[str, str] | None = None,
           checkpoint: Path = DEFAULT_CHECKPOINT, models=MODELS,
           extra_engines: dict[str, dict[str, str]] | None = None) -> Path:
    """`extra_engines`: more engine models from the same template, {name: knob overrides} (e.g. a
    smaller-limit engine for the gateway's routing)."""
    values = resolve_values(target, overrides or {}, Path(checkpoint))
    rendered = {values["engine_model_name"] if m == "tensorrt_llm" else m: (m, render_config(m, target, values))
                for m in models}  # all or nothing
    for name, engine_overrides in (extra_engines or {}).items():
        engine_values = resolve_values(target, {**(overrides or {}), **engine_overrides,
                                                "engine_model_name": name}, Path(checkpoint))
        rendered[name] = ("tensorrt_llm", render_config("tensorrt_llm", target, engine_values))
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    for name, (model, text) in rendered.items():
        dest = out / name
        (dest / "1").mkdir(parents=True)
        (dest / "config.pbtxt").write_text(text)
        is_python = target == "cpu" or model != "tensorrt_llm"
        src_model = TEMPLATES / model / "1" / "model.py"
        if is_python and src_model.is_file():
            shutil.copy2(src_model, dest / "1" / "model.py")
    (out / "render.json").write_text(json.dumps({"target": target, "values": values}, indent=2) + "\n")
    return out


def parse_sets(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        if "=" not in item:
            raise RenderError(f"--set expects key=value, got {item!r}")
        k, v = item.split("=", 1)
        out[k.strip()] = v
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", choices=TARGETS, default="cpu")
    p.add_argument("--out", type=Path, default=ROOT / "runtime" / "model_repository")
    p.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT, help="HF checkpoint folder")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a knob")
    p.add_argument("--engine", action="append", default=[], metavar="NAME[:KEY=VALUE,...]",
                   help="render one more engine model, e.g. tensorrt_llm_small:max_seq_len=2048,max_num_tokens=256")
    args = p.parse_args(argv)
    try:
        extra = {}
        for spec in args.engine:
            name, _, knobs = spec.partition(":")
            extra[name] = parse_sets([kv for kv in knobs.split(",") if kv])
        out = render(args.target, args.out, parse_sets(args.set), args.checkpoint, extra_engines=extra)
    except RenderError as e:
        print(f"render: error: {e}", file=sys.stderr)
        return 2
    print(f"rendered target '{args.target}' into {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
