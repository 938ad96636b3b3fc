"""The one definition of every model's tensor contract.

Names follow NVIDIA's `inflight_batcher_llm` (TensorRT-LLM 1.x: `min_tokens`, `seed`). The rendered
`config.pbtxt` files, the model adapters, the clients and the tests all read these tables, so a
tensor is added or renamed in exactly one place.

Dims exclude the batch dimension: every model has `max_batch_size > 0`, as upstream.
"""
from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass

import numpy as np

_NUMPY = {
    "TYPE_STRING": np.object_,
    "TYPE_BOOL": np.bool_,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_UINT64": np.uint64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
}
_WIRE = {  # tritonclient datatype strings
    "TYPE_STRING": "BYTES",
    "TYPE_BOOL": "BOOL",
    "TYPE_INT32": "INT32",
    "TYPE_INT64": "INT64",
    "TYPE_UINT64": "UINT64",
    "TYPE_FP16": "FP16",
    "TYPE_FP32": "FP32",
}


@dataclass(frozen=True)
class Tensor:
    name: str
    data_type: str
    dims: tuple[int, ...]
    optional: bool = False
    reshape: tuple[int, ...] | None = None  # upstream reshapes engine scalars to []
    ragged: bool = False  # allow_ragged_batch, as upstream does for variable-length engine inputs

    @property
    def numpy_dtype(self):
        return _NUMPY[self.data_type]

    @property
    def wire_dtype(self) -> str:
        return _WIRE[self.data_type]

    def to_pbtxt(self, is_input: bool) -> str:
        dims = ", ".join(str(d) for d in self.dims)
        parts = [f'name: "{self.name}"', f"data_type: {self.data_type}", f"dims: [ {dims} ]"]
        if self.reshape is not None:
            parts.append("reshape: { shape: [ %s ] }" % ", ".join(str(d) for d in self.reshape))
        if is_input and self.optional:
            parts.append("optional: true")
        if is_input and self.ragged:
            parts.append("allow_ragged_batch: true")
        return "  {\n    " + "\n    ".join(parts) + "\n  }"


@dataclass(frozen=True)
class Contract:
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]

    def input(self, name: str) -> Tensor:
        return self._inputs_by_name[name]

    def output(self, name: str) -> Tensor:
        return self._outputs_by_name[name]

    @functools.cached_property
    def _inputs_by_name(self) -> dict[str, Tensor]:
        return {t.name: t for t in self.inputs}  # looked up for every input of every request

    @functools.cached_property
    def _outputs_by_name(self) -> dict[str, Tensor]:
        return {t.name: t for t in self.outputs}

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @functools.cached_property
    def input_name_set(self) -> frozenset[str]:
        return frozenset(t.name for t in self.inputs)

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    def pbtxt(self) -> dict[str, str]:
        """The `${inputs}` and `${outputs}` blocks of a config template."""
        return {
            "inputs": "input [\n" + ",\n".join(t.to_pbtxt(True) for t in self.inputs) + "\n]",
            "outputs": "output [\n" + ",\n".join(t.to_pbtxt(False) for t in self.outputs) + "\n]",
        }


def _scalar(name, dtype, optional=True, reshape=None):
    return Tensor(name, dtype, (1,), optional=optional, reshape=reshape)


