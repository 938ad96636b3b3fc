"""The OpenAI-compatible front against a real stack (tritonserver + gateway + CPU engine), driven by the
official `openai` SDK: answers, streaming, usage, per-tenant models, errors as the SDK's own classes,
rate limits with Retry-After, disconnects that stop the engine, and a public door that hides Triton."""
import http.client
import json
import os
import urllib.error
import urllib.request

import openai
import pytest

from clients import LLMClient
from tests.support.server import metric_value
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def stack(shared_stack):
    """The session's shared stack; this module's tenants: front (every model, a 2,048-token context),
    front-standard (tensorrt_llm only), front-solo (free, one request at a time); tests/support/tenants.py."""
    return shared_stack


def sdk(stack, key="k-front", **kw):
    return openai.OpenAI(base_url=f"{stack.front_url}/v1", api_key=key, max_retries=0, timeout=120, **kw)


def test_chat_and_completion_answer_greedily_with_usage_and_the_model_used(stack):
    client = sdk(stack)
    raw = client.chat.completions.with_raw_response.create(model="auto", messages=CHAT, max_tokens=16,
                                                           temperature=0)
    chat = raw.parse()
    assert raw.headers["x-model-used"] == "tensorrt_llm" == chat.model
    assert "Paris" in chat.choices[0].message.content and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.prompt_tokens > 10 and chat.usage.completion_tokens > 0
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    done = client.completions.create(model="tensorrt_llm", prompt=PROMPT, max_tokens=8, temperature=0)
    assert " Paris" in done.choices[0].text and done.usage.completion_tokens == 8
    assert done.choices[0].finish_reason == "length"


def front_text_events(stack, route, lane) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.front_metrics_port}/metrics", timeout=5) as r:
        return metric_value(r.read().decode(), "llm_front_sse_text_events_total", route=route, lane=lane) or 0


def test_the_served_front_runs_the_compiled_token_lane_where_it_is_built(stack):
    """make setup builds front/token_lane.c; the served front says which per-token path it runs (and the
    streaming tests of this module then run through it)."""
    from front import token_lane

    with urllib.request.urlopen(f"http://127.0.0.1:{stack.front_metrics_port}/metrics", timeout=5) as r:
        page = r.read().decode()
    running = "compiled" if token_lane.Lane is not None else "python"
    assert metric_value(page, "llm_front_token_lane", lane=running) == 1
    assert metric_value(page, "llm_front_token_lane", lane="python" if running == "compiled" else "compiled") is None


def test_streamed_deltas_concatenate_to_the_non_streamed_text_and_usage_matches_the_gateway(stack):
    client = sdk(stack)
    direct_before = front_text_events(stack, "/v1/chat/completions", "direct")
    whole = client.chat.completions.create(model="auto", messages=CHAT, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model="auto", messages=CHAT, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    usage = chunks[-1].usage
    # the CPU engine's tokens come one by one while the body waits: its text events went the fast lane
    # (front/app.py _SseText), byte for byte the events `send` would carry (the SDK parsed them above)
    if os.environ.get("FRONT_ENGINE_PROTOCOL", "http") == "http":  # over gRPC every event goes through `send`
        assert front_text_events(stack, "/v1/chat/completions", "direct") > direct_before
    assert not chunks[-1].choices and usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens
    # the gateway's own counts for the same request (gRPC, clients/ library)
    direct = LLMClient(stack.grpc_url, api_key="k-front").generate(messages=CHAT, max_tokens=24, temperature=0)
    assert (direct.num_input_tokens, direct.num_output_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="auto", prompt=PROMPT, max_tokens=12, temperature=0, stream=True))
    assert streamed == client.completions.create(model="auto", prompt=PROMPT, max_tokens=12,
                                                 temperature=0).choices[0].text


