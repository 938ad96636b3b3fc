"""`postprocessing`: engine token ids -> text, one string per beam."""
from __future__ import annotations

import numpy as np

from text.detokenize import Detokenizer


def detokenize_batch(detok: Detokenizer, tokens_batch: np.ndarray, sequence_length: np.ndarray) -> np.ndarray:
    """TOKENS_BATCH [B, beams, T] and SEQUENCE_LENGTH [B, beams] -> OUTPUT [B, beams] (bytes)."""
    tokens = np.asarray(tokens_batch)
    if tokens.ndim == 2:  # a single beam without its axis
        tokens = tokens[:, None, :]
    lengths = np.asarray(sequence_length).reshape(tokens.shape[0], -1)
    out = np.empty(tokens.shape[:2], dtype=object)
    for b in range(tokens.shape[0]):
        for beam in range(tokens.shape[1]):
            n = int(lengths[b, beam]) if beam < lengths.shape[1] else tokens.shape[2]
            out[b, beam] = detok.decode(tokens[b, beam, :n].tolist()).encode("utf-8")
    return out
