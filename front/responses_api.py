"""OpenAI's Responses API (`POST /v1/responses`) over the chat machinery.

A Responses body is mapped to the chat body it means (`instructions` -> a system message, `input` text
or items -> messages, `function_call` / `function_call_output` items -> an assistant's tool calls and
tool results, `tools` / `tool_choice` -> the chat forms, `text.format` -> response_format,
`max_output_tokens` -> max_tokens) and parsed by `parse_request`, so limits, tools and guided decoding
are the very same; errors name the Responses field. What this server cannot do (background runs, built-in
tools, reasoning, `include`, ...) is refused with a 400 naming the field. The answer is a `response` object,
or its SSE events (`response.created` ... `response.output_text.delta` /
`response.function_call_arguments.delta` ... `response.completed`).

Stored responses (`store`, true unless asked otherwise, as OpenAI's; only where the key's tenant keeps
conversations): the gateway keeps the response object and the conversation up to it (gateway/sessions.py
StoredObjects); a next request that names it as `previous_response_id` is answered with that conversation
before its own input (the earlier `instructions` are not carried over, as OpenAI's are not), and
GET / DELETE /v1/responses/{id} and GET /v1/responses/{id}/input_items read and forget it. A request that
names a `conversation` (front/conversations_api.py) is answered after its items, and adds its own to it.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from contracts.errors import ServingError, invalid
from front.openai_schema import (Completion, GatewayCall, chat_logprobs, check_fields, parse_request,
                                 read_stream_options, utf8_text)
from front.stored_objects import check_stored_id

# chat parameter -> the Responses field to name in an error
_PARAM = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
          "response_format": "text.format", "messages": "input"}


@dataclass
class ResponsesCall:
    call: GatewayCall
    echo: dict = field(default_factory=dict)  # request fields the response object repeats
    store: bool = False  # keep the response (gateway/sessions.py StoredObjects) before its end reaches the client
    input_items: list[dict] = field(default_factory=list)  # this request's input as items with ids (as stored)
    # the conversation it follows: a stored response's (previous_response_id) or a conversation's items
    history: list[dict] = field(default_factory=list)
    conversation: str | None = None  # the conversation its input and output are added to

    def stored(self, response: dict) -> dict:
        """What the gateway keeps of a finished response."""
        return {"response": response, "input": self.input_items,
                "items": self.history + self.input_items + response["output"]}


@dataclass(frozen=True)
class StoredReference:
    """What a Responses body says of stored objects, checked: the response it follows, the conversation it
    belongs to (at most one of the two), and `store` as asked (None: not said)."""
    previous: str | None
    conversation: str | None
    store: bool | None


def stored_reference(body: dict) -> StoredReference:
    previous, conversation, store = body.get("previous_response_id"), body.get("conversation"), body.get("store")
    if previous is not None:
        check_stored_id("response", previous, "previous_response_id")
    if isinstance(conversation, dict) and set(conversation) == {"id"}:
        conversation = conversation["id"]
    if conversation is not None:
        check_stored_id("conversation", conversation, "conversation")
        if previous is not None:
            raise invalid("conversation", "cannot be used with previous_response_id")
    if store is not None and not isinstance(store, bool):
        raise invalid("store", "must be true or false")
    return StoredReference(previous, conversation, store)


def check_metadata(metadata) -> dict:
    """OpenAI's `metadata`: at most 16 string pairs (keys 64 characters, values 512); None: {}."""
    if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in metadata.items())):
        raise invalid("metadata", "must be at most 16 string keys (64 characters) with string values (512)")
    return metadata or {}


