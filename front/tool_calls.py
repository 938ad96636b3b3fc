"""OpenAI tool calling and structured outputs: request fields -> a `ToolPlan` and a guide for the engine;
the model's answer -> `tool_calls` (whole, or streamed as deltas).

- `tools`, `tool_choice` (`none` | `auto` | `required` | `{"type": "function", "function": {"name"}}`),
  `parallel_tool_calls`: the tools go into the prompt (text/chat_tools.py renders them the model's
  way) unless the choice is `none`. With `auto` the model decides and its answer is parsed: calls come
  as `<tool_call>[{"name", "arguments"}]</tool_call>`. With `required` or a named function the answer
  is constrained (the engine's guided decoding) to a JSON array of calls whose `name` is one of the
  offered functions and whose `arguments` follow that function's `parameters` schema, so even a small
  model returns a call that validates; `parallel_tool_calls: false` makes it exactly one call. With
  `auto` nothing constrains the model, so its calls are checked once complete: a call of a function not
  offered, or of a `strict` function whose arguments do not validate against its schema, is no call (the
  answer is returned as text); streamed, auto-mode calls are therefore sent whole, once checked.
- `response_format`: `json_object` (a JSON object) and `json_schema` (its `schema`) become a
  `json_schema` guide: the answer is constrained to it, never hoped for. `text` is the default.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from contracts.errors import invalid
from text.chat_tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

MAX_TOOLS = 128
# Integers a schema leaves unbounded are held to I-JSON's exact range (RFC 7493: what every JSON parser
# reads exactly, +-(2**53 - 1)): a grammar then always lets a number end, where a small model left free
# writes "1111..." until max_tokens (measured with SmolLM2-135M on a Pydantic model's int field)
MAX_SAFE_INTEGER = 2 ** 53 - 1


@dataclass(frozen=True)
class Guide:
    """What the engine is asked to follow (TensorRT-LLM's guide type and text), and the OpenAI parameter
    that asked for it (named in an error the engine reports about the guide)."""
    guide_type: str
    guide: str
    param: str


@dataclass
class ToolPlan:
    tools: list[dict]  # as the prompt gets them: [{"type": "function", "function": {name, description, parameters}}]
    choice: str  # none | auto | required | named
    named: str | None = None
    parallel: bool = True

    def check(self, calls: list[dict]) -> bool:
        """Auto mode: every call names an offered function, and a strict one's arguments validate."""
        import jsonschema

        by_name = {t["function"]["name"]: t["function"] for t in self.tools}
        for call in calls:
            fn = by_name.get(call["function"]["name"])
            if fn is None:
                return False
            if fn.get("strict"):
                try:
                    jsonschema.validate(json.loads(call["function"]["arguments"]), fn["parameters"])
                except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError):
                    return False
        return True

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")

    def guide(self) -> Guide | None:
        """`required` / named: the answer is a JSON array of calls of the offered functions."""
        if not self.constrained:
            return None
        fns = [t["function"] for t in self.tools if self.choice == "required" or t["function"]["name"] == self.named]
        calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                   "arguments": f.get("parameters") or {"type": "object"}},
                  "required": ["name", "arguments"], "additionalProperties": False} for f in fns]
        schema = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return Guide("json_schema", json.dumps(bounded(schema)), "tool_choice")

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of a whole answer; no calls when it holds none that parse."""
        if not self.parses_calls:
            return text, []
        if self.constrained:
            head, body = "", text
        else:
            at = text.find(TOOL_CALL_OPEN)
            if at < 0:
                return text, []
            head, body = text[:at], text[at + len(TOOL_CALL_OPEN):]
        try:
            raw, _ = json.JSONDecoder().raw_decode(body.lstrip())
        except ValueError:
            return text, []
        raw = raw if isinstance(raw, list) else [raw]
        calls = [_call(item) for item in raw if isinstance(item, dict) and isinstance(item.get("name"), str)]
        if not self.parallel:
            calls = calls[:1]
        if not self.constrained and not self.check(calls):
            return text, []
        # the text before the calls as it was (streamed, it went out as it came)
        return (head if head.strip() else None) if calls else text, calls


def bounded(schema):
    """A copy of a JSON schema with every unbounded integer held to +-MAX_SAFE_INTEGER."""
    if isinstance(schema, list):
        return [bounded(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded(v) for k, v in schema.items()}
    kind = out.get("type")
    if kind == "integer" or (isinstance(kind, list) and "integer" in kind):
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -MAX_SAFE_INTEGER
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = MAX_SAFE_INTEGER
    return out


def _call(item: dict) -> dict:
    args = item.get("arguments", {})
    return {"id": new_call_id(), "type": "function",
            "function": {"name": item["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# -- request fields ---------------------------------------------------------------------------------
def _function(i: int, tool) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise invalid(where, "only {\"type\": \"function\", \"function\": {...}} tools are supported")
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise invalid(f"{where}.function.name", "is required (a string)")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise invalid(f"{where}.function.parameters", "must be a JSON schema object")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise invalid(f"{where}.function.description", "must be a string")
    out = {"name": fn["name"], **({"description": fn["description"]} if fn.get("description") else {}),
           "parameters": params or {"type": "object", "properties": {}}}
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise invalid(f"{where}.function.strict", "must be true or false")
    if fn.get("strict"):
        import jsonschema

        try:
            jsonschema.validators.validator_for(out["parameters"]).check_schema(out["parameters"])
        except jsonschema.SchemaError as e:
            raise invalid(f"{where}.function.parameters", f"is not a valid JSON schema: {e.message}") from None
        out["strict"] = True
    return {"type": "function", "function": out}


def parse_tools(body: dict) -> ToolPlan | None:
    """`tools`, `tool_choice`, `parallel_tool_calls` of a chat body (Responses bodies are mapped to this
    shape first); None when the request offers no tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls", "must be true or false")
    if tools in (None, []):
        if choice not in (None, "none"):
            raise invalid("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise invalid("tools", f"must be a list of at most {MAX_TOOLS} function tools")
    fns = [_function(i, t) for i, t in enumerate(tools)]
    names = [f["function"]["name"] for f in fns]
    if len(set(names)) != len(names):
        raise invalid("tools", "function names must be unique")
    named = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function") if isinstance(choice.get("function"), dict) else choice
        named = fn.get("name") if choice.get("type") == "function" else None
        if not isinstance(named, str) or named not in names:
            raise invalid("tool_choice", f"must name one of the tools ({', '.join(names)}), got {json.dumps(choice)[:80]}")
        choice = "named"
    elif choice not in ("none", "auto", "required"):
        raise invalid("tool_choice", "must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\"}}")
    return ToolPlan(fns, choice, named, True if parallel is None else parallel)


def parse_response_format(value, param: str = "response_format") -> Guide | None:
    """OpenAI's `response_format` (chat) or `text.format` (Responses): the guide it asks for, or None (text)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid(param, "must be an object with a \"type\"")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Guide("json_schema", json.dumps({"type": "object"}), param)
    if kind == "json_schema":
        spec = value.get("json_schema", value)  # chat nests it; Responses' text.format does not
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise invalid(param, "json_schema needs a \"schema\" object")
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise invalid(param, "json_schema.strict must be true or false")
        return Guide("json_schema", json.dumps(bounded(spec.get("schema") or {"type": "object"})), param)
    raise invalid(param, f"type must be text, json_object or json_schema, got {json.dumps(kind)[:40]}")


def message_tool_fields(i: int, m: dict) -> dict:
    """The tool parts of chat message i: an assistant's `tool_calls`, a tool result's `tool_call_id`."""
    out = {}
    calls = m.get("tool_calls")
    if calls not in (None, []):
        if m.get("role") != "assistant" or not isinstance(calls, list):
            raise invalid(f"messages[{i}].tool_calls", "only an assistant message carries a list of tool calls")
        clean = []
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                    or not isinstance(fn.get("arguments", ""), str):
                raise invalid(f"messages[{i}].tool_calls[{j}]", "must be {\"id\", \"type\": \"function\", "
                              "\"function\": {\"name\", \"arguments\": <JSON string>}}")
            clean.append({"id": str(c.get("id") or ""), "type": "function",
                          "function": {"name": fn["name"], "arguments": fn.get("arguments") or "{}"}})
        out["tool_calls"] = clean
    if m.get("role") == "tool" and m.get("tool_call_id") is not None:
        if not isinstance(m["tool_call_id"], str):
            raise invalid(f"messages[{i}].tool_call_id", "must be a string")
        out["tool_call_id"] = m["tool_call_id"]
    return out


# -- streaming --------------------------------------------------------------------------------------
@dataclass
class _Call:
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    args_is_string: bool = False
    id: str = field(default_factory=new_call_id)
    announced: bool = False
    sent: int = 0  # characters of the arguments sent


class ToolCallStream:
    """The answer's text in, chat deltas out: `{"content": ...}` until a call starts, then for each call
    a first delta with its `index`, `id` and `function.name`, and its `arguments` as they grow.

    Scans the JSON array of calls character by character (strings, escapes, depth), so with `required`
    or a named function (a constrained answer, valid by construction) the arguments of a call stream
    while the model writes them and no delta ever needs taking back. With `auto` the calls are held
    until the array is complete and checked (ToolPlan.check), then sent whole, or as text if they fail."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.in_calls = plan.constrained  # constrained: the answer is the array itself
        self.held = ""  # auto: text that may be the start of TOOL_CALL_OPEN
        self.buf = ""  # the calls' JSON so far
        self.pos = 0
        self.depth, self.in_string, self.escape = 0, False, False
        self.string_start, self.expect_key, self.key = 0, False, None
        self.calls: list[_Call] = []
        self.closed = False
        self.settled = False  # auto: the held calls went out (as calls or as text)
        self.as_text = False  # ... as text

    @property
    def made_calls(self) -> bool:
        return any(c.announced for c in self.calls)

    def push(self, text: str) -> list[dict]:
        if self.as_text and text:  # auto calls that failed their check: the rest is text as well
            return [{"content": text}]
        if self.closed or not text:
            return []
        if not self.in_calls:
            buf = self.held + text
            at = buf.find(TOOL_CALL_OPEN)
            if at < 0:
                keep = next((n for n in range(min(len(buf), len(TOOL_CALL_OPEN) - 1), 0, -1)
                             if TOOL_CALL_OPEN.startswith(buf[-n:])), 0)
                self.held = buf[len(buf) - keep:] if keep else ""
                out = buf[:len(buf) - keep]
                return [{"content": out}] if out else []
            self.in_calls, self.held = True, ""
            head = buf[:at]
            return ([{"content": head}] if head else []) + self._scan(buf[at + len(TOOL_CALL_OPEN):])
        return self._scan(text)

    def finish(self) -> list[dict]:
        """The end of the answer: text held back was never a tool call (nor were unfinished auto calls)."""
        rest, self.held = self.held, ""
        if self.in_calls and not self.plan.constrained and not self.settled:
            self.settled = True
            return [{"content": TOOL_CALL_OPEN + self.buf}]
        return [{"content": rest}] if rest and not self.in_calls else []

    def _scan(self, text: str) -> list[dict]:
        self.buf += text
        buf = self.buf
        while self.pos < len(buf) and not self.closed:
            i, c = self.pos, buf[self.pos]
            self.pos += 1
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.in_string = False
                    self._string_end(i)
                continue
            if c == '"':
                self.in_string, self.string_start = True, i
            elif c in "{[":
                self.depth += 1
                if self.depth == 2 and c == "{":
                    self.calls.append(_Call())
                    self.expect_key = True
                elif self.depth == 3 and self.key == "arguments" and self.calls and self.calls[-1].args_start is None:
                    self.calls[-1].args_start = i
            elif c in "}]":
                self.depth -= 1
                if self.depth == 2 and self.key == "arguments" and self.calls and self.calls[-1].args_end is None \
                        and self.calls[-1].args_start is not None:
                    self.calls[-1].args_end = i + 1
                if self.depth <= 0:
                    self.closed = True
            elif c == ":" and self.depth == 2:
                self.expect_key = False
            elif c == "," and self.depth == 2:
                self.expect_key, self.key = True, None
        return self._deltas()

    def _string_end(self, i: int) -> None:
        if self.depth != 2 or not self.calls:
            return
        raw = self.buf[self.string_start:i + 1]
        call = self.calls[-1]
        if self.expect_key:
            self.key = json.loads(raw)
        elif self.key == "name" and call.name is None:
            call.name = json.loads(raw)
        elif self.key == "arguments" and call.args_start is None:
            call.args_start, call.args_end, call.args_is_string = self.string_start, i + 1, True

    def _deltas(self) -> list[dict]:
        if not self.plan.constrained:  # auto: nothing until the calls are complete and checked
            if not self.closed or self.settled:
                return []
            self.settled = True
            content, calls = self.plan.parse(TOOL_CALL_OPEN + self.buf)
            if not calls:
                self.as_text = True
                return [{"content": TOOL_CALL_OPEN + self.buf}]
            for call, found in zip(self.calls, calls):
                call.id = found["id"]
        out = []
        for index, call in enumerate(self.calls):
            if not self.plan.parallel and index > 0:
                break
            if call.name is None:
                continue
            first = not call.announced
            if first:
                call.announced = True
            args = ""
            if call.args_start is not None:
                if call.args_is_string:
                    args = json.loads(self.buf[call.args_start:call.args_end]) if not call.sent else ""
                else:
                    end = call.args_end if call.args_end is not None else len(self.buf)
                    args = self.buf[call.args_start + call.sent:end]
                call.sent += len(args) if not call.args_is_string else 1
            if first:
                out.append({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                            "function": {"name": call.name, "arguments": args}}]})
            elif args:
                out.append({"tool_calls": [{"index": index, "function": {"arguments": args}}]})
        return out
