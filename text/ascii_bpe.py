"""A byte-level BPE tokenizer's own ids for ASCII text, without its pre-tokenizer's regex engine.

Why: `tokenizers` pre-tokenizes byte-level BPE (GPT-2's and SmolLM2's ByteLevel regex, Llama 3's and Qwen's
Split regex) with Oniguruma, and that regex is nearly all of an encode: 135 µs of a 64-token prompt's 146, 17.6
ms for 16 KiB, on the 2-core host (benchmarks/tokenizer_bench.py). The front tokenizes every admitted prompt on
its event loop and `preprocessing` every other: that time is each request's, before its first token, and
blocks every other stream of the process. For ASCII text the same patterns are plain classes (`\\p{L}` is
`[A-Za-z]`, `\\p{N}` `[0-9]`), which Python's `re` runs several times faster, and a word's BPE depends on the
word alone, so each word's ids are the model's own (`Tokenizer.model.tokenize`), cached.

Exactness is the contract: `AsciiBpe.for_tokenizer` reads the tokenizer's own pipeline (tokenizer.json) and
answers None unless every step is one this module reproduces (no normalizer but Unicode normal forms;
pre-tokenizers Digits, ByteLevel without a prefix space, Split with a regex translatable for ASCII and
isolated matches; a BPE model; added tokens without strip or single-word rules; no truncation or padding);
`encode` answers None for text that is not ASCII. The caller then asks the tokenizer itself.
tests/text/test_ascii_bpe.py holds the ids equal to `tokenizers`' on a corpus, on random ASCII and on other
models' pipelines (Llama 3's and Qwen 2's patterns).
"""
from __future__ import annotations

import json
import re

_SPACE = "\\t\\n\\x0b\\x0c\\r "  # ASCII's White_Space, what Oniguruma's \s matches there
# GPT-2's pattern (tokenizers' ByteLevel with use_regex) with its Unicode classes as ASCII ones
_BYTE_LEVEL = (r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^" + _SPACE + r"A-Za-z0-9]+"
               r"|[" + _SPACE + r"]+(?![^" + _SPACE + r"])|[" + _SPACE + r"]+")
