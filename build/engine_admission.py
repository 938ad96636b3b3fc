"""The gateway's admission bounds, derived from the engine a repository serves (issue 28, item 4).

`gateway_max_inflight` is how many requests the gateway lets run on one engine model at once; the rest
wait in the gateway's admission queue, where tiers and per-tenant round robin choose who goes next
(docs/gateway.md). More in flight than the engine can run means they wait in the engine's own queue
instead (first come, first served: no tiers, no fairness); fewer leaves sequences of the engine idle.

- **trtllm**: the engine's `max_batch_size` (what `trtllm-build --max_batch_size` built it for, read from
  `build_config.max_batch_size` of the engine folder's `config.json`, TensorRT-LLM 1.x's layout; from
  `manifest.json`'s `build` where only that exists), at most the sequences its paged KV cache holds at
  `max_seq_len` when that is knowable (`clients/sizing.py`'s arithmetic over the checkpoint's shape, the
  engine's weight and KV dtypes and tensor parallelism and the GPU's memory; `max_tokens_in_paged_kv_cache`
  when it is set). `gateway_max_queue` is QUEUE_PER_SLOT x `gateway_max_inflight`. With no engine to read
  (a render for a cluster whose engine lives elsewhere), `build/trtllm.py build`'s default batch size
  is used and the render says so (render.json `admission`, and a warning from the command line).
- **cpu**: the CPU engine's `max_engine_batch_size` (the gateway counts each request's KV itself, so the
  batch alone bounds the slots), and QUEUE_PER_SLOT x that queued. Fewer slots than the batch (the CPU
  default was 16 of 64 until 2026-11-28) kept each stream's time per token low but left the batch a quarter
  full while the rest waited 20 s for a first token (docs/benchmarks.md): the engine's batch is the one
  knob of that trade-off, for the ensemble and the gateway alike.

An explicit `--set gateway_max_inflight=` or `--set gateway_max_queue=` always wins. The KV plan counts tensor
parallelism only: with pipeline parallelism each GPU holds fewer layers than it assumes, so the bound errs low.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from gateway.engine_limits import positive_int
from build import lookahead

# `build/trtllm.py build` defaults (BuildArgs takes them from here): trtllm-build's --max_batch_size and
# --tokens_per_block
BUILD_MAX_BATCH_SIZE = 64
BUILD_TOKENS_PER_BLOCK = 32
# admission-queue places per engine slot (the CPU defaults' ratio before they came from the engine: 256 per 16)
QUEUE_PER_SLOT = 16
H100_80GB_GB = 85.5  # what an "80 GB" H100 reports, in 1e9 bytes (docs/sizing.md)
# the C++ backend's kv_cache_free_gpu_mem_fraction when the knob is unset
DEFAULT_GPU_MEM_FRACTION = 0.9

# TensorRT-LLM's dtype and QuantAlgo names -> clients/sizing.py's BYTES keys (only what this project builds
# is mapped; any other quantization leaves the KV bound unknown rather than guessed)
_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
_WEIGHT_ALGOS = {"FP8": "fp8"}
_KV_ALGOS = {"FP8": "fp8", "INT8": "int8"}


class EngineConfigError(Exception):
    pass


@dataclass(frozen=True)
class EngineBuild:
    """What the engine was built for, as far as admission needs it."""
    max_batch_size: int
    source: str  # the file and field it was read from
    max_seq_len: int | None = None
    tokens_per_block: int | None = None
    tp: int = 1
    weights: str | None = None  # clients/sizing.py BYTES key; None: not known
    kv: str | None = None
    max_draft_len: int | None = None  # build_config.max_draft_len (absent: 0, as the runtime reads it); None: not known
    lookahead: tuple[int, int, int] | None = None  # the (W, N, G) build/trtllm.py built it for (manifest only)


@dataclass
class Admission:
    values: dict[str, str]  # the knobs to render
    record: dict = field(default_factory=dict)  # how they were derived (render.json "admission")
    warnings: list[str] = field(default_factory=list)
    engine: EngineBuild | None = None  # the engine read, if any


def _from_config_json(path: Path) -> EngineBuild | None:
    """trtllm-build's config.json (TensorRT-LLM 1.x: `version`, `pretrained_config`, `build_config`;
    build/upstream/tensorrt_llm_backend.json, engine_config). None when it is not that layout."""
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    build = cfg.get("build_config") if isinstance(cfg, dict) else None
    if not isinstance(build, dict) or positive_int(build.get("max_batch_size")) is None:
        return None
    pretrained = cfg.get("pretrained_config") if isinstance(cfg.get("pretrained_config"), dict) else {}
    plugin = build.get("plugin_config") if isinstance(build.get("plugin_config"), dict) else {}
    mapping = pretrained.get("mapping") if isinstance(pretrained.get("mapping"), dict) else {}
    quant = pretrained.get("quantization") if isinstance(pretrained.get("quantization"), dict) else {}
    dtype = _DTYPES.get(str(pretrained.get("dtype")))
    algo, kv_algo = quant.get("quant_algo"), quant.get("kv_cache_quant_algo")
    return EngineBuild(
        max_batch_size=positive_int(build["max_batch_size"]), source=f"{path} build_config.max_batch_size",
        max_seq_len=positive_int(build.get("max_seq_len")), tokens_per_block=positive_int(plugin.get("tokens_per_block")),
        tp=positive_int(mapping.get("tp_size")) or 1,
        weights=dtype if algo is None else _WEIGHT_ALGOS.get(str(algo)),
        kv=dtype if kv_algo is None else _KV_ALGOS.get(str(kv_algo)),
        max_draft_len=_draft_len(build.get("max_draft_len", 0)), lookahead=_manifest_lookahead(path.parent / "manifest.json"))


def _manifest_draft_len(path: Path) -> int:
    """The --max_draft_len build/trtllm.py gave trtllm-build: from the recorded (W, N, G), else 0."""
    config = _manifest_lookahead(path)
    return lookahead.max_draft_len(*config) if config else 0


def _draft_len(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _manifest_lookahead(path: Path) -> tuple[int, int, int] | None:
    """The (W, N, G) build/trtllm.py recorded beside the engine, if any."""
    try:
        value = json.loads(path.read_text()).get("lookahead")
    except (OSError, ValueError, AttributeError):
        return None
    return tuple(value) if isinstance(value, list) and len(value) == 3 and all(isinstance(v, int) for v in value) \
        else None


def _from_manifest(path: Path) -> EngineBuild | None:
    """build/trtllm.py build's manifest.json: the arguments it gave trtllm-build."""
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    build = m.get("build") if isinstance(m, dict) else None
    if not isinstance(build, dict) or positive_int(build.get("max_batch_size")) is None:
        return None
    quant = m.get("quantization") if isinstance(m.get("quantization"), dict) else {}
    return EngineBuild(
        max_batch_size=positive_int(build["max_batch_size"]), source=f"{path} build.max_batch_size",
        max_seq_len=positive_int(build.get("max_seq_len")), tokens_per_block=positive_int(build.get("tokens_per_block")),
        tp=positive_int(m.get("tp_size")) or 1, weights=quant.get("weights"), kv=quant.get("kv_cache"),
        lookahead=_manifest_lookahead(path), max_draft_len=_manifest_draft_len(path))


