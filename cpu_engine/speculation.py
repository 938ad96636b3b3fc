"""Speculative decoding: draft tokens proposed cheaply, verified by the model in one batched step.

Two proposers (the engine's `decoding_mode`): `lookahead`, prompt lookup, copies the tokens that followed
an earlier occurrence of the sequence's tail (below); `draft_tokens_external` (TensorRT-LLM's name for
draft-target speculation) asks a smaller model for them greedily (draft_model.py). Both are verified the
same way (engine._sample_and_verify) and switched per request by the same lookahead inputs.

A request's lookahead configuration keeps TensorRT-LLM's per-request names and bounds, `(w, n, g)` =
(`lookahead_window_size`, `lookahead_ngram_size`, `lookahead_verification_set_size`), each at most the
engine's `(W, N, G)`; `(1, 1, 0)` is plain decoding. The CPU engine runs lookahead's verification branch
only, with its n-gram pool drawn from the prompt and the output so far (upstream seeds its pool from the
prompt too) and no Jacobi lookahead branch:
- `n`: at most n tokens come out of one step: the last token plus up to n - 1 draft tokens are verified
  at once, the draft being the tokens that followed the latest earlier occurrence of the sequence's
  current tail (the longest tail of at most `max_matching_ngram_size` tokens that occurred before);
- `g`: at most g candidates are verified per step; the CPU engine verifies one (g >= 1 turns it on);
- `w`: the width of the Jacobi branch upstream runs beside; the CPU engine runs none, so any w <= W holds.

Drafts of both proposers are deterministic (the draft model's are its argmax), so the standard
rejection rule (accept a draft token d with probability min(1, p(d) / q(d)), q = one-hot at d; on
rejection draw from p without d) is the same as
drawing each token from the target distribution p in order and accepting while the draw equals the draft:
the engine does exactly that with the request's own generator, one draw per output token, so the output
distribution (and, for a seed, the tokens) equals plain decoding's.
"""
from __future__ import annotations

from dataclasses import dataclass

from contracts.tensors import LOOKAHEAD_INPUTS  # noqa: F401 (the engine's names of w, n, g)

# the engine's decoding modes: TensorRT-LLM's `decoding_mode` values the CPU engine runs ("" = its default,
# the sampling each request asks for); medusa / eagle / redrafter / beam_search need what it does not have
PLAIN_MODES = ("", "top_k", "top_p", "top_k_top_p")
SPECULATIVE_MODES = ("lookahead", "draft_tokens_external")  # prompt lookup; a draft model (draft_model.py)
DECODING_MODES = PLAIN_MODES + SPECULATIVE_MODES
# a draft needs a tail of at least this many tokens seen before: on SmolLM2's greedy answers to
# benchmarks/spec_decode_bench.py's prompts a single matching token predicted the next one far less often
# than two or three did, and every rejected draft token costs a verified row
MIN_MATCHING_NGRAM_SIZE = 2


@dataclass(frozen=True)
class LookaheadConfig:
    """(w, n, g) of TensorRT-LLM's lookahead decoding: the engine's maxima or one request's values."""
    window_size: int = 1
    ngram_size: int = 1
    verification_set_size: int = 0

    @property
    def speculates(self) -> bool:
        return self.ngram_size >= 2 and self.verification_set_size >= 1

    @property
    def max_draft_len(self) -> int:
        """Draft tokens verified per step (n - 1), 0 when the request decodes plainly."""
        return self.ngram_size - 1 if self.speculates else 0


PLAIN = LookaheadConfig(1, 1, 0)  # upstream's "forces non-speculative, autoregressive mode"


def request_lookahead(engine_max: LookaheadConfig | None, w=None, n=None, g=None) -> tuple[LookaheadConfig, list]:
    """A request's (w, n, g) from its inputs (None: the engine's value) -> (config, [(field, message)]).
    `engine_max` None: the engine runs no lookahead, so only a plain configuration is accepted."""
    base = engine_max or PLAIN
    values = {"lookahead_window_size": base.window_size if w is None else w,
              "lookahead_ngram_size": base.ngram_size if n is None else n,
              "lookahead_verification_set_size": base.verification_set_size if g is None else g}
    problems = []
    for (field, value), low, high in zip(values.items(), (1, 1, 0),
                                         (base.window_size, base.ngram_size, base.verification_set_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append((field, f"must be an integer, got {value!r}"))
        elif value < low:
            problems.append((field, f"must be >= {low}, got {value}"))
        elif value > high and engine_max is not None:
            problems.append((field, f"must be at most the engine's {field} {high}, got {value}"))
    config = LookaheadConfig(*values.values()) if not problems else PLAIN
    if engine_max is None and not problems and config.speculates:
        problems.append(("lookahead_ngram_size", "this engine runs no lookahead decoding (decoding_mode is not "
                         "'lookahead'): only the plain configuration (1, 1, 0) is accepted"))
    return config, problems


def next_draft_len(drafted: int, accepted: int, current: int, limit: int) -> int:
    """The draft length of a request's next step: doubled (up to `limit`) after a draft accepted in
    full, else one more than what was accepted. A rejected token costs a verified row, so text with
    little to look up settles at one-token drafts, while a run of copied text is back at `limit` within
    a few steps."""
    if drafted == 0:
        return current
    return min(limit, 2 * current) if accepted == drafted else max(1, accepted + 1)


class NgramIndex:
    """Where each n-gram (n = MIN_MATCHING_NGRAM_SIZE .. max_ngram) of a sequence last occurred, kept up to date as tokens are
    appended, so a proposal costs a few dict lookups whatever the sequence length."""

    def __init__(self, max_ngram: int):
        self.max_ngram = max_ngram
        self._next: list[dict[tuple, int]] = [{} for _ in range(max_ngram)]  # [n - 1]: n-gram -> index after it
        self._indexed = 0  # n-grams ending before this index are in the maps

    def propose(self, ids: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest tail of `ids`."""
        last = len(ids) - 1
        # every n-gram that ends before the last token has a continuation: index it (its latest start wins)
        for end in range(self._indexed, last):
            for n in range(MIN_MATCHING_NGRAM_SIZE, min(self.max_ngram, end + 1) + 1):
                self._next[n - 1][tuple(ids[end - n + 1:end + 1])] = end + 1
        self._indexed = max(self._indexed, last)
        if k <= 0:
            return []
        for n in range(min(self.max_ngram, len(ids)), MIN_MATCHING_NGRAM_SIZE - 1, -1):
            start = self._next[n - 1].get(tuple(ids[len(ids) - n:]))
            if start is not None:
                return ids[start:start + k]
        return []
