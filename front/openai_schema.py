"""OpenAI request bodies -> one `GatewayCall`; gateway results -> OpenAI response bodies and chunks.

Framework-free: the HTTP layer (`front/app.py`) hands in parsed JSON and gets dicts back. Every bad
field is a `ServingError("invalid_argument", field=...)` naming OpenAI's parameter, so a client sees
400 with `param` set, never a 500 or Triton's "Unable to parse 'data'".

OpenAI's ranges are checked here and nowhere else (temperature 0..2, top_p 0..1, penalties -2..2, n up to
128, logit_bias -100..100, top_logprobs up to 20): the gateway passes sampling on, and the engine checks its
own, wider contract (cpu_engine/sequence.py SamplingParams.problems).
"""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii

from contracts.errors import ServingError, invalid
from front.tool_calls import Guide, ToolPlan, message_tool_fields, parse_response_format, parse_tools
from contracts.generation import Outputs
from contracts.logprobs import MAX_TOP_LOGPROBS, MIN_TEMPERATURE, TokenLogprob
from front.openai_fields import HONOURED, ENDPOINTS, STREAM_OPTIONS

MAX_STOP_SEQUENCES = 4  # as OpenAI
MAX_UINT64 = 2**64 - 1
MAX_INT32 = 2**31 - 1
MAX_N = 128  # choices per request
MAX_LOGIT_BIAS_ENTRIES = 1024
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class GatewayCall:
    """What the front asks the gateway for (the gateway contract's inputs, contracts/tensors.py GATEWAY)."""
    max_tokens: int | None = None  # None: an operation that generates nothing (tokenize, sessions, leases)
    text: str | None = None
    messages: list[dict] | None = None  # [{"role", "content": str}]
    stream: bool = False
    include_usage: bool = False
    sampling: dict = field(default_factory=dict)  # temperature, top_p, top_k, seed, min_tokens
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    model: str = "auto"  # an engine model, an upstream's, or a LoRA adapter's name (the gateway resolves it)
    user: str | None = None
    tool_plan: ToolPlan | None = None  # tools offered (front/tool_calls.py); None: none
    guide: Guide | None = None  # guided decoding: response_format or a required / named tool call
    session_id: str | None = None  # a chat session the gateway keeps: body `session_id` or `x-session-id`
    prompt_cache_key: str | None = None  # OpenAI's: the engine keeps this prompt's KV ahead of one-off prompts
    # the gateway drops the conversation's oldest turns that do not fit the window, keeping the system
    # messages and at least the last `slide_keep` messages (Responses' truncation "auto"); None: never
    slide_keep: int | None = None
    n: int = 1
    logprobs: int | None = None  # None: none; 0: each token's own; k: and k alternatives
    echo: bool = False  # completions: the prompt before the completion
    prompt_ids: list[int] | None = None  # completions: the prompt as token ids (text is None then)
    logit_bias: dict[str, float] | None = None

    @property
    def echo_logprobs(self) -> bool:
        """The prompt's tokens are needed: their log probs, or the text of a token-id prompt."""
        return self.echo and (self.logprobs is not None or self.prompt_ids is not None)

    def outputs(self) -> Outputs:
        """What this call asks of the engine beyond its tokens, as the gateway reads it from its inputs."""
        return Outputs(self.n, self.logprobs, self.echo_logprobs,
                       {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None)

    @property
    def token_level(self) -> bool:
        return self.outputs().token_level


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
    return utf8_text(name, value)


def utf8_text(name: str, value: str) -> str:
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
    return [utf8_text("stop", w) for w in words]


def _content(i: int, content) -> str:
    """A message's content: a string, or a list of `{"type": "text", "text": ...}` parts."""
    where = f"messages[{i}].content"
    if isinstance(content, str):
        return utf8_text(where, content)
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(where, f"part {j} must be {{\"type\": \"text\", \"text\": <string>}} "
                              "(only text is supported)")
            parts.append(utf8_text(where, part["text"]))
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


def _is_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def _prompt(body: dict) -> str | list[int]:
    """One prompt: a string, or token ids ([ids] or [[ids]], as lm-evaluation-harness sends them)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str) or _is_ids(prompt[0])):
        prompt = prompt[0]
    if _is_ids(prompt):
        if len(prompt) > 1_000_000 or any(not 0 <= t <= MAX_INT32 for t in prompt):
            raise invalid("prompt", "token ids must be non-negative 32-bit integers")
        return prompt
    if not isinstance(prompt, str):
        raise invalid("prompt", "must be a string or a list of token ids (one prompt per request)")
    return utf8_text("prompt", prompt)


def check_fields(body: dict, route: str, table: dict | None = None, within: str = "") -> None:
    """Unknown fields, and refused fields with a value that asks for something, are 400s naming them.
    `table`: another table than the route's (`within` names the object, as `stream_options`)."""
    table = ENDPOINTS[route] if table is None else table
    prefix, of = (f"{within}.", f"{within} of {route}") if within else ("", route)
    for name, value in body.items():
        spec = table.get(name)
        if spec is None:
            raise invalid(prefix + name, f"is not a field of {of} that this server knows (docs/openai-api.md)")
        if spec.status != HONOURED and not any(value == v and type(value) is type(v) for v in spec.neutral):
            raise invalid(prefix + name, f"is not supported by this server: {spec.note}")


def _logit_bias(body: dict) -> dict[str, float] | None:
    value = body.get("logit_bias")
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise invalid("logit_bias", f"must be an object of token id -> bias (at most {MAX_LOGIT_BIAS_ENTRIES})")
    out = {}
    for key, bias in value.items():
        if not (key.isdigit() and len(key) < 10):
            raise invalid("logit_bias", f"keys must be token ids (non-negative integers), got {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias) \
                or not -100 <= bias <= 100:
            raise invalid("logit_bias", f"the bias of token {key} must be a number in [-100, 100], got {_show(bias)}")
        out[str(int(key))] = float(bias)
    return out or None


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives per token (0: the token's own log prob only); None: no log probs."""
    if chat:
        top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if not _bool(body, "logprobs"):
            if top:
                raise invalid("top_logprobs", "needs logprobs: true")
            return None
        return top or 0
    return _int(body, "logprobs", 0, MAX_TOP_LOGPROBS)


def parse_request(body: dict, chat: bool, default_max_tokens: int) -> GatewayCall:
    """A `/v1/chat/completions` (chat=True) or `/v1/completions` body as a GatewayCall."""
    n = _int(body, "n", 1, MAX_N, 1)
    if not chat and body.get("best_of") is not None and _int(body, "best_of", 1, MAX_N) == n:
        body = {k: v for k, v in body.items() if k != "best_of"}  # best_of = n: n samples, all returned
    route = "/v1/chat/completions" if chat else "/v1/completions"
    check_fields(body, route)
    stream = _bool(body, "stream")
    include_usage = read_stream_options(body, route, stream)
    max_tokens = _int(body, "max_completion_tokens", 1, MAX_INT32) if chat else None
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, MAX_INT32, default_max_tokens)
    sampling = {
        "temperature": _float(body, "temperature", 0.0, 2.0),
        "top_p": _float(body, "top_p", 0.0, 1.0),
        "top_k": _int(body, "top_k", -1, MAX_INT32),  # vLLM's extra; -1 and 0 mean off
        "seed": _int(body, "seed", 0, MAX_UINT64),
        "min_tokens": _int(body, "min_tokens", 0, MAX_INT32),
        "presence_penalty": _float(body, "presence_penalty", -2.0, 2.0),
        "frequency_penalty": _float(body, "frequency_penalty", -2.0, 2.0),
    }
    if sampling["top_k"] is not None and sampling["top_k"] < 0:
        sampling["top_k"] = 0
    if sampling["temperature"] and sampling["temperature"] >= MIN_TEMPERATURE and sampling["top_p"] is None \
            and not sampling["top_k"]:
        # OpenAI samples at a temperature > 0 over the whole distribution (top_p defaults to 1); the engine,
        # as TensorRT-LLM, is greedy when neither top_k nor top_p is set
        sampling["top_p"] = 1.0
    for name in ("presence_penalty", "frequency_penalty"):
        if sampling[name] == 0.0:
            sampling[name] = None  # the engine's default
    model = _str(body, "model", "auto") or "auto"
    plan, guide = _constraints(body, sampling) if chat else (None, None)
    if guide is not None and _bool(body, "ignore_eos"):
        raise invalid("ignore_eos", f"cannot be combined with a constrained answer ({guide.param})")
    prompt = None if chat else _prompt(body)
    return GatewayCall(
        max_tokens=max_tokens,
        messages=_messages(body) if chat else None,
        text=prompt if isinstance(prompt, str) else None,
        prompt_ids=prompt if isinstance(prompt, list) else None,
        n=n,
        logprobs=_logprobs(body, chat),
        echo=False if chat else _bool(body, "echo"),
        logit_bias=_logit_bias(body),
        stream=stream,
        include_usage=include_usage,
        sampling={k: v for k, v in sampling.items() if v is not None},
        stop=_stop(body),
        ignore_eos=_bool(body, "ignore_eos"),
        model=model,
        user=_end_user(body),
        tool_plan=plan,
        guide=guide,
        session_id=_session_id(body, chat),
        prompt_cache_key=_str(body, "prompt_cache_key"),
    )


def _end_user(body: dict) -> str | None:
    """`user`, or OpenAI's `safety_identifier` that replaces it: the usage ledger's end user."""
    user, safety = _str(body, "user"), _str(body, "safety_identifier")
    if user is not None and safety is not None and user != safety:
        raise invalid("safety_identifier", "names another end user than `user`: send one of them")
    return user if user is not None else safety


def read_stream_options(body: dict, route: str, stream: bool) -> bool:
    """The body's `stream_options` (front/openai_fields.py STREAM_OPTIONS) -> include_usage."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise invalid("stream_options", "must be an object")
    check_fields(options, route, STREAM_OPTIONS, "stream_options")
    if options and not stream:
        raise invalid("stream_options", "is only allowed when stream is true")
    value = options.get("include_usage")
    if value is not None and not isinstance(value, bool):
        raise invalid("stream_options.include_usage", f"must be true or false, got {_show(value)}")
    return bool(value)


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
    call.session_id = utf8_text("session_id", header)
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
        return GatewayCall(messages=_messages(body), model=_str(body, "model", "auto") or "auto",
                           tool_plan=plan if plan is not None and plan.choice != "none" else None)
    prompt = _prompt(body)
    if not isinstance(prompt, str):
        raise invalid("prompt", "must be a string (it is tokenized)")
    return GatewayCall(text=prompt, model=_str(body, "model", "auto") or "auto")


def parse_token_ids(body: dict, vocab_limit: int = MAX_INT32) -> list[int]:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise invalid("tokens", "must be a list of token ids (integers)")
    if len(tokens) > 1_000_000 or any(not 0 <= t <= vocab_limit for t in tokens):
        raise invalid("tokens", "ids must be non-negative 32-bit integers (at most 1,000,000 of them)")
    return tokens


# -- responses --------------------------------------------------------------------------------------
@dataclass
class Choice:
    """One choice of a finished request (front/choices.py builds them)."""
    index: int
    text: str  # with echo: the prompt's text first
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None  # with echo: the prompt's tokens first
    text_start: int = 0  # where the completion starts in `text` (after the echoed prompt)
    tool_calls: list[dict] | None = None  # the answer's calls (front/tool_calls.py); text: the content before them


@dataclass
class Completion:
    """The end of one generation, as the gateway reported it."""
    choices: list[Choice]
    model: str
    prompt_tokens: int
    completion_tokens: int  # every choice's

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def finish_reason(self) -> str:
        return self.choices[0].finish_reason

    @property
    def tool_calls(self) -> list[dict] | None:
        return self.choices[0].tool_calls

    @property
    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def _token_text(t: TokenLogprob | tuple) -> str:
    data = t.bytes if isinstance(t, TokenLogprob) else t[2]
    return data.decode("utf-8", errors="replace")


def chat_logprobs(tokens: list[TokenLogprob]) -> dict:
    """OpenAI's chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}."""
    return {"content": [{"token": _token_text(t), "logprob": t.logprob, "bytes": list(t.bytes),
                         "top_logprobs": [{"token": _token_text(a), "logprob": a[1], "bytes": list(a[2])}
                                          for a in t.top]} for t in tokens], "refusal": None}


def completion_logprobs(tokens: list[TokenLogprob], offset: int = 0) -> dict:
    """OpenAI's completions `logprobs`: parallel lists; an entry without a log prob (the echoed prompt's
    first token) has null for its log prob and its alternatives. `text_offset`: each token's start in
    the choice's text, counted from `offset`."""
    offsets, data = [], b""
    for t in tokens:
        offsets.append(offset + len(data.decode("utf-8", errors="ignore")))
        data += t.bytes
    return {"tokens": [_token_text(t) for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [None if t.logprob is None else {_token_text(a): a[1] for a in t.top} for t in tokens],
            "text_offset": offsets}


class ResponseBuilder:
    """OpenAI bodies for one request: ids and `created` are fixed once, shared by every chunk."""

    def __init__(self, chat: bool):
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._text_event: tuple | None = None  # (model, index, include_usage, prefix, suffix)

    def text_event(self, model: str, text: str, index: int = 0, include_usage: bool = False) -> bytes:
        """The SSE event of `chunk(model, text, index=index, include_usage=include_usage)` (a choice's next
        text, after its first chunk, no log probs, no finish), byte for byte as `sse` writes it: the
        chunk's JSON around the text is the same for every token of a stream, so only the text is encoded
        (the hot path: one per streamed token)."""
        head, tail = self.text_event_parts(model, index, include_usage)
        return head + encode_basestring_ascii(text).encode() + tail  # json.dumps(text), in one C call

    def text_event_parts(self, model: str, index: int = 0, include_usage: bool = False) -> tuple[bytes, bytes]:
        """text_event's bytes before and after the JSON string of the text."""
        cached = self._text_event
        if cached is None or cached[0] != model or cached[1] != index or cached[2] != include_usage:
            marker = "\x00TEXT\x00"
            whole = json.dumps(self.chunk(model, marker, index=index, include_usage=include_usage),
                               separators=(",", ":"))
            encoded_marker = json.dumps(marker)
            at = whole.index(encoded_marker)
            cached = self._text_event = (model, index, include_usage, b"data: " + whole[:at].encode(),
                                         whole[at + len(encoded_marker):].encode() + b"\n\n")
        return cached[3], cached[4]

    def _head(self, obj: str, model: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": model}

    def _logprobs(self, tokens: list[TokenLogprob] | None, offset: int = 0):
        if tokens is None:
            return None
        return chat_logprobs(tokens) if self.chat else completion_logprobs(tokens, offset)

    def full(self, c: Completion) -> dict:
        if self.chat:
            choices = []
            for ch in c.choices:
                message = {"role": "assistant", "content": ch.text}
                if ch.tool_calls:
                    message = {"role": "assistant", "content": ch.text or None, "tool_calls": ch.tool_calls}
                choices.append({"index": ch.index, "message": message, "logprobs": self._logprobs(ch.logprobs),
                                "finish_reason": ch.finish_reason})
            return {**self._head("chat.completion", c.model), "choices": choices, "usage": c.usage}
        choices = [{"index": ch.index, "text": ch.text, "logprobs": self._logprobs(ch.logprobs),
                    "finish_reason": ch.finish_reason} for ch in c.choices]
        return {**self._head("text_completion", c.model), "choices": choices, "usage": c.usage}

    def chunk(self, model: str, text: str | None, finish_reason: str | None = None, first: bool = False,
              include_usage: bool = False, index: int = 0, logprobs: list[TokenLogprob] | None = None,
              text_offset: int = 0, delta: dict | None = None) -> dict:
        """One SSE chunk of choice `index`: its new text, and the log probs of its new tokens (chat: a
        chunk's `logprobs` is null when none are asked for; completions: `text_offset` counts from
        `text_offset`, where the chunk's text starts in the choice). `delta`: a chat delta of its own (tool
        calls: front/tool_calls.py ToolCallStream) in place of `text`."""
        if self.chat:
            if delta is None:
                delta = {"content": text} if text else {}
            if first:
                delta = {"role": "assistant", "content": "", **delta} if "tool_calls" not in delta \
                    else {"role": "assistant", **delta}
            choice = {"index": index, "delta": delta, "logprobs": self._logprobs(logprobs),
                      "finish_reason": finish_reason}
            body = {**self._head("chat.completion.chunk", model), "choices": [choice]}
        else:
            choice = {"index": index, "text": text or "", "logprobs": self._logprobs(logprobs, text_offset),
                      "finish_reason": finish_reason}
            body = {**self._head("text_completion", model), "choices": [choice]}
        if include_usage:  # OpenAI: every chunk has "usage": null, the last one (no choices) the figures
            body["usage"] = None
        return body

    def usage_chunk(self, c: Completion) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj, c.model), "choices": [], "usage": c.usage}


def error_body(err: ServingError) -> dict:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    from contracts.errors import KINDS

    spec = KINDS[err.kind]
    code = spec.openai_code
    if code == "model_not_found" and err.field not in ("model", "adapter"):
        code = None  # a route, session, stored response, file or batch not found: OpenAI's code is for models
    return {"error": {"message": err.message, "type": spec.openai_type, "param": err.field, "code": code}}


def retry_after_header(err: ServingError) -> dict[str, str]:
    """`Retry-After` in whole seconds, rounded up, for 429 and 503."""
    if err.status in (429, 503):
        return {"Retry-After": str(max(1, math.ceil(err.retry_after or 1)))}
    return {}
