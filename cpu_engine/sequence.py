"""A request's state inside the engine."""
from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from contracts.tensors import PERF_OUTPUTS, SAMPLING_TO_ENGINE
from cpu_engine.speculation import PLAIN, LookaheadConfig, NgramIndex
from contracts.generation import MAX_RETURN_SEQUENCES
from contracts.logprobs import MIN_TEMPERATURE

# the ensemble's (and gateway's) input name -> the engine tensor it becomes, where they differ
ENGINE_NAMES = {"max_tokens": "request_output_len",
                **{name: engine for name, engine in SAMPLING_TO_ENGINE.items() if name != engine}}
MAX_TEMPERATURE = 1e4  # above it the distribution is uniform to float32 precision anyway
MAX_PENALTY = 2.0  # presence / frequency penalties: OpenAI's range is [-2, 2]


@dataclass
class SamplingParams:
    """Per-request sampling with TensorRT-LLM semantics (temperature defaults to 1.0; greedy when
    temperature == 0 (or below MIN_TEMPERATURE), top_k == 1, or top_k == 0 and top_p == 0)."""

    max_new_tokens: int
    end_id: int | None = None
    pad_id: int | None = None
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    stop_words: list[list[int]] = field(default_factory=list)
    bad_words: list[list[int]] = field(default_factory=list)
    return_log_probs: bool = False
    guide: object | None = None  # guided.GuideSpec: the grammar every token must follow (guided decoding)
    # TensorRT-LLM's names: presence / frequency penalties (over the generated tokens, as OpenAI and
    # vLLM count them), `embedding_bias` (a [vocab] float vector added to the logits: OpenAI's
    # logit_bias), `num_return_sequences` (n sequences sharing the prompt's KV blocks)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    embedding_bias: np.ndarray | None = None
    num_return_sequences: int = 1
    return_context_logits: bool = False  # the prompt's logits [prompt, vocab], with the first output
    return_generation_logits: bool = False  # each generated token's logits [vocab], as it is sent

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1 or (self.top_k == 0 and self.top_p == 0)

    def problems(self) -> list[tuple[str, str]]:
        """(field, message) for every value the engine cannot honour; empty when all are valid. Fields
        carry the ensemble's names (ENGINE_NAMES gives the engine tensor each stands for)."""
        out = []

        def integer(name, value, low, what):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                out.append((name, f"must be an integer, got {value!r}"))
            elif value < low:
                out.append((name, f"must be {what}, got {value}"))

        def real(name, value, low, high):
            try:
                v = float(value)
            except (TypeError, ValueError):
                out.append((name, f"must be a number, got {value!r}"))
                return
            if not math.isfinite(v) or not low <= v <= high:
                out.append((name, f"must be a finite number in [{low:g}, {high:g}], got {v!r}"))

        integer("max_tokens", self.max_new_tokens, 1, ">= 1")
        real("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        integer("top_k", self.top_k, 0, ">= 0")
        real("top_p", self.top_p, 0.0, 1.0)
        integer("min_tokens", self.min_tokens, 0, ">= 0")
        real("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        real("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        integer("num_return_sequences", self.num_return_sequences, 1, ">= 1")
        if isinstance(self.num_return_sequences, int) and self.num_return_sequences > MAX_RETURN_SEQUENCES:
            out.append(("num_return_sequences", f"must be at most {MAX_RETURN_SEQUENCES}, "
                                                f"got {self.num_return_sequences}"))
        if self.embedding_bias is not None and not np.all(np.isfinite(self.embedding_bias)):
            out.append(("embedding_bias", "must hold finite numbers"))
        if self.seed is not None:
            integer("seed", self.seed, 0, ">= 0")
        for name, value in (("end_id", self.end_id), ("pad_id", self.pad_id)):
            if value is not None:
                integer(name, value, -(2 ** 31), "an int32 token id")
        for name, words in (("stop_words", self.stop_words), ("bad_words", self.bad_words)):
            if not all(isinstance(w, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in w)
                       for w in words):
                out.append((name, "must be lists of token ids"))
        return out


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_log_probs: list[float] | None
    cum_log_prob: float
    finished: bool
    finish_reason: str | None  # length | end_id | stop_words | cancelled | error
    error: str | None
    num_prompt_tokens: int
    num_generated_tokens: int
    perf: dict  # PERF_FIELDS -> int; also readable as attributes (out.kv_cache_reused_blocks)
    error_kind: str | None = None  # contracts/errors.py kind of `error` (None: internal)
    sequence_index: int = 0  # which of the request's num_return_sequences this output belongs to
    context_logits: np.ndarray | None = None  # [prompt, vocab] float32, on the first output when asked
    generation_logits: list | None = None  # one [vocab] float32 row per new token, when asked
    # the last output of the request (every sequence of it finished); None: `finished` (one sequence)
    request_finished: bool | None = None

    @property
    def ends_request(self) -> bool:
        return self.finished if self.request_finished is None else self.request_finished

    def __getattr__(self, name):
        if name in PERF_FIELDS:
            return self.perf[name]
        raise AttributeError(name)


# TensorRT-LLM's `return_perf_metrics` outputs: the engine contract's names
PERF_FIELDS = PERF_OUTPUTS


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    on_output: Callable[[RequestOutput], None]
    is_cancelled: Callable[[], bool] | None = None
    cache_salt: str | None = None
    adapter: str | None = None  # the LoRA adapter's name (lora.py); None: the base model
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    pending_ids: list[int] = field(default_factory=list)  # produced since the last callback
    pending_log_probs: list[float] = field(default_factory=list)
    pending_logits: list = field(default_factory=list)  # generation logits rows of pending_ids
    context_logits: np.ndarray | None = None  # filled row by row during prefill, sent once
    context_logits_sent: bool = False
    sequence_index: int = 0  # 0: the request's first sequence; 1..n-1: the ones forked from it
    pending_forks: int = 0  # sequences still to fork from this one once its prompt is computed
    siblings: list = field(default_factory=list)  # the first sequence: every sequence of its request
    cum_log_prob: float = 0.0
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # positions whose K/V are in the cache
    num_registered: int = 0  # leading blocks registered for reuse
    last_key: bytes = bytes(32)  # prefix key of the last registered block (kv_cache_manager.ROOT_KEY)
    last_serial: int | None = 0  # its registration in the block pool; None once a block stayed private
    reused_blocks: int = 0
    new_blocks: int = 0
    preemptions: int = 0
    last_decode_step: int = 0  # the scheduler's step it last decoded in (tenant-fair turns)
    cancel_requested: bool = False
    cancel_polled: bool = False  # is_cancelled was asked after this step's output (engine._deliver)
    arrival_time_ns: int = field(default_factory=time.time_ns)
    first_scheduled_time_ns: int = 0
    first_token_time_ns: int = 0
    last_token_time_ns: int = 0
    rng: np.random.Generator | None = None
    lora: object | None = None  # the loaded lora.LoraAdapter, pinned in the pool while this sequence lives
    guide: object | None = None  # guided.Guide compiled from params.guide at submit: masks each token
    lookahead: LookaheadConfig = PLAIN  # this request's (w, n, g) (speculation.py); PLAIN: no drafts
    retention: object | None = None  # retention.Retention: its blocks' eviction priorities; None: the default
    ngrams: NgramIndex | None = None  # where its n-grams occurred, for prompt-lookup drafts
    draft: list[int] = field(default_factory=list)  # this step's proposal (the scheduler may shorten it)
    draft_len: int = 0  # the next proposal's length (speculation.next_draft_len)
    draft_computed: int = 0  # positions whose K/V the draft model wrote for this sequence (draft_model.py)
    draft_tokens: int = 0  # draft tokens verified so far (TensorRT-LLM's total_draft_tokens)
    accepted_draft_tokens: int = 0  # of which accepted (total_accepted_draft_tokens)

    @property
    def cache_namespace(self):
        """What the prefix-cache keys are salted with: the cache salt, and the adapter's identity if any."""
        return self.cache_salt if self.lora is None else (self.cache_salt, self.lora.identity)

    def __post_init__(self):
        # sequence i > 0 of a seeded request draws from (seed, i): reproducible, and not a copy of sequence 0
        seed = self.params.seed
        self.rng = np.random.default_rng(seed if seed is None or not self.sequence_index
                                         else [seed, self.sequence_index])

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.num_tokens - 1

    def perf(self) -> dict:
        return {
            "kv_cache_alloc_new_blocks": self.new_blocks,
            "kv_cache_reused_blocks": self.reused_blocks,
            "kv_cache_alloc_total_blocks": self.new_blocks + self.reused_blocks,
            "arrival_time_ns": self.arrival_time_ns,
            "first_scheduled_time_ns": self.first_scheduled_time_ns,
            "first_token_time_ns": self.first_token_time_ns,
            "last_token_time_ns": self.last_token_time_ns,
            "acceptance_rate": self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0,
            "total_accepted_draft_tokens": self.accepted_draft_tokens,
            "total_draft_tokens": self.draft_tokens,
        }
