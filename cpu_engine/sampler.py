"""Per-request token selection for the sequences of one step.

Order per row: the guide's grammar mask (guided decoding, cpu_engine/guided.py) -> logit processing
(`embedding_bias`, presence / frequency penalties over the tokens generated so far, bad words and
min_tokens masks) -> log-probs (of the temperature-scaled distribution, contracts/logprobs.py) ->
greedy argmax, or top-k / top-p filtering and a draw from the request's own generator (a fixed `seed`
gives the same tokens every time).
"""
from __future__ import annotations

import numpy as np

from contracts.logprobs import log_softmax
from cpu_engine.guided import constrain
from cpu_engine.sequence import Sequence


def _banned(seq: Sequence) -> list[int]:
    """Last tokens of bad words whose prefix the sequence has just produced; and, before
    `min_tokens`, the end id and single-token stop words."""
    out = []
    tail = seq.output_ids
    for word in seq.params.bad_words:
        prefix = word[:-1]
        if not prefix or (len(tail) >= len(prefix) and tail[len(tail) - len(prefix):] == prefix):
            out.append(word[-1])
    if len(seq.output_ids) < seq.params.min_tokens:
        if seq.params.end_id is not None:
            out.append(seq.params.end_id)
        out.extend(w[0] for w in seq.params.stop_words if len(w) == 1)
    return out


def process(seq: Sequence, logits: np.ndarray) -> np.ndarray:
    """The logits the request samples from: the model's, biased, penalized and masked (a copy when
    anything changes)."""
    p = seq.params
    banned = _banned(seq)
    penalized = (p.presence_penalty or p.frequency_penalty) and seq.output_ids
    if p.embedding_bias is None and not banned and not penalized:
        return logits
    logits = logits.astype(np.float32, copy=True)
    if p.embedding_bias is not None:
        logits[: len(p.embedding_bias)] += p.embedding_bias  # a shorter bias (the tokenizer's vocabulary): 0 past it
    if penalized:
        counts = np.bincount(np.asarray(seq.output_ids), minlength=logits.shape[0])[: logits.shape[0]]
        logits -= p.presence_penalty * (counts > 0) + p.frequency_penalty * counts
    if banned:
        logits[[b for b in banned if 0 <= b < logits.shape[0]]] = -np.inf
    return logits


def sample(seq: Sequence, logits: np.ndarray) -> tuple[int, float]:
    """Choose the next token of `seq` from its logits row [V]; returns (token, log-prob)."""
    p = seq.params
    logits = process(seq, constrain(seq.guide, logits))
    if p.greedy:
        token = int(np.argmax(logits))
        lp = float(log_softmax(logits, p.temperature)[token]) if p.return_log_probs else 0.0
        return token, lp
    # float64 and shifted by the maximum before scaling: (l - max) / T <= 0, so no temperature the
    # request validation lets through (sequence.MIN/MAX_TEMPERATURE) can overflow to inf or NaN
    x = logits.astype(np.float64)
    scaled = (x - x.max()) / float(p.temperature)
    candidates = np.arange(scaled.shape[0])
    if p.top_k > 0 and p.top_k < scaled.shape[0]:
        candidates = np.argpartition(-scaled, p.top_k - 1)[: p.top_k]
    cand_logits = scaled[candidates]
    order = np.argsort(-cand_logits, kind="stable")
    candidates, cand_logits = candidates[order], cand_logits[order]
    probs = np.exp(cand_logits - cand_logits[0])
    probs /= probs.sum()
    if 0.0 < p.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
        candidates, probs = candidates[:keep], probs[:keep] / probs[:keep].sum()
    token = int(candidates[seq.rng.choice(len(candidates), p=probs)])
    lp = float(log_softmax(logits, p.temperature)[token]) if p.return_log_probs else 0.0
    return token, lp


def stop_reason(seq: Sequence) -> str | None:
    """Why the sequence ends after its latest token, if it does."""
    p = seq.params
    out = seq.output_ids
    if len(out) >= p.min_tokens:
        if p.end_id is not None and out and out[-1] == p.end_id:
            return "end_id"
        for word in p.stop_words:
            if word and len(out) >= len(word) and out[len(out) - len(word):] == word:
                return "stop_words"
    if len(out) >= p.max_new_tokens:
        return "length"
    return None
