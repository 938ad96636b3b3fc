"""The typed objects that cross the gateway's edges, in place of tensor-keyed dicts (as NVIDIA's
`decode.py` has Request / PreprocResponse / GenerationResponse): what the request carries for sampling,
and what preprocessing hands to the engine call. The tensor names live only in the two converters."""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from contracts.errors import invalid
from contracts.tensors import PREPROCESSING, SAMPLING_TO_ENGINE


@dataclass(frozen=True)
class Sampling:
    """The sampling inputs a caller gave (None: the engine's default)."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    min_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def engine_inputs(self) -> dict:
        """{engine tensor name: value} for the values that were given (each field read as it is: `asdict`
        deep-copies every value, a cost on every admit of the gateway's one event loop)."""
        return {engine: v for name, engine in _SAMPLING_FIELDS if (v := getattr(self, name)) is not None}


assert set(Sampling.__dataclass_fields__) == set(SAMPLING_TO_ENGINE), "Sampling must mirror the contract"
_SAMPLING_FIELDS = tuple((f.name, SAMPLING_TO_ENGINE[f.name]) for f in fields(Sampling))


@dataclass(frozen=True)
class Guide:
    """Guided decoding for the engine: TensorRT-LLM's guide type (contracts.GUIDE_TYPES) and its text."""

    guide_type: str
    guide: str = ""

    def engine_inputs(self) -> dict:
        return {"guided_decoding_guide_type": [[self.guide_type]], "guided_decoding_guide": [[self.guide]]}


@dataclass(frozen=True)
class Preprocessed:
    """Preprocessing's answer, as the engine call needs it: the arrays keep the shapes preprocessing gave
    them (batch dimension first), since they go on to the engine as they are."""

    input_ids: np.ndarray  # [1, n] (padded: only the first `n_input` count)
    input_lengths: np.ndarray  # [1, 1]
    request_output_len: np.ndarray | None = None
    end_id: np.ndarray | None = None
    pad_id: np.ndarray | None = None
    stop_words: np.ndarray | None = None  # [1, 2, k]: TensorRT-LLM's flattened word list
    bad_words: np.ndarray | None = None

    @classmethod
    def from_tensors(cls, t: dict) -> "Preprocessed":
        """From preprocessing's output tensors (contracts/tensors.py PREPROCESSING)."""
        return cls(t["INPUT_ID"], t["REQUEST_INPUT_LEN"], t.get("REQUEST_OUTPUT_LEN"), t.get("OUT_END_ID"),
                   t.get("OUT_PAD_ID"), t.get("STOP_WORDS_IDS"), t.get("BAD_WORDS_IDS"))

    @classmethod
    def from_front(cls, outputs, vocab_size: int) -> "Preprocessed":
        """What the front's own `text.preprocess.Preprocessor` answered for a lease's admit (the same outputs
        as preprocessing's, as JSON lists: front/prompt_prep.py), checked for shape and vocabulary so
        that a faulty front is refused here, naming `lease`, never by the engine."""
        try:
            t = {name: np.asarray(outputs[name], dtype=dtype) for name, dtype in _FROM_FRONT}
        except (TypeError, KeyError, ValueError, OverflowError):
            raise invalid("lease", "prep must hold preprocessing's outputs as integer lists") from None
        ids, n = t["INPUT_ID"], t["REQUEST_INPUT_LEN"]
        words_ok = all(w.ndim == 3 and w.shape[:2] == (1, 2) and w.shape[2] >= 1 and int(w.max()) < vocab_size
                       for w in (t["STOP_WORDS_IDS"], t["BAD_WORDS_IDS"]))
        if not (ids.ndim == 2 and ids.shape[0] == 1 and 0 < ids.shape[1] and n.shape == (1, 1)
                and int(n[0, 0]) == ids.shape[1] and int(ids.min()) >= 0 and int(ids.max()) < vocab_size
                and all(t[k].shape == (1, 1) and 0 <= int(t[k][0, 0]) < vocab_size for k in ("OUT_END_ID", "OUT_PAD_ID"))
                and words_ok):
            raise invalid("lease", f"prep is not a prompt of token ids in [0, {vocab_size}) with its length, "
                                   f"end and pad ids, and word lists")
        return cls.from_tensors(t)

    @property
    def n_input(self) -> int:
        return int(self.input_lengths.reshape(-1)[0])

    @property
    def token_ids(self) -> list[int]:
        return [int(t) for t in self.input_ids.reshape(-1)[:self.n_input]]


# the outputs of preprocessing a front sends for a lease's admit, with their types (Preprocessed.from_front)
_FROM_FRONT = tuple((name, PREPROCESSING.output(name).numpy_dtype) for name in (
    "INPUT_ID", "REQUEST_INPUT_LEN", "STOP_WORDS_IDS", "BAD_WORDS_IDS", "REQUEST_OUTPUT_LEN", "OUT_END_ID", "OUT_PAD_ID"))