def test_a_streams_last_events_arrive_in_one_chunk(stack):
    """The finish event, the usage and [DONE] go out in one write (one wake-up of the client), after the
    text events, on a raw connection that sees the body's chunks as the front framed them."""
    import socket

    body = json.dumps({"model": "auto", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True,
                       "ignore_eos": True, "stream_options": {"include_usage": True}}).encode()
    host, port = stack.front_url.split("://")[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k-front\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        raw = b""
        while not raw.endswith(b"\r\n0\r\n\r\n"):
            data = conn.recv(65536)
            assert data, raw[-300:]
            raw += data
    rest = raw.split(b"\r\n\r\n", 1)[1]
    chunks = []
    while True:  # the chunked body's chunks, as written
        line, _, rest = rest.partition(b"\r\n")
        size = int(line, 16)
        if not size:
            break
        chunks.append(rest[:size])
        rest = rest[size + 2:]
    events = [c.split(b"\n\n")[:-1] for c in chunks]
    last = events[-1]
    assert len(last) == 3 and last[-1] == b"data: [DONE]", last
    finish, usage = (json.loads(e[len(b"data: "):]) for e in last[:2])
    assert finish["choices"][0]["finish_reason"] == "length" and usage["usage"]["completion_tokens"] == 6
    text = "".join(json.loads(e[len(b"data: "):])["choices"][0]["text"] for c in events[:-1] for e in c)
    assert text == sdk(stack).completions.create(model="auto", prompt=PROMPT, max_tokens=6, temperature=0,
                                                 extra_body={"ignore_eos": True}).choices[0].text


def test_stop_strings_end_the_answer_without_the_stop_text(stack):
    done = sdk(stack).completions.create(model="auto", prompt=PROMPT, max_tokens=32, temperature=0, stop=["."])
    assert done.choices[0].text.strip() == "Paris" and done.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in sdk(stack).completions.create(
        model="auto", prompt=PROMPT, max_tokens=32, temperature=0, stop="\n\n", stream=True))
    assert streamed == " Paris."  # the greedy answer goes on with "\n\nThe United States ..."


def test_ignore_eos_and_min_tokens_force_the_length(stack):
    done = sdk(stack).completions.create(model="auto", prompt=PROMPT, max_tokens=40, temperature=0,
                                         extra_body={"ignore_eos": True, "min_tokens": 40})
    assert done.usage.completion_tokens == 40 and done.choices[0].finish_reason == "length"


def test_models_are_listed_per_tenant(stack):
    assert {m.id for m in sdk(stack).models.list()} == {"tensorrt_llm", "tensorrt_llm_big", "auto"}
    standard = sdk(stack, "k-front-standard")
    assert {m.id for m in standard.models.list()} == {"tensorrt_llm", "auto"}
    assert standard.models.retrieve("tensorrt_llm").id == "tensorrt_llm"
    with pytest.raises(openai.NotFoundError):
        standard.models.retrieve("tensorrt_llm_big")


def test_tokenize_counts_what_the_model_sees_and_detokenize_inverts_it(stack):
    headers = {"authorization": "Bearer k-front"}
    tok = _post(stack, "/v1/tokenize", {"prompt": PROMPT}, headers)
    done = sdk(stack).completions.create(model="auto", prompt=PROMPT, max_tokens=1, temperature=0)
    assert tok["count"] == len(tok["tokens"]) == done.usage.prompt_tokens
    assert _post(stack, "/v1/detokenize", {"tokens": tok["tokens"]}, headers)["prompt"] == PROMPT
    chat_tok = _post(stack, "/v1/tokenize", {"messages": CHAT}, headers)
    chat = sdk(stack).chat.completions.create(model="auto", messages=CHAT, max_tokens=1, temperature=0)
    assert chat_tok["count"] == chat.usage.prompt_tokens
    with pytest.raises(urllib.error.HTTPError) as e:
        _post(stack, "/v1/tokenize", {"prompt": PROMPT}, {})
    assert e.value.code == 401


def test_errors_arrive_as_the_sdks_own_classes(stack):
    with pytest.raises(openai.AuthenticationError):
        sdk(stack, "k-wrong").chat.completions.create(model="auto", messages=CHAT, max_tokens=4)
    with pytest.raises(openai.PermissionDeniedError):
        sdk(stack, "k-front-standard").chat.completions.create(model="tensorrt_llm_big", messages=CHAT, max_tokens=4)
    with pytest.raises(openai.NotFoundError) as e:
        sdk(stack).chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=4)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        sdk(stack).chat.completions.create(model="auto", messages=CHAT, max_tokens=4, n=200)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        sdk(stack).chat.completions.create(model="auto", messages=CHAT, max_tokens=4, temperature="hot")
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        sdk(stack).completions.create(model="auto", prompt="word " * 3000, max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded"


def test_a_second_request_over_the_free_tiers_concurrency_gets_429_with_retry_after(stack):
    first = sdk(stack, "k-front-solo").chat.completions.create(
        model="auto", messages=CHAT, max_tokens=200, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "min_tokens": 200})
    next(iter(first))  # the first request holds the tenant's one slot while it streams
    try:
        with pytest.raises(openai.RateLimitError) as e:
            sdk(stack, "k-front-solo").chat.completions.create(model="auto", messages=CHAT, max_tokens=4)
        retry = e.value.response.headers["retry-after"]
        assert retry.isdigit() and int(retry) >= 1
        assert e.value.body["code"] == "rate_limit_exceeded"
    finally:
        first.close()


