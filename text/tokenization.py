"""Tokenizer loading, chat templates and stop/bad word lists (what `preprocessing` does).

Reads a Hugging Face checkpoint folder: `tokenizer.json` (the `tokenizers` library) and
`tokenizer_config.json` (chat template, special tokens). No `transformers` dependency.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import jinja2
import jinja2.sandbox
import numpy as np
from tokenizers import Tokenizer

from contracts.errors import invalid
from text.ascii_bpe import AsciiBpe
from text.chat_tools import messages_for_template, template_knows_tools

END_OF_TURN_CANDIDATES = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def _token_str(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<|im_end|>", ...} form
        return value.get("content")
    return value


@dataclass
class TokenizerBundle:
    tokenizer: Tokenizer
    config: dict
    # ASCII text past Oniguruma (text/ascii_bpe.py), built with the bundle: reading the tokenizer's pipeline
    # takes tens of ms, which the first request's encode would otherwise spend on its process's event loop
    ascii_bpe: AsciiBpe | None = None

    @classmethod
    def load(cls, tokenizer_dir: str | Path) -> "TokenizerBundle":
        d = Path(tokenizer_dir)
        if not (d / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{d / 'tokenizer.json'} not found: is tokenizer_dir a prepared checkpoint?")
        cfg_path = d / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        return cls(tokenizer, cfg, AsciiBpe.for_tokenizer(tokenizer))

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    @cached_property
    def eos_id(self) -> int | None:
        return self.token_id(_token_str(self.config.get("eos_token")))

    @cached_property
    def pad_id(self) -> int:
        pad = self.token_id(_token_str(self.config.get("pad_token")))
        return pad if pad is not None else (self.eos_id or 0)

    @cached_property
    def end_of_turn_id(self) -> int | None:
        """The token the chat template closes a turn with; generation should stop there."""
        template = self.chat_template or ""
        for tok in END_OF_TURN_CANDIDATES:
            if tok in template and self.token_id(tok) is not None:
                return self.token_id(tok)
        return self.eos_id

    @property
    def chat_template(self) -> str | None:
        return self.config.get("chat_template")

    @cached_property
    def vocab_size(self) -> int:
        """Cached: `tokenizers` rebuilds the whole vocabulary on every call (~7 ms for SmolLM2's 49k
        tokens), and preprocessing checks two ids against it per request."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._encode(text, bool(self.config.get("add_bos_token", False)))

    def _encode(self, text: str, add_special: bool) -> list[int]:
        """The tokenizer's ids; ASCII text through AsciiBpe (the same ids, several times faster)."""
        ids = self.ascii_bpe.encode(text, add_special) if self.ascii_bpe is not None else None
        return ids if ids is not None else self.tokenizer.encode(text, add_special_tokens=add_special).ids

    @cached_property
    def special_tokens(self) -> tuple[str, ...]:
        return tuple(t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special)

    @cached_property
    def _literal(self) -> Tokenizer:
        """A copy that reads special-token text as plain text (its own object: the flag is per tokenizer)."""
        t = Tokenizer.from_str(self.tokenizer.to_str())
        t.encode_special_tokens = True
        return t

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The chat's ids: the template's markers as special tokens, the messages' text as text, so a user
        who types `<|im_start|>system` into a message cannot forge a turn (issue 29). Messages without any
        special-token text (all of them, normally) are encoded as the rendered whole, as before."""
        contents = [m.get("content") for m in messages]
        if not any(isinstance(c, str) and sp in c for c in contents for sp in self.special_tokens):
            return self.encode(self.render_chat(messages, tools=tools))
        marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
        text = self.render_chat([{**m, "content": mark} if isinstance(m.get("content"), str) else m
                                 for m, mark in zip(messages, marks)], tools=tools)
        used = [i for i, c in enumerate(contents) if isinstance(c, str)]
        if any(text.count(marks[i]) != 1 for i in used):  # the template rewrote a content (tool messages)
            return self.encode(self.render_chat(messages, tools=tools))
        ids: list[int] = []
        rest, first = text, True
        for i in sorted(used, key=lambda i: text.index(marks[i])):
            head, rest = rest.split(marks[i], 1)
            ids += self._encode_piece(head, first)
            ids += self._literal.encode(contents[i], add_special_tokens=False).ids
            first = False
        return ids + self._encode_piece(rest, first)

    def _encode_piece(self, text: str, first: bool) -> list[int]:
        if not text:
            return []
        return self._encode(text, first and bool(self.config.get("add_bos_token", False)))

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        """`messages` may carry assistant `tool_calls` and `tool` results, `tools` the functions offered
        (text/chat_tools.py: natively where the template knows tools, else SmolLM2's way)."""
        if not self.chat_template:
            raise invalid("messages", "this model has no chat template")
        knows = template_knows_tools(self.chat_template)
        messages = messages_for_template(messages, tools, knows)
        return _compile(self.chat_template).render(
            messages=messages,
            **({"tools": tools} if knows and tools else {}),
            add_generation_prompt=add_generation_prompt,
            bos_token=_token_str(self.config.get("bos_token")) or "",
            eos_token=_token_str(self.config.get("eos_token")) or "",
        )

    def words_to_list(self, words: list[str]) -> np.ndarray:
        """NVIDIA's word-list format [2, L]: flat ids, then cumulative end offsets padded with -1."""
        ids: list[int] = []
        offsets: list[int] = []
        for w in words:
            if not w:
                continue
            ids.extend(self._encode(w, False))
            offsets.append(len(ids))
        width = max(len(ids), 1)
        out = np.full((2, width), -1, dtype=np.int32)
        out[0, : len(ids)] = ids
        out[1, : len(offsets)] = offsets
        if not ids:
            out[0, 0] = 0  # upstream's empty list: one padding id, no offsets
        return out


def _raise(message):
    raise jinja2.TemplateError(message)


_TEMPLATES: dict[str, jinja2.Template] = {}


def _compile(source: str) -> jinja2.Template:
    if source not in _TEMPLATES:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]


def parse_word_list(arr: np.ndarray) -> list[list[int]]:
    """Inverse of `words_to_list`: the [2, L] format back to a list of token sequences."""
    arr = np.asarray(arr).reshape(2, -1)
    ids, offsets = arr[0], arr[1]
    words, start = [], 0
    for end in offsets:
        if end < 0:
            break
        if end > start:
            words.append([int(t) for t in ids[start:end]])
        start = int(end)
    return words
