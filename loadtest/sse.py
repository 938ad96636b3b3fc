"""Server-sent events of OpenAI-compatible and llama.cpp streaming endpoints, parsed one line at a time.

One parser for every client that reads the front (or a peer) as a stream: `loadtest/run.py`'s peer
client, the locust front user and `benchmarks/triton_bench.py`'s front layer, so all of them take TTFT
at the same event (the first one with non-empty text) and treat an error event the same way.
"""
from __future__ import annotations

import json
import time


class StreamError(RuntimeError):
    """An error event inside a stream (the front sends one when an error comes after streaming began)."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


def parse_line(raw: bytes | str) -> dict | None:
    """The JSON event of one SSE line (`data: {...}`); None for anything else: blank lines, comments,
    other fields and the `data: [DONE]` sentinel. An error event raises StreamError."""
    if isinstance(raw, str):
        raw = raw.encode()
    raw = raw.strip()
    if not raw.startswith(b"data:"):
        return None
    data = raw[5:].strip()
    if not data or data == b"[DONE]":
        return None
    event = json.loads(data)
    if isinstance(event, dict) and event.get("error"):
        err = event["error"]
        if isinstance(err, dict):
            raise StreamError(str(err.get("message") or err), err.get("code"))
        raise StreamError(str(err))
    return event if isinstance(event, dict) else None


def event_text(event: dict) -> str:
    """The text an event carries: OpenAI completions (`choices[0].text`), chat completions
    (`choices[0].delta.content`) or llama.cpp's `/completion` (`content`); "" for none (a role-only
    first chat chunk, a finish chunk, the usage chunk)."""
    choices = event.get("choices")
    if choices is None:
        return event.get("content") or ""
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def event_usage(event: dict) -> dict | None:
    """The `usage` of an event (the last chunk when `stream_options.include_usage` is set), else None."""
    usage = event.get("usage")
    return usage if isinstance(usage, dict) else None


__all__ = ["StreamError", "parse_line", "event_text", "event_usage"]


class StreamTimeline:
    """What a client sees of one SSE stream, fed line by line as it arrives: when it started, when the
    first non-empty text came (the TTFT every layer counts the same way), the text pieces, the usage."""

    def __init__(self):
        self.start, self.first, self.pieces, self.usage = time.perf_counter(), None, [], None

    def feed(self, raw: bytes | str) -> None:
        event = parse_line(raw)
        if event is None:
            return
        piece = event_text(event)
        if piece:
            self.first = self.first if self.first is not None else time.perf_counter()
            self.pieces.append(piece)
        self.usage = event_usage(event) or self.usage

    @property
    def text(self) -> str:
        return "".join(self.pieces)
