"""Tool calling, structured outputs and the Responses mapping as libraries: request fields -> plan and guide,
answers -> tool_calls (whole and streamed in any cut), the prompt SmolLM2's template gets, and the
Responses events built from chat deltas."""
import json

import pytest
from hypothesis import given, settings, strategies as st

from contracts.errors import ServingError
from text.chat_tools import TOOL_CALL_OPEN, messages_for_template
from text.tokenization import TokenizerBundle
from front.openai_schema import Choice, Completion, parse_request
from front.responses_api import ResponsesBuilder, ResponsesEvents, input_items_page, parse_responses
from front.tool_calls import MAX_SAFE_INTEGER, ToolCallStream, bounded, parse_response_format, parse_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def chat(**body):
    return parse_request({"messages": [{"role": "user", "content": "hi"}], **body}, True, 16)


def test_required_and_named_choices_constrain_to_the_offered_functions():
    call = chat(tools=[WEATHER, TIME], tool_choice="required")
    schema = json.loads(call.guide.guide)
    assert call.guide.guide_type == "json_schema" and call.guide.param == "tool_choice"
    names = [alt["properties"]["name"]["const"] for alt in schema["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"] and schema["minItems"] == 1 and "maxItems" not in schema
    args = schema["items"]["anyOf"][0]["properties"]["arguments"]
    assert args["properties"]["days"]["maximum"] == MAX_SAFE_INTEGER  # the I-JSON bound
    named = json.loads(chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}},
                            parallel_tool_calls=False).guide.guide)
    assert named["items"]["properties"]["name"] == {"const": "get_time"} and named["maxItems"] == 1
    assert chat(tools=[WEATHER]).guide is None and chat(tools=[WEATHER]).tool_plan.choice == "auto"
    none = chat(tools=[WEATHER], tool_choice="none")
    assert none.tool_plan is None and none.guide is None  # no tools in the prompt, a plain answer


def test_response_formats_become_json_schema_guides():
    assert json.loads(chat(response_format={"type": "json_object"}).guide.guide) == {"type": "object"}
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 5}}}
    got = json.loads(chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                                   "strict": True}}).guide.guide)
    assert got["properties"]["n"] == {"type": "integer", "maximum": 5, "minimum": -MAX_SAFE_INTEGER}
    assert chat(response_format={"type": "text"}).guide is None
    assert parse_response_format(None) is None


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": []}}}, "response_format"),
    ({"tools": [WEATHER], "tool_choice": "required", "min_tokens": 3}, "min_tokens"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]},
     "messages[0].tool_calls"),
])
def test_bad_tool_and_format_fields_are_400s_naming_them(body, param):
    with pytest.raises(ServingError) as e:
        chat(**body)
    assert e.value.kind == "invalid_argument" and e.value.field == param


def test_completions_refuse_chat_only_fields():
    for name, value in (("tools", [WEATHER]), ("response_format", {"type": "json_object"})):
        with pytest.raises(ServingError) as e:
            parse_request({"prompt": "x", name: value}, False, 16)
        assert e.value.field == name


def test_an_answer_parses_into_calls_or_stays_content():
    plan = parse_tools({"tools": [WEATHER]})
    content, calls = plan.parse('Let me check. <tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_call>')
    assert content == "Let me check. " and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert plan.parse("Oslo is cold.") == ("Oslo is cold.", [])
    assert plan.parse("<tool_call>[{broken") == ("<tool_call>[{broken", [])
    required = parse_tools({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False})
    content, calls = required.parse('[{"name": "get_weather", "arguments": {"city": "Rome"}}, '
                                    '{"name": "get_weather", "arguments": {"city": "Bern"}}]')
    assert content is None and [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Rome"]


def _assemble(deltas):
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            slot = calls.setdefault(tc["index"], {"name": None, "arguments": "", "ids": []})
            if tc.get("id"):
                slot["ids"].append(tc["id"])
                slot["name"] = tc["function"]["name"]
            slot["arguments"] += tc["function"].get("arguments", "")
    return content, calls


ANSWER = ('Checking. ' + TOOL_CALL_OPEN + '[{"name": "get_weather", "arguments": {"city": "Sa\\"o {P}aulo", '
          '"days": [1, {"x": "]"}]}}, {"arguments": {"tz": "UTC"}, "name": "get_time"}]</tool_call>')


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=len(ANSWER)), min_size=1, max_size=40))
def test_streamed_calls_assemble_to_the_whole_parse_however_the_text_is_cut(cuts):
    plan = parse_tools({"tools": [WEATHER, TIME]})
    stream, deltas, at = ToolCallStream(plan), [], 0
    for cut in sorted(set(cuts)) + [len(ANSWER)]:
        deltas += stream.push(ANSWER[at:cut])
        at = max(at, cut)
    deltas += stream.finish()
    content, calls = _assemble(deltas)
    _, whole = plan.parse(ANSWER)
    assert content == plan.parse(ANSWER)[0] == "Checking. " and stream.made_calls
    assert [c["name"] for c in calls.values()] == [w["function"]["name"] for w in whole]
    assert all(len(c["ids"]) == 1 for c in calls.values())  # one id per call, sent once
    assert [json.loads(c["arguments"]) for c in calls.values()] == [json.loads(w["function"]["arguments"]) for w in whole]


