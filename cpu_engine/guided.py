"""Guided decoding on the CPU engine: a token mask per step from a grammar, as TensorRT-LLM's
`guided_decoding_guide_type` / `guided_decoding_guide` inputs ask for.

TensorRT-LLM runs xgrammar on the GPU; xgrammar's Python package needs torch, so the CPU engine uses
llguidance (Rust, no Python dependencies; vLLM's `guidance` backend), which compiles the same guide
types the C++ backend maps (contracts.GUIDE_TYPES): `json` (any JSON object or array, xgrammar's built-in
JSON grammar), `json_schema`, `regex` and `ebnf_grammar` (GBNF, converted to llguidance's Lark). A guide is
compiled once per request when it is submitted (a bad one is refused there), then each step masks the
logits row to the tokens the grammar allows and the chosen token advances the matcher. The grammar's
end is the request's end id: once the grammar is complete only that token is allowed, so a
constrained answer ends where its grammar does.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from contracts.tensors import GUIDE_TYPES

_ANY_JSON = {"anyOf": [{"type": "object"}, {"type": "array"}]}
# JSON written as json.dumps writes it (", " and ": ", no newlines): a small model given free whitespace
# wanders into blank lines; a schema's own "x-guidance" options still win
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GuideError(ValueError):
    """A guide the engine cannot compile; `field` is the engine input to name."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class GuideSpec:
    """What a request asked for: TensorRT-LLM's guide type and guide text."""
    guide_type: str
    guide: str = ""


def grammar_of(spec: GuideSpec) -> str:
    """The llguidance grammar (its JSON form) for a guide; GuideError for a guide type or text that is
    not one (the grammar's own errors come when it is compiled against the tokenizer)."""
    import llguidance

    t = spec.guide_type
    if t not in GUIDE_TYPES:
        raise GuideError("guided_decoding_guide_type", f"must be one of {', '.join(GUIDE_TYPES)}, got {t!r}")
    if t == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(_ANY_JSON, defaults=_JSON_OPTIONS)
    if not spec.guide:
        raise GuideError("guided_decoding_guide", f"is required for guide type {t!r}")
    if t == "json_schema":
        try:
            schema = json.loads(spec.guide)
        except (ValueError, RecursionError):
            raise GuideError("guided_decoding_guide", "is not valid JSON (a json_schema guide)") from None
        if not isinstance(schema, dict):
            raise GuideError("guided_decoding_guide", "a JSON schema must be a JSON object")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    if t == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.guide)
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        lark = gbnf_to_lark(spec.guide)
    except Exception as e:  # noqa: BLE001 - the converter's parse errors have no common type
        raise GuideError("guided_decoding_guide", f"is not a valid EBNF grammar: {e}") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


class GuideCompiler:
    """Compiles guides against the engine's tokenizer (its `tokenizer.json`); built on first use, since
    loading the vocabulary into llguidance takes ~0.2 s and most engines never see a guide."""

    def __init__(self, tokenizer_json: Path, vocab_size: int):
        self.path, self.vocab_size = Path(tokenizer_json), vocab_size
        self._tokenizer = None
        self._lock = threading.Lock()

    def _llg_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                if not self.path.is_file():
                    raise GuideError("guided_decoding_guide", f"guided decoding needs {self.path}")
                self._tokenizer = llguidance.LLTokenizer(self.path.read_text(encoding="utf-8"), n_vocab=self.vocab_size)
            return self._tokenizer

    def matcher(self, spec: GuideSpec, end_id: int | None) -> "Guide":
        import llguidance

        grammar = grammar_of(spec)  # the guide's own errors first: they name what the client sent
        if end_id is None:
            raise GuideError("end_id", "guided decoding needs an end id (ignore_eos cannot be combined with it)")
        m = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if m.is_error():
            raise GuideError("guided_decoding_guide", f"cannot be compiled: {m.get_error()}")
        return Guide(m, self._llg_tokenizer().eos_token, end_id)


class Guide:
    """One request's matcher: the mask before each token, the token after."""

    def __init__(self, matcher, grammar_eos: int, end_id: int):
        self.matcher, self.grammar_eos, self.end_id = matcher, grammar_eos, end_id

    def allowed(self, vocab: int) -> np.ndarray:
        """Boolean mask [vocab] of the tokens the grammar allows next; the grammar's end is `end_id`.
        GuideError when the matcher failed (a parser limit of a pathological grammar): that request ends
        with the matcher's reason, never with a token the grammar did not allow."""
        if self.matcher.is_error():
            raise GuideError("guided_decoding_guide", f"the grammar could not go on: {self.matcher.get_error()}")
        if self.matcher.is_stopped():
            bits = np.zeros(vocab, dtype=bool)
        else:
            raw = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
            bits = np.zeros(vocab, dtype=bool)
            unpacked = np.unpackbits(raw, bitorder="little").astype(bool)
            n = min(vocab, unpacked.shape[0])
            bits[:n] = unpacked[:n]
        complete = self.matcher.is_accepting() or self.matcher.is_stopped()
        if 0 <= self.grammar_eos < vocab and self.grammar_eos != self.end_id:
            bits[self.grammar_eos] = False
        if 0 <= self.end_id < vocab:
            bits[self.end_id] = complete
        return bits

    def accept(self, token: int) -> None:
        """Advance past the chosen token (the end id ends the request and is not consumed)."""
        if token != self.end_id:
            self.matcher.consume_token(token)


def constrain(guide: Guide | None, logits: np.ndarray) -> np.ndarray:
    """The logits row with every token the guide forbids at -inf (a copy; the row itself when no guide)."""
    if guide is None:
        return logits
    out = np.full_like(logits, -np.inf)
    allowed = guide.allowed(logits.shape[0])
    out[allowed] = logits[allowed]
    return out
