"""Sessions, the response cache and stored responses and conversations through the public door: a real
stack (tritonserver, gateway, CPU engine, front) whose gateway keeps them in a real redis-server, driven by
the openai SDK and plain HTTP; and a second replica of the stack on the same Redis behind a real nginx."""
import json
import time
import urllib.error
import urllib.request

import openai
import pytest
import redis

from tests.support.nginx import Nginx
from tests.support.redis import RedisServer
from tests.support.server import TritonServer, metric_value
from tests.support.tenants import Tenant, write_tenants

pytestmark = pytest.mark.integration

TENANTS = [
    Tenant("acme", price_in_per_1k=1.0, price_out_per_1k=2.0, extra={"response_cache": True}),
    Tenant("globex", extra={"response_cache": {"ttl_s": 600}}),
    Tenant("tiny", limits={"max_context_tokens": 256}, extra={"sessions": {"ttl_s": 120}}),
    Tenant("replicas"),  # stored responses and conversations across two replicas
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
ENGINE_WORK = [("nv_inference_request_success", {"model": "tensorrt_llm"}),
               ("nv_inference_count", {"model": "tensorrt_llm"}),
               ("nv_inference_request_success", {"model": "preprocessing"}),
               ("nv_trt_llm_general_metrics", {"general_type": "iteration_counter"})]


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as r:
        yield r


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_server):
    cfg = tmp_path_factory.mktemp("conversations") / "tenants.yaml"
    write_tenants(cfg, TENANTS, models={"tensorrt_llm": 2048})
    s = TritonServer(overrides={"gateway_config": str(cfg), "gateway_redis_url": redis_server.url}, front=True).start()
    yield s
    s.stop()


def sdk(stack, key="k-acme"):
    return openai.OpenAI(base_url=f"{stack.front_url}/v1", api_key=key, max_retries=0, timeout=120)


def engine_work(stack) -> list:
    text = stack.metrics()
    return [metric_value(text, name, **labels) for name, labels in ENGINE_WORK]


def settled_engine_work(stack) -> list:
    """The engine's counters once they stop moving (its own gauges are published every iteration)."""
    last = engine_work(stack)
    for _ in range(20):
        time.sleep(1.0)
        now = engine_work(stack)
        if now == last:
            return now
        last = now
    return last


def moved_from(stack, before: list, wait_s: float = 10.0) -> list:
    """The engine's counters once they differ from `before` (its gauges are published after the iteration
    that moved them, so a request that just ended may not show yet), or `before` after wait_s."""
    deadline = time.monotonic() + wait_s
    now = engine_work(stack)
    while now == before and time.monotonic() < deadline:
        time.sleep(0.2)
        now = engine_work(stack)
    return now


def cache_count(stack, tenant, result):
    return metric_value(stack.metrics(), "gateway_response_cache_requests_total", tenant=tenant, result=result) or 0


