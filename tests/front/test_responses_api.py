"""`POST /v1/responses` through the whole stack with the real openai SDK: text input and message items,
instructions, max_output_tokens, streaming events, function tools (required: a call that validates;
function_call_output items back into the prompt), text.format json_schema, usage as the gateway counts
it, stored responses (`store`, `previous_response_id`, retrieve, input items, delete, per tenant), the
Conversations API and `conversation`, `truncation: "auto"`, and every part this server cannot honour refused
with a 400 naming it."""
import json
import urllib.error
import urllib.request

import openai
import pytest
from pydantic import BaseModel

from tests.support.server import metric_value

pytestmark = pytest.mark.integration

WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}, "strict": True}


class Capital(BaseModel):
    country: str
    capital: str


@pytest.fixture(scope="module")
def stack(shared_stack):
    """The session's shared stack; this module's tenant: "responses" (enterprise, at most 200 output
    tokens; tests/support/tenants.py)."""
    return shared_stack


def sdk(stack, key="k-responses"):
    return openai.OpenAI(base_url=f"{stack.front_url}/v1", api_key=key, max_retries=0, timeout=120)


def test_text_input_answers_with_usage_as_chat_counts_it(stack):
    client = sdk(stack)
    r = client.responses.create(model="auto", input="What is the capital of France?", max_output_tokens=16,
                                temperature=0)
    assert r.object == "response" and r.status in ("completed", "incomplete") and "Paris" in r.output_text
    chat = client.chat.completions.create(model="auto", messages=[{"role": "user", "content": "What is the capital of France?"}],
                                          max_tokens=16, temperature=0)
    assert r.output_text == chat.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.model == "tensorrt_llm" and r.output[0].role == "assistant"