def parse_responses(body: dict, default_max_tokens: int, history: list[dict] | None = None,
                    store: bool = False, ref: StoredReference | None = None) -> ResponsesCall:
    """`history`: the items of the stored response named by `previous_response_id`, or of the conversation
    named by `conversation`; `store`: whether this one is kept (stored_reference and the tenant's policy);
    `ref`: the body's stored_reference where the caller read it already."""
    check_fields(body, "/v1/responses")  # front/openai_fields.py: unknown and refused fields are 400s
    ref = ref or stored_reference(body)
    metadata = check_metadata(body.get("metadata"))
    text = body.get("text")
    if text is not None and (not isinstance(text, dict) or set(text) - {"format", "verbosity"}):
        raise invalid("text", "must be {\"format\": {...}}")
    if text and text.get("verbosity") not in (None, "medium"):
        raise invalid("text.verbosity", "is not supported")
    # the usage is in the last event whatever include_usage says (benchmark clients ask for it anyway)
    read_stream_options(body, "/v1/responses", body.get("stream") is True)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions", "must be a string")
    if instructions:
        utf8_text("instructions", instructions)
    history = history or []
    new_messages, new_items = input_items(body.get("input"))
    messages = ([{"role": "system", "content": instructions}] if instructions else []) \
        + (_input(history) if history else []) + new_messages
    chat = {"model": body.get("model"), "messages": messages, "max_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"), "stream": body.get("stream"),
            "tools": _tools(body.get("tools")), "tool_choice": _tool_choice(body.get("tool_choice")),
            "parallel_tool_calls": body.get("parallel_tool_calls"), "user": body.get("user"),
            "safety_identifier": body.get("safety_identifier"),
            "response_format": (text or {}).get("format"), "top_k": body.get("top_k"),
            "min_tokens": body.get("min_tokens"), "ignore_eos": body.get("ignore_eos"),
            "prompt_cache_key": body.get("prompt_cache_key")}
    logprobs, top = _logprobs(body)
    if logprobs:
        chat |= {"logprobs": True, "top_logprobs": top}
    truncation = body.get("truncation", "disabled")
    if truncation not in ("disabled", "auto"):
        raise invalid("truncation", "must be \"disabled\" or \"auto\"")
    try:
        call = parse_request({k: v for k, v in chat.items() if v is not None}, True, default_max_tokens)
    except ServingError as e:
        raise responses_error(e) from None
    if truncation == "auto":  # OpenAI's: items go from the conversation's start; the last turn and the system stay
        call.slide_keep = 1
    echo = {"instructions": instructions, "metadata": metadata, "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "max_output_tokens": body.get("max_output_tokens"),
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "text": {"format": (text or {}).get("format") or {"type": "text"}}, "user": body.get("user"),
            "store": store, "previous_response_id": ref.previous, "truncation": truncation,
            "prompt_cache_key": body.get("prompt_cache_key"), "safety_identifier": body.get("safety_identifier"),
            "conversation": {"id": ref.conversation} if ref.conversation else None}
    return ResponsesCall(call, echo, store, new_items, history, ref.conversation)


LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _logprobs(body: dict) -> tuple[bool, int | None]:
    """(whether the output text carries log probs, how many alternatives): `include`'s
    message.output_text.logprobs, or `top_logprobs` (its range is the chat parser's)."""
    include, top = body.get("include"), body.get("top_logprobs")
    if include is not None and not (isinstance(include, list) and all(isinstance(i, str) for i in include)):
        raise invalid("include", "must be a list of strings")
    for value in include or []:
        if value != LOGPROBS_INCLUDE:
            raise invalid("include", f"only {LOGPROBS_INCLUDE!r} is available, got {value[:60]!r}")
    return bool(include) or top is not None, top


def response_logprobs(tokens) -> list[dict]:
    """Output text's log probs as the Responses API gives them (the chat form: token, logprob, bytes,
    top_logprobs)."""
    return chat_logprobs(tokens)["content"] if tokens else []


def responses_error(e: ServingError) -> ServingError:
    """An error about the chat body (or from the gateway) naming the Responses field instead."""
    if e.field in _PARAM or (e.field or "").startswith("messages"):
        named = _PARAM.get(e.field, "input")
        e.message = e.message.replace(e.field, named, 1)
        e.field = named
    return e


def _input(value, name: str = "input") -> list[dict]:
    """Responses items (or a text) as chat messages; a 400 naming `name[i]` for an item it cannot take."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise invalid(name, "must be a string or a non-empty list of input items")
    out: list[dict] = []
    for i, item in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(item, dict):
            raise invalid(where, "must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid(f"{where}.role", "must be user, system, developer or assistant")
            out.append({"role": role, "content": _content(where, item.get("content"))})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments", ""), str):
                raise invalid(where, "a function_call needs a name and arguments (a JSON string)")
            call = {"id": str(item.get("call_id") or ""), "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                raise invalid(f"{where}.output", "must be a string")
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""), "content": output})
        else:
            raise invalid(where, f"input items of type {json.dumps(kind)[:40]} are not supported "
                          "(message, function_call, function_call_output)")
    return out


_ITEM_ID = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_"}


def input_items(value, name: str = "input") -> tuple[list[dict], list[dict]]:
    """Items (or a text) -> (their chat messages, as `_input` checks and maps them; the items, each with an id,
    a status and its content as parts: what is stored and what GET /v1/responses/{id}/input_items lists)."""
    messages = _input(value, name)
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    out = []
    for i, item in enumerate(value):
        if "id" in item and not (isinstance(item["id"], str) and 0 < len(item["id"]) <= 128):
            raise invalid(f"{name}[{i}].id", "must be a string of 1 to 128 characters")
        item = {"type": "message", **item}
        if item["type"] == "message" and isinstance(item.get("content"), str):
            kind = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": kind, "text": item["content"]}]
        item.setdefault("id", _ITEM_ID[item["type"]] + uuid.uuid4().hex)
        item.setdefault("status", "completed")
        out.append(item)
    return messages, out


def input_items_page(items: list[dict], query) -> dict:
    """A page of items as OpenAI lists them (GET /v1/responses/{id}/input_items, /v1/conversations/{id}/items):
    `order` desc (the default) or asc, `limit` 1-100 (20), `after` an item id; any other query parameter
    (`include`: no extra output data is available) is a 400 naming it."""
    for name in query:
        if name not in ("order", "limit", "after"):
            raise invalid(name, "is not a parameter of this list (order, limit, after)")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("order", "must be asc or desc")
    try:
        limit = int(query.get("limit", 20))
    except ValueError:
        raise invalid("limit", "must be an integer") from None
    if not 1 <= limit <= 100:
        raise invalid("limit", "must be in [1, 100]")
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        at = next((i for i, item in enumerate(ordered) if item.get("id") == after), None)
        if at is None:
            raise invalid("after", f"no item {after!r} in this list")
        ordered = ordered[at + 1:]
    page = ordered[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > limit}


def _content(where: str, content):
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}.content", "must be a string or a list of text parts")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            raise invalid(f"{where}.content[{j}]", "only input_text / output_text parts are supported")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _tools(tools):
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise invalid("tools", "must be a list")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise invalid(f"tools[{i}]", f"only function tools are supported, got {json.dumps(kind)[:40]}")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                                      if k in t}})
    return out


def _tool_choice(choice):
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise invalid("tool_choice", "must be none, auto, required or {\"type\": \"function\", \"name\"}")
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


# -- the response object and its events ---------------------------------------------------------------
class ResponsesBuilder:
    def __init__(self, echo: dict):
        self.echo = echo
        self.id = "resp_" + uuid.uuid4().hex
        self.created_at = int(time.time())
        self.seq = 0

    def response(self, model: str, status: str, output: list[dict], done: Completion | None = None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        body = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "model": model, "output": output, "error": None, "incomplete_details": incomplete,
                **self.echo, "usage": None}
        if done is not None:
            body["usage"] = {"input_tokens": done.prompt_tokens, "output_tokens": done.completion_tokens,
                             "total_tokens": done.prompt_tokens + done.completion_tokens,
                             "input_tokens_details": {"cached_tokens": 0},
                             "output_tokens_details": {"reasoning_tokens": 0}}
            body["completed_at"] = int(time.time())
        return body

    @staticmethod
    def status(done: Completion) -> str:
        return "incomplete" if done.finish_reason == "length" else "completed"

    @staticmethod
    def message_item(item_id: str, text: str, status: str = "completed", logprobs: list[dict] | None = None) -> dict:
        return {"type": "message", "id": item_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}

    @staticmethod
    def call_item(item_id: str, call: dict, status: str = "completed") -> dict:
        return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["function"]["name"],
                "arguments": call["function"]["arguments"], "status": status}

    def output(self, done: Completion) -> list[dict]:
        items = []
        if done.text:
            tokens = done.choices[0].logprobs if not done.tool_calls else None  # a call's tokens are not text
            items.append(self.message_item("msg_" + uuid.uuid4().hex, done.text, logprobs=response_logprobs(tokens)))
        for call in done.tool_calls or []:
            items.append(self.call_item("fc_" + uuid.uuid4().hex, call))
        return items

    def full(self, done: Completion) -> dict:
        return self.response(done.model, self.status(done), self.output(done), done)

    def event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}


class ResponsesEvents:
    """Chat deltas (`{"content"}` / `{"tool_calls"}`, as ToolCallStream gives them) in, Responses events out."""

    def __init__(self, builder: ResponsesBuilder, model: str):
        self.b, self.model = builder, model
        self.items: list[dict] = []  # finished output items
        self.open: dict | None = None  # the item being written
        self.text = ""
        self.logprobs: list[dict] = []  # the open message's, as streamed
        self.call_index: int | None = None

    def start(self) -> list[dict]:
        body = self.b.response(self.model, "in_progress", [])
        return [self.b.event("response.created", response=body), self.b.event("response.in_progress", response=body)]

    def delta(self, d: dict, logprobs=None) -> list[dict]:
        """`logprobs`: the tokens' log probs (contracts.logprobs.TokenLogprob) that go with a content delta."""
        out = []
        if d.get("content"):
            if self.open is None or self.open["type"] != "message":
                out += self._close()
                self.open, self.text = self.b.message_item("msg_" + uuid.uuid4().hex, "", "in_progress"), ""
                self.logprobs = []
                out.append(self.b.event("response.output_item.added", output_index=len(self.items),
                                        item={**self.open, "content": []}))
                out.append(self.b.event("response.content_part.added", item_id=self.open["id"],
                                        output_index=len(self.items), content_index=0,
                                        part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
            self.text += d["content"]
            lps = response_logprobs(logprobs)
            self.logprobs += lps
            out.append(self.b.event("response.output_text.delta", item_id=self.open["id"], output_index=len(self.items),
                                    content_index=0, delta=d["content"], logprobs=lps))
        for tc in d.get("tool_calls", []):
            if tc.get("id") is not None and tc["index"] != self.call_index:
                out += self._close()
                self.call_index = tc["index"]
                self.open = self.b.call_item("fc_" + uuid.uuid4().hex, {"id": tc["id"], "function": {
                    "name": tc["function"]["name"], "arguments": ""}}, "in_progress")
                out.append(self.b.event("response.output_item.added", output_index=len(self.items), item=dict(self.open)))
            args = (tc.get("function") or {}).get("arguments") or ""
            if args and self.open is not None and self.open["type"] == "function_call":
                self.open["arguments"] += args
                out.append(self.b.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                        output_index=len(self.items), delta=args))
        return out

    def _close(self, logprobs: list[dict] | None = None) -> list[dict]:
        """The open item done; a message's log probs: `logprobs` when given (the answer's, exact), else
        those streamed with it."""
        if self.open is None:
            return []
        item, index, out = self.open, len(self.items), []
        if item["type"] == "message":
            lps = self.logprobs if logprobs is None else logprobs
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": lps}
            out.append(self.b.event("response.output_text.done", item_id=item["id"], output_index=index,
                                    content_index=0, text=self.text, logprobs=lps))
            out.append(self.b.event("response.content_part.done", item_id=item["id"], output_index=index,
                                    content_index=0, part=part))
            item = self.b.message_item(item["id"], self.text, logprobs=lps)
        else:
            out.append(self.b.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                    arguments=item["arguments"], name=item["name"]))
            item = {**item, "status": "completed"}
        out.append(self.b.event("response.output_item.done", output_index=index, item=item))
        self.items.append(item)
        self.open = None
        return out

    def finish(self, done: Completion) -> list[dict]:
        exact = None  # the last message's log probs as the answer has them (a stop string cut, no calls made)
        if self.open is not None and self.open["type"] == "message" and not done.tool_calls:
            exact = response_logprobs(done.choices[0].logprobs)
        out = self._close(exact)
        status = self.b.status(done)
        body = self.b.response(done.model, status, self.items, done)
        return out + [self.b.event("response.completed" if status == "completed" else "response.incomplete",
                                   response=body)]