_CLASSES = {"L": "A-Za-z", "N": "0-9"}
MAX_CACHED_WORDS = 1 << 17


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map (ByteLevel's), for the ASCII bytes."""
    printable = set(range(ord("!"), ord("~") + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in printable or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return {b: c for b, c in out.items() if b < 128}


def ascii_pattern(pattern: str) -> str | None:
    """An Oniguruma pattern (tokenizers' Split) as a Python one that matches the same ASCII text the same way,
    or None where it uses what this does not translate: a Unicode class other than L and N, a negated one, a
    class or anchor whose meaning differs (Oniguruma's `$` ends a line), a nested class, a possessive
    quantifier, a capturing or named group, an inline flag other than `i`."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c, nxt = pattern[i], pattern[i + 1:i + 2]
        if c == "\\" and nxt:
            if nxt == "p":
                m = re.match(r"\{(\w+)\}|(\w)", pattern[i + 2:])
                name = m and (m.group(1) or m.group(2))
                if name not in _CLASSES:
                    return None
                out.append(_CLASSES[name] if in_class else f"[{_CLASSES[name]}]")
                i += 2 + m.end()
                continue
            if nxt == "s":
                out.append(_SPACE if in_class else f"[{_SPACE}]")
            elif nxt == "S" and not in_class:
                out.append(f"[^{_SPACE}]")
            elif nxt.isalpha() and nxt not in "rntfvx":  # classes, anchors and escapes not checked here
                return None
            else:
                out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            if c == "[":  # a nested class: Oniguruma's, not Python's
                return None
            in_class = c != "]"
            out.append(c)
        elif c == "[":
            in_class = True
            start = 2 if pattern[i + 1:i + 2] == "^" else 1
            if pattern[i + start:i + start + 1] == "]":  # a literal ] first in a class
                out.append(pattern[i:i + start] + "\\]")
                i += start + 1
                continue
            out.append(c)
        elif c in "^$":
            return None
        elif c == "(" and not (pattern.startswith("(?", i) and
                               any(pattern.startswith(p, i + 2) for p in (":", "=", "!", "<=", "<!", "i:"))):
            return None
        elif c in "+*?}" and nxt == "+":  # possessive
            return None
        else:
            out.append(c)
        i += 1
    return "".join(out)


class AsciiBpe:
    """`encode(text)` -> a byte-level BPE tokenizer's ids for ASCII text, or None (the caller asks the tokenizer)."""

    def __init__(self, model, steps: list, added: list[dict[str, int]], adds_tokens: bool):
        """`model`: the tokenizer's BPE model (`Tokenizer.model`); `steps`: the pre-tokenizer's, each ("digits",
        individual) or ("split", compiled pattern); `added`: the added tokens' passes, content -> id (the
        unnormalized ones first, as tokenizers splits them); `adds_tokens`: whether its post-processor adds
        tokens when asked to add special ones."""
        self.model, self.steps, self.adds_tokens = model, steps, adds_tokens
        self.added_splits = [re.compile("(" + "|".join(re.escape(c) for c in sorted(ids, key=len, reverse=True))
                                        + ")") for ids in added]
        self.added_ids = {content: i for ids in added for content, i in ids.items()}
        self.chars = str.maketrans(_byte_chars())
        self.words: dict[str, tuple[int, ...]] = {}

    @classmethod
    def for_tokenizer(cls, tokenizer) -> "AsciiBpe | None":
        """An AsciiBpe for this `tokenizers.Tokenizer`, or None where its pipeline is not one it reproduces."""
        spec = json.loads(tokenizer.to_str())
        if not _identity_on_ascii(spec.get("normalizer")) or spec.get("truncation") or spec.get("padding") \
                or tokenizer.encode_special_tokens:
            return None
        if (spec.get("model") or {}).get("type") != "BPE" or spec["model"].get("dropout"):
            return None
        steps = _steps(spec.get("pre_tokenizer"))
        if steps is None:
            return None
        tokens = spec.get("added_tokens") or []
        if any(t.get("single_word") or t.get("lstrip") or t.get("rstrip") or not t.get("content") for t in tokens):
            return None
        added = [ids for ids in ({t["content"]: t["id"] for t in tokens if bool(t.get("normalized")) == normalized}
                                 for normalized in (False, True)) if ids]
        post = (spec.get("post_processor") or {}).get("type")
        return cls(tokenizer.model, steps, added, adds_tokens=post not in (None, "ByteLevel"))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int] | None:
        """The tokenizer's `encode(text, add_special_tokens).ids`, or None: text that is not ASCII, or special
        tokens asked of a post-processor that adds them."""
        if not text.isascii() or (add_special_tokens and self.adds_tokens):
            return None
        pieces = [text]  # text and added tokens alternating, text first and last (re.split's with one group)
        for split in self.added_splits:
            out = []
            for k, piece in enumerate(pieces):
                if k & 1:
                    out.append(piece)
                else:
                    out.extend(split.split(piece))
            pieces = out
        ids: list[int] = []
        for k, piece in enumerate(pieces):
            if k & 1:
                ids.append(self.added_ids[piece])
            elif piece:
                self._words(piece, ids)
        return ids

    def _words(self, text: str, ids: list[int]) -> None:
        """Text between added tokens: pre-tokenized by the steps, each word's ids the model's (cached)."""
        pieces = [text]
        for kind, arg in self.steps:
            out = []
            for piece in pieces:
                if kind == "digits":
                    out.extend(p for p in arg.split(piece) if p)
                    continue
                found = arg.findall(piece)
                if sum(map(len, found)) == len(piece):
                    out.extend(found)
                    continue
                pos = 0  # what matched, and what lay between matches, each a piece (Split's Isolated)
                for m in arg.finditer(piece):
                    if m.start() > pos:
                        out.append(piece[pos:m.start()])
                    out.append(m.group())
                    pos = m.end()
                if pos < len(piece):
                    out.append(piece[pos:])
            pieces = out
        words = self.words
        for word in pieces:
            got = words.get(word)
            if got is None:
                got = tuple(t.id for t in self.model.tokenize(word.translate(self.chars)))
                if len(words) >= MAX_CACHED_WORDS:
                    words.clear()
                words[word] = got
            ids.extend(got)


def _identity_on_ascii(normalizer: dict | None) -> bool:
    """No normalizer, or Unicode normal forms only (ASCII text is its own NFC, NFD, NFKC and NFKD)."""
    if not normalizer:
        return True
    if normalizer.get("type") == "Sequence":
        return all(_identity_on_ascii(n) for n in normalizer.get("normalizers") or [])
    return normalizer.get("type") in ("NFC", "NFD", "NFKC", "NFKD")


def _steps(pre: dict | None) -> list | None:
    """The pre-tokenizer's splitting steps for ASCII text, or None where one is not reproduced here. Its bytes
    must be mapped (ByteLevel), and last."""
    if not pre:
        return None
    steps, mapped = [], False
    for p in pre["pretokenizers"] if pre.get("type") == "Sequence" else [pre]:
        kind = p.get("type")
        if mapped:  # bytes mapped: nothing may follow
            return None
        if kind == "Digits":
            steps.append(("digits", re.compile("([0-9])" if p.get("individual_digits") else "([0-9]+)")))
        elif kind == "ByteLevel":
            if p.get("add_prefix_space"):
                return None
            if p.get("use_regex", True):
                steps.append(("split", re.compile(_BYTE_LEVEL)))
            mapped = True
        elif kind == "Split":
            pattern = p.get("pattern") or {}
            if p.get("behavior") != "Isolated" or p.get("invert"):
                return None
            source = re.escape(pattern["String"]) if "String" in pattern else ascii_pattern(pattern.get("Regex", ""))
            try:
                compiled = None if source is None else re.compile(source)
            except re.error:
                return None
            if compiled is None or compiled.search("") is not None:  # an empty match: engines differ there
                return None
            steps.append(("split", compiled))
        else:
            return None
    return steps if mapped else None