# --- preprocessing: text or chat messages -> token ids ---------------------------------------
PREPROCESSING = Contract(
    inputs=(
        # optional because MESSAGES may stand in for it; its absence is reported by the model
        _scalar("QUERY", "TYPE_STRING"),
        # required upstream; optional here so that the model itself reports "max_tokens: is required"
        # (Triton 2.51 does not enforce required ensemble inputs: the request silently got no answer)
        _scalar("REQUEST_OUTPUT_LEN", "TYPE_INT32"),
        Tensor("BAD_WORDS_DICT", "TYPE_STRING", (-1,), optional=True),
        Tensor("STOP_WORDS_DICT", "TYPE_STRING", (-1,), optional=True),
        _scalar("END_ID", "TYPE_INT32"),
        _scalar("PAD_ID", "TYPE_INT32"),
        # Project extension (the gateway uses it): JSON chat messages rendered with the chat template.
        _scalar("MESSAGES", "TYPE_STRING"),
        # Project extension: min_tokens and its older name min_length (genai-perf sends it) become one
        # OUT_MIN_TOKENS, so the engine sees only `min_tokens` on either target
        _scalar("MIN_TOKENS", "TYPE_INT32"),
        _scalar("MIN_LENGTH", "TYPE_INT32"),
        # Project extension (the gateway uses it): JSON list of OpenAI tools, rendered into the chat
        # template with MESSAGES (text/chat_tools.py)
        _scalar("TOOLS", "TYPE_STRING"),
        # Project extension: a prompt given as token ids (OpenAI completions' token-id prompts), checked
        # against the vocabulary and the context window as a text prompt's ids are
        Tensor("PROMPT_IDS", "TYPE_INT32", (-1,), optional=True),
    ),
    outputs=(
        Tensor("INPUT_ID", "TYPE_INT32", (-1,)),
        Tensor("REQUEST_INPUT_LEN", "TYPE_INT32", (1,)),
        Tensor("BAD_WORDS_IDS", "TYPE_INT32", (2, -1)),
        Tensor("STOP_WORDS_IDS", "TYPE_INT32", (2, -1)),
        Tensor("REQUEST_OUTPUT_LEN", "TYPE_INT32", (-1,)),
        Tensor("OUT_END_ID", "TYPE_INT32", (1,)),
        Tensor("OUT_PAD_ID", "TYPE_INT32", (1,)),
        Tensor("OUT_MIN_TOKENS", "TYPE_INT32", (1,)),
    ),
)

# --- the engine: `tensorrt_llm` (C++ backend on H100, the CPU engine model here) ---------------
# TensorRT-LLM's `return_perf_metrics` outputs, filled only when asked; the CPU engine's request outputs
# carry the same names (cpu_engine/sequence.py), so this is their one list. The C++ backend writes all ten
# when asked, the speculative-decoding three included even without a draft model (build/upstream facts
# backend_behaviour.perf_metrics_outputs): an undeclared one fails the response ("unexpected inference
# output"). The CPU engine fills those three from its prompt-lookup drafts (0 when a request drafts none).
PERF_TENSORS = (
    Tensor("kv_cache_alloc_new_blocks", "TYPE_INT32", (1,)),
    Tensor("kv_cache_reused_blocks", "TYPE_INT32", (1,)),
    Tensor("kv_cache_alloc_total_blocks", "TYPE_INT32", (1,)),
    Tensor("arrival_time_ns", "TYPE_INT64", (1,)),
    Tensor("first_scheduled_time_ns", "TYPE_INT64", (1,)),
    Tensor("first_token_time_ns", "TYPE_INT64", (1,)),
    Tensor("last_token_time_ns", "TYPE_INT64", (1,)),
    Tensor("acceptance_rate", "TYPE_FP32", (1,)),
    Tensor("total_accepted_draft_tokens", "TYPE_INT32", (1,)),
    Tensor("total_draft_tokens", "TYPE_INT32", (1,)),
)
PERF_OUTPUTS = tuple(t.name for t in PERF_TENSORS)
# per-request lookahead decoding (w, n, g), in this order: the engine's inputs (TensorRT-LLM's names)
LOOKAHEAD_INPUTS = ("lookahead_window_size", "lookahead_ngram_size", "lookahead_verification_set_size")
# KV retention (TensorRT-LLM's KvCacheRetentionConfig), per token range of the prompt and for the generated tokens
RETENTION_RANGE_INPUTS = ("retention_token_range_starts", "retention_token_range_ends",
                          "retention_token_range_priorities", "retention_token_range_durations_ms")
