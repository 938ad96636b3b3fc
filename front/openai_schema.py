"""OpenAI request bodies -> one `GatewayCall`; gateway results -> OpenAI response bodies and chunks.

Framework-free: the HTTP layer (`front/app.py`) hands in parsed JSON and gets dicts back. Every bad
field is a `ServingError("invalid_argument", field=...)` naming OpenAI's parameter, so a client sees
400 with `param` set, never a 500 or Triton's "Unable to parse 'data'".
"""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field

from bls.serving.errors import ServingError, invalid
from front.tool_calls import Guide, ToolPlan, message_tool_fields, parse_response_format, parse_tools

MAX_STOP_SEQUENCES = 4  # as OpenAI
MAX_UINT64 = 2**64 - 1
MAX_INT32 = 2**31 - 1
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class GatewayCall:
    """What the front asks the gateway for (the gateway contract's inputs, bls/serving/contracts.py GATEWAY)."""
    max_tokens: int
    text: str | None = None
    messages: list[dict] | None = None  # [{"role", "content": str}]
    stream: bool = False
    include_usage: bool = False
    sampling: dict = field(default_factory=dict)  # temperature, top_p, top_k, seed, min_tokens
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    model: str = "auto"
    adapter: str | None = None
    user: str | None = None
    tool_plan: ToolPlan | None = None  # tools offered (front/tool_calls.py); None: none
    guide: Guide | None = None  # guided decoding: response_format or a required / named tool call
    session_id: str | None = None  # a chat session the gateway keeps: body `session_id` or `x-session-id`


