"""What a generate request asks of the engine beyond its tokens (OpenAI's n, logprobs, echo, logit_bias),
as TensorRT-LLM's inputs, and one engine response read back. Shared by the gateway (its engine call and
stream) and the front's direct stream, so both ask and read the same way."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# the most sequences one request may ask of the engine (its num_return_sequences): the CPU engine refuses
# more, and the gateway, whose reservation counts every sequence, refuses more before reserving
MAX_RETURN_SEQUENCES = 128


@dataclass(frozen=True)
class Outputs:
    """What a generate request asks of the engine beyond its tokens (OpenAI's n, logprobs, echo)."""

    num_return_sequences: int = 1
    logprobs: int | None = None  # None: none; 0: each token's own; k: and the k best alternatives
    echo_logprobs: bool = False  # the prompt's log probs too (the engine's context logits)
    logit_bias: dict | None = None  # {token id: bias}: the engine's embedding_bias

    @property
    def token_level(self) -> bool:
        """The answer is per token (log probs) or per sequence: the front gets token ids, not text only."""
        return self.num_return_sequences > 1 or self.logprobs is not None or self.echo_logprobs

    def engine_inputs(self, vocab_size: int) -> dict:
        """{engine tensor name: value} of these asks (TensorRT-LLM's names)."""
        values = {}
        if self.num_return_sequences > 1:
            values["num_return_sequences"] = self.num_return_sequences
        if self.logprobs is not None:
            values["return_log_probs"] = True
            if self.logprobs > 0:
                values["return_generation_logits"] = True
        if self.echo_logprobs:
            values["return_context_logits"] = True
        return {k: [[v]] for k, v in values.items()} | ({"embedding_bias": [self.dense_bias(vocab_size)]}
                                                        if self.logit_bias else {})

    def dense_bias(self, vocab_size: int) -> np.ndarray:
        bias = np.zeros(vocab_size, np.float32)
        for token, value in (self.logit_bias or {}).items():
            bias[int(token)] = float(value)
        return bias

    def output_names(self) -> list[str]:
        """The engine outputs a stream of these asks reads."""
        names = ["output_ids", "sequence_length"]
        if self.num_return_sequences > 1:
            names.append("sequence_index")
        if self.logprobs is not None:
            names.append("output_log_probs")
            if self.logprobs > 0:
                names.append("generation_logits")
        if self.echo_logprobs:
            names.append("context_logits")
        return names


# An engine `stop`: a request that names another one by its request id, which the engine then ends (with a
# final response, as any end); TensorRT-LLM's way, since the backend's requests outlive a cancelled caller.
STOP_REQUEST = {"input_ids": [[0]], "input_lengths": [[1]], "request_output_len": [[1]], "stop": [[True]]}


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ sets each field through object.__setattr__,
# 3.7x the cost of a plain one, and the front makes one per streamed token (docs/benchmarks.md)
class EngineStep:
    """One engine response of a stream: its tokens, the sequence they belong to, and the arrays asked for."""

    ids: list
    sequence_index: int = 0
    log_probs: np.ndarray | None = None  # [tokens]
    generation_logits: np.ndarray | None = None  # [tokens, vocab]
    context_logits: np.ndarray | None = None  # [prompt, vocab]

    @classmethod
    def from_outputs(cls, get) -> "EngineStep | None":
        """From an engine response's outputs (`get(name)` -> numpy array or None); None without output_ids."""
        out = get("output_ids")
        if out is None:
            return None
        n = int(get("sequence_length").reshape(-1)[0])
        index = get("sequence_index")
        lps, gen, ctx = get("output_log_probs"), get("generation_logits"), get("context_logits")
        return cls(out.reshape(-1)[:n].tolist(), 0 if index is None else int(index.reshape(-1)[0]),
                   None if lps is None else lps.reshape(-1)[:n],
                   None if gen is None or gen.size == 0 else gen.reshape(-1, gen.shape[-1])[:n],
                   None if ctx is None or ctx.size == 0 else ctx.reshape(-1, ctx.shape[-1]))


FINISH_REASONS = ("stop", "length")  # what an engine stream's end is, before the front adds its own


class GeneratedCounts:
    """The tokens each sequence of one engine stream generated, and why each ended: the one place that
    rule lives. TensorRT-LLM's outputs carry no finish reason, so whoever reads the engine's stream (the
    gateway, or the front on a lease) counts with this: a sequence that produced the `max_tokens` the engine
    was asked for was cut there ("length"); a shorter one ended on its own, at the end id or a stop word
    ("stop"). Every later layer passes the reason on; the front only adds what it alone knows (its own stop
    strings, tool calls)."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.by_sequence: dict[int, int] = {}

    def add(self, step: EngineStep) -> None:
        self.by_sequence[step.sequence_index] = self.by_sequence.get(step.sequence_index, 0) + len(step.ids)

    @property
    def total(self) -> int:
        return sum(self.by_sequence.values())

    def finish_reason(self, sequence: int | None = None) -> str:
        """One sequence's reason, or (None) the request's: "length" when any of its sequences was cut."""
        counts = self.by_sequence.values() if sequence is None else [self.by_sequence.get(sequence, 0)]
        return "length" if any(n >= self.max_tokens for n in counts) else "stop"
