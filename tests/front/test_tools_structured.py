"""Tool calling and structured outputs through the whole stack (front -> gateway -> CPU engine with guided
decoding), driven by the real openai SDK and LangChain's ChatOpenAI: `chat.completions.parse` returns a
parsed Pydantic object, `tool_choice="required"` / a named function return calls whose arguments validate
against the function's schema (streamed and not), tool results render back into the prompt, and a
guide the engine cannot compile is a 400 naming the field."""
import json
import time
import urllib.error
import urllib.request
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from tests.support.server import metric_value

pytestmark = pytest.mark.integration


class City(BaseModel):
    name: str
    country: str
    is_capital: bool
    population_millions: int


class WeatherArgs(BaseModel):
    city: str
    unit: Literal["celsius", "fahrenheit"]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def stack(shared_stack):
    """The session's shared stack; this module's tenant: "tools" (enterprise, allowed the demo-support
    adapter; tests/support/tenants.py)."""
    return shared_stack


def sdk(stack):
    return openai.OpenAI(base_url=f"{stack.front_url}/v1", api_key="k-tools", max_retries=0, timeout=120)


def test_parse_with_a_pydantic_model_returns_the_parsed_object(stack):
    done = sdk(stack).chat.completions.parse(
        model="auto", temperature=0, max_tokens=120, response_format=City,
        messages=[{"role": "user", "content": "Describe the city of Paris."}])
    city = done.choices[0].message.parsed
    assert isinstance(city, City) and done.choices[0].finish_reason == "stop"
    assert json.loads(done.choices[0].message.content) == city.model_dump()
    assert done.usage.completion_tokens > 5  # constrained tokens are billed like any others


def test_json_object_answers_are_json_objects_streamed_or_not(stack):
    client = sdk(stack)
    kw = dict(model="auto", temperature=0, max_tokens=80, response_format={"type": "json_object"},
              messages=[{"role": "user", "content": "Give me a JSON object with a name and an age."}])
    whole = client.chat.completions.create(**kw)
    assert whole.choices[0].finish_reason == "stop" and isinstance(json.loads(whole.choices[0].message.content), dict)
    chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    # (not always the same text: the second request reads its prompt from the prefix cache, whose int8
    # attention path can tip a near-tie between two names; docs/engine.md)
    assert isinstance(json.loads(streamed), dict) and chunks[-1].choices[0].finish_reason == "stop"


def test_tool_choice_required_returns_a_call_that_validates(stack):
    done = sdk(stack).chat.completions.create(model="auto", temperature=0, max_tokens=100, messages=ASK,
                                              tools=[WEATHER, TIME], tool_choice="required")
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in ("get_weather", "get_time")
        if call.function.name == "get_weather":
            WeatherArgs.model_validate_json(call.function.arguments)
        else:
            assert isinstance(json.loads(call.function.arguments)["city"], str)


