"""Engine knobs, named as TensorRT-LLM names them where a counterpart exists."""
from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from pathlib import Path

from cpu_engine import kernels
from cpu_engine.checkpoint import WEIGHT_DTYPES, resolve_weight_dtype
from cpu_engine.hf_config import max_seq_len, read_config
from cpu_engine.kernels import BACKENDS
from cpu_engine.speculation import DECODING_MODES, MIN_MATCHING_NGRAM_SIZE, SPECULATIVE_MODES, LookaheadConfig

POLICIES = ("guaranteed_no_evict", "max_utilization")
# model-config parameters (TensorRT-LLM's names) that name an EngineConfig field differently
PARAMETER_ALIASES = {"gpt_model_path": "checkpoint_dir", "max_engine_batch_size": "max_batch_size"}


class ConfigError(ValueError):
    pass


@dataclass
class EngineConfig:
    checkpoint_dir: str
    max_batch_size: int = 64  # sequences running at once
    max_num_tokens: int = 512  # tokens per step: decode tokens + prefill chunks
    max_seq_len: int | None = None  # default: the checkpoint's (hf_config.max_seq_len)
    tokens_per_block: int = 32
    max_tokens_in_paged_kv_cache: int | None = 16384
    kv_cache_free_mem_fraction: float = 0.1  # of MemAvailable; the KV size is the min of both
    enable_chunked_context: bool = True
    enable_kv_cache_reuse: bool = True
    # evicted prefix blocks kept as float16 copies in up to this many bytes, onboarded on reuse (host_tier.py;
    # TensorRT-LLM's host-memory KV offload knob); 0: off
    kv_cache_host_memory_bytes: int = 0
    batch_scheduler_policy: str = "guaranteed_no_evict"
    max_queue_size: int = 256  # waiting requests; 0 = unbounded
    weight_dtype: str = "auto"  # auto | float32 | bfloat16 | int8 (see checkpoint.resolve_weight_dtype)
    num_threads: int | None = None  # BLAS, MLAS, numba (and torch) threads; None: all cores
    matmul_backend: str = "auto"  # auto | numpy | onnxruntime (weights packed once; see onnx_graphs.py)
    attention_backend: str = "auto"  # auto | numpy | numba (decode attention, RoPE + cache write; kernels.py)
    output_threads: int = 2  # threads that deliver a step's outputs and poll cancellation (engine._deliver)
    lora_dir: str = ""  # folder of PEFT LoRA adapters, one folder per adapter (lora.py); empty: no adapters
    max_loras: int = 8  # adapters kept in memory at once (LRU)
    max_lora_rank: int = 64  # adapters of a higher rank are refused at load
    # speculative decoding (speculation.py): TensorRT-LLM's decoding_mode and its lookahead maxima (W, N, G)
    # "" (plain) | top_k | top_p | top_k_top_p | lookahead (prompt-lookup drafts) | draft_tokens_external
    # (drafts from a draft model: draft_model.py); the lookahead maxima bound both speculating modes
    decoding_mode: str = ""
    lookahead_window_size: int = 1  # W: requests may ask up to it (the CPU engine runs no Jacobi window)
    lookahead_ngram_size: int = 8  # N: up to N - 1 draft tokens verified per step
    lookahead_verification_set_size: int = 1  # G: candidates verified per step (the CPU engine verifies one)
    max_matching_ngram_size: int = 3  # longest tail of the sequence looked up for a draft (>= 2)
    max_draft_tokens_per_step: int = 16  # draft tokens verified in one step, all requests together (0: none)
    # draft_tokens_external: the draft model, a HF Llama checkpoint folder with the same vocabulary ("": this
    # engine's own checkpoint), and its weight precision (a cheaper copy of the model drafts for it)
    draft_model_dir: str = ""
    draft_weight_dtype: str = "int8"
    # ... and only while at most this many requests decode (measured: 1.25-1.32x for a lone stream, 0.94-1.08x
    # at 4 and 0.57-0.68x at 16 with no bound, docs/benchmarks.md); 0: at any batch
    draft_model_max_batch_size: int = 1
    # while several tenants (cache salts) decode, each tenant's rows in a step hold at most this many context
    # tokens, its longest-waiting row always (scheduler.py); 0: every running row decodes every step. 1,024
    # tokens of context cost about a third of the weights' pass (docs/benchmarks.md "Noisy neighbours")
    decode_context_share_tokens: int = 1024

    def __post_init__(self):
        for name in ("max_batch_size", "max_num_tokens", "tokens_per_block", "output_threads", "max_loras",
                     "max_lora_rank", "lookahead_window_size", "lookahead_ngram_size", "max_matching_ngram_size"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_threads is not None and int(self.num_threads) < 1:
            raise ConfigError(f"num_threads must be >= 1 (or unset), got {self.num_threads}")
        if self.kv_cache_host_memory_bytes < 0:
            raise ConfigError(f"kv_cache_host_memory_bytes must be >= 0, got {self.kv_cache_host_memory_bytes}")
        if self.max_queue_size < 0:
            raise ConfigError(f"max_queue_size must be >= 0, got {self.max_queue_size}")
        if not 0.0 < self.kv_cache_free_mem_fraction <= 1.0:
            raise ConfigError(f"kv_cache_free_mem_fraction must be in (0, 1], got {self.kv_cache_free_mem_fraction}")
        if self.batch_scheduler_policy not in POLICIES:
            raise ConfigError(f"batch_scheduler_policy must be one of {POLICIES}, got {self.batch_scheduler_policy!r}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ConfigError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {self.weight_dtype!r}")
        for knob, choices in BACKENDS.items():
            if getattr(self, knob) not in choices:
                raise ConfigError(f"{knob} must be one of {', '.join(choices)}, got {getattr(self, knob)!r}")
        if self.max_tokens_in_paged_kv_cache is not None and self.max_tokens_in_paged_kv_cache < self.tokens_per_block:
            raise ConfigError("max_tokens_in_paged_kv_cache must hold at least one block")
        if self.decoding_mode not in DECODING_MODES:
            raise ConfigError(f"decoding_mode must be one of {', '.join(repr(m) for m in DECODING_MODES)} on the CPU "
                              f"engine, got {self.decoding_mode!r}")
        if self.max_matching_ngram_size < MIN_MATCHING_NGRAM_SIZE:
            raise ConfigError(f"max_matching_ngram_size must be >= {MIN_MATCHING_NGRAM_SIZE}, got "
                              f"{self.max_matching_ngram_size}")
        if self.decode_context_share_tokens < 0:
            raise ConfigError(f"decode_context_share_tokens must be >= 0, got {self.decode_context_share_tokens}")
        if self.draft_model_max_batch_size < 0:
            raise ConfigError(f"draft_model_max_batch_size must be >= 0, got {self.draft_model_max_batch_size}")
        if self.max_draft_tokens_per_step < 0:
            raise ConfigError(f"max_draft_tokens_per_step must be >= 0, got {self.max_draft_tokens_per_step}")
        if self.lookahead_verification_set_size < 0:
            raise ConfigError(f"lookahead_verification_set_size must be >= 0, got {self.lookahead_verification_set_size}")
        if self.decoding_mode in SPECULATIVE_MODES and not self.lookahead.speculates:
            raise ConfigError(f"decoding_mode {self.decoding_mode} needs lookahead_ngram_size >= 2 and "
                              "lookahead_verification_set_size >= 1")
        if self.draft_weight_dtype not in WEIGHT_DTYPES:
            raise ConfigError(f"draft_weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got "
                              f"{self.draft_weight_dtype!r}")
        if self.draft_model_dir and not (Path(self.draft_model_dir) / "config.json").is_file():
            raise ConfigError(f"draft_model_dir {self.draft_model_dir}: no config.json (not a HF checkpoint folder)")
        if not (Path(self.checkpoint_dir) / "config.json").is_file():
            raise ConfigError(f"checkpoint_dir {self.checkpoint_dir}: no config.json (not a HF checkpoint folder)")
        if self.max_seq_len is None:
            self.max_seq_len = max_seq_len(read_config(self.checkpoint_dir))

    @property
    def lookahead(self) -> LookaheadConfig | None:
        """The engine's (W, N, G) when decoding_mode speculates, else None (no request speculates)."""
        if self.decoding_mode not in SPECULATIVE_MODES:
            return None
        return LookaheadConfig(self.lookahead_window_size, self.lookahead_ngram_size,
                               self.lookahead_verification_set_size)

    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> "EngineConfig":
        """Build from Triton model-config string parameters (unknown keys are ignored)."""
        kinds = {f.name: f.type for f in fields(cls)}
        values = {}
        for key, raw in params.items():
            name = PARAMETER_ALIASES.get(key, key)
            if name not in kinds or raw is None or str(raw).strip() == "" or str(raw).startswith("${"):
                continue
            kind = str(kinds[name])
            try:
                if "bool" in kind:
                    if raw.lower() not in ("true", "false", "1", "0"):
                        raise ValueError
                    values[name] = raw.lower() in ("true", "1")
                elif "int" in kind:
                    values[name] = int(raw)
                elif "float" in kind:
                    values[name] = float(raw)
                else:
                    values[name] = raw
            except ValueError:
                raise ConfigError(f"parameter {key}: cannot parse {raw!r} as {kind}") from None
        return cls(**values)


def parameter_defaults() -> dict[str, str]:
    """Every knob's default as a model-config parameter string, by parameter name: the one definition the
    renderer (build/render.py) and the benchmarks read, so the repository and the engine cannot drift.
    Fields without a default value (None: derived at load, such as max_seq_len) are left out."""
    out = {}
    by_field = {v: k for k, v in PARAMETER_ALIASES.items()}
    for f in fields(EngineConfig):
        if f.default is MISSING or f.default is None:
            continue
        value = ("true" if f.default else "false") if isinstance(f.default, bool) else str(f.default)
        out[by_field.get(f.name, f.name)] = value
    return out


def resolve_backends(weight_dtype: str, matmul_backend: str, attention_backend: str) -> dict[str, str]:
    """What the three `auto` knobs become in this environment; the matmul backend first, since int8
    weights need onnxruntime."""
    matmul = kernels.resolve("matmul_backend", matmul_backend)
    return {"weight_dtype": resolve_weight_dtype(weight_dtype, matmul), "matmul_backend": matmul,
            "attention_backend": kernels.resolve("attention_backend", attention_backend)}


def available_memory_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30
