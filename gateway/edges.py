"""The typed objects that cross the gateway's edges, in place of tensor-keyed dicts (as NVIDIA's
`decode.py` has Request / PreprocResponse / GenerationResponse): what the request carries for sampling,
and what preprocessing hands to the engine call. The tensor names live only in the two converters."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from contracts.tensors import SAMPLING_TO_ENGINE


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
        """{engine tensor name: value} for the values that were given."""
        return {SAMPLING_TO_ENGINE[k]: v for k, v in asdict(self).items() if v is not None}


assert set(Sampling.__dataclass_fields__) == set(SAMPLING_TO_ENGINE), "Sampling must mirror the contract"


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

    @property
    def n_input(self) -> int:
        return int(self.input_lengths.reshape(-1)[0])

    @property
    def token_ids(self) -> list[int]:
        return [int(t) for t in self.input_ids.reshape(-1)[:self.n_input]]
