"""Token ids -> text that streams correctly.

Upstream `postprocessing` decodes each streamed chunk on its own with `batch_decode`, which loses the
leading space of SentencePiece pieces and splits multi-byte characters (tensorrtllm_backend #34,
#112, #332). Here every token maps to its exact bytes, text is the UTF-8 decoding of the byte
concatenation, and streams are cut only where the bytes so far form complete UTF-8. So the pieces of
a stream concatenate to exactly the non-streamed text.
"""
from __future__ import annotations

import json
import re

from tokenizers import Tokenizer


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2 byte-level BPE maps each byte to a printable code point; return the inverse map."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping, shift = {}, 0
    for b in range(256):
        if b in printable:
            mapping[chr(b)] = b
        else:
            mapping[chr(256 + shift)] = b
            shift += 1
    return mapping


_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def token_byte_table(tokenizer: Tokenizer, skip_special: bool = True) -> list[bytes]:
    """The bytes each token id stands for (special tokens -> b"" when skipped)."""
    spec = json.loads(tokenizer.to_str())
    decoder = spec.get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders", [])}
    byte_level = "ByteLevel" in kinds
    alphabet = byte_level_alphabet()
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    table = [b""] * size
    for token, idx in tokenizer.get_vocab(with_added_tokens=True).items():
        if idx >= size:
            continue
        if byte_level:
            table[idx] = bytes(alphabet.get(ch, 0x3F) for ch in token) if all(ch in alphabet for ch in token) \
                else token.encode("utf-8")
        else:
            m = _BYTE_TOKEN.match(token)
            table[idx] = bytes([int(m.group(1), 16)]) if m else token.replace("\u2581", " ").encode("utf-8")
    for added in spec.get("added_tokens", []):
        idx = added["id"]
        if idx < size:
            table[idx] = b"" if (added.get("special") and skip_special) else added["content"].encode("utf-8")
    return table


def incomplete_tail(data: bytes) -> int:
    """How many trailing bytes of `data` start a UTF-8 character that is not complete yet."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b & 0xC0 == 0x80:  # continuation byte: keep looking for the lead
            continue
        need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
        return back if need > back else 0
    return 0


class Detokenizer:
    def __init__(self, table: list[bytes]):
        self.table = table

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer, skip_special: bool = True) -> "Detokenizer":
        return cls(token_byte_table(tokenizer, skip_special))

    @property
    def vocab_size(self) -> int:
        return len(self.table)

    def to_bytes(self, ids) -> bytes:
        table, n = self.table, len(self.table)
        return b"".join(table[i] if 0 <= i < n else b"" for i in ids)

    def token_bytes(self, token: int) -> bytes:
        return self.table[token] if 0 <= token < len(self.table) else b""

    def decode(self, ids) -> str:
        return self.to_bytes(ids).decode("utf-8", errors="replace")


class IncrementalDetokenizer:
    """Per-request streaming decoder: `push(ids)` returns the new complete text, `finish()` the rest."""

    def __init__(self, detok: Detokenizer):
        self.detok = detok
        self.pending = b""

    def push(self, ids) -> str:
        if len(ids) == 1:  # a streamed step's one token: the common case, without to_bytes' join
            table, i = self.detok.table, ids[0]
            data = table[i] if 0 <= i < len(table) else b""
        else:
            data = self.detok.to_bytes(ids)
        if self.pending:
            data = self.pending + data
        if not data or data[-1] < 0x80:  # ends in ASCII: nothing held back
            self.pending = b""
            return data.decode("utf-8", errors="replace")
        cut = len(data) - incomplete_tail(data)
        self.pending = data[cut:]
        return data[:cut].decode("utf-8", errors="replace")

    def finish(self) -> str:
        rest, self.pending = self.pending, b""
        return rest.decode("utf-8", errors="replace")
