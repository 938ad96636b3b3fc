"""Every OpenAI request field of the generation endpoints, honoured or refused: the one table.

`front/openai_schema.py` (and `front/responses_api.py`) read a body through it: a field the table does not know is a 400 naming it, a
refused field is a 400 naming it unless it carries its neutral value (what the field means when it is
left out: `n: 1`, `logprobs: false`, `store: false` ...), and every honoured field is read by the parser.
docs/openai-api.md prints this table (tests/front/test_openai_fields.py keeps the two equal and sends
every field to a real server).
"""
from __future__ import annotations

from dataclasses import dataclass

HONOURED, REFUSED = "honoured", "refused"


@dataclass(frozen=True)
class Field:
    status: str  # HONOURED | REFUSED
    note: str = ""  # how it is honoured, or why it is refused
    neutral: tuple = (None,)  # values that mean "not used": accepted even when the field is refused


def honoured(note: str = "") -> Field:
    return Field(HONOURED, note)


def refused(note: str, *neutral) -> Field:
    return Field(REFUSED, note, (None,) + neutral)


# OpenAI's prompt_cache_key asks for better cache hits across requests that share a prefix (agents send their
# session's id, as Codex does); prefix reuse is automatic per tenant, so what the key adds is retention
_CACHE_KEY_NOTE = ("the prompt's KV is kept in the engine ahead of one-off prompts for the tenant's session TTL, as a "
                   "session's turns are (prefix reuse itself is automatic, per tenant)")

# OpenAI's safety_identifier replaces `user` (the end user, for abuse detection): it is the ledger's end user
_SAFETY_ID_NOTE = "recorded as `end_user` in the usage ledger, as `user` is (both at once must agree)"

_SAMPLING = {
    "model": honoured("an engine model, an adapter, or `auto` (the tenant's routing)"),
    "max_tokens": honoured("per choice; default 256"),
    "temperature": honoured("0 to 2; 0 is greedy"),
    "top_p": honoured("0 to 1; a temperature > 0 without top_p or top_k samples with 1 (OpenAI's default)"),
    "seed": honoured("choice i > 0 of a seeded request draws from (seed, i)"),
    "stop": honoured("a string or up to 4; matched on the text"),
    "stream": honoured("SSE chunks, `data: [DONE]` last"),
    "stream_options": honoured("its options: the table below"),
    "n": honoured("1 to 128 choices; they share the prompt's KV blocks; usage counts every choice"),
    "presence_penalty": honoured("-2 to 2, over the tokens generated so far (TensorRT-LLM's presence_penalty)"),
    "frequency_penalty": honoured("-2 to 2, over the tokens generated so far (TensorRT-LLM's frequency_penalty)"),
    "logit_bias": honoured("token id -> -100 to 100, added to the logits (TensorRT-LLM's embedding_bias)"),
    "user": honoured("recorded as `end_user` in the usage ledger"),
    # vLLM's extras
    "top_k": honoured("vLLM's extra; -1 or 0: off"),
    "min_tokens": honoured("vLLM's extra"),
    "ignore_eos": honoured("vLLM's extra"),
}

CHAT = {
    "messages": honoured("roles system, developer (as system), user, assistant, tool; text content parts"),
    **_SAMPLING,
    "max_completion_tokens": honoured("wins over max_tokens"),
    "logprobs": honoured("each token's log prob at the request's temperature (T = 1 when greedy)"),
    "top_logprobs": honoured("0 to 20 alternatives per token; needs logprobs: true"),
    "tools": honoured("functions, rendered the way SmolLM2's model card describes; calls parsed into "
                      "tool_calls (auto: a call counts when it names an offered function and a strict one's "
                      "arguments validate)"),
    "tool_choice": honoured("none, auto, required, or a named function (required and named: constrained "
                            "to the function's JSON schema)"),
    "parallel_tool_calls": honoured("false: exactly one call"),
    "functions": refused("deprecated by OpenAI (use tools)", []),
    "function_call": refused("deprecated by OpenAI (use tool_choice)", "none"),
    "response_format": honoured("text, json_object, json_schema: enforced by the engine's guided decoding"),
    "audio": refused("audio output: this server serves text models"),
    "modalities": refused("only text output", ["text"]),
    "prediction": refused("predicted outputs are not supported"),
    "reasoning_effort": refused("not a reasoning model"),
    "verbosity": refused("not supported", "medium"),
    "web_search_options": refused("no web search"),
    "store": refused("this server stores no completions", False),
    "metadata": refused("only with store, which this server does not do"),
    "service_tier": refused("the tier is the API key's (docs/gateway.md)", "auto", "default"),
    "prompt_cache_key": honoured(_CACHE_KEY_NOTE),
    "safety_identifier": honoured(_SAFETY_ID_NOTE),
    "session_id": honoured("a chat session the gateway keeps (docs/sessions.md; also the x-session-id "
                           "header); not with n > 1, logprobs or echo"),
}