def test_instructions_and_message_items_and_max_output_tokens(stack):
    r = sdk(stack).responses.create(
        model="auto", instructions="You answer in French.", max_output_tokens=5, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Name a large city in Europe."}]}])
    assert r.usage.output_tokens == 5 and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens" and r.instructions == "You answer in French."
    chat = sdk(stack).chat.completions.create(model="auto", max_tokens=5, temperature=0, messages=[
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Name a large city in Europe."}])
    # the instructions were the system turn of the prompt
    assert (r.usage.input_tokens, r.output_text) == (chat.usage.prompt_tokens, chat.choices[0].message.content)


def test_streaming_events_build_the_same_answer(stack):
    client = sdk(stack)
    whole = client.responses.create(model="auto", input="What is the capital of France?", max_output_tokens=24,
                                    temperature=0)
    events = list(client.responses.create(model="auto", input="What is the capital of France?",
                                          max_output_tokens=24, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    assert next(e for e in events if e.type == "response.output_text.done").text == text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == whole.usage.output_tokens


def test_required_function_tools_return_a_call_streamed_and_not_and_its_output_goes_back(stack):
    client = sdk(stack)
    kw = dict(model="auto", input="What is the weather like in Paris?", tools=[WEATHER], tool_choice="required",
              parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    r = client.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    events = list(client.responses.create(stream=True, **kw))
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == ["function_call"] and added[0].item.name == "get_weather"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == json.loads(calls[0].arguments)
    assert next(e for e in events if e.type == "response.function_call_arguments.done").arguments == args
    follow = client.responses.create(model="auto", tools=[WEATHER], max_output_tokens=30, temperature=0, input=[
        {"role": "user", "content": "What is the weather like in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny and 24 degrees celsius"}])
    assert follow.usage.input_tokens > r.usage.input_tokens + 10 and follow.output


def test_text_format_json_schema_is_enforced(stack):
    r = sdk(stack).responses.create(
        model="auto", input="What is the capital of France?", max_output_tokens=60, temperature=0,
        text={"format": {"type": "json_schema", "name": "capital", "strict": True,
                         "schema": {**Capital.model_json_schema(), "additionalProperties": False}}})
    assert isinstance(Capital.model_validate_json(r.output_text), Capital)
    parsed = sdk(stack).responses.parse(model="auto", input="What is the capital of France?", max_output_tokens=60,
                                        temperature=0, text_format=Capital)
    assert isinstance(parsed.output_parsed, Capital)


def test_output_text_log_probs_are_chats_streamed_or_not(stack):
    """include message.output_text.logprobs (and top_logprobs): the answer's tokens with the log probs and
    alternatives chat gives for the same prompt, in the text part, the deltas and the done event."""
    client = sdk(stack)
    question = "What is the capital of France?"
    kw = dict(model="auto", input=question, max_output_tokens=8, temperature=0, store=False)
    r = client.responses.create(include=["message.output_text.logprobs"], top_logprobs=2, **kw)
    got = r.output[0].content[0].logprobs
    chat = client.chat.completions.create(model="auto", messages=[{"role": "user", "content": question}], max_tokens=8,
                                          temperature=0, logprobs=True, top_logprobs=2)
    want = chat.choices[0].logprobs.content

    def rows(lps):
        return [(lp.token, round(lp.logprob, 4), [a.token for a in lp.top_logprobs]) for lp in lps]

    assert len(got) == r.usage.output_tokens and rows(got) == rows(want)
    assert "".join(lp.token for lp in got).startswith(r.output_text)
    events = list(client.responses.create(top_logprobs=2, stream=True, **kw))  # top_logprobs alone asks for them
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert rows(streamed) == rows(got)
    assert rows(next(e for e in events if e.type == "response.output_text.done").logprobs) == rows(got)
    assert rows(events[-1].response.output[0].content[0].logprobs) == rows(got)
    assert client.responses.create(**kw).output[0].content[0].logprobs == []  # not asked: none


def test_responses_at_once_in_one_conversation_all_keep_their_items(stack):
    from concurrent.futures import ThreadPoolExecutor

    client = sdk(stack)
    conv = client.conversations.create()
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: client.responses.create(
            model="auto", conversation=conv.id, input=f"Say {i}.", max_output_tokens=2, store=False), range(4)))
    items = client.conversations.items.list(conv.id, limit=100)
    texts = {i.content[0].text for i in items.data if i.role == "user"}
    assert texts == {f"Say {i}." for i in range(4)} and len(items.data) == 4 + sum(len(a.output) for a in answers)


def test_metadata_updates_and_item_removals_during_responses_lose_no_items(stack):
    """A metadata update or an item's removal is written only over the version the front read: responses
    in the conversation at the same time keep their items, and every removal and the last update hold
    (read, change and write from the front without it lose items here)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    client = sdk(stack)
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": f"old {i}"}
                                              for i in range(6)])
    old = [i.id for i in client.conversations.items.list(conv.id, order="asc").data]
    answering = threading.Event()
    answering.set()

    def respond(i):
        return client.responses.create(model="auto", conversation=conv.id, input=f"Say {i}.", max_output_tokens=2,
                                       store=False)

    def update():
        n = 0
        while answering.is_set():
            n += 1
            client.conversations.update(conv.id, metadata={"n": str(n)})

    def remove():
        for item_id in old:
            client.conversations.items.delete(item_id, conversation_id=conv.id)

    with ThreadPoolExecutor(8) as pool:
        busy = [pool.submit(update), pool.submit(remove)]
        answers = list(pool.map(respond, range(4)))
        answering.clear()
        [b.result() for b in busy]
    items = client.conversations.items.list(conv.id, limit=100).data
    assert not {i.id for i in items} & set(old)
    assert {i.content[0].text for i in items if i.role == "user"} == {f"Say {i}." for i in range(4)}
    assert len(items) == 4 + sum(len(a.output) for a in answers)
    assert client.conversations.update(conv.id, metadata={"n": "last"}).metadata == {"n": "last"}
    assert client.conversations.retrieve(conv.id).metadata == {"n": "last"}
    assert len(client.conversations.items.list(conv.id, limit=100).data) == len(items)  # an update keeps the items


def test_a_coding_agents_turns_as_codex_sends_them(stack):
    """The Responses bodies of a Codex-style agent (the Codex CLI's wire protocol: instructions, function
    tools with strict false, tool_choice auto, parallel calls, store false, include [], prompt_cache_key the
    session's id, streamed): a call, then its output sent back with the whole input, both answered."""
    shell = {"type": "function", "name": "shell", "description": "Runs a shell command and returns its output",
             "strict": False, "parameters": {"type": "object", "properties": {"command": {
                 "type": "array", "items": {"type": "string"}}}, "required": ["command"]}}
    client = sdk(stack)
    turn = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files here."}]}]
    kw = dict(model="auto", instructions="You are a coding agent. Use the shell tool.", tools=[shell],
              tool_choice="auto", parallel_tool_calls=True, store=False, include=[], stream=True,
              prompt_cache_key="0199-session-id", max_output_tokens=60, temperature=0)
    first = list(client.responses.create(input=turn, **{**kw, "tool_choice": "required"}))[-1].response
    call = next(o for o in first.output if o.type == "function_call")
    assert call.name == "shell" and isinstance(json.loads(call.arguments)["command"], list)
    assert first.prompt_cache_key == "0199-session-id" and first.store is False
    turn += [{"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "README.md\nsrc"}]
    second = list(client.responses.create(input=turn, **kw))[-1]
    assert second.type in ("response.completed", "response.incomplete") and second.response.output
    # chat completions take the key too
    chat = client.chat.completions.create(model="auto", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                          prompt_cache_key="0199-session-id")
    assert chat.choices[0].message.content is not None


def _post(stack, body, path="/v1/responses"):
    req = urllib.request.Request(f"{stack.front_url}{path}", data=json.dumps(body).encode(),
                                 headers={"authorization": "Bearer k-responses"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("body,param", [
    ({"previous_response_id": "resp 1"}, "previous_response_id"),  # not an id's form
    ({"previous_response_id": 7}, "previous_response_id"),
    ({"store": "yes"}, "store"),
    ({"conversation": "nope"}, "conversation"),  # not an id's form
    ({"conversation": "conv_1", "previous_response_id": "resp_1"}, "conversation"),  # one or the other
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": [{"type": "input_image", "image_url": "http://x"}]}, "input[0]"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 500}, "max_output_tokens"),  # over the tenant's output quota
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ({"frobnicate": 1}, "frobnicate"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(stack, body, param):
    status, answer = _post(stack, {"model": "auto", "input": "hi", "max_output_tokens": 4, **body})
    assert status == 400 and answer["error"]["param"] == param, answer


def test_unauthenticated_is_401(stack):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{stack.front_url}/v1", api_key="nope", max_retries=0).responses.create(
            model="auto", input="hi", max_output_tokens=4)


# -- stored responses ---------------------------------------------------------------------------------
def test_previous_response_id_continues_the_stored_conversation(stack):
    """The second request sends only its new input; its prompt is the first's conversation, answer included,
    as if it had been sent whole (the same prompt tokens and answer), and the first's instructions are not
    carried over (as OpenAI's are not)."""
    client = sdk(stack)
    first = client.responses.create(model="auto", instructions="You are terse.", max_output_tokens=12,
                                    temperature=0, input="My name is Ada. What is the capital of France?")
    assert first.store is True and first.previous_response_id is None
    second = client.responses.create(model="auto", previous_response_id=first.id, max_output_tokens=12,
                                     temperature=0, input="What is my name?")
    assert second.previous_response_id == first.id and second.store is True
    whole = client.responses.create(model="auto", max_output_tokens=12, temperature=0, store=False, input=[
        {"role": "user", "content": "My name is Ada. What is the capital of France?"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    assert whole.store is False
    assert (second.usage.input_tokens, second.output_text) == (whole.usage.input_tokens, whole.output_text)
    # a chain: the third follows the second, so the whole conversation
    third = client.responses.create(model="auto", previous_response_id=second.id, max_output_tokens=4,
                                    temperature=0, input="Thanks.")
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


def test_a_stored_response_is_retrieved_listed_and_deleted_by_its_tenant_only(stack):
    client, other = sdk(stack), sdk(stack, "k-responses-other")
    r = client.responses.create(model="auto", max_output_tokens=8, temperature=0, metadata={"case": "retrieve"},
                                input=[{"role": "user", "content": "Say hi."}])
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    items = client.responses.input_items.list(r.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "Say hi.")]
    assert items.data[0].id.startswith("msg_")
    for call in (lambda: other.responses.retrieve(r.id), lambda: other.responses.delete(r.id),
                 lambda: other.responses.create(model="auto", previous_response_id=r.id, input="hi",
                                                max_output_tokens=4)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.BadRequestError) as e:  # a stored response is answered whole, never as events
        client.responses.retrieve(r.id, stream=True)
    assert e.value.body["param"] == "stream"
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(r.id)
    assert (e.value.body["param"], e.value.body["code"]) == ("response_id", None)  # model_not_found is for models
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="auto", previous_response_id=r.id, input="hi", max_output_tokens=4)
    assert e.value.body["param"] == "previous_response_id"


def test_a_streamed_response_is_stored_before_its_end_and_function_calls_chain(stack):
    """A streamed response can be named the moment its last event arrives; a function call's output sent
    with previous_response_id is answered after the stored call, as if the call had been sent again."""
    client = sdk(stack)
    kw = dict(model="auto", tools=[WEATHER], max_output_tokens=60, temperature=0)
    events = list(client.responses.create(input="What is the weather like in Paris?", tool_choice="required",
                                          parallel_tool_calls=False, stream=True, **kw))
    done = events[-1].response
    call = next(o for o in done.output if o.type == "function_call")
    assert client.responses.retrieve(done.id).output[0].call_id == call.call_id
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny and 24 degrees celsius"}
    chained = client.responses.create(previous_response_id=done.id, input=[result], **{**kw, "max_output_tokens": 30})
    whole = client.responses.create(store=False, input=[
        {"role": "user", "content": "What is the weather like in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        result], **{**kw, "max_output_tokens": 30})
    assert (chained.usage.input_tokens, chained.output_text) == (whole.usage.input_tokens, whole.output_text)


def test_store_false_keeps_nothing_and_a_tenant_without_conversations_cannot_store(stack):
    client = sdk(stack)
    r = client.responses.create(model="auto", input="hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = sdk(stack, "k-responses-unstored")
    r = unstored.responses.create(model="auto", input="hi", max_output_tokens=4)  # the default: not kept, said so
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        unstored.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError) as e:
        unstored.responses.create(model="auto", input="hi", max_output_tokens=4, store=True)
    assert e.value.body["param"] == "store"
    with pytest.raises(openai.BadRequestError) as e:
        unstored.conversations.create()
    assert e.value.body["param"] == "conversation"


def test_a_response_over_the_tenants_store_bound_is_answered_and_says_it_was_not_stored(stack):
    """Over the tenant's sessions.max_bytes, a response is answered whole but not kept: its `store` says
    false (streamed: in the last event), naming it later is a 404, and the failure is counted."""
    client = sdk(stack, "k-responses-small-store")
    short = client.responses.create(model="auto", input="hi", max_output_tokens=4)
    assert short.store is True and client.responses.retrieve(short.id).id == short.id
    long_input = "Summarize this. " + "The quick brown fox jumps over the lazy dog. " * 100  # ~4.6 KB
    r = client.responses.create(model="auto", input=long_input, max_output_tokens=4)
    assert r.output_text and r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    events = list(client.responses.create(model="auto", input=long_input, max_output_tokens=4, stream=True))
    final = events[-1].response  # response.incomplete: cut by max_output_tokens
    assert final.output_text and final.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="auto", input="and?", max_output_tokens=4, previous_response_id=final.id)
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{stack.front_metrics_port}/metrics", timeout=10).read().decode()
    assert metric_value(metrics, "llm_front_errors_total", route="/v1/responses", kind="store_invalid_argument") >= 2


@pytest.mark.parametrize("path", ["/v1/responses/%ED%A0%80", "/v1/responses/resp_%2E%2E", "/v1/responses/resp_" + "x" * 80,
                                  "/v1/responses/%ED%A0%80/input_items", "/v1/sessions/%ED%A0%80"])
def test_a_stored_ids_path_that_is_not_an_id_is_a_400(stack, path):
    for method in ("GET", "DELETE"):
        req = urllib.request.Request(f"{stack.front_url}{path}", method=method,
                                     headers={"authorization": "Bearer k-responses"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        if e.value.code != 405:  # input_items is GET only
            assert e.value.code == 400, (method, path, e.value.read())
            assert json.loads(e.value.read())["error"]["param"] in ("response_id", "session_id")


def test_langchain_continues_a_conversation_by_previous_response_id(stack):
    """LangChain's ChatOpenAI on the Responses API with use_previous_response_id sends only the messages
    after its last answer, naming that answer's response: the same prompt and answer as the whole
    conversation sent again, and a 404 once the named response is deleted (so it was the stored one)."""
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    def llm(**kw):
        return ChatOpenAI(base_url=f"{stack.front_url}/v1", api_key="k-responses", model="auto", temperature=0,
                          max_tokens=12, max_retries=0, timeout=120, use_responses_api=True, **kw)

    first = llm().invoke([HumanMessage("My name is Ada. Say hello.")])
    turns = [HumanMessage("My name is Ada. Say hello."), first, HumanMessage("What is my name?")]
    chained = llm(use_previous_response_id=True).invoke(turns)
    whole = llm().invoke(turns)
    assert chained.usage_metadata["input_tokens"] == whole.usage_metadata["input_tokens"]
    assert chained.text == whole.text
    sdk(stack).responses.delete(first.response_metadata["id"])
    with pytest.raises(openai.NotFoundError):
        llm(use_previous_response_id=True).invoke(turns)


def test_truncation_auto_drops_the_oldest_turns_of_a_conversation_over_the_window(stack):
    """truncation "auto" (OpenAI's: items dropped from the conversation's start) answers a conversation that
    "disabled" (the default) refuses as over the window: whole turns go, the instructions and the last turn
    stay, and the answer is the one to what was kept sent alone."""
    client = sdk(stack, "k-responses-window")
    turns = []
    for i in range(8):
        turns += [{"role": "user", "content": f"Fact {i}: the sky is blue and the grass is green, they say." * 3},
                  {"role": "assistant", "content": f"Noted fact {i}."}]
    question = {"role": "user", "content": "What is the capital of France?"}
    kw = dict(model="auto", instructions="Be brief.", max_output_tokens=8, temperature=0, store=False)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(input=turns + [question], **kw)
    assert e.value.body["code"] == "context_length_exceeded"
    r = client.responses.create(input=turns + [question], truncation="auto", **kw)
    assert r.truncation == "auto" and r.status in ("completed", "incomplete") and r.usage.input_tokens + 8 <= 400
    kept = None
    for i in range(2, len(turns), 2):  # the newest whole turns that fit: the first cut the window takes
        try:
            alone = client.responses.create(input=turns[i:] + [question], **kw)
        except openai.BadRequestError:
            continue
        kept = turns[i:]
        break
    assert kept and alone.usage.input_tokens == r.usage.input_tokens
    assert client.responses.create(input=kept + [question], **kw).output_text == r.output_text
    # a conversation within the window is sent whole
    short = client.responses.create(input=[question], truncation="auto", **kw)
    assert short.output_text == client.responses.create(input=[question], **kw).output_text



# -- the Conversations API ----------------------------------------------------------------------------
def test_a_conversation_is_created_read_changed_and_deleted_by_its_tenant_only(stack):
    client, other = sdk(stack), sdk(stack, "k-responses-other")
    conv = client.conversations.create(metadata={"topic": "travel"}, items=[
        {"type": "message", "role": "user", "content": "I am planning a trip to Oslo."},
        {"type": "message", "role": "assistant", "content": "Noted."}])
    assert conv.id.startswith("conv_") and conv.object == "conversation" and conv.metadata == {"topic": "travel"}
    assert client.conversations.retrieve(conv.id).model_dump() == conv.model_dump()
    assert client.conversations.update(conv.id, metadata={"topic": "work"}).metadata == {"topic": "work"}
    items = client.conversations.items.list(conv.id)
    assert [(i.role, i.content[0].text) for i in items.data] == [("assistant", "Noted."),
                                                                ("user", "I am planning a trip to Oslo.")]  # desc
    added = client.conversations.items.create(conv.id, items=[
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "In May."}]}])
    assert [i.content[0].text for i in added.data] == ["In May."] and added.first_id == added.data[0].id
    assert client.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id).content[0].text == "In May."
    assert [i.id for i in client.conversations.items.list(conv.id, order="asc", limit=2)][1] == items.data[0].id
    for call in (lambda: other.conversations.retrieve(conv.id), lambda: other.conversations.items.list(conv.id),
                 lambda: other.conversations.delete(conv.id),
                 lambda: other.responses.create(model="auto", conversation=conv.id, input="hi", max_output_tokens=2)):
        with pytest.raises(openai.NotFoundError):
            call()
    after = client.conversations.items.delete(items.data[0].id, conversation_id=conv.id)
    assert after.id == conv.id
    assert [i.content[0].text for i in client.conversations.items.list(conv.id, order="asc")] == \
        ["I am planning a trip to Oslo.", "In May."]
    with pytest.raises(openai.NotFoundError) as e:
        client.conversations.items.retrieve(items.data[0].id, conversation_id=conv.id)
    assert e.value.body["param"] == "item_id"
    assert client.conversations.delete(conv.id).deleted is True
    with pytest.raises(openai.NotFoundError) as e:
        client.conversations.retrieve(conv.id)
    assert (e.value.body["param"], e.value.body["code"]) == ("conversation_id", None)
    for bad, param in (({"items": [{"type": "input_image"}]}, "items[0]"), ({"items": [{}] * 21}, "items"),
                       ({"metadata": {"k": 1}}, "metadata"), ({"frobnicate": 1}, "frobnicate")):
        status, answer = _post(stack, bad, "/v1/conversations")
        assert status == 400 and answer["error"]["param"] == param, answer


def test_responses_in_a_conversation_follow_its_items_and_add_theirs(stack):
    """A response that names a conversation is answered after its items, as if they were sent with its input,
    and its input and output are added to it (streamed or not)."""
    client = sdk(stack)
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": "My name is Ada."},
                                              {"type": "message", "role": "assistant", "content": "Hello Ada."}])
    kw = dict(model="auto", max_output_tokens=12, temperature=0)
    r = client.responses.create(conversation=conv.id, input="What is my name?", **kw)
    assert r.conversation.id == conv.id
    whole = client.responses.create(store=False, input=[
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": "Hello Ada."},
        {"role": "user", "content": "What is my name?"}], **kw)
    assert (r.usage.input_tokens, r.output_text) == (whole.usage.input_tokens, whole.output_text)
    events = list(client.responses.create(conversation={"id": conv.id}, input="Thanks.", stream=True, **kw))
    streamed = events[-1].response
    texts = [(i.role, i.content[0].text) for i in client.conversations.items.list(conv.id, order="asc")]
    assert texts == [("user", "My name is Ada."), ("assistant", "Hello Ada."), ("user", "What is my name?"),
                     ("assistant", r.output_text), ("user", "Thanks."), ("assistant", streamed.output_text)]
    assert streamed.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens
