"""Render `model_repository/` templates for a target (`cpu` or `trtllm`) into a deployable repository.

Templates are NVIDIA `fill_template`-style `config.pbtxt` files with `${name}` placeholders. Tensor
blocks (`${inputs}`, `${outputs}`, `${ensemble_scheduling}`) come from `contracts/tensors.py`, engine
parameters from the target's table below. Rendering fails if any placeholder is left, and every
rendered config is parsed with `tritonclient.grpc.model_config_pb2` before it is written.

    python build/render.py --target cpu --out runtime/model_repository [--set key=value ...]
    python build/render.py --target trtllm --deploy compose --engine-dir engines/smollm2-fp8 \
        --out runtime/model_repository_trtllm

`--deploy docker|compose|k8s` (GPU target only) renders the paths the container sees
(build/deploy_targets.py): without it, paths are this machine's. `--engine-dir` (GPU target) names the
engine folder on this machine: the gateway's admission bounds come from it (build/engine_admission.py).
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

from contracts import tensors  # noqa: E402
from cpu_engine.config import parameter_defaults  # noqa: E402
from cpu_engine.hf_config import max_seq_len, read_config  # noqa: E402
from build import engine_admission, lookahead  # noqa: E402
from build.prepare_model import DEFAULT_CHECKPOINT  # noqa: E402

TEMPLATES = ROOT / "model_repository"
TARGETS = ("cpu", "trtllm")
MODELS = ("preprocessing", "tensorrt_llm", "postprocessing", "ensemble", "gateway")

# The CPU engine's own defaults (cpu_engine/config.py EngineConfig), by parameter name: its knobs here are
# taken from there, and the engine knobs both targets share default to the same values.
_ENGINE = parameter_defaults()

# Knobs shared by both targets. Every knob is documented in docs/knobs.md (generated: build/knobs_doc.py).
COMMON = {
    "triton_max_batch_size": "64",
    "preprocessing_instance_count": "1",
    "postprocessing_instance_count": "1",
    "decoupled_mode": "true",
    "skip_special_tokens": "true",
    "engine_model_name": "tensorrt_llm",
    "max_seq_len": None,  # from the checkpoint (cpu_engine/hf_config.py max_seq_len)
    "max_output_len": None,  # defaults to max_seq_len
    "tokenizer_dir": None,  # the HF checkpoint folder
    # engine knobs with TensorRT-LLM's names
    "batch_scheduler_policy": _ENGINE["batch_scheduler_policy"],
    "enable_kv_cache_reuse": _ENGINE["enable_kv_cache_reuse"],
    "enable_chunked_context": _ENGINE["enable_chunked_context"],
    "max_queue_size": _ENGINE["max_queue_size"],
    "max_tokens_in_paged_kv_cache": _ENGINE["max_tokens_in_paged_kv_cache"],
    "exclude_input_in_output": "true",
    # gateway (gateway/core.py; docs/gateway.md)
    "gateway_config": str(ROOT / "deploy" / "gateway.example.yaml"),
    "gateway_redis_url": "",  # empty: rate-limit state in the gateway process
    "gateway_fail_policy": "fail_open",  # when Redis is unreachable: fail_open | fail_closed
    # engine requests in flight per engine model before queueing, and the queue's bound: from the engine served
    # (the CPU engine's max_engine_batch_size; a GPU engine's max_batch_size, at most the sequences its KV cache
    # holds at max_seq_len), and 16 queued per slot (build/engine_admission.py; --engine-dir names a GPU engine)
    "gateway_max_inflight": None,
    "gateway_max_queue": None,
    "gateway_max_queue_wait_s": "30",
    "gateway_batch_inflight_when_busy": "0",  # batch-tier requests per engine model while interactive ones run
    "gateway_lease_ttl_s": "60",  # a front's lease that is not renewed for this long is settled (front died)
    "gateway_response_threads": "0",  # >0: the answers to the front's lease operations sent from this many threads
    # LoRA adapters (docs/lora.md): a folder of PEFT adapters per engine model, read by the CPU engine and
    # listed by the gateway; default: `<checkpoint>-loras` beside the checkpoint, where rendering for the
    # CPU writes the demo adapters (build/make_demo_adapters.py) if they are missing
    "lora_dir": None,
}
TARGET_DEFAULTS = {
    "cpu": {
        "triton_backend": "python",
        "gpt_model_path": None,  # the HF checkpoint folder the CPU engine loads
        "max_num_tokens": _ENGINE["max_num_tokens"],
        "tokens_per_block": _ENGINE["tokens_per_block"],
        "kv_cache_free_mem_fraction": _ENGINE["kv_cache_free_mem_fraction"],
        "kv_cache_host_memory_bytes": _ENGINE["kv_cache_host_memory_bytes"],  # evicted prefix blocks kept (float16)
        "weight_dtype": _ENGINE["weight_dtype"],  # auto: bf16 where torch + native bf16, else int8 layer matmuls (docs/engine.md)
        "matmul_backend": _ENGINE["matmul_backend"],  # auto: onnxruntime (MLAS, weights packed once) when installed, else numpy
        "attention_backend": _ENGINE["attention_backend"],  # auto: the numba decode-attention kernel when installed, else numpy
        "num_threads": "",  # empty: all cores
        "stream_interval": "1",  # streaming: tokens per response after the first (cpu_engine/triton_contract.py)
        "output_threads": _ENGINE["output_threads"],  # threads that send a step's responses and poll cancellation (cpu_engine/engine.py)
        "max_engine_batch_size": _ENGINE["max_engine_batch_size"],
        "stats_check_period_ms": "100",
        "max_loras": _ENGINE["max_loras"],  # adapters in memory at once, LRU (cpu_engine/lora.py)
        "max_lora_rank": _ENGINE["max_lora_rank"],  # adapters of a higher rank are refused at load
        # speculative decoding (cpu_engine/speculation.py): prompt-lookup drafts under TensorRT-LLM's lookahead names,
        # or a draft model's (decoding_mode draft_tokens_external, cpu_engine/draft_model.py)
        "decoding_mode": _ENGINE["decoding_mode"],
        "lookahead_window_size": _ENGINE["lookahead_window_size"],
        "lookahead_ngram_size": _ENGINE["lookahead_ngram_size"],
        "lookahead_verification_set_size": _ENGINE["lookahead_verification_set_size"],
        "max_matching_ngram_size": _ENGINE["max_matching_ngram_size"],
        "max_draft_tokens_per_step": _ENGINE["max_draft_tokens_per_step"],
        "draft_model_dir": _ENGINE["draft_model_dir"],
        "draft_weight_dtype": _ENGINE["draft_weight_dtype"],
        "draft_model_max_batch_size": _ENGINE["draft_model_max_batch_size"],
        # tenant fairness inside a step (cpu_engine/scheduler.py): a tenant's decode rows' context per step
        "decode_context_share_tokens": _ENGINE["decode_context_share_tokens"],
        # capacity benchmarks only: a simulated GPU engine in place of the CPU engine (cpu_engine/simulated_gpu.py)
        "simulated_engine": "false",
        "sim_ttft_ms": "30",
        "sim_itl_ms": "10",
        "sim_lora_cache": "0",
        "engine_instance_count": "1",  # stub processes of the engine model (the simulated engine scales with it)
    },
    "trtllm": {
        "triton_backend": "tensorrtllm",
        # Every key of upstream's tensorrt_llm/config.pbtxt is rendered (build/upstream/tensorrt_llm_backend.json
        # lists them with the file and commit they come from). An empty value is what upstream leaves unset:
        # the C++ backend then uses its default. Three keys it reads with no fallback at all (tokenizer_dir,
        # guided_decoding_backend, xgrammar_tokenizer_info_path) must exist even when empty.
        "max_beam_width": "1",
        "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
        "gpt_model_type": "inflight_fused_batching",
        "gpt_model_path": "/engines/engine",  # the trtllm-build output inside the container (--deploy sets it)
        "encoder_model_path": "",
        "max_tokens_in_paged_kv_cache": "",  # empty: bounded by the memory fraction only
        "max_attention_window_size": "",
        "sink_token_length": "",
        "kv_cache_free_gpu_mem_fraction": "0.9",
        "cross_kv_cache_fraction": "",
        "kv_cache_host_memory_bytes": "",
        "kv_cache_onboard_blocks": "",
        "enable_trt_overlap": "",
        "cancellation_check_period_ms": "100",
        "stats_check_period_ms": "100",
        "iter_stats_max_iterations": "",
        "request_stats_max_iterations": "",
        # The C++ backend ignores the gateway's cache_salt (it never sets a salt on the executor request), so
        # prefix reuse would share KV blocks across tenants: off by default on the GPU (docs/gpu.md, isolation).
        "enable_kv_cache_reuse": "false",
        "normalize_log_probs": "",
        "gpu_device_ids": "",
        "participant_ids": "",
        "num_nodes": "",
        "lora_cache_optimal_adapter_size": "",
        "lora_cache_max_adapter_size": "",
        "lora_cache_gpu_memory_fraction": "",
        "lora_cache_host_memory_bytes": "",
        "lora_prefetch_dir": "",
        "decoding_mode": "",
        "executor_worker_path": "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker",
        "lookahead_window_size": "",
        "lookahead_ngram_size": "",
        "lookahead_verification_set_size": "",
        "medusa_choices": "",
        "eagle_choices": "",
        "gpu_weights_percent": "",
        "enable_context_fmha_fp32_acc": "",
        "multi_block_mode": "",
        "cuda_graph_mode": "",
        "cuda_graph_cache_size": "",
        "speculative_decoding_fast_logits": "",
        # guided decoding (structured outputs, required tool calls): xgrammar, with the tokenizer info it needs
        # written beside the engine's config.pbtxt when rendering (XGRAMMAR_INFO); an empty backend turns it off
        "guided_decoding_backend": "xgrammar",
        "xgrammar_tokenizer_info_path": "",  # empty: <repository>/<engine model>/xgrammar_tokenizer_info.json
        "engine_instance_count": "1",  # the C++ backend runs one instance per model (it batches inside)
        # dynamic_batching of the engine model: the C++ backend takes its queue bound (ExecutorConfig
        # maxQueueSize) from default_queue_policy.max_queue_size, never from a parameter
        "max_queue_delay_microseconds": "0",
        "encoder_input_features_data_type": "TYPE_FP16",
        "logits_datatype": "TYPE_FP32",
        "prompt_embedding_table_data_type": "TYPE_FP16",
    },
}
# Which knobs become `parameters { }` of the engine model, per target.
ENGINE_PARAMETERS = {
    "cpu": (
        "gpt_model_path", "batch_scheduler_policy", "enable_kv_cache_reuse", "enable_chunked_context",
        "max_queue_size", "max_tokens_in_paged_kv_cache", "kv_cache_free_mem_fraction", "kv_cache_host_memory_bytes",
        "max_num_tokens",
        "tokens_per_block", "max_seq_len", "max_engine_batch_size", "exclude_input_in_output",
        "tokenizer_dir", "stats_check_period_ms", "weight_dtype", "matmul_backend", "attention_backend",
        "num_threads", "stream_interval", "output_threads", "lora_dir", "max_loras", "max_lora_rank",
        "decoding_mode", "lookahead_window_size", "lookahead_ngram_size", "lookahead_verification_set_size",
        "max_matching_ngram_size", "max_draft_tokens_per_step", "draft_model_dir", "draft_weight_dtype",
        "draft_model_max_batch_size", "decode_context_share_tokens", "simulated_engine", "sim_ttft_ms", "sim_itl_ms",
        "sim_lora_cache",
    ),
    # upstream's 46 keys in upstream's order (tests hold this against build/upstream/tensorrt_llm_backend.json)
    "trtllm": (
        "max_beam_width", "FORCE_CPU_ONLY_INPUT_TENSORS", "gpt_model_type", "gpt_model_path", "encoder_model_path",
        "max_tokens_in_paged_kv_cache", "max_attention_window_size", "sink_token_length", "batch_scheduler_policy",
        "kv_cache_free_gpu_mem_fraction", "cross_kv_cache_fraction", "kv_cache_host_memory_bytes",
        "kv_cache_onboard_blocks", "enable_trt_overlap", "exclude_input_in_output", "cancellation_check_period_ms",
        "stats_check_period_ms", "iter_stats_max_iterations", "request_stats_max_iterations", "enable_kv_cache_reuse",
        "normalize_log_probs", "enable_chunked_context", "gpu_device_ids", "participant_ids", "num_nodes",
        "lora_cache_optimal_adapter_size", "lora_cache_max_adapter_size", "lora_cache_gpu_memory_fraction",
        "lora_cache_host_memory_bytes", "lora_prefetch_dir", "decoding_mode", "executor_worker_path",
        "lookahead_window_size", "lookahead_ngram_size", "lookahead_verification_set_size", "medusa_choices",
        "eagle_choices", "gpu_weights_percent", "enable_context_fmha_fp32_acc", "multi_block_mode", "cuda_graph_mode",
        "cuda_graph_cache_size", "speculative_decoding_fast_logits", "tokenizer_dir", "guided_decoding_backend",
        "xgrammar_tokenizer_info_path",
    ),
}
PLACEHOLDER = re.compile(r"\$\{([^}]*)\}")
XGRAMMAR_INFO = "xgrammar_tokenizer_info.json"


class RenderError(Exception):
    pass


def checkpoint_limits(checkpoint: Path) -> dict[str, str]:
    if not (checkpoint / "config.json").is_file():
        return {}
    return {"max_seq_len": str(max_seq_len(read_config(checkpoint)))}


def default_lora_dir(checkpoint: Path) -> Path:
    """Where a checkpoint's adapters live unless `lora_dir` is set: `<checkpoint>-loras` beside it."""
    checkpoint = Path(checkpoint)
    return checkpoint.parent / f"{checkpoint.name}-loras"


def ensure_demo_adapters(checkpoint: Path, lora_dir: Path) -> None:
    """The demo adapters in the default adapter folder of a checkpoint (fixed seed, written once)."""
    from build.make_demo_adapters import DEMO_ADAPTERS, make_demo_adapters

    config = Path(checkpoint) / "config.json"
    if not config.is_file() or "intermediate_size" not in json.loads(config.read_text()):
        return  # not a full model config (a test's stand-in): nothing to fit adapters to
    if not all((lora_dir / name / "adapter_model.safetensors").is_file() for name in DEMO_ADAPTERS):
        make_demo_adapters(Path(checkpoint), lora_dir)


def resolve_values(target: str, overrides: dict[str, str], checkpoint: Path,
                   deploy: str | None = None, engine_dir: Path | None = None, gpu_mem_gb: float | None = None,
                   report: dict | None = None) -> dict[str, str]:
    """`engine_dir`, `gpu_mem_gb`: the GPU engine folder on this machine and the GPU's memory, for the
    gateway's admission bounds (build/engine_admission.py), which `report` receives with how they were found."""
    if target not in TARGETS:
        raise RenderError(f"unknown target {target!r}: choose one of {', '.join(TARGETS)}")
    if deploy is not None and target != "trtllm":
        raise RenderError(f"--deploy {deploy} is for the trtllm target (the CPU target runs on this machine)")
    values = {**COMMON, **TARGET_DEFAULTS[target]}
    unknown = set(overrides) - set(values)
    if unknown:
        raise RenderError(f"unknown knob(s) for target {target}: {', '.join(sorted(unknown))}")
    values.update(checkpoint_limits(checkpoint))
    values["tokenizer_dir"] = str(checkpoint)
    values["lora_dir"] = str(default_lora_dir(checkpoint))
    if target == "cpu":
        values["gpt_model_path"] = str(checkpoint)
    shared_state = {}
    if deploy is not None:
        from build import deploy_targets

        try:
            target = deploy_targets.get(deploy)
        except KeyError as e:
            raise RenderError(str(e.args[0])) from None
        values.update(target.paths)
        shared_state = target.shared_state
        values.update(shared_state)
    values.update(overrides)
    for knob in shared_state:  # several replicas: state kept per replica would multiply the limits
        if not values[knob]:
            raise RenderError(f"--deploy {deploy} runs several replicas, which must share their rate limits: "
                              f"{knob} cannot be empty (default {shared_state[knob]}, build/deploy_targets.py)")
    try:
        ckpt_cfg = read_config(checkpoint) if (Path(checkpoint) / "config.json").is_file() else None
        admission = engine_admission.derive(target, values, overrides, engine_dir, deploy, ckpt_cfg, gpu_mem_gb)
    except (engine_admission.EngineConfigError, ValueError) as e:
        raise RenderError(str(e)) from None
    values.update(admission.values)
    if target == "trtllm":
        engine = admission.engine
        if engine is not None and engine.lookahead and "decoding_mode" not in overrides:
            values.update(lookahead.server_values(engine.lookahead))  # what build/trtllm.py built it for
        try:
            lookahead.check(values, engine.max_draft_len if engine is not None else None)
        except ValueError as e:
            raise RenderError(str(e)) from None
    if report is not None:
        report.update(admission.record, warnings=admission.warnings)
    if values.get("max_output_len") is None:
        values["max_output_len"] = values.get("max_seq_len")
    missing = sorted(k for k, v in values.items() if v is None)
    if missing:
        raise RenderError(
            f"no value for {', '.join(missing)}: is {checkpoint} a prepared checkpoint (config.json)?"
        )
    return values