def test_text_that_only_looks_like_a_tag_is_released_as_content():
    stream = ToolCallStream(parse_tools({"tools": [WEATHER]}))
    assert stream.push("a <tool") == [{"content": "a "}]
    assert stream.push("box> b") == [{"content": "<toolbox> b"}]
    assert stream.push(" <tool_") == [{"content": " "}] and stream.finish() == [{"content": "<tool_"}]


def test_bounded_leaves_given_bounds_and_other_types_alone():
    s = {"type": "object", "properties": {"a": {"type": ["integer", "null"]}, "b": {"type": "integer", "exclusiveMaximum": 3},
                                          "c": {"type": "number"}}}
    out = bounded(s)
    assert out["properties"]["a"]["minimum"] == -MAX_SAFE_INTEGER and "maximum" not in out["properties"]["b"]
    assert out["properties"]["c"] == {"type": "number"} and s["properties"]["a"] == {"type": ["integer", "null"]}


def test_smollm2_prompt_carries_tools_calls_and_results(checkpoint):
    tok = TokenizerBundle.load(checkpoint)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Snow, -3 C"}]
    text = tok.render_chat(msgs, tools=[WEATHER])
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou are an expert in composing functions.")
    assert "<tools>" + json.dumps([WEATHER["function"]]) + "</tools>" in text
    assert '<|im_start|>assistant\n<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_call><|im_end|>' in text
    assert "<|im_start|>tool\nSnow, -3 C<|im_end|>\n<|im_start|>assistant\n" in text
    assert "<tools>" not in tok.render_chat(msgs[:2])  # no tools offered: the template's own prompt
    native = messages_for_template(msgs, [WEATHER], knows_tools=True)
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}  # HF templates take objects


