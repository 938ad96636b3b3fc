"""`preprocessing`: validate a request and turn text (or chat messages) into the engine's inputs."""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from contracts.errors import ServingError, invalid
from text.tokenization import TokenizerBundle


@dataclass
class Preprocessor:
    tokenizer: TokenizerBundle
    # prompt + output tokens the engine accepts: max_tokens' cap when max_output_len is unset (None: no cap
    # here, as in the front's copy: the gateway holds a prompt it tokenized to preprocessing's cap)
    max_seq_len: int | None
    max_output_len: int | None = None  # cap on max_tokens alone (defaults to max_seq_len)

    def prompt_ids(self, query, messages=None, tools=None, prompt_ids=None) -> list[int]:
        if prompt_ids is not None and query is None and messages is None:
            ids = [int(t) for t in np.asarray(prompt_ids).reshape(-1)]
            vocab = self.tokenizer.vocab_size
            if not ids:
                raise invalid("prompt_ids", "must not be empty")
            if min(ids) < 0 or max(ids) >= vocab:
                raise invalid("prompt_ids", f"token ids must be in [0, {vocab})")
            return ids
        if messages is not None:
            return self.tokenizer.encode_chat(parse_messages(messages), tools=parse_tools(tools))
        else:
            text = decode_text("text_input", query)
            if not text.strip():
                raise invalid("text_input", "must not be empty")
        return self.tokenizer.encode(text)

    def __call__(self, query, request_output_len, bad_words=None, stop_words=None,
                 end_id=None, pad_id=None, messages=None, min_tokens=None, min_length=None,
                 tools=None, prompt_ids=None) -> dict[str, np.ndarray]:
        max_tokens = check_max_tokens(request_output_len, self.max_output_len or self.max_seq_len)
        min_new = resolve_min_tokens(min_tokens, min_length)
        if tools is not None and messages is None:
            raise invalid("tools", "need chat messages")
        # whether prompt + max_tokens fit is the gateway's decision (gateway/routing.py) and the engine's own
        # invariant, not preprocessing's
        ids = self.prompt_ids(query, messages, tools, prompt_ids)
        end = self.tokenizer.end_of_turn_id if end_id is None else int(end_id)
        pad = self.tokenizer.pad_id if pad_id is None else int(pad_id)
        for name, value in (("end_id", end), ("pad_id", pad)):
            if value is None or not 0 <= value < self.tokenizer.vocab_size:
                raise invalid(name, f"must be a token id in [0, {self.tokenizer.vocab_size}), got {value}")
        return {
            "INPUT_ID": np.array([ids], dtype=np.int32),
            "REQUEST_INPUT_LEN": np.array([[len(ids)]], dtype=np.int32),
            "BAD_WORDS_IDS": self.tokenizer.words_to_list(decode_words("bad_words", bad_words))[None],
            "STOP_WORDS_IDS": self.tokenizer.words_to_list(decode_words("stop_words", stop_words))[None],
            "REQUEST_OUTPUT_LEN": np.array([[max_tokens]], dtype=np.int32),
            "OUT_END_ID": np.array([[end]], dtype=np.int32),
            "OUT_PAD_ID": np.array([[pad]], dtype=np.int32),
            "OUT_MIN_TOKENS": np.array([[min_new]], dtype=np.int32),
        }


def check_max_tokens(value, limit: int | None = None) -> int:
    """The one check of `max_tokens` on Triton's side (the gateway before admission, preprocessing for
    the ensemble): present, at least 1, and at most `limit` (the engine's max_output_len) when given."""
    if value is None:
        raise invalid("max_tokens", "is required")
    value = int(value)
    if value < 1:
        raise invalid("max_tokens", f"must be at least 1, got {value}")
    if limit is not None and value > limit:
        raise invalid("max_tokens", f"must be at most {limit}, got {value}")
    return value


def resolve_min_tokens(min_tokens, min_length) -> int:
    """`min_tokens`, or `min_length`, its older TensorRT-LLM name (genai-perf sends it); 0 if neither."""
    if min_tokens is not None and min_length is not None and int(min_tokens) != int(min_length):
        raise invalid("min_length", f"is the older name of min_tokens: give one, or both equal "
                                    f"(got min_tokens={min_tokens}, min_length={min_length})")
    name, value = ("min_tokens", min_tokens) if min_tokens is not None else ("min_length", min_length)
    if value is None:
        return 0
    if int(value) < 0:
        raise invalid(name, f"must be >= 0, got {value}")
    return int(value)


def decode_text(field: str, value) -> str:
    if value is None:
        raise invalid(field, "is required")
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid(field, f"is not valid UTF-8 ({e.reason} at byte {e.start})") from None


def decode_words(field: str, values) -> list[str]:
    if values is None:
        return []
    return [decode_text(field, v) for v in np.asarray(values, dtype=object).reshape(-1)]


def parse_messages(raw) -> list[dict]:
    text = decode_text("messages", raw)
    try:
        messages = json.loads(text)
    except json.JSONDecodeError as e:
        raise invalid("messages", f"is not valid JSON: {e.msg} at position {e.pos}") from None
    except RecursionError:  # json's C scanner gives up past the interpreter's recursion limit
        raise invalid("messages", "is nested too deeply: a list of {role, content} objects has depth 2") from None
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "must be a non-empty JSON list of {role, content} objects")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise invalid("messages", f"item {i} must be an object with string 'role' and 'content'")
        calls = m.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(
                isinstance(c, dict) and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str) for c in calls)):
            raise invalid("messages", f"item {i}: tool_calls must be a list of {{\"function\": {{\"name\", "
                                      "\"arguments\"}}}} objects")
        try:  # JSON escapes can carry lone surrogates ("\\ud800"), which are not text
            m["role"].encode("utf-8"), m["content"].encode("utf-8")
        except UnicodeEncodeError:
            raise invalid("messages", f"item {i} is not valid Unicode text (a lone surrogate)") from None
    return messages


def parse_tools(raw) -> list[dict] | None:
    """The `TOOLS` input: a JSON list of OpenAI tool objects ({"type": "function", "function": {...}})."""
    if raw is None:
        return None
    text = decode_text("tools", raw)
    try:
        tools = json.loads(text)
    except (ValueError, RecursionError):
        raise invalid("tools", "is not valid JSON") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                                              for t in tools):
        raise invalid("tools", "must be a JSON list of {\"type\": \"function\", \"function\": {...}} objects")
    return tools or None


__all__ = ["Preprocessor", "ServingError", "check_max_tokens", "decode_text", "parse_messages", "resolve_min_tokens"]