def xgrammar_tokenizer_info(checkpoint: Path) -> dict | None:
    """The tokenizer as TensorRT-LLM's C++ backend reads it for xgrammar (what upstream's
    examples/generate_xgrammar_tokenizer_info.py writes, made here from tokenizer.json without
    transformers): the vocabulary's token strings in id order, the tokenizer's JSON, and the end token.
    None when the checkpoint has no tokenizer.json (guided decoding then stays off)."""
    from text.tokenization import TokenizerBundle

    if not (Path(checkpoint) / "tokenizer.json").is_file():
        return None
    bundle = TokenizerBundle.load(checkpoint)
    vocab = bundle.tokenizer.get_vocab(with_added_tokens=True)
    return {"encoded_vocab": [token for token, _ in sorted(vocab.items(), key=lambda kv: kv[1])],
            "tokenizer_str": bundle.tokenizer.to_str(), "stop_token_ids": [bundle.eos_id]}


def _guided_decoding(target: str, values: dict[str, str], engine_name: str, repo_root: str, info: dict | None,
                     overrides: dict) -> dict | None:
    """Where an engine model's xgrammar tokenizer info is (GPU, guided decoding on, no path given): set in
    `values`; returns the info to write into that model's folder, or None."""
    if target != "trtllm" or not values.get("guided_decoding_backend") or overrides.get("xgrammar_tokenizer_info_path"):
        return None
    if info is None:
        values["guided_decoding_backend"] = ""  # no tokenizer to describe: off, as upstream leaves it
        return None
    values["xgrammar_tokenizer_info_path"] = f"{repo_root.rstrip('/')}/{engine_name}/{XGRAMMAR_INFO}"
    return info


