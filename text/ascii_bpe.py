"""A byte-level BPE tokenizer's own ids for ASCII text, without its pre-tokenizer's regex engine.

Why: `tokenizers` pre-tokenizes byte-level BPE (GPT-2's and SmolLM2's ByteLevel regex, Llama 3's and Qwen's
Split regex) with Oniguruma, and that regex is most of an encode (benchmarks/tokenizer_bench.py; ASCII text
5-10x faster here: benchmarks/results/2026-11-29-tokenizer-bench.json). The front tokenizes every admitted
prompt on its event loop and `preprocessing` every other: that time is each request's, before its first token, and
blocks every other stream of the process. For ASCII text the same patterns are plain classes (`\\p{L}` is
`[A-Za-z]`, `\\p{N}` `[0-9]`), which Python's `re` runs several times faster, and a word's BPE depends on the
word alone, so each word's ids are the model's own (`Tokenizer.model.tokenize`), cached. Text with a few
characters beyond ASCII (a quote, a name, a dash) is cut where the patterns of SPACE_BOUNDED cut whatever
lies around, for a tokenizer without a normalizer: each stretch beyond ASCII goes to the tokenizer, the rest
is done here.

Exactness is the contract: `AsciiBpe.for_tokenizer` reads the tokenizer's own pipeline (tokenizer.json) and
answers None unless every step is one this module reproduces (no normalizer but Unicode normal forms;
pre-tokenizers Digits, ByteLevel without a prefix space, Split with a regex translatable for ASCII and
isolated matches; a BPE model; added tokens without strip or single-word rules; no truncation or padding);
`encode` answers None for text beyond ASCII it cannot cut. The caller then asks the tokenizer itself.
tests/text/test_ascii_bpe.py holds the ids equal to `tokenizers`' on a corpus, on random ASCII, on random
text mixed with characters beyond it, and on other models' pipelines (Llama 3's and Qwen 2's patterns).
"""
from __future__ import annotations

import json
import re

from text.detokenize import byte_level_alphabet

_SPACE = "\\t\\n\\x0b\\x0c\\r "  # ASCII's White_Space, what Oniguruma's \s matches there
_CLASSES = {"L": "A-Za-z", "N": "0-9"}
# the patterns of GPT-2's ByteLevel (tokenizers' with use_regex), Llama 3's Split and Qwen 2's, as Oniguruma reads them
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
         r"|\s+(?!\S)|\s+")
# No match of these takes a space that follows a printable ASCII character together with that character
# (a space only starts a match, or is one of a run of white space), and none looks past such a space: so
# text cut there is split as the whole is, whatever lies on either side (_boundary_before).
SPACE_BOUNDED = frozenset((GPT2, LLAMA3, QWEN2))
NON_ASCII = re.compile(r"[^\x00-\x7f]+")  # a stretch beyond ASCII
# where text beyond ASCII is cut (SPACE_BOUNDED): a space after a printable ASCII character
_CUT = re.compile(r"(?<=[!-~]) ")
RUN_CHARS = 64  # text with more than one stretch of other characters in this many goes to the tokenizer whole
MAX_CACHED_WORDS = 1 << 17


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

    def __init__(self, tokenizer, steps: list, added: list[dict[str, int]], adds_tokens: bool, mixed: bool):
        """`tokenizer`: the `tokenizers.Tokenizer`; `steps`: its pre-tokenizer's, each ("digits", pattern) or
        ("split", pattern); `added`: the added tokens' passes, content -> id (the unnormalized ones first, as
        tokenizers splits them); `adds_tokens`: whether its post-processor adds tokens when asked to add special
        ones; `mixed`: whether text beyond ASCII may be cut where SPACE_BOUNDED says (no normalizer, every
        pattern one of those), its stretches beyond ASCII given to the tokenizer."""
        self.tokenizer, self.model, self.steps, self.adds_tokens = tokenizer, tokenizer.model, steps, adds_tokens
        self.mixed = mixed
        self.added_splits = [re.compile("(" + "|".join(re.escape(c) for c in sorted(ids, key=len, reverse=True))
                                        + ")") for ids in added]
        self.added_ids = {content: i for ids in added for content, i in ids.items()}
        self.chars = str.maketrans({b: c for c, b in byte_level_alphabet().items() if b < 128})
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
        split = _steps(spec.get("pre_tokenizer"))
        if split is None:
            return None
        steps, space_bounded = split
        tokens = spec.get("added_tokens") or []
        if any(t.get("single_word") or t.get("lstrip") or t.get("rstrip") or not t.get("content") for t in tokens):
            return None
        added = [ids for ids in ({t["content"]: t["id"] for t in tokens if bool(t.get("normalized")) == normalized}
                                 for normalized in (False, True)) if ids]
        post = (spec.get("post_processor") or {}).get("type")
        return cls(tokenizer, steps, added, adds_tokens=post not in (None, "ByteLevel"),
                   mixed=space_bounded and not spec.get("normalizer"))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int] | None:
        """The tokenizer's `encode(text, add_special_tokens).ids`, or None: text beyond ASCII where this
        tokenizer's patterns cannot be cut (or more than one stretch of it in RUN_CHARS characters: the
        tokenizer whole is faster), or special tokens asked of a post-processor that adds them."""
        if add_special_tokens and self.adds_tokens:
            return None
        if not text.isascii() and (not self.mixed or len(NON_ASCII.findall(text)) * RUN_CHARS > len(text)):
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
            elif piece.isascii():
                self._words(piece, ids)
            else:
                self._mixed(piece, ids)
        return ids

    def _mixed(self, text: str, ids: list[int]) -> None:
        """Text between added tokens with characters beyond ASCII: each stretch of them, widened to the places
        where the patterns cut whatever lies around, goes to the tokenizer; the ASCII between them here."""
        pos = 0
        for m in NON_ASCII.finditer(text):
            if m.start() < pos:  # inside the last stretch given to the tokenizer
                continue
            start = _boundary_before(text, m.start(), pos)
            after = _CUT.search(text, m.end())
            end = after.start() if after else len(text)
            if start > pos:
                self._words(text[pos:start], ids)
            ids.extend(self.tokenizer.encode(text[start:end], add_special_tokens=False).ids)
            pos = end
        if pos < len(text):
            self._words(text[pos:], ids)

    def _words(self, text: str, ids: list[int]) -> None:
        """ASCII text between added tokens: pre-tokenized by the steps, each word's ids the model's (cached)."""
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


def _boundary_before(text: str, i: int, lo: int) -> int:
    """The last place in (lo, i] where text beyond ASCII may be cut (_CUT's rule, searched backwards: a regex
    would find every cut from lo on), else lo."""
    k = text.rfind(" ", lo + 1, i + 1)
    while k > lo:
        if "!" <= text[k - 1] <= "~":
            return k
        k = text.rfind(" ", lo + 1, k)
    return lo


def _steps(pre: dict | None) -> tuple[list, bool] | None:
    """The pre-tokenizer's splitting steps for ASCII text and whether every pattern is SPACE_BOUNDED, or None
    where a step is not reproduced here. Its bytes must be mapped (ByteLevel), and last."""
    if not pre:
        return None
    steps, mapped, bounded = [], False, True
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
                steps.append(("split", re.compile(ascii_pattern(GPT2))))
            mapped = True
        elif kind == "Split":
            pattern = p.get("pattern") or {}
            if p.get("behavior") != "Isolated" or p.get("invert"):
                return None
            bounded = bounded and pattern.get("Regex") in SPACE_BOUNDED
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
    return (steps, bounded) if mapped else None