def _engine_idle(stack) -> bool:
    m = stack.metrics()
    active = metric_value(m, "nv_trt_llm_request_metrics", request_type="active")
    used = metric_value(m, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="used")
    return active == 0 and used == 0


@pytest.mark.parametrize("key,model", [("k-front", "auto"), ("k-tools", "demo-support")],
                         ids=["from-the-engine", "through-the-gateway"])
def test_a_client_that_disconnects_stops_the_engine(stack, key, model):
    """A stream from the engine (a lease) ends by the engine's stop; one through the gateway (a LoRA
    adapter) by the gateway's stop for its stream_id: neither cancels its gRPC call."""
    # the shared stack: whatever an earlier module left running ends first, and the front's counters are
    # compared before and after
    assert wait_until(lambda: _engine_idle(stack), 30), "the engine is still busy from an earlier test"
    stops = {how: _front_metric(stack, "llm_front_engine_stops_total", how=how) for how in ("stop", "cancel")}
    conn = http.client.HTTPConnection("127.0.0.1", stack.front_port, timeout=60)
    body = {"model": model, "prompt": PROMPT, "max_tokens": 1500, "stream": True, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"authorization": f"Bearer {key}"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.read(6) == b"data: "  # generation is under way
    assert wait_until(lambda: not _engine_idle(stack), 5), "the engine never showed the request"
    conn.sock.shutdown(2)
    conn.close()
    assert wait_until(lambda: _engine_idle(stack), 10), "the engine kept generating for a client that left"
    # ended by a stop and read to its end, not by cancelling the gRPC call (which can abort Triton 2.51's
    # server when many streams end so at once: front/gateway_client.py ReadAheadCall)
    assert wait_until(lambda: _front_metric(stack, "llm_front_engine_stops_total", how="stop") >= stops["stop"] + 1, 5)
    assert _front_metric(stack, "llm_front_engine_stops_total", how="cancel") == stops["cancel"]


def _front_metric(stack, name, **labels) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{stack.front_metrics_port}/metrics").read().decode()
    return metric_value(text, name, **labels) or 0.0


def test_the_public_door_hides_triton_and_survives_hostile_bodies(stack):
    for path in ("/v2/models/ensemble/generate", "/v2/logging", "/metrics", "/v2/repository/index"):
        with pytest.raises(urllib.error.HTTPError) as e:
            _post(stack, path, {"text_input": "x", "max_tokens": 1}, {})
        assert e.value.code in (404, 405)
    for raw in (b"[" * 1_000_000, b"{" * 200_000, b"\xff\xfe", b'{"messages": ' + b"[" * 100_000):
        with pytest.raises(urllib.error.HTTPError) as e:
            _post(stack, "/v1/chat/completions", raw, {"authorization": "Bearer k-front"})
        assert e.value.code == 400
    big = b'{"prompt": "' + b"a" * (5 * 1024 * 1024) + b'"}'
    with pytest.raises(urllib.error.HTTPError) as e:
        _post(stack, "/v1/completions", big, {"authorization": "Bearer k-front"})
    assert e.value.code == 400 and b"limit" in e.value.read()
    # Triton's own admin API is closed even on its internal port without the launcher's key
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(urllib.request.Request(
            f"http://{stack.http_url}/v2/repository/models/tensorrt_llm/unload", data=b"{}", method="POST"))
    done = sdk(stack).completions.create(model="auto", prompt=PROMPT, max_tokens=4, temperature=0)
    assert "Paris" in done.choices[0].text


def _post(stack, path, body, headers):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(stack.front_url + path, data=data, method="POST", headers=headers)
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())