def parse_json(body: bytes, max_bytes: int) -> dict:
    """The request body as a JSON object; size and nesting are bounded before anything reaches Triton."""
    if len(body) > max_bytes:
        raise ServingError("invalid_argument", f"request body of {len(body)} bytes is over the limit of "
                           f"{max_bytes} bytes")
    try:
        data = json.loads(body)
    except RecursionError:
        raise ServingError("invalid_argument", "request body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ServingError("invalid_argument", f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ServingError("invalid_argument", "request body must be a JSON object")
    return data


# -- typed field readers: bool is not an int, NaN is not a number ------------------------------------
def _int(body: dict, name: str, lo: int, hi: int, default=None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise invalid(name, f"must be an integer, got {_show(value)}")
    if not lo <= value <= hi:
        raise invalid(name, f"must be between {lo} and {hi}, got {value}")
    return value


def _float(body: dict, name: str, lo: float, hi: float, default=None) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(name, f"must be a number, got {_show(value)}")
    value = float(value)
    if not math.isfinite(value) or not lo <= value <= hi:
        raise invalid(name, f"must be a finite number between {lo:g} and {hi:g}, got {value!r}")
    return value


def _bool(body: dict, name: str, default=False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(name, f"must be true or false, got {_show(value)}")
    return value


def _str(body: dict, name: str, default=None, max_len: int = 256) -> str | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise invalid(name, f"must be a string, got {_show(value)}")
    if len(value) > max_len:
        raise invalid(name, f"must be at most {max_len} characters")
    return _utf8(name, value)


def _utf8(name: str, value: str) -> str:
    """JSON escapes can carry lone surrogates ("\\ud800"): not text, and not encodable for the gateway."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise invalid(name, f"is not valid Unicode text (a lone surrogate at character {e.start})") from None
    return value


def _show(value) -> str:
    text = json.dumps(value)[:40] if not isinstance(value, str) else repr(value[:40])
    return f"{type(value).__name__} {text}"


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    words = [value] if isinstance(value, str) else value
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise invalid("stop", "must be a string or a list of strings")
    if len(words) > MAX_STOP_SEQUENCES:
        raise invalid("stop", f"at most {MAX_STOP_SEQUENCES} sequences, got {len(words)}")
    if any(not w or len(w) > 256 for w in words):
        raise invalid("stop", "each sequence must be 1 to 256 characters")
    return [_utf8("stop", w) for w in words]


def _content(i: int, content) -> str:
    """A message's content: a string, or a list of `{"type": "text", "text": ...}` parts."""
    where = f"messages[{i}].content"
    if isinstance(content, str):
        return _utf8(where, content)
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(where, f"part {j} must be {{\"type\": \"text\", \"text\": <string>}} "
                              "(only text is supported)")
            parts.append(_utf8(where, part["text"]))
        return "".join(parts)
    if content is None:
        return ""
    raise invalid(where, f"must be a string or a list of text parts, got {_show(content)}")


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "must be a non-empty list of {\"role\", \"content\"} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise invalid(f"messages[{i}]", f"must be an object, got {_show(m)}")
        role = m.get("role")
        if role not in ROLES:
            raise invalid(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {_show(role)}")
        out.append({"role": "system" if role == "developer" else role, "content": _content(i, m.get("content")),
                    **message_tool_fields(i, m)})
    return out


def _prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise invalid("prompt", "must be a string (one prompt per request; token-id prompts are not supported)")
    return _utf8("prompt", prompt)


def parse_request(body: dict, chat: bool, default_max_tokens: int) -> GatewayCall:
    """A `/v1/chat/completions` (chat=True) or `/v1/completions` body as a GatewayCall."""
    n = _int(body, "n", 1, 128, 1)
    if n != 1:
        raise invalid("n", f"only n=1 is supported, got {n}")
    if _int(body, "best_of", 1, 128, 1) != 1:
        raise invalid("best_of", "only best_of=1 is supported")
    for unsupported in ("logprobs", "top_logprobs", "echo", "suffix", "functions", "function_call", "logit_bias") \
            + (() if chat else ("tools", "tool_choice", "response_format")):
        if body.get(unsupported) not in (None, False, [], {}):
            raise invalid(unsupported, "is not supported by this server")
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise invalid("stream_options", "must be an object")
    stream = _bool(body, "stream")
    if stream_options and not stream:
        raise invalid("stream_options", "is only allowed when stream is true")
    max_tokens = _int(body, "max_completion_tokens", 1, MAX_INT32) if chat else None
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, MAX_INT32, default_max_tokens)
    sampling = {
        "temperature": _float(body, "temperature", 0.0, 2.0),
        "top_p": _float(body, "top_p", 0.0, 1.0),
        "top_k": _int(body, "top_k", -1, MAX_INT32),  # vLLM's extra; -1 and 0 mean off
        "seed": _int(body, "seed", 0, MAX_UINT64),
        "min_tokens": _int(body, "min_tokens", 0, MAX_INT32),
    }
    if sampling["top_k"] is not None and sampling["top_k"] < 0:
        sampling["top_k"] = 0
    model = _str(body, "model", "auto") or "auto"
    plan, guide = _constraints(body, sampling) if chat else (None, None)
    if guide is not None and _bool(body, "ignore_eos"):
        raise invalid("ignore_eos", f"cannot be combined with a constrained answer ({guide.param})")
    return GatewayCall(
        max_tokens=max_tokens,
        messages=_messages(body) if chat else None,
        text=None if chat else _prompt(body),
        stream=stream,
        include_usage=bool(stream_options and _bool(stream_options, "include_usage")),
        sampling={k: v for k, v in sampling.items() if v is not None},
        stop=_stop(body),
        ignore_eos=_bool(body, "ignore_eos"),
        model=model,
        user=_str(body, "user"),
        tool_plan=plan,
        guide=guide,
        session_id=_session_id(body, chat),
    )


def _session_id(body: dict, chat: bool) -> str | None:
    """The body's `session_id` (the gateway checks its form and keeps the conversation: chat only)."""
    session_id = _str(body, "session_id", max_len=128)
    if session_id is not None and not chat:
        raise invalid("session_id", "sessions keep chat conversations: use /v1/chat/completions")
    return session_id


def with_session_header(call: GatewayCall, header: str | None) -> GatewayCall:
    """The `x-session-id` header, which names the same session as the body's `session_id` or stands alone."""
    if header is None:
        return call
    if call.session_id is not None and call.session_id != header:
        raise invalid("session_id", "the body's session_id and the x-session-id header name different sessions")
    if call.messages is None:
        raise invalid("session_id", "sessions keep chat conversations: use /v1/chat/completions")
    call.session_id = _utf8("session_id", header)
    return call


def _constraints(body: dict, sampling: dict) -> tuple[ToolPlan | None, Guide | None]:
    """Tools and response_format (front/tool_calls.py): the plan for the answer and the engine's guide."""
    plan = parse_tools(body)
    fmt = parse_response_format(body.get("response_format"))
    if plan is not None and plan.choice == "none":
        plan = None  # no tools in the prompt, no calls parsed: a plain answer
    if fmt is not None and plan is not None:
        raise invalid("response_format", "a JSON response_format cannot be combined with tools unless "
                      "tool_choice is none")
    guide = fmt or (plan.guide() if plan is not None else None)
    if guide is not None and sampling.get("min_tokens"):
        raise invalid("min_tokens", f"cannot be combined with a constrained answer ({guide.param})")
    return plan, guide


def parse_tokenize(body: dict) -> GatewayCall:
    """`/v1/tokenize`: `prompt` (text) or `messages` (chat-templated as the chat endpoint does, with `tools`)."""
    if "messages" in body:
        plan = parse_tools(body)  # tools are part of the prompt (vLLM's /tokenize takes them too)
        return GatewayCall(max_tokens=1, messages=_messages(body), model=_str(body, "model", "auto") or "auto",
                           tool_plan=plan if plan is not None and plan.choice != "none" else None)
    return GatewayCall(max_tokens=1, text=_prompt(body), model=_str(body, "model", "auto") or "auto")


def parse_token_ids(body: dict, vocab_limit: int = MAX_INT32) -> list[int]:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise invalid("tokens", "must be a list of token ids (integers)")
    if len(tokens) > 1_000_000 or any(not 0 <= t <= vocab_limit for t in tokens):
        raise invalid("tokens", "ids must be non-negative 32-bit integers (at most 1,000,000 of them)")
    return tokens


# -- responses --------------------------------------------------------------------------------------
@dataclass
class Completion:
    """The end of one generation, as the gateway reported it."""
    text: str
    model: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    tool_calls: list[dict] | None = None  # the answer's calls (front/tool_calls.py); text is the content before them

    @property
    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


class ResponseBuilder:
    """OpenAI bodies for one request: ids and `created` are fixed once, shared by every chunk."""

    def __init__(self, chat: bool):
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, obj: str, model: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": model}

    def full(self, c: Completion) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": c.text}
            if c.tool_calls:
                message = {"role": "assistant", "content": c.text or None, "tool_calls": c.tool_calls}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": c.finish_reason}
            return {**self._head("chat.completion", c.model), "choices": [choice], "usage": c.usage}
        choice = {"index": 0, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
        return {**self._head("text_completion", c.model), "choices": [choice], "usage": c.usage}

    def chunk(self, model: str, text: str | None, finish_reason: str | None = None, first: bool = False,
              include_usage: bool = False, delta: dict | None = None) -> dict:
        """`delta`: a chat delta of its own (tool calls: front/tool_calls.py ToolCallStream) in place of `text`."""
        if self.chat:
            if delta is None:
                delta = {"content": text} if text else {}
            if first:
                delta = {"role": "assistant", "content": "", **delta} if "tool_calls" not in delta \
                    else {"role": "assistant", **delta}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            body = {**self._head("chat.completion.chunk", model), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            body = {**self._head("text_completion", model), "choices": [choice]}
        if include_usage:  # OpenAI: every chunk has "usage": null, the last one (no choices) the figures
            body["usage"] = None
        return body

    def usage_chunk(self, c: Completion) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj, c.model), "choices": [], "usage": c.usage}


def error_body(err: ServingError) -> dict:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    from bls.serving.errors import KINDS

    spec = KINDS[err.kind]
    return {"error": {"message": err.message, "type": spec.openai_type, "param": err.field,
                      "code": spec.openai_code}}


def retry_after_header(err: ServingError) -> dict[str, str]:
    """`Retry-After` in whole seconds, rounded up, for 429 and 503."""
    if err.status in (429, 503):
        return {"Retry-After": str(max(1, math.ceil(err.retry_after or 1)))}
    return {}
