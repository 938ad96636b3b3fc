"""Tools in the prompt: how a chat with `tools`, assistant `tool_calls` and `tool` results becomes the
messages a chat template renders.

A template that knows tools (it reads `tools`, as Hugging Face's tool-use templates do) gets them as
they are, with each call's arguments as an object. SmolLM2's own template renders only role and
content (any role: a `tool` result is `<|im_start|>tool ...`), so the tools go where SmolLM2's model
card puts them for function calling: a system turn listing them inside `<tools>...</tools>` and asking
for calls as `<tool_call>[{"name": ..., "arguments": {...}}]</tool_call>`; earlier calls of the
assistant are written back in that same form. The front parses answers in that form (TOOL_CALL_OPEN).
"""
from __future__ import annotations

import json

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"

TOOLS_SYSTEM = (
    "You are an expert in composing functions. You are given a question and a set of possible functions. "
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose. "
    "If none of the functions can be used, answer the question in plain text.\n\n"
    "You have access to the following tools:\n<tools>{tools}</tools>\n\n"
    "To call tools, answer with nothing but the calls in this format:\n"
    + TOOL_CALL_OPEN + '[{{"name": "func_name1", "arguments": {{"argument1": "value1"}}}}]' + TOOL_CALL_CLOSE
)


def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def _call_text(calls: list[dict]) -> str:
    """An assistant's earlier calls as the model writes them."""
    out = []
    for c in calls:
        fn = c.get("function", {})
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except ValueError:
            args = fn.get("arguments")
        out.append({"name": fn.get("name"), "arguments": args})
    return TOOL_CALL_OPEN + json.dumps(out) + TOOL_CALL_CLOSE


def messages_for_template(messages: list[dict], tools: list[dict] | None, knows_tools: bool) -> list[dict]:
    """`messages` (role, content, and `tool_calls` on an assistant turn) as the template takes them."""
    if knows_tools:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _arguments(c)}}
                                   for c in m["tool_calls"]]
            out.append(m)
        return out
    out = []
    for m in messages:
        content = m.get("content") or ""
        if m.get("tool_calls"):
            content = content + _call_text(m["tool_calls"])
        out.append({"role": m["role"], "content": content})
    if tools:
        block = TOOLS_SYSTEM.format(tools=json.dumps([t.get("function", t) for t in tools]))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _arguments(call: dict):
    raw = call["function"].get("arguments")
    try:
        return json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        return raw