def read_engine(engine_dir: Path | str) -> EngineBuild:
    """The engine folder's config.json (what the runtime itself reads), else its manifest.json."""
    engine_dir = Path(engine_dir)
    found = _from_config_json(engine_dir / "config.json") or _from_manifest(engine_dir / "manifest.json")
    if found is None:
        raise EngineConfigError(
            f"engine folder {engine_dir}: neither config.json (trtllm-build's build_config.max_batch_size) nor "
            "manifest.json (build/trtllm.py build) says what batch size it was built for: build it with "
            "`python build/trtllm.py build`, or set gateway_max_inflight explicitly")
    return found


def kv_sequences(engine: EngineBuild, values: dict[str, str], checkpoint_config: dict | None,
                 gpu_mem_gb: float = H100_80GB_GB) -> tuple[int | None, str]:
    """Sequences of `max_seq_len` tokens the paged KV cache holds at once, and how that was found; None
    when neither the GPU-memory plan nor `max_tokens_in_paged_kv_cache` can say."""
    from clients.sizing import ModelShape, plan

    seq_len = positive_int(values.get("max_seq_len")) or engine.max_seq_len
    if engine.max_seq_len and seq_len:
        seq_len = min(seq_len, engine.max_seq_len)
    if not seq_len:
        return None, "max_seq_len unknown"
    block = engine.tokens_per_block or BUILD_TOKENS_PER_BLOCK
    tokens, how = None, []
    shape = None
    if checkpoint_config is not None:
        try:
            shape = ModelShape.from_hf_config(checkpoint_config)
        except (KeyError, TypeError, ValueError):
            shape = None
    if shape is not None and engine.weights and engine.kv:
        fraction = float(values.get("kv_cache_free_gpu_mem_fraction") or DEFAULT_GPU_MEM_FRACTION)
        p = plan(shape, gpu_mem_gb, engine.weights, engine.kv, seq_len, engine.max_batch_size, fraction=fraction,
                 tokens_per_block=block, tp=engine.tp)
        tokens = p.tokens
        how.append(f"{p.tokens:,} KV tokens on {gpu_mem_gb:g} GB ({engine.weights} weights, {engine.kv} KV, "
                   f"TP {engine.tp}, fraction {fraction:g}; docs/sizing.md)")
    else:
        missing = ("the checkpoint's model shape" if shape is None else
                   "the engine's weight/KV dtypes" if not (engine.weights and engine.kv) else "")
        how.append(f"no GPU-memory plan ({missing} unknown)")
    cap = positive_int(values.get("max_tokens_in_paged_kv_cache"))
    if cap is not None:
        tokens = cap if tokens is None else min(tokens, cap)
        how.append(f"max_tokens_in_paged_kv_cache {cap:,}")
    if tokens is None:
        return None, "; ".join(how)
    sequences = (tokens // block) // math.ceil(seq_len / block)
    return sequences, f"{sequences} sequences of {seq_len} tokens: " + "; ".join(how)


def derive(target: str, values: dict[str, str], overrides: dict[str, str], engine_dir: Path | str | None = None,
           deploy: str | None = None, checkpoint_config: dict | None = None,
           gpu_mem_gb: float | None = None) -> Admission:
    """`gateway_max_inflight` and `gateway_max_queue` for a render of `target` (see the module's text).
    `values`: the knobs resolved so far; `overrides`: what was set explicitly (it wins); `engine_dir`: the
    GPU engine folder on this machine (without it and without --deploy, `gpt_model_path` is read when it
    is a folder here)."""
    inflight_set, queue_set = "gateway_max_inflight" in overrides, "gateway_max_queue" in overrides
    for knob in ("gateway_max_inflight", "gateway_max_queue"):
        if knob in overrides and positive_int(overrides[knob]) is None:
            raise EngineConfigError(f"{knob} must be a positive integer, got {overrides[knob]!r}")
    out = Admission({"gateway_max_inflight": values["gateway_max_inflight"],
                     "gateway_max_queue": values["gateway_max_queue"]})
    engine = None
    if target == "cpu":
        batch = positive_int(values.get("max_engine_batch_size"))
        if batch is None:
            raise EngineConfigError(f"max_engine_batch_size must be a positive integer, "
                                    f"got {values.get('max_engine_batch_size')!r}")
        record: dict = {"engine": "max_engine_batch_size", "engine_max_batch_size": batch}
        # the gateway counts each request's KV itself (docs/gateway.md), so only the batch bounds the slots
        kv, kv_how = None, "counted per request by the gateway"
    else:
        if engine_dir is not None:
            engine = read_engine(engine_dir)
        elif deploy is None and values.get("gpt_model_path") and Path(values["gpt_model_path"]).is_dir():
            engine = read_engine(values["gpt_model_path"])  # a render for this machine names a real folder
        record = {"engine": engine.source if engine else None}
        if engine is None:
            batch = BUILD_MAX_BATCH_SIZE
            record["engine_max_batch_size"] = batch
            if not inflight_set:
                out.warnings.append(
                    f"no engine read (the trtllm-build output folder: render.py --engine-dir, trtllm.py serve "
                    f"--engine): gateway_max_inflight assumes build/trtllm.py build's default max_batch_size {batch}")
            kv, kv_how = None, "no engine read"
        else:
            batch = engine.max_batch_size
            record["engine_max_batch_size"] = batch
            kv, kv_how = kv_sequences(engine, values, checkpoint_config, gpu_mem_gb or H100_80GB_GB)
    record["kv_sequences"] = kv
    record["kv_from"] = kv_how
    if inflight_set:
        inflight = positive_int(overrides["gateway_max_inflight"])
        record["from"] = "explicit"
        if inflight > batch:
            out.warnings.append(f"gateway_max_inflight {inflight} is more than the engine's max_batch_size "
                                f"{batch}: the rest wait in the engine's own queue, outside tiers and fairness")
    else:
        inflight = batch if kv is None else max(1, min(batch, kv))
        out.values["gateway_max_inflight"] = str(inflight)
        record["from"] = ("the CPU engine's max_engine_batch_size" if target == "cpu"
                          else "build/trtllm.py build's default max_batch_size (no engine read)" if engine is None
                          else "engine max_batch_size" if kv is None or kv >= batch else "KV cache at max_seq_len")
        if kv == 0:
            out.warnings.append(f"the KV cache cannot hold one sequence of max_seq_len ({kv_how}): "
                                "gateway_max_inflight 1")
    if not queue_set:
        out.values["gateway_max_queue"] = str(QUEUE_PER_SLOT * inflight)
    record["gateway_max_inflight"] = out.values["gateway_max_inflight"]
    record["gateway_max_queue"] = out.values["gateway_max_queue"]
    out.record = record
    out.engine = engine
    return out