def test_tool_choice_required_streams_deltas_that_assemble_to_the_same_call(stack):
    client = sdk(stack)
    kw = dict(model="auto", temperature=0, max_tokens=100, messages=ASK, tools=[WEATHER],
              tool_choice="required", parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in c.choices[0].delta.tool_calls or []:
            slot = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            slot["id"] = slot["id"] or d.id
            slot["name"] = slot["name"] or (d.function.name if d.function else None)
            slot["arguments"] += (d.function.arguments or "") if d.function else ""
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert list(calls) == [0] and len(whole) == 1
    assert calls[0]["name"] == whole[0].function.name == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == json.loads(whole[0].function.arguments)
    WeatherArgs.model_validate_json(calls[0]["arguments"])
    assert sum(1 for c in chunks if c.choices[0].delta.tool_calls) > 2  # the arguments came in pieces


def test_a_named_function_is_the_one_called(stack):
    done = sdk(stack).chat.completions.create(
        model="auto", temperature=0, max_tokens=60, messages=ASK, tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False)
    calls = done.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"]
    assert set(json.loads(calls[0].function.arguments)) >= {"city"}


def test_requests_through_the_gateway_carry_tools_and_guides_too(stack):
    """A LoRA adapter's request streams through the gateway (not the front's lease): the same tools in the
    prompt and the same guided decoding."""
    client = sdk(stack)
    done = client.chat.completions.create(model="demo-support", temperature=0, max_tokens=100, messages=ASK,
                                          tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert done.model == "tensorrt_llm"  # the engine model that served the adapter
    WeatherArgs.model_validate_json(done.choices[0].message.tool_calls[0].function.arguments)
    base = client.chat.completions.create(model="auto", temperature=0, max_tokens=1, messages=ASK, tools=[WEATHER])
    assert done.usage.prompt_tokens == base.usage.prompt_tokens  # the tools were rendered the same way
    parsed = client.chat.completions.parse(model="demo-support", temperature=0, max_tokens=120, response_format=City,
                                           messages=[{"role": "user", "content": "Describe the city of Paris."}])
    assert isinstance(parsed.choices[0].message.parsed, City)


def test_tool_choice_none_answers_in_text_and_tool_results_reach_the_prompt(stack):
    client = sdk(stack)
    plain = client.chat.completions.create(model="auto", temperature=0, max_tokens=16, messages=ASK,
                                           tools=[WEATHER], tool_choice="none")
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason in ("stop", "length")
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 degrees celsius"}]
    short = client.chat.completions.create(model="auto", temperature=0, max_tokens=1, messages=ASK, tools=[WEATHER])
    answer = client.chat.completions.create(model="auto", temperature=0, max_tokens=40, messages=history,
                                            tools=[WEATHER])
    assert answer.usage.prompt_tokens > short.usage.prompt_tokens + 20  # the call and its result were rendered
    req = urllib.request.Request(f"{stack.front_url}/v1/tokenize", headers={"authorization": "Bearer k-tools"},
                                 data=json.dumps({"messages": history, "tools": [WEATHER]}).encode())
    with urllib.request.urlopen(req, timeout=30) as r:
        assert json.loads(r.read())["count"] == answer.usage.prompt_tokens  # /v1/tokenize renders tools too
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls


def _post(stack, body):
    req = urllib.request.Request(f"{stack.front_url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"authorization": "Bearer k-tools", "content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _errors(stack) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.front_metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return metric_value(text, "llm_front_errors_total", route="/v1/chat/completions", kind="400") or 0


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0]"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 5}, "min_tokens"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(stack, body, param):
    before = _errors(stack)
    status, answer = _post(stack, {"model": "auto", "messages": ASK, "max_tokens": 8, **body})
    assert status == 400 and answer["error"]["param"] == param, answer
    assert _errors(stack) == before + 1
    # nothing stays held: the reservation and the engine slot of an admitted request whose guide the engine
    # refused are settled (asynchronously, by the front's lease)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (_gauge(stack, "gateway_reserved_tokens", tenant="tools")
                                           or _gauge(stack, "gateway_inflight_requests", model="tensorrt_llm")):
        time.sleep(0.1)
    assert _gauge(stack, "gateway_reserved_tokens", tenant="tools") == 0
    assert _gauge(stack, "gateway_inflight_requests", model="tensorrt_llm") == 0
    assert _post(stack, {"model": "auto", "messages": ASK, "max_tokens": 2})[0] == 200


def _gauge(stack, name, **labels) -> float:
    return metric_value(stack.metrics(), name, **labels) or 0.0


def test_langchain_bind_tools_and_with_structured_output(stack):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{stack.front_url}/v1", api_key="k-tools", model="auto", temperature=0,
                     max_tokens=120, max_retries=0, timeout=120)
    ai = llm.bind_tools([WEATHER], tool_choice="required").invoke("What is the weather like in Paris today?")
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather"
    WeatherArgs.model_validate(ai.tool_calls[0]["args"])
    city = llm.with_structured_output(City).invoke("Describe the city of Paris.")
    assert isinstance(city, City)