def http(stack, method, path, key, body=None, headers=None):
    req = urllib.request.Request(f"{stack.front_url}{path}", method=method, data=json.dumps(body).encode() if body else None,
                                 headers={"authorization": f"Bearer {key}", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# -- the response cache ------------------------------------------------------------------------------
def test_a_cached_deterministic_request_returns_the_same_body_without_engine_work(stack, redis_server):
    client = sdk(stack)
    ask = {"model": "auto", "messages": CHAT, "max_tokens": 12, "temperature": 0}
    first = client.chat.completions.create(**ask)
    hits = cache_count(stack, "acme", "hit")
    before = settled_engine_work(stack)
    again = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    time.sleep(2.5)
    assert engine_work(stack) == before  # no engine step, not even preprocessing
    assert cache_count(stack, "acme", "hit") == hits + 2
    strip = lambda c: {k: v for k, v in c.model_dump().items() if k not in ("id", "created")}  # noqa: E731
    assert strip(again) == strip(first) and "Paris" in first.choices[0].message.content
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == first.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == first.usage.completion_tokens
    # the same request of another tenant is its own entry: a miss, and engine work
    other = sdk(stack, "k-globex").chat.completions.create(**ask)
    assert other.choices[0].message.content == first.choices[0].message.content
    assert cache_count(stack, "globex", "hit") == 0 and moved_from(stack, before) != before
    # the hits went through the gateway's accounting: requests and tokens counted for acme
    keys = redis.Redis.from_url(redis_server.url).keys("llm:rcache:*")
    assert len(keys) >= 2  # acme's and globex's entries, in the shared store


def test_sampled_requests_are_never_cached(stack):
    client, misses = sdk(stack), cache_count(stack, "acme", "miss")
    hits = cache_count(stack, "acme", "hit")
    for _ in range(2):
        client.chat.completions.create(model="auto", messages=CHAT, max_tokens=4, temperature=0.9)
    assert cache_count(stack, "acme", "hit") == hits and cache_count(stack, "acme", "miss") == misses


# -- sessions ------------------------------------------------------------------------------------------
def test_a_three_turn_session_answers_in_context_without_resending_history(stack):
    client, sid = sdk(stack), "conv-1"
    turns = [[{"role": "user", "content": "I have a dog named Max."}],
             [{"role": "user", "content": "What is the capital of Italy?"}],
             [{"role": "user", "content": "What is my dog's name?"}]]
    history, answers = [], []
    for i, new in enumerate(turns):
        kw = {"extra_body": {"session_id": sid}} if i != 1 else {"extra_headers": {"x-session-id": sid}}
        got = client.chat.completions.create(model="auto", messages=new, max_tokens=32, temperature=0, **kw)
        history += new
        # the engine was given the whole conversation: as many prompt tokens as the history sent whole
        # (the answers themselves may differ in a token: a reused prefix is not bit-identical to a fresh prefill)
        whole = client.chat.completions.create(model="auto", messages=history, max_tokens=1, temperature=0.5)
        assert got.usage.prompt_tokens == whole.usage.prompt_tokens
        history.append({"role": "assistant", "content": got.choices[0].message.content})
        answers.append(got.choices[0].message.content)
    # a fact the 135M model recalls from its context in int8 and float32 alike (a favourite colour, asked
    # back, it did not on every host)
    assert "Rome" in answers[1] and "Max" in answers[2], answers
    alone = client.chat.completions.create(model="auto", messages=turns[2], max_tokens=32, temperature=0)
    assert "Max" not in alone.choices[0].message.content  # the name came from the session
    status, stored = http(stack, "GET", f"/v1/sessions/{sid}", "k-acme")
    assert status == 200 and stored["messages"] == history


def test_past_the_window_the_session_keeps_answering_with_its_system_prompt(stack):
    client, sid = sdk(stack, "k-tiny"), "long-1"
    system = {"role": "system", "content": "You are a terse assistant."}
    slid_before = metric_value(stack.metrics(), "gateway_session_turns_total", tenant="tiny", window="slid") or 0
    for i in range(6):
        new = ([system] if i == 0 else []) + [{"role": "user", "content": f"Fact {i}: " + "the sky is blue and " * 8}]
        got = client.chat.completions.create(model="auto", messages=new, max_tokens=16, temperature=0,
                                             extra_body={"session_id": sid})
        assert got.choices[0].finish_reason in ("stop", "length")
        assert got.usage.prompt_tokens + 16 <= 256
    slid = metric_value(stack.metrics(), "gateway_session_turns_total", tenant="tiny", window="slid")
    assert slid >= slid_before + 2
    status, stored = http(stack, "GET", f"/v1/sessions/{sid}", "k-tiny")
    assert status == 200 and stored["messages"][0] == system and len(stored["messages"]) == 13
    # the same history sent whole, without a session, is over the window: a 400
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="auto", messages=stored["messages"] + [{"role": "user", "content": "Hi"}],
                                       max_tokens=16, temperature=0)


def test_another_tenant_can_neither_read_nor_use_a_session(stack):
    acme, sid = sdk(stack), "private-1"
    acme.chat.completions.create(model="auto", max_tokens=8, temperature=0, extra_body={"session_id": sid},
                                 messages=[{"role": "user", "content": "The secret word is pineapple."}])
    assert http(stack, "GET", f"/v1/sessions/{sid}", "k-globex")[0] == 404
    assert http(stack, "DELETE", f"/v1/sessions/{sid}", "k-globex")[0] == 404
    question = [{"role": "user", "content": "What is the secret word?"}]
    theirs = sdk(stack, "k-globex").chat.completions.create(model="auto", max_tokens=8, temperature=0,
                                                            messages=question, extra_body={"session_id": sid})
    fresh = sdk(stack, "k-globex").chat.completions.create(model="auto", max_tokens=8, temperature=0.0, top_p=1.0,
                                                           messages=question)
    assert theirs.usage.prompt_tokens == fresh.usage.prompt_tokens  # nothing of acme's conversation
    status, stored = http(stack, "GET", f"/v1/sessions/{sid}", "k-acme")
    assert status == 200 and len(stored["messages"]) == 2 and "pineapple" in stored["messages"][0]["content"]
    assert http(stack, "DELETE", f"/v1/sessions/{sid}", "k-acme") == (200, {"id": sid, "object": "chat.session.deleted",
                                                                            "deleted": True})
    assert http(stack, "GET", f"/v1/sessions/{sid}", "k-acme")[0] == 404


def test_session_ids_are_checked_at_the_door(stack):
    body = {"model": "auto", "messages": CHAT, "max_tokens": 2, "session_id": "a"}
    status, err = http(stack, "POST", "/v1/chat/completions", "k-acme", body, {"x-session-id": "b"})
    assert status == 400 and err["error"]["param"] == "session_id"
    status, err = http(stack, "POST", "/v1/completions", "k-acme", {"prompt": "Hi", "max_tokens": 2, "session_id": "a"})
    assert status == 400 and err["error"]["param"] == "session_id"
    status, err = http(stack, "POST", "/v1/chat/completions", "k-acme", {**body, "session_id": "no spaces"})
    assert status == 400 and err["error"]["param"] == "session_id"


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, stack, redis_server):
    """A second replica of the stack (its own tritonserver, gateway, engine and front) on the same Redis,
    both fronts behind nginx in round robin: consecutive requests alternate replicas."""
    cfg = tmp_path_factory.mktemp("replica") / "tenants.yaml"
    write_tenants(cfg, TENANTS, models={"tensorrt_llm": 2048})
    other = TritonServer(overrides={"gateway_config": str(cfg), "gateway_redis_url": redis_server.url},
                         front=True).start()
    try:
        with Nginx([s.front_url.removeprefix("http://") for s in (stack, other)], ready_path="/health/ready") as lb:
            yield f"http://{lb.url}", (stack, other)
    finally:
        other.stop()


