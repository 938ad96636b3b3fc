"""The engine model's tensor contract <-> the CPU engine library (`cpu_engine`).

`parse_engine_request` turns `tensorrt_llm` input tensors into a validated engine call with
TensorRT-LLM's defaults; `ResponseAssembler` turns the engine's per-step outputs for one request into
the output tensors of each response: one per chunk when streaming, one at the end otherwise.
Streamed chunks are cut only on UTF-8 character boundaries, so the stateless `postprocessing` step of
the ensemble decodes every chunk to complete text. A request with `num_return_sequences` n > 1 streams its
sequences' responses interleaved, each naming its `sequence_index`; the last response of the last
sequence to finish is the final one. `stream_interval` (vLLM's knob of that name) sends
the first token at once and then a response every N tokens: each response costs ~0.7 ms of CPU across
the stub, the server, `postprocessing` and the client, ~12% of a 16-stream step on 2 cores
(docs/benchmarks.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from contracts.tensors import (
    ENGINE, GUIDE_TYPES, LOOKAHEAD_INPUTS, PERF_OUTPUTS, RETENTION_DECODE_INPUTS, RETENTION_RANGE_INPUTS,
)
from text.detokenize import Detokenizer, incomplete_tail
from contracts.errors import invalid
from text.preprocess import resolve_min_tokens
from text.tokenization import parse_word_list
from contracts.triton_io import scalar
from cpu_engine import SamplingParams
from cpu_engine.guided import GuideSpec
from cpu_engine.retention import Retention, parse_retention


@dataclass
class EngineCall:
    prompt_ids: list[int]
    params: SamplingParams | None
    streaming: bool = False
    exclude_input: bool = True
    return_log_probs: bool = False
    return_context_logits: bool = False
    return_generation_logits: bool = False
    return_perf: bool = False
    stop: bool = False
    lora_task_id: int | None = None  # the adapter (cpu_engine/lora.py task_id of its folder name)
    lora_weights: bool = False  # the request carried `lora_weights` (TensorRT-LLM's way to ship an adapter)
    lookahead: dict | None = None  # the lookahead inputs sent (w, n, g by LOOKAHEAD_INPUTS name); None: none
    retention: Retention | None = None  # KV eviction priorities (cpu_engine/retention.py); None: the default


def parse_engine_request(x: dict[str, np.ndarray], default_exclude_input: bool = True) -> EngineCall:
    flag = lambda name, default=False: bool(scalar(x, name, default))  # noqa: E731
    if flag("stop"):
        return EngineCall([], None, stop=True)
    if "input_ids" not in x:
        raise invalid("input_ids", "is required")
    ids = np.asarray(x["input_ids"]).reshape(-1)
    length = scalar(x, "input_lengths", len(ids), int)
    if not 0 < length <= len(ids):
        raise invalid("input_lengths", f"must be in [1, {len(ids)}] (the number of input_ids), got {length}")
    max_new = scalar(x, "request_output_len", None)
    if max_new is None or int(max_new) < 1:
        raise invalid("request_output_len", f"must be at least 1, got {max_new}")
    min_tokens = _min_tokens(x)
    seed = scalar(x, "seed", None)
    end_id = scalar(x, "end_id", None)
    pad_id = scalar(x, "pad_id", None)
    bias = None
    if "embedding_bias" in x and np.asarray(x["embedding_bias"]).size:
        bias = np.asarray(x["embedding_bias"], dtype=np.float32).reshape(-1)
    params = SamplingParams(
        max_new_tokens=int(max_new),
        end_id=None if end_id is None or int(end_id) < 0 else int(end_id),  # -1: never end (ignore_eos)
        pad_id=None if pad_id is None else int(pad_id),
        temperature=scalar(x, "temperature", 1.0, float),
        top_k=scalar(x, "runtime_top_k", 0, int),
        top_p=scalar(x, "runtime_top_p", 0.0, float),
        seed=None if seed is None else int(seed),
        min_tokens=min_tokens,
        stop_words=_word_list(x, "stop_words_list", "stop_words"),
        bad_words=_word_list(x, "bad_words_list", "bad_words"),
        return_log_probs=flag("return_log_probs"),
        guide=_guide(x),
        embedding_bias=bias,
        num_return_sequences=scalar(x, "num_return_sequences", 1, int),
        return_context_logits=flag("return_context_logits"),
        return_generation_logits=flag("return_generation_logits"),
        presence_penalty=scalar(x, "presence_penalty", 0.0, float),
        frequency_penalty=scalar(x, "frequency_penalty", 0.0, float),
    )
    for field, message in params.problems():  # the sampling ranges, defined once (SamplingParams.problems)
        raise invalid(field, message)
    return EngineCall(
        prompt_ids=[int(t) for t in ids[:length]],
        params=params,
        streaming=flag("streaming"),
        exclude_input=flag("exclude_input_in_output", default_exclude_input),
        return_log_probs=flag("return_log_probs"),
        return_context_logits=flag("return_context_logits"),
        return_generation_logits=flag("return_generation_logits"),
        return_perf=flag("return_perf_metrics"),
        lora_task_id=_lora_task_id(x),
        lora_weights="lora_weights" in x,
        lookahead={name: scalar(x, name, None, int) for name in LOOKAHEAD_INPUTS if name in x} or None,
        retention=_retention(x),
    )


def _retention(x: dict) -> Retention | None:
    ranges = [np.asarray(x[name]).reshape(-1).tolist() if name in x else None for name in RETENTION_RANGE_INPUTS]
    decode = [scalar(x, name, None, int) for name in RETENTION_DECODE_INPUTS]
    try:
        return parse_retention(*ranges, *decode)
    except ValueError as e:
        field, message = e.args
        raise invalid(field, message) from None


def _guide(x: dict) -> GuideSpec | None:
    """`guided_decoding_guide_type` / `guided_decoding_guide` (strings, as upstream's Triton model reads
    them); the grammar itself is compiled when the engine takes the request (cpu_engine/guided.py)."""
    kind = scalar(x, "guided_decoding_guide_type", None)
    guide = scalar(x, "guided_decoding_guide", None)
    if kind is None:
        if guide is not None:
            raise invalid("guided_decoding_guide", "needs guided_decoding_guide_type (which grammar it is)")
        return None
    kind, guide = (_text(name, v) for name, v in (("guided_decoding_guide_type", kind),
                                                   ("guided_decoding_guide", guide or b"")))
    if kind and kind not in GUIDE_TYPES:
        raise invalid("guided_decoding_guide_type", f"must be one of {', '.join(GUIDE_TYPES)}, got {kind[:40]!r}")
    return GuideSpec(kind, guide) if kind else None


def _text(name: str, value) -> str:
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError:
        raise invalid(name, "is not valid UTF-8") from None


def _lora_task_id(x: dict) -> int | None:
    """`lora_task_id` (uint64). `lora_weights` / `lora_config` are TensorRT-LLM's way to ship an adapter with
    a request; the CPU engine reads PEFT folders of its own `lora_dir` instead and ignores them."""
    value = scalar(x, "lora_task_id", None)
    if value is None:
        return None
    value = int(value)
    if value < 0:
        raise invalid("lora_task_id", f"must be >= 0, got {value}")
    return value


def _min_tokens(x: dict) -> int:
    """`min_tokens`, or its older TensorRT-LLM name `min_length` (backend <= v0.19, genai-perf)."""
    return resolve_min_tokens(scalar(x, "min_tokens", None, int), scalar(x, "min_length", None, int))


def _word_list(x: dict, name: str, field: str) -> list[list[int]]:
    if name not in x:
        return []
    try:
        return parse_word_list(x[name])
    except (ValueError, TypeError) as e:
        raise invalid(field, f"{name} must be NVIDIA's [2, L] word list (ids, end offsets): {e}") from None


@dataclass
class _Held:
    """What one sequence of a request produced and has not sent yet."""
    ids: list = field(default_factory=list)
    lps: list = field(default_factory=list)
    logits: list = field(default_factory=list)
    bytes: bytes = b""
    sent_any: bool = False  # its first response is out
    context: np.ndarray | None = None  # the prompt's logits, on the sequence's next response


@dataclass
class ResponseAssembler:
    call: EngineCall
    detok: Detokenizer | None = None  # None: stream token by token
    stream_interval: int = 1  # streaming: tokens per response after the first (the final one takes the rest)
    held: dict = field(default_factory=dict)  # sequence index -> _Held
    done: bool = field(default=False, init=False)  # the final response (or an error) is out

    def feed(self, out) -> list[tuple[dict[str, np.ndarray] | None, bool]]:
        """Engine output for this request -> [(output tensors, is_final)] to send now; tensors None:
        send `out.error` as the final response."""
        if self.done:  # the request ended (an error of one of its sequences): the others' ends are moot
            return []
        h = self.held.setdefault(out.sequence_index, _Held())
        h.ids.extend(out.new_token_ids)
        h.lps.extend(out.new_log_probs or [0.0] * len(out.new_token_ids))
        if out.generation_logits:
            h.logits.extend(out.generation_logits)
        if out.context_logits is not None:
            h.context = out.context_logits
        if self.call.streaming and self.detok is not None and out.new_token_ids:
            h.bytes += self.detok.to_bytes(out.new_token_ids)
        if out.finished and out.error:
            # a failed request: what it streamed so far goes out, then the error (arrays None)
            self.done = True
            held = self._take(h)
            if self.call.streaming and held[0]:
                return [(self._tensors(out, h, held, final=False), False), (None, True)]
            return [(None, True)]
        if out.finished:
            final = out.ends_request
            self.done = final
            taken = self._take(h)
            if taken[0] or final or h.context is not None:
                return [(self._tensors(out, h, taken, final=final), final)]
            return []
        if not self.call.streaming or not h.ids:
            return []
        if h.sent_any and len(h.ids) < self.stream_interval:
            return []
        if self.detok is not None and incomplete_tail(h.bytes):
            return []  # a multi-byte character is still incomplete: wait for its next bytes
        h.sent_any = True
        return [(self._tensors(out, h, self._take(h), final=False), False)]

    @staticmethod
    def _take(h: _Held):
        taken = (h.ids, h.lps, h.logits)
        h.ids, h.lps, h.logits, h.bytes = [], [], [], b""
        return taken

    def _tensors(self, out, h: _Held, taken, final: bool) -> dict[str, np.ndarray]:
        ids, lps, logits = taken
        if not self.call.streaming and not self.call.exclude_input:
            ids = self.call.prompt_ids + ids
            lps = [0.0] * len(self.call.prompt_ids) + lps
        arrays = {
            "output_ids": np.array([[ids]], dtype=np.int32).reshape(1, 1, len(ids)),
            "sequence_length": np.array([[len(ids)]], dtype=np.int32),
        }
        # the optional outputs travel only when asked for: every extra tensor is serialized per token
        if self.call.return_log_probs:
            arrays["cum_log_probs"] = np.array([[out.cum_log_prob]], np.float32)
            arrays["output_log_probs"] = np.array(lps, dtype=np.float32).reshape(1, 1, len(ids))
        if self.call.return_generation_logits:
            rows = np.asarray(logits, dtype=np.float32).reshape(len(logits), -1) if logits else \
                np.zeros((0, 0), np.float32)
            arrays["generation_logits"] = rows[None, None]
        if h.context is not None:
            arrays["context_logits"] = h.context[None]
            h.context = None
        if self.call.params is not None and self.call.params.num_return_sequences > 1:
            arrays["sequence_index"] = np.array([[out.sequence_index]], dtype=np.int32)
        if self.call.return_perf:
            for name in PERF_OUTPUTS:
                arrays[name] = np.array([[out.perf.get(name, 0)]], dtype=ENGINE.output(name).numpy_dtype)
        return arrays


def stream_interval(raw: str) -> int:
    """The `stream_interval` model parameter: an integer >= 1 (empty: 1)."""
    try:
        value = int(raw or 1)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"parameter stream_interval must be an integer >= 1, got {raw!r}")
    return value
