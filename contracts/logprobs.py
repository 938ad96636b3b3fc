"""Log probabilities as the API reports them: the one definition, shared by the CPU engine's sampler
(`output_log_probs`) and the front (top alternatives from the engine's `generation_logits` /
`context_logits`, which are the model's raw logits on either target).

A log prob is taken from the distribution the engine samples from, after temperature: log_softmax of
logits / T. A greedy request (temperature 0, below MIN_TEMPERATURE) has no such distribution, so its
log probs are those of the model's own (T = 1), as vLLM and TensorRT-LLM report them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from contracts.errors import ServingError

MIN_TEMPERATURE = 1e-5  # below it sampling is greedy: 1 / T would overflow the scaled logits
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs (and on completions' logprobs)


def distribution_temperature(temperature: float | None) -> float:
    """The T that log probs are reported at: the request's temperature (TensorRT-LLM's default 1.0 when
    none is given), or 1.0 for a greedy request."""
    if temperature is None:
        return 1.0
    t = float(temperature)
    return t if t >= MIN_TEMPERATURE else 1.0


def log_softmax(logits: np.ndarray, temperature: float | None = None) -> np.ndarray:
    """log_softmax(logits / T) over the last axis, in float64 (shifted by the maximum first, so no
    temperature overflows); -inf where a logit is -inf."""
    x = np.asarray(logits, dtype=np.float64)
    x = (x - x.max(axis=-1, keepdims=True)) / distribution_temperature(temperature)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def top_logprobs(logprobs: np.ndarray, k: int) -> tuple[list[int], list[float]]:
    """The k most likely token ids of one row of log probs, best first (ties: lower id first)."""
    if k <= 0:
        return [], []
    k = min(k, logprobs.shape[-1])
    ids = np.argpartition(-logprobs, k - 1)[:k]
    ids = ids[np.lexsort((ids, -logprobs[ids]))]
    return [int(i) for i in ids], [float(logprobs[i]) for i in ids]


@dataclass
class TokenLogprob:
    """One token of a choice (generated, or of the prompt for echo): its bytes, its log prob (None: the
    prompt's first token, which nothing predicts) and its `top` alternatives (id, log prob, bytes), best
    first."""
    id: int
    bytes: bytes
    logprob: float | None
    top: list[tuple[int, float, bytes]] = field(default_factory=list)

    def to_list(self) -> list:
        return [self.id, self.bytes.hex(), self.logprob, [[i, lp, b.hex()] for i, lp, b in self.top]]

    @classmethod
    def from_list(cls, raw) -> "TokenLogprob":
        token, data, lp, top = raw
        return cls(int(token), bytes.fromhex(data), None if lp is None else float(lp),
                   [(int(i), float(v), bytes.fromhex(b)) for i, v, b in top])


def _top(row, k: int, token_bytes) -> list[tuple[int, float, bytes]]:
    ids, lps = top_logprobs(row, k)
    return [(i, lp, token_bytes(i)) for i, lp in zip(ids, lps)]


def generated_logprobs(ids, output_log_probs, generation_logits, temperature, k: int,
                       token_bytes) -> list[TokenLogprob]:
    """The generated tokens' entries: each token's log prob as the engine reported it (`output_log_probs`,
    else from its logits row), and the k best alternatives from `generation_logits` (rows of [vocab]).
    `token_bytes(id)`: the bytes a token stands for."""
    if output_log_probs is None and generation_logits is None:
        raise ServingError("internal", "the engine returned no log probs (output_log_probs) for a request that "
                                       "asked for them")
    out = []
    for j, token in enumerate(ids):
        row = log_softmax(generation_logits[j], temperature) if generation_logits is not None else None
        lp = float(output_log_probs[j]) if output_log_probs is not None else float(row[token])
        top = _top(row, k, token_bytes) if row is not None and k > 0 else []
        out.append(TokenLogprob(int(token), token_bytes(int(token)), lp, top))
    return out


def prompt_logprobs(prompt_ids, context_logits, temperature, k: int, token_bytes) -> list[TokenLogprob]:
    """The prompt's entries from the engine's `context_logits` [prompt, vocab] (row i predicts token i+1):
    the first token has none."""
    out = [TokenLogprob(int(prompt_ids[0]), token_bytes(int(prompt_ids[0])), None)]
    for i in range(1, len(prompt_ids)):
        row = log_softmax(context_logits[i - 1], temperature)
        token = int(prompt_ids[i])
        out.append(TokenLogprob(token, token_bytes(token), float(row[token]), _top(row, k, token_bytes) if k > 0 else []))
    return out