def test_stored_responses_and_conversations_are_every_replicas(replicas):
    """A response stored through one replica is continued, read and deleted through the other; responses in
    one conversation through both at once, with metadata updates, all keep their items (each gateway's
    append and the fronts' updates are compare-and-set writes in the shared Redis)."""
    from concurrent.futures import ThreadPoolExecutor

    lb_url, stacks = replicas
    lb = openai.OpenAI(base_url=f"{lb_url}/v1", api_key="k-replicas", max_retries=0, timeout=120)
    direct = [sdk(s, "k-replicas") for s in stacks]
    first = lb.responses.create(model="auto", input="Name a colour.", max_output_tokens=3)
    second = lb.responses.create(model="auto", input="And another?", max_output_tokens=3, previous_response_id=first.id)
    for client in direct:  # each replica reads what either stored
        assert client.responses.retrieve(first.id).output_text == first.output_text
        items = client.responses.input_items.list(second.id).data
        assert [i.content[0].text for i in items] == ["And another?"]
    direct[0].responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        direct[1].responses.retrieve(first.id)

    conv = lb.conversations.create(metadata={"n": "0"})

    def respond(i):
        return lb.responses.create(model="auto", conversation=conv.id, input=f"Say {i}.", max_output_tokens=2,
                                   store=False)

    with ThreadPoolExecutor(8) as pool:
        updates = [pool.submit(lb.conversations.update, conv.id, metadata={"n": str(i)}) for i in range(1, 7)]
        answers = list(pool.map(respond, range(8)))
        [u.result() for u in updates]
    for client in direct:
        items = client.conversations.items.list(conv.id, limit=100).data
        assert {i.content[0].text for i in items if i.role == "user"} == {f"Say {i}." for i in range(8)}
        assert len(items) == 8 + sum(len(a.output) for a in answers)
    for s in stacks:  # both replicas answered responses
        text = urllib.request.urlopen(f"http://127.0.0.1:{s.front_metrics_port}/metrics", timeout=10).read().decode()
        assert (metric_value(text, "llm_front_requests_total", route="/v1/responses", status="200") or 0) >= 3