RETENTION_DECODE_INPUTS = ("retention_decode_priority", "retention_decode_duration_ms")
_S = ()  # upstream reshapes the engine's [1] inputs to scalars
ENGINE = Contract(
    inputs=(
        Tensor("input_ids", "TYPE_INT32", (-1,), optional=True, ragged=True),
        _scalar("input_lengths", "TYPE_INT32", optional=False, reshape=_S),
        _scalar("request_output_len", "TYPE_INT32", optional=False, reshape=_S),
        # n sequences of one prompt (OpenAI's n): each response names its `sequence_index`
        _scalar("num_return_sequences", "TYPE_INT32", reshape=_S),
        _scalar("end_id", "TYPE_INT32", reshape=_S),
        _scalar("pad_id", "TYPE_INT32", reshape=_S),
        Tensor("stop_words_list", "TYPE_INT32", (2, -1), optional=True, ragged=True),
        Tensor("bad_words_list", "TYPE_INT32", (2, -1), optional=True, ragged=True),
        # [vocab] added to the logits before sampling: OpenAI's logit_bias, made dense by the gateway
        Tensor("embedding_bias", "TYPE_FP32", (-1,), optional=True, ragged=True),
        _scalar("temperature", "TYPE_FP32", reshape=_S),
        _scalar("runtime_top_k", "TYPE_INT32", reshape=_S),
        _scalar("runtime_top_p", "TYPE_FP32", reshape=_S),
        _scalar("seed", "TYPE_UINT64", reshape=_S),
        _scalar("min_tokens", "TYPE_INT32", reshape=_S),
        # the older TensorRT-LLM name of min_tokens (backend <= v0.19): the CPU engine accepts either;
        # the C++ backend of TensorRT-LLM 1.x reads min_tokens only (the ensemble sends that one)
        _scalar("min_length", "TYPE_INT32", reshape=_S),
        _scalar("presence_penalty", "TYPE_FP32", reshape=_S),
        _scalar("frequency_penalty", "TYPE_FP32", reshape=_S),
        _scalar("streaming", "TYPE_BOOL", reshape=_S),
        _scalar("exclude_input_in_output", "TYPE_BOOL", reshape=_S),
        _scalar("return_log_probs", "TYPE_BOOL", reshape=_S),
        # the model's raw logits: of every prompt position (echo's prompt log probs; the GPU engine needs
        # --gather_context_logits) and of each generated token (top_logprobs' alternatives)
        _scalar("return_context_logits", "TYPE_BOOL", reshape=_S),
        _scalar("return_generation_logits", "TYPE_BOOL", reshape=_S),
        _scalar("return_perf_metrics", "TYPE_BOOL", reshape=_S),
        _scalar("stop", "TYPE_BOOL", reshape=_S),
        # LoRA, as upstream: the adapter's task id; on TensorRT-LLM its weights ([layers x modules, in*r + r*out]
        # float16, from hf_lora_convert.py) and config ([.., 3]: module id, layer, rank) come with the
        # first request of a replica, then the task id alone. The CPU engine maps the task id to a folder
        # of its `lora_dir` (cpu_engine/lora.py task_id) and ignores lora_weights / lora_config.
        _scalar("lora_task_id", "TYPE_UINT64", reshape=_S),
        Tensor("lora_weights", "TYPE_FP16", (-1, -1), optional=True, ragged=True),
        Tensor("lora_config", "TYPE_INT32", (-1, 3), optional=True, ragged=True),
        # guided decoding, as upstream: a guide type (GUIDE_TYPES) and its text; the C++ backend compiles it with xgrammar, the CPU engine with llguidance
        # (cpu_engine/guided.py). Structured outputs and constrained tool calls of the front arrive here.
        Tensor("guided_decoding_guide_type", "TYPE_STRING", (1,), optional=True, ragged=True),
        Tensor("guided_decoding_guide", "TYPE_STRING", (1,), optional=True, ragged=True),
        # lookahead decoding, per request, as upstream: (w, n, g) at most the engine's (W, N, G); (1, 1, 0)
        # decodes plainly. The CPU engine reads them as prompt-lookup drafts (cpu_engine/speculation.py).
        *(Tensor(name, "TYPE_INT32", (1,), optional=True, ragged=True) for name in LOOKAHEAD_INPUTS),
        # KV retention, as upstream: eviction priorities (0-100, default 35) of prompt token ranges (end -1: the
        # prompt's end) and of generated tokens, each for a duration; the gateway sends them for session turns
        # (gateway/sessions.py), the CPU engine honours them (cpu_engine/retention.py)
        *(Tensor(name, "TYPE_INT32", (-1,), optional=True, ragged=True) for name in RETENTION_RANGE_INPUTS),
        *(Tensor(name, "TYPE_INT32", (1,), optional=True, ragged=True) for name in RETENTION_DECODE_INPUTS),
    ),
    outputs=(
        Tensor("output_ids", "TYPE_INT32", (-1, -1)),
        Tensor("sequence_length", "TYPE_INT32", (-1,)),
        Tensor("cum_log_probs", "TYPE_FP32", (-1,)),
        Tensor("output_log_probs", "TYPE_FP32", (-1, -1)),
        Tensor("context_logits", "TYPE_FP32", (-1, -1)),  # upstream: ${logits_datatype}, rendered FP32
        Tensor("generation_logits", "TYPE_FP32", (-1, -1, -1)),
        Tensor("sequence_index", "TYPE_INT32", (1,)),
    ) + PERF_TENSORS,
)