COMPLETIONS = {
    "prompt": honoured("a string, or token ids (a list of integers, or one such list in a list)"),
    **_SAMPLING,
    "logprobs": honoured("0 to 20: each token's log prob at the request's temperature and that many "
                         "alternatives"),
    "echo": honoured("the prompt before the completion; with logprobs, the prompt's log probs (the first null)"),
    "best_of": refused("only best_of = n (the default) is supported"),
    "suffix": refused("insertion is not supported", ""),
}

# `stream_options` of every endpoint, read the same way (a 400 names `stream_options.<option>`)
STREAM_OPTIONS = {
    "include_usage": honoured("a last chunk (no choices) carries the request's usage; every other chunk has "
                              "`usage: null`"),
    "include_obfuscation": refused("chunks are not padded with an `obfuscation` field", False),
    "continuous_usage_stats": refused("vLLM's extra: usage is sent once, in the last chunk (`include_usage`)",
                                      False),
}

_NOTHING = (False, [], {})  # what a refused Responses field may carry: nothing asked

RESPONSES = {
    "model": _SAMPLING["model"],
    "input": honoured("text, or items: messages (text parts), function_call, function_call_output"),
    "instructions": honoured("a system message before the input"),
    "max_output_tokens": honoured("default 256"),
    "temperature": _SAMPLING["temperature"],
    "top_p": _SAMPLING["top_p"],
    "stream": honoured("SSE events: response.created ... output_text / function_call_arguments deltas ... "
                       "response.completed"),
    "tools": honoured("function tools, as chat's"),
    "tool_choice": CHAT["tool_choice"],
    "parallel_tool_calls": CHAT["parallel_tool_calls"],
    "text": honoured("`format`: text, json_object, json_schema (guided decoding, as chat's response_format)"),
    "metadata": honoured("repeated in the response (at most 16 string pairs)"),
    "user": _SAMPLING["user"],
    # vLLM's extras, as chat's (benchmark clients send them to every endpoint: aiperf's --extra-inputs)
    "top_k": _SAMPLING["top_k"],
    "min_tokens": _SAMPLING["min_tokens"],
    "ignore_eos": _SAMPLING["ignore_eos"],
    "store": honoured("true (the default) keeps the response and its conversation for the tenant's session TTL "
                      "(docs/sessions.md); a 400 when the key's tenant keeps no conversations; the answer says "
                      "false when it could not be kept (over the tenant's max_bytes)"),
    "previous_response_id": honoured("a stored response of the same tenant: its conversation comes before this "
                                     "input (its instructions do not); 404 when unknown or expired"),
    "truncation": honoured("\"disabled\" (the default): a conversation over the context window is a 400; \"auto\": "
                           "its oldest turns are dropped until it fits (the instructions and the last turn stay)"),
    "service_tier": refused("the tier is the API key's (docs/gateway.md)", "auto", "default"),
    "conversation": honoured("a conversation of the same tenant (/v1/conversations): its items come before this "
                             "input, and this input and the output are added to it; not with previous_response_id"),
    "background": refused("background responses are not supported", *_NOTHING),
    "include": honoured("only \"message.output_text.logprobs\": each output token's log prob (and top_logprobs "
                        "alternatives) with the answer's text, streamed or not"),
    "reasoning": refused("the served models have no reasoning options", *_NOTHING),
    "prompt": refused("stored prompt templates are not supported", *_NOTHING),
    "max_tool_calls": refused("not supported", *_NOTHING),
    "top_logprobs": honoured("0 to 20 alternatives per output token (implies the log probs of include)"),
    "stream_options": honoured("as chat's (the table below); the last event carries the usage in any case"),
    "prompt_cache_key": honoured(_CACHE_KEY_NOTE),
    "safety_identifier": honoured(_SAFETY_ID_NOTE),
}

ENDPOINTS = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETIONS, "/v1/responses": RESPONSES}


def markdown() -> str:
    """The tables of docs/openai-api.md (between its `fields:begin` / `fields:end` markers)."""
    out = []
    tables = [(f"`{route}`", table) for route, table in ENDPOINTS.items()]
    for title, table in tables + [("`stream_options`", STREAM_OPTIONS)]:
        out += [f"### {title}", "", "| field | | how it is honoured, or why it is refused |", "|---|---|---|"]
        for name, spec in table.items():
            neutral = [v for v in spec.neutral if v is not None]
            note = spec.note + (f" (accepted: {', '.join(_show(v) for v in neutral)})" if neutral else "")
            out.append(f"| `{name}` | {spec.status} | {note} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _show(value) -> str:
    import json

    return f"`{json.dumps(value)}`"


if __name__ == "__main__":
    print(markdown(), end="")
