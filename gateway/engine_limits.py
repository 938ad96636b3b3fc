"""What an engine model can ever hold, so the gateway refuses an impossible request before it reserves
rate-limit tokens or waits for an engine slot (issue 18, finding 10: the refusal used to come from the
engine, after the admission queue, 10.5 s late under a full cache).

The gateway learns the limits from the rendered repository it is served from: the engine model's
`config.pbtxt` next to its own (`build/render.py` writes `max_seq_len`, `max_tokens_in_paged_kv_cache`
and `tokens_per_block` there for the CPU engine), or, for a TensorRT-LLM engine, the `build_config`
of the engine's `config.json` under `gpt_model_path`. A limit that cannot be found is not enforced
here; the engine still refuses what it cannot hold.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

_PARAMETER = re.compile(
    r'parameters\s*:?\s*\{\s*key\s*:\s*"(?P<key>[^"]+)"\s*value\s*:?\s*\{\s*string_value\s*:\s*"(?P<value>[^"]*)"\s*\}\s*\}')


@dataclass(frozen=True)
class EngineLimits:
    max_seq_len: int | None = None  # prompt + output tokens of one sequence
    kv_cache_tokens: int | None = None  # the whole paged KV cache, in whole blocks
    lora_dir: str | None = None  # the engine's LoRA adapter folder (`lora_dir` parameter), if it has one
    served: bool = True  # False: the repository has no such engine model (a degrade target this render left out)
    tokens_per_block: int | None = None  # the KV cache's block: a sequence holds whole blocks

    def adapters(self) -> list[str] | None:
        """The adapter names the engine serves (its adapter folder's subfolders, read now: adapters added
        on disk are served without a reload); None when the engine declares no adapter folder."""
        if not self.lora_dir:
            return None
        try:
            return sorted(p.name for p in Path(self.lora_dir).iterdir() if (p / "adapter_config.json").is_file())
        except OSError:
            return []

    def converted_lora(self, adapter: str) -> tuple[Path, Path] | None:
        """TensorRT-LLM's converted weights of an adapter (hf_lora_convert.py's model.lora_weights.npy and
        model.lora_config.npy beside its PEFT files; build/trtllm.py lora-convert), or None."""
        if not self.lora_dir:
            return None
        folder = Path(self.lora_dir) / adapter
        files = folder / "model.lora_weights.npy", folder / "model.lora_config.npy"
        return files if all(f.is_file() for f in files) else None

    def limit(self) -> tuple[int, str] | None:
        """(tokens, what bounds them), the tighter of the two; None when neither is known. Whether a request
        fits is decided with the model's other bound in gateway/routing.py context_refusal."""
        known = [(v, what) for v, what in ((self.max_seq_len, "max_seq_len"),
                                           (self.kv_cache_tokens, "KV cache capacity")) if v]
        return min(known) if known else None


def config_parameters(text: str) -> dict[str, str]:
    """`parameters { key: "..." value: { string_value: "..." } }` entries of a config.pbtxt."""
    return {m["key"]: m["value"] for m in _PARAMETER.finditer(text)}


def positive_int(value) -> int | None:
    """A knob's value as an integer > 0, or None (unset, not a number, or not positive)."""
    try:
        n = int(str(value).strip())
    except (TypeError, ValueError):
        return None
    return n if n > 0 else None


def limits_from_parameters(params: dict[str, str]) -> EngineLimits:
    max_seq_len = positive_int(params.get("max_seq_len"))
    if max_seq_len is None and params.get("gpt_model_path"):  # a TensorRT-LLM engine directory
        max_seq_len = _engine_build_max_seq_len(Path(params["gpt_model_path"]))
    kv = positive_int(params.get("max_tokens_in_paged_kv_cache"))
    block = positive_int(params.get("tokens_per_block"))
    if kv is not None and block is not None:
        kv = kv // block * block  # the cache holds whole blocks only
    return EngineLimits(max_seq_len, kv or None, params.get("lora_dir") or None, tokens_per_block=block)


def _engine_build_max_seq_len(engine_dir: Path) -> int | None:
    try:
        cfg = json.loads((engine_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    build = cfg.get("build_config") if isinstance(cfg, dict) else None
    return positive_int(build.get("max_seq_len")) if isinstance(build, dict) else None


class RepositoryEngineLimits:
    """`limits(model)` for the engine models of a rendered model repository, read once per model."""

    def __init__(self, repository, lora_dir: str | None = None):
        """`lora_dir`: the gateway's own `lora_dir` parameter, for engines whose config names none (the
        TensorRT-LLM backend has no such key: there it holds the converted adapters the gateway sends)."""
        self.repository = Path(repository)
        self.lora_dir = lora_dir or None
        self._cache: dict[str, EngineLimits] = {}

    def __call__(self, model: str) -> EngineLimits:
        if model not in self._cache:
            try:
                text = (self.repository / model / "config.pbtxt").read_text()
            except OSError:
                self._cache[model] = EngineLimits(served=False)
            else:
                limits = limits_from_parameters(config_parameters(text))
                if limits.lora_dir is None and self.lora_dir:
                    limits = dataclasses.replace(limits, lora_dir=self.lora_dir)
                self._cache[model] = limits
        return self._cache[model]


def preprocessing_max_output_len(repository) -> int | None:
    """The cap `preprocessing` puts on max_tokens (its max_output_len, else its max_seq_len), read from its
    config next to the gateway's; None where there is none to read."""
    try:
        params = config_parameters((Path(repository) / "preprocessing" / "config.pbtxt").read_text())
    except OSError:
        return None
    return positive_int(params.get("max_output_len")) or positive_int(params.get("max_seq_len"))


_NO_LIMITS = EngineLimits()


def no_limits(model: str) -> EngineLimits:
    return _NO_LIMITS