# --- postprocessing: token ids -> text -------------------------------------------------------
POSTPROCESSING = Contract(
    inputs=(
        Tensor("TOKENS_BATCH", "TYPE_INT32", (-1, -1)),
        Tensor("SEQUENCE_LENGTH", "TYPE_INT32", (-1,)),
    ),
    outputs=(Tensor("OUTPUT", "TYPE_STRING", (-1,)),),
)

# --- ensemble: NVIDIA's text-in/text-out contract --------------------------------------------
ENSEMBLE = Contract(
    inputs=(
        # Required upstream. Triton 2.51 does not enforce required inputs when optional ones are
        # present (a missing text_input silently produced no response), so it is optional here and
        # preprocessing reports "text_input: is required" itself.
        _scalar("text_input", "TYPE_STRING"),
        _scalar("max_tokens", "TYPE_INT32"),  # required upstream; optional for the same reason
        Tensor("bad_words", "TYPE_STRING", (-1,), optional=True),
        Tensor("stop_words", "TYPE_STRING", (-1,), optional=True),
        _scalar("end_id", "TYPE_INT32"),
        _scalar("pad_id", "TYPE_INT32"),
        _scalar("top_k", "TYPE_INT32"),
        _scalar("top_p", "TYPE_FP32"),
        _scalar("temperature", "TYPE_FP32"),
        _scalar("min_tokens", "TYPE_INT32"),
        _scalar("min_length", "TYPE_INT32"),  # the older name of min_tokens, sent by genai-perf
        _scalar("seed", "TYPE_UINT64"),
        _scalar("presence_penalty", "TYPE_FP32"),
        _scalar("frequency_penalty", "TYPE_FP32"),
        _scalar("exclude_input_in_output", "TYPE_BOOL"),
        _scalar("return_log_probs", "TYPE_BOOL"),
        _scalar("return_perf_metrics", "TYPE_BOOL"),
        _scalar("stream", "TYPE_BOOL"),
        # guided decoding, passed to the engine as upstream's ensemble does (GUIDE_TYPES)
        _scalar("guided_decoding_guide_type", "TYPE_STRING"),
        _scalar("guided_decoding_guide", "TYPE_STRING"),
    ),
    outputs=(Tensor("text_output", "TYPE_STRING", (-1,)),)
    + tuple(t for t in ENGINE.outputs
            if t.name not in ("output_ids", "sequence_length", "context_logits", "generation_logits", "sequence_index")),
)

# The sampling inputs of the ensemble and the gateway -> the engine tensor each becomes (TensorRT-LLM
# prefixes top_k/top_p with `runtime_`): the ensemble's wiring, the gateway's engine call and the CPU
# engine's error names read it.
SAMPLING_TO_ENGINE = {"temperature": "temperature", "top_k": "runtime_top_k", "top_p": "runtime_top_p",
                      "seed": "seed", "min_tokens": "min_tokens", "presence_penalty": "presence_penalty",
                      "frequency_penalty": "frequency_penalty"}