def engine_parameters_block(target: str, values: dict[str, str]) -> str:
    lines = []
    if target == "trtllm":  # upstream's queue: the C++ backend reads its bound only from here
        lines.append(
            "dynamic_batching {\n"
            f"  preferred_batch_size: [ {values['triton_max_batch_size']} ]\n"
            f"  max_queue_delay_microseconds: {values['max_queue_delay_microseconds']}\n"
            f"  default_queue_policy: {{ max_queue_size: {values['max_queue_size']} }}\n"
            "}")
    for key in ENGINE_PARAMETERS[target]:
        value = values[key]
        lines.append(f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}')
    return "\n".join(lines)


UPSTREAM_FACTS = ROOT / "build" / "upstream" / "tensorrt_llm_backend.json"


def upstream_engine_contract() -> tensors.Contract:
    """The engine contract as the C++ backend knows it: the project's tensors that upstream's
    tensorrt_llm model also has (a project-only name, such as the CPU engine's `min_length` alias,
    would be declared on the GPU and silently ignored there; undeclared, Triton rejects it)."""
    facts = json.loads(UPSTREAM_FACTS.read_text())["tensorrt_llm_model"]
    ins = {t["name"] for t in facts["inputs"]}
    outs = {t["name"] for t in facts["outputs"]}
    engine = tensors.CONTRACTS["tensorrt_llm"]
    return tensors.Contract(tuple(t for t in engine.inputs if t.name in ins),
                              tuple(t for t in engine.outputs if t.name in outs))