def test_responses_bodies_map_to_chat_and_name_their_own_fields():
    r = parse_responses({"model": "auto", "instructions": "Be brief.", "max_output_tokens": 7, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "Snow"}],
        "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "text"}}}, 16)
    call = r.call
    assert call.max_tokens == 7 and [m["role"] for m in call.messages] == ["system", "user", "assistant", "tool"]
    assert [c["id"] for c in call.messages[2]["tool_calls"]] == ["c1", "c2"]  # parallel calls: one turn
    assert call.tool_plan.choice == "named" and call.guide.param == "tool_choice"
    for body, param in (({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
                        ({"input": "x", "text": {"format": {"type": "json_schema", "schema": 3}}}, "text.format"),
                        ({"input": []}, "input"), ({"input": "x", "seed": 1}, "seed")):
        with pytest.raises(ServingError) as e:
            parse_responses(body, 16)
        assert e.value.field == param


def test_a_stored_conversation_comes_before_the_input_and_is_stored_with_the_output():
    """previous_response_id's items (the stored response's conversation) are the prompt's first turns, after
    this request's instructions; what is stored next is them, this input (as items with ids) and the output."""
    builder = ResponsesBuilder({})
    first = parse_responses({"instructions": "Be brief.", "input": "Weather in Oslo?"}, 16, store=True)
    out = builder.full(Completion([Choice(0, "", "tool_calls", tool_calls=[
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}])], "m", 3, 4))
    doc = first.stored(out)
    assert [i["type"] for i in doc["items"]] == ["message", "function_call"] and doc["input"] == doc["items"][:1]
    assert doc["input"][0]["content"] == [{"type": "input_text", "text": "Weather in Oslo?"}]
    assert doc["input"][0]["id"].startswith("msg_") and first.echo["store"] is True
    second = parse_responses({"instructions": "Use Celsius.", "previous_response_id": out["id"], "input": [
        {"type": "function_call_output", "call_id": "c1", "output": "Snow"}]}, 16, doc["items"], store=False)
    assert [m["role"] for m in second.call.messages] == ["system", "user", "assistant", "tool"]
    assert second.call.messages[0]["content"] == "Use Celsius."  # the first's instructions are not carried over
    assert second.call.messages[2]["tool_calls"][0]["id"] == "c1"
    assert (second.echo["previous_response_id"], second.echo["store"]) == (out["id"], False)
    assert second.stored(out)["items"][:2] == doc["items"] and second.input_items[0]["id"].startswith("fco_")
    assert (second.call.slide_keep, second.echo["truncation"]) == (None, "disabled")
    auto = parse_responses({"input": "x", "truncation": "auto"}, 16)
    assert (auto.call.slide_keep, auto.echo["truncation"]) == (1, "auto")  # the last turn stays, and the system
    for body, param in (({"input": "x", "store": 1}, "store"), ({"input": "x", "previous_response_id": ""},
                                                                "previous_response_id"),
                        ({"input": "x", "truncation": "yes"}, "truncation"),
                        ({"input": [{"role": "user", "content": "x", "id": 5}]}, "input[0].id"),
                        ({"input": "x", "conversation": "conv_1", "previous_response_id": "resp_1"}, "conversation"),
                        ({"input": "x", "conversation": {"id": "conv_1", "x": 1}}, "conversation")):
        with pytest.raises(ServingError) as e:
            parse_responses(body, 16)
        assert e.value.field == param


def test_input_items_are_listed_as_openai_pages():
    items = [{"id": f"msg_{i}"} for i in range(5)]
    page = input_items_page(items, {})
    assert [i["id"] for i in page["data"]] == ["msg_4", "msg_3", "msg_2", "msg_1", "msg_0"]  # desc, the default
    page = input_items_page(items, {"order": "asc", "limit": "2", "after": "msg_1"})
    assert (page["first_id"], page["last_id"], page["has_more"]) == ("msg_2", "msg_3", True)
    assert input_items_page(items, {"after": "msg_0"}) == {"object": "list", "data": [], "first_id": None,
                                                           "last_id": None, "has_more": False}
    for query, param in (({"order": "up"}, "order"), ({"limit": "0"}, "limit"), ({"limit": "x"}, "limit"),
                         ({"after": "msg_9"}, "after"), ({"include": "message.output_text.logprobs"}, "include")):
        with pytest.raises(ServingError) as e:
            input_items_page(items, query)
        assert e.value.field == param


def test_responses_events_number_themselves_and_close_each_item():
    builder = ResponsesBuilder({"tools": [], "tool_choice": "auto", "parallel_tool_calls": True})
    ev = ResponsesEvents(builder, "m")
    out = ev.start() + ev.delta({"content": "Hi"}) + ev.delta({"tool_calls": [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a"'}}]})
    out += ev.delta({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]})
    out += ev.finish(Completion([Choice(0, "", "tool_calls")], "m", 3, 4))
    kinds = [e["type"] for e in out]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    final = out[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["message", "function_call"]
    assert final["output"][1]["arguments"] == '{"a": 1}' and final["usage"]["total_tokens"] == 7


STRICT = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}


def _stream_all(plan, text, step=5):
    stream, out = ToolCallStream(plan), []
    for i in range(0, len(text), step):
        out += stream.push(text[i:i + step])
    return out + stream.finish(), stream


@pytest.mark.parametrize("answer,is_call", [
    ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_call>', True),
    ('<tool_call>[{"name": "get_weather", "arguments": {"town": "Oslo"}}]</tool_call>', False),  # strict: invalid
    ('<tool_call>[{"name": "get_weather", "arguments": {"city": 3}}]</tool_call>', False),
    ('<tool_call>[{"name": "launch_rocket", "arguments": {}}]</tool_call>', False),  # not offered
    ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Os', False),  # cut by max_tokens
])
def test_auto_calls_are_checked_before_they_count_streamed_or_not(answer, is_call):
    plan = parse_tools({"tools": [STRICT]})
    content, calls = plan.parse(answer)
    assert bool(calls) == is_call and (content is None) == is_call
    deltas, stream = _stream_all(plan, answer)
    text, streamed = _assemble(deltas)
    assert stream.made_calls == is_call
    if is_call:
        assert [json.loads(c["arguments"]) for c in streamed.values()] == [{"city": "Oslo"}] and text == ""
        # sent whole once checked: the call's first delta carries all its arguments
        assert json.loads(next(d for d in deltas if "tool_calls" in d)["tool_calls"][0]["function"]["arguments"])
    else:
        assert not streamed and text == answer


def test_a_strict_function_needs_a_valid_schema():
    with pytest.raises(ServingError) as e:
        parse_tools({"tools": [{"type": "function", "function": {"name": "f", "strict": True,
                                                                  "parameters": {"type": "no-such-type"}}}]})
    assert e.value.field == "tools[0].function.parameters"