# Ensemble wiring: (step model, {step input: ensemble tensor}, {step output: ensemble tensor}).
# Internal tensors start with "_" as upstream.
ENSEMBLE_STEPS = (
    (
        "preprocessing",
        {
            "QUERY": "text_input",
            "REQUEST_OUTPUT_LEN": "max_tokens",
            "BAD_WORDS_DICT": "bad_words",
            "STOP_WORDS_DICT": "stop_words",
            "END_ID": "end_id",
            "PAD_ID": "pad_id",
            "MIN_TOKENS": "min_tokens",
            "MIN_LENGTH": "min_length",
        },
        {
            "INPUT_ID": "_INPUT_ID",
            "REQUEST_INPUT_LEN": "_REQUEST_INPUT_LEN",
            "REQUEST_OUTPUT_LEN": "_REQUEST_OUTPUT_LEN",
            "STOP_WORDS_IDS": "_STOP_WORDS_IDS",
            "BAD_WORDS_IDS": "_BAD_WORDS_IDS",
            "OUT_END_ID": "_PREPROCESSOR_END_ID",
            "OUT_PAD_ID": "_PREPROCESSOR_PAD_ID",
            "OUT_MIN_TOKENS": "_MIN_TOKENS",
        },
    ),
    (
        "${engine_model_name}",
        {
            "input_ids": "_INPUT_ID",
            "input_lengths": "_REQUEST_INPUT_LEN",
            "request_output_len": "_REQUEST_OUTPUT_LEN",
            "end_id": "_PREPROCESSOR_END_ID",
            "pad_id": "_PREPROCESSOR_PAD_ID",
            "stop_words_list": "_STOP_WORDS_IDS",
            "bad_words_list": "_BAD_WORDS_IDS",
            **{engine: name for name, engine in SAMPLING_TO_ENGINE.items() if name != "min_tokens"},
            "min_tokens": "_MIN_TOKENS",  # min_tokens or min_length, resolved by preprocessing
            "streaming": "stream",
            "exclude_input_in_output": "exclude_input_in_output",
            "return_log_probs": "return_log_probs",
            "return_perf_metrics": "return_perf_metrics",
            "guided_decoding_guide_type": "guided_decoding_guide_type",
            "guided_decoding_guide": "guided_decoding_guide",
        },
        {"output_ids": "_TOKENS_BATCH", "sequence_length": "_SEQUENCE_LENGTH"}
        | {name: name for name in ("cum_log_probs", "output_log_probs") + PERF_OUTPUTS},
    ),
    (
        "postprocessing",
        {"TOKENS_BATCH": "_TOKENS_BATCH", "SEQUENCE_LENGTH": "_SEQUENCE_LENGTH"},
        {"OUTPUT": "text_output"},
    ),
)


def ensemble_scheduling_pbtxt(engine_model_name: str) -> str:
    """The `ensemble_scheduling` block, generated from ENSEMBLE_STEPS."""
    steps = []
    for model, ins, outs in ENSEMBLE_STEPS:
        model = model.replace("${engine_model_name}", engine_model_name)
        maps = [
            "      input_map { key: \"%s\" value: \"%s\" }" % kv for kv in ins.items()
        ] + ["      output_map { key: \"%s\" value: \"%s\" }" % kv for kv in outs.items()]
        steps.append(
            '    {\n      model_name: "%s"\n      model_version: -1\n%s\n    }' % (model, "\n".join(maps))
        )
    return "ensemble_scheduling {\n  step [\n" + ",\n".join(steps) + "\n  ]\n}"