def render_config(model: str, target: str, values: dict[str, str]) -> str:
    template = (TEMPLATES / model / "config.pbtxt").read_text()
    if (model, target) == ("tensorrt_llm", "trtllm"):
        contract = upstream_engine_contract()
    else:
        contract = tensors.CONTRACTS[model]
    blocks = dict(contract.pbtxt())
    if model == "ensemble":
        blocks["ensemble_scheduling"] = tensors.ensemble_scheduling_pbtxt(values["engine_model_name"])
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
           extra_engines: dict[str, dict[str, str]] | None = None, deploy: str | None = None,
           engine_dir: Path | None = None, gpu_mem_gb: float | None = None) -> Path:
    """`extra_engines`: more engine models from the same template, {name: knob overrides} (e.g. a
    smaller-limit engine for the gateway's routing). `deploy`: a GPU deploy target whose container
    paths are rendered (build/deploy_targets.py). `engine_dir` (GPU: the trtllm-build output on this
    machine) and `gpu_mem_gb`: what the gateway's admission bounds come from (build/engine_admission.py;
    render.json `admission` says how)."""
    admission: dict = {}
    values = resolve_values(target, overrides or {}, Path(checkpoint), deploy, engine_dir, gpu_mem_gb, admission)
    if target == "cpu" and values["lora_dir"] == str(default_lora_dir(checkpoint)):
        ensure_demo_adapters(Path(checkpoint), Path(values["lora_dir"]))
    from build import deploy_targets

    repo_root = deploy_targets.get(deploy).model_repository if deploy else str(Path(out).resolve())
    info = xgrammar_tokenizer_info(Path(checkpoint)) if target == "trtllm" else None
    guided = {}  # engine model -> its xgrammar tokenizer info to write
    if "tensorrt_llm" in models:
        found = _guided_decoding(target, values, values["engine_model_name"], repo_root, info, overrides or {})
        if found is not None:
            guided[values["engine_model_name"]] = found
    rendered = {values["engine_model_name"] if m == "tensorrt_llm" else m: (m, render_config(m, target, values))
                for m in models}  # all or nothing
    for name, engine_overrides in (extra_engines or {}).items():
        merged = {**(overrides or {}), **engine_overrides, "engine_model_name": name}
        engine_values = resolve_values(target, merged, Path(checkpoint), deploy, engine_dir, gpu_mem_gb)
        found = _guided_decoding(target, engine_values, name, repo_root, info, merged)
        if found is not None:
            guided[name] = found
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
        if name in guided:
            (dest / XGRAMMAR_INFO).write_text(json.dumps(guided[name]), encoding="utf-8")
    meta = {"target": target, "values": values} if deploy is None else {"target": target, "deploy": deploy,
                                                                         "values": values}
    meta["admission"] = admission
    (out / "render.json").write_text(json.dumps(meta, indent=2) + "\n")
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
    p.add_argument("--deploy", choices=("docker", "compose", "k8s"),
                   help="trtllm only: render the container paths of this deploy target (build/deploy_targets.py)")
    p.add_argument("--engine", action="append", default=[], metavar="NAME[:KEY=VALUE,...]",
                   help="render one more engine model, e.g. tensorrt_llm_small:max_seq_len=2048,max_num_tokens=256")
    p.add_argument("--engine-dir", type=Path, help="trtllm only: the engine folder (trtllm-build output) on this "
                   "machine; the gateway's admission bounds come from its config.json (build/engine_admission.py)")
    p.add_argument("--gpu-mem-gb", type=float, help="trtllm only: GPU memory in 1e9 bytes for the KV-cache bound "
                   f"(default {engine_admission.H100_80GB_GB}, an H100 80GB)")
    args = p.parse_args(argv)
    try:
        extra = {}
        for spec in args.engine:
            name, _, knobs = spec.partition(":")
            extra[name] = parse_sets([kv for kv in knobs.split(",") if kv])
        if args.target != "trtllm" and (args.engine_dir or args.gpu_mem_gb):
            raise RenderError("--engine-dir and --gpu-mem-gb are for the trtllm target")
        out = render(args.target, args.out, parse_sets(args.set), args.checkpoint, extra_engines=extra,
                     deploy=args.deploy, engine_dir=args.engine_dir, gpu_mem_gb=args.gpu_mem_gb)
    except RenderError as e:
        print(f"render: error: {e}", file=sys.stderr)
        return 2
    admission = json.loads((out / "render.json").read_text())["admission"]
    for w in admission.get("warnings", []):
        print(f"render: warning: {w}", file=sys.stderr)
    if args.target == "trtllm":
        print(f"render: gateway_max_inflight {admission['gateway_max_inflight']}, gateway_max_queue "
              f"{admission['gateway_max_queue']} ({admission['from']}; KV: {admission['kv_from']})", file=sys.stderr)
    print(f"rendered target '{args.target}' into {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