# --- gateway: the ensemble's inputs plus chat messages, model choice and usage outputs ----------
GATEWAY = Contract(
    inputs=(
        _scalar("text_input", "TYPE_STRING"),
        _scalar("messages", "TYPE_STRING"),  # JSON [{"role": ..., "content": ...}], chat-templated
        # generate's (the gateway refuses one without it, naming it); the other operations generate nothing
        _scalar("max_tokens", "TYPE_INT32"),
        _scalar("stream", "TYPE_BOOL"),
        _scalar("temperature", "TYPE_FP32"),
        _scalar("top_k", "TYPE_INT32"),
        _scalar("top_p", "TYPE_FP32"),
        _scalar("seed", "TYPE_UINT64"),
        _scalar("min_tokens", "TYPE_INT32"),
        _scalar("presence_penalty", "TYPE_FP32"),
        _scalar("frequency_penalty", "TYPE_FP32"),
        Tensor("stop_words", "TYPE_STRING", (-1,), optional=True),
        Tensor("bad_words", "TYPE_STRING", (-1,), optional=True),
        # JSON {"token id": bias in [-100, 100]}: OpenAI's logit_bias, the engine's embedding_bias
        _scalar("logit_bias", "TYPE_STRING"),
        # n sequences of the prompt (OpenAI's n): the engine's num_return_sequences, billed per sequence
        _scalar("num_return_sequences", "TYPE_INT32"),
        # per-token log probs: 0 the chosen token's, k > 0 also the k best alternatives (OpenAI's
        # top_logprobs / completions' logprobs); absent: none. echo_logprobs: the prompt's too
        _scalar("logprobs", "TYPE_INT32"),
        _scalar("echo_logprobs", "TYPE_BOOL"),
        _scalar("user", "TYPE_STRING"),  # the end user the caller names (OpenAI's user): the usage ledger's
        _scalar("model", "TYPE_STRING"),  # an engine model name or "auto"
        _scalar("adapter", "TYPE_STRING"),
        _scalar("ignore_eos", "TYPE_BOOL"),  # generate past the end token (benchmarks: forced lengths)
        # what to do (GATEWAY_OPERATIONS, default "generate"): the front's /v1/tokenize, /v1/detokenize
        # and /v1/models go through the gateway too, so auth and tenancy stay in one place
        _scalar("operation", "TYPE_STRING"),
        # detokenize's input; generate's prompt as token ids when there is no text_input or messages
        Tensor("token_ids", "TYPE_INT32", (-1,), optional=True),
        _scalar("tools", "TYPE_STRING"),  # JSON [OpenAI tool objects], rendered with `messages`
        # guided decoding, passed to the engine as they are (the engine contract's names and GUIDE_TYPES)
        _scalar("guided_decoding_guide_type", "TYPE_STRING"),
        _scalar("guided_decoding_guide", "TYPE_STRING"),
    ),
    outputs=(
        Tensor("text_output", "TYPE_STRING", (-1,)),
        Tensor("token_ids", "TYPE_INT32", (-1,)),  # tokenize's output
        Tensor("model_used", "TYPE_STRING", (1,)),
        Tensor("finish_reason", "TYPE_STRING", (1,)),
        Tensor("num_input_tokens", "TYPE_INT32", (1,)),
        Tensor("num_output_tokens", "TYPE_INT32", (1,)),
        # with num_return_sequences > 1 or logprobs: the sequence a chunk belongs to, and its tokens' log
        # probs as JSON {"tokens": [[id, logprob, [[id, logprob], ...]], ...], "prompt": [...]}
        # (contracts/logprobs.py TokenLogprob)
        Tensor("sequence_index", "TYPE_INT32", (1,)),
        Tensor("token_logprobs", "TYPE_STRING", (1,)),
        # `models`: the models the caller may use, entry i of each (an empty owner or parent: none); the
        # context is the tokens the tenant may use on it
        Tensor("model_ids", "TYPE_STRING", (-1,)),
        Tensor("model_context_tokens", "TYPE_INT32", (-1,)),
        Tensor("model_owners", "TYPE_STRING", (-1,)),
        Tensor("model_parents", "TYPE_STRING", (-1,)),
        # `whoami`: the caller's tenant and tier, the prompt bound the front applies before reading a body,
        # and whether its tenant keeps conversations (sessions, stored responses)
        Tensor("tenant", "TYPE_STRING", (1,)),
        Tensor("tier", "TYPE_STRING", (1,)),
        Tensor("max_prompt_bytes", "TYPE_INT64", (1,)),
        Tensor("stores_conversations", "TYPE_BOOL", (1,)),
    ),
)

# the values of `guided_decoding_guide_type`: the GuidedDecodingParams.GuideType names TensorRT-LLM's C++ backend
# maps (build/upstream/tensorrt_llm_backend.json guide_types); the CPU engine compiles each (cpu_engine/guided.py)
GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar")


@dataclass(frozen=True)
class StoredKind:
    """A kind of object the front keeps through the gateway: its ids' form (the front makes them: a prefix
    and 32 random hex digits; the gateway keys its store by them), the parts of what is stored, and what
    can be done with one (`append`: items added to its last part in the gateway, one writer at a time)."""
    name: str
    id_form: re.Pattern
    parts: tuple[str, ...]
    verbs: tuple[str, ...] = ("get", "put", "delete")

    @property
    def id_field(self) -> str:
        return f"{self.name}_id"


STORED_KINDS = {k.name: k for k in (
    # a response, its input items, and the conversation up to and with its output (front/responses_api.py)
    StoredKind("response", re.compile(r"resp_[A-Za-z0-9]{1,64}"), ("response", "input", "items")),
    # a conversation object and its items (front/conversations_api.py)
    StoredKind("conversation", re.compile(r"conv_[A-Za-z0-9]{1,64}"), ("conversation", "items"),
               ("get", "put", "append", "delete")),
)}
STORED_OPERATIONS = tuple(f"{k.name}_{verb}" for k in STORED_KINDS.values() for verb in k.verbs)


def stored_revision(stored: dict) -> str:
    """Which version of a stored object (its parts) a conditional `_put` was made from (request parameter
    `stored_revision`): SHA-256 of its canonical JSON, computed by the front over what it read and by the
    gateway over what it holds, so a change made in between is never written over."""
    canonical = json.dumps(stored, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()

# admit / settle / renew / engine_check: the front's leases (gateway/core.py Leases), front key only;
# session_get / session_delete: the caller's chat session (request parameter session_id; gateway/sessions.py);
# response_* / conversation_*: the objects of the Responses and Conversations APIs the gateway keeps for the
# front (STORED_KINDS): _get and _delete the caller's own (request parameter response_id / conversation_id),
# _put (front key only) stores one (request parameter stored_object, JSON; gateway/sessions.py StoredObjects),
# with stored_revision (stored_revision()) only over that version of it (answer "stored": false otherwise),
# conversation_append (front key only) adds the items of stored_object {"items": [...]} to one;
# stop: end the caller's own generate stream named by its request parameter stream_id (gateway/core.py Streams)
GATEWAY_OPERATIONS = ("generate", "tokenize", "detokenize", "models", "whoami", "admit", "settle", "renew",
                      "engine_check", "session_get", "session_delete", *STORED_OPERATIONS, "stop")
# a JSON request parameter (`lease`, `stored_object`) holds at most this many characters; a grouped admit
# (`lease` {"admits": [...]}: gateway/request.py grouped_admits) at most MAX_ADMITS_PER_GROUP admits
MAX_JSON_PARAMETER_CHARS = 1 << 20
MAX_ADMITS_PER_GROUP = 256


def lora_task_id(name: str) -> int:
    """The engine's `lora_task_id` (uint64, kept below 2**63) that stands for the adapter `name`: the first
    8 bytes of SHA-256 of the name. Part of the contract because both sides compute it: the gateway sends
    it, the CPU engine maps it back through its adapter folder (cpu_engine/lora.py)."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "little") & (2 ** 63 - 1)


CONTRACTS = {
    "preprocessing": PREPROCESSING,
    "postprocessing": POSTPROCESSING,
    "tensorrt_llm": ENGINE,
    "ensemble": ENSEMBLE,
    "gateway": GATEWAY,
}
