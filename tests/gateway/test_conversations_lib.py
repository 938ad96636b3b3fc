"""Sessions, stored responses and the response cache in the gateway library (gateway/sessions.py,
response_cache.py), with a fake backend (no Triton) and, where state is shared, a real redis-server: a hit
does no engine work and still passes the tenant's limits and the ledger; a session keeps its turns, slides
past the window and belongs to one tenant; a stored response is the front's to write and its tenant's only."""
import asyncio
import json
import time

import numpy as np
import pytest

from contracts.generation import EngineStep
from gateway.admission import Admission
from gateway.core import Gateway, GatewayRequest
from gateway.edges import Preprocessed, Sampling
from gateway.kv_store import MemoryKV, RedisKV
from gateway.metrics import GatewayMetrics, MemoryRegistry
from gateway.ratelimit import MemoryLimiter
from gateway.response_cache import ResponseCache, cache_key
from gateway.sessions import Sessions, fit_window
from gateway.tenants import ConfigError, hash_key, parse_config
from contracts.generation import Outputs
from contracts.errors import ServingError
from contracts.tensors import stored_revision
from text.detokenize import Detokenizer
from contracts.usage_record import UsageRecord
from tests.support.clock import Clock

GREEDY = Sampling(temperature=0.0)


class CountingBackend:
    """Tokenizes by bytes (messages: their contents' bytes + 4 per message) and answers with the prompt's
    length in letters; counts every engine call, which a cache hit must not make."""

    def __init__(self):
        self.engine_calls = 0
        self.seen: list = []

    async def tokenize(self, req):
        if req.messages is not None:
            messages = json.loads(req.messages)
            n = sum(len(m["content"].encode()) + 4 for m in messages)
        else:
            n = len(req.text.encode())
        return Preprocessed.from_tensors({"INPUT_ID": np.zeros((1, n), np.int32), "REQUEST_INPUT_LEN": np.array([[n]])})

    async def engine_stream(self, model, req, prep, tenant):
        self.engine_calls += 1
        self.seen.append(req.messages)
        self.retention = req.kv_retention
        for i in range(req.max_tokens):
            await asyncio.sleep(0)
            yield EngineStep([ord("a") + (prep.n_input + i) % 26])

    async def engine_stop(self, model, req):
        pass


class Ledger:
    def __init__(self):
        self.lines = []

    def append(self, line):
        self.lines.append(UsageRecord.from_dict(json.loads(line)))


def config(cache=None, sessions=None, context=4096):
    tenant = lambda key, **kw: {"tier": "enterprise", "api_key_sha256": [hash_key(key)],  # noqa: E731
                                "price_per_1k_input_tokens": 1.0, "price_per_1k_output_tokens": 2.0,
                                "limits": {"max_context_tokens": context, "tokens_per_minute": 10_000}, **kw}
    extra = {**({"response_cache": cache} if cache is not None else {}),
             **({"sessions": sessions} if sessions is not None else {})}
    return parse_config({"routing": {"default_model": "m", "models": {"m": {"max_context_tokens": 8192}}},
                         "tenants": {"acme": tenant("k-acme", **extra), "globex": tenant("k-globex", **extra)}})


FRONT_KEY = "fk-conversations"


def gateway(cfg, store=None, backend=None):
    reg, ledger = MemoryRegistry(), Ledger()
    metrics = GatewayMetrics(reg)
    store = store or MemoryKV()
    gw = Gateway(lambda: cfg, MemoryLimiter(Clock()), Admission(4, 16, 1.0), metrics, backend or CountingBackend(),
                 Detokenizer([bytes([i]) for i in range(256)]), ledger=ledger, front_key_sha256=hash_key(FRONT_KEY),
                 response_cache=ResponseCache(store, metrics), sessions=Sessions(store))
    return gw, reg, ledger


async def answer(gw, req):
    chunks = [c async for c in gw.handle(req)]
    return "".join(c.text for c in chunks), chunks[-1]


def ask(key, text="Say something", sampling=GREEDY, **kw):
    return GatewayRequest(key, 6, text=text, sampling=sampling, model="m", **kw)


# -- the response cache ------------------------------------------------------------------------------
def test_config_validates_the_new_fields():
    assert config().authenticate("k-acme").response_cache is None  # opt-in
    assert config().authenticate("k-acme").sessions is not None  # on by default
    assert config(cache=True).authenticate("k-acme").response_cache.billing == "full"
    assert config(sessions=False).authenticate("k-acme").sessions is None
    for kw, where in [({"cache": {"billing": "half"}}, "response_cache.billing"),
                      ({"cache": {"ttl_s": 0}}, "response_cache.ttl_s"),
                      ({"cache": {"tll_s": 5}}, "response_cache: unknown"),
                      ({"sessions": {"context_policy": "summarize"}}, "sessions.context_policy"),
                      ({"sessions": {"max_messages": 1.5}}, "sessions.max_messages")]:
        with pytest.raises(ConfigError, match=where.replace(".", r"\.")):
            config(**kw)


def test_only_deterministic_requests_have_a_key_and_every_field_counts():
    base = ask("k")
    assert cache_key("acme", ask("k", sampling=Sampling())) is None  # temperature 1 (the engine's default)
    assert cache_key("acme", ask("k", sampling=Sampling(temperature=0.7))) is None
    assert cache_key("acme", ask("k", sampling=Sampling(temperature=0.7, seed=3))) is not None
    assert cache_key("acme", ask("k", sampling=Sampling(top_k=1))) is not None
    key = cache_key("acme", base)
    assert key == cache_key("acme", ask("k")) and len(key) == 64
    others = [cache_key("globex", base), cache_key("acme", ask("k", text="Say something else")),
              cache_key("acme", ask("k", sampling=Sampling(temperature=0.0, top_p=0.5))),
              cache_key("acme", GatewayRequest("k", 7, text="Say something", sampling=GREEDY, model="m")),
              cache_key("acme", ask("k", stop_words=["x"])), cache_key("acme", ask("k", adapter="a")),
              cache_key("acme", ask("k", sampling=Sampling(temperature=0.0, presence_penalty=0.5))),
              cache_key("acme", ask("k", outputs=Outputs(logit_bias={42: 5.0}))),
              cache_key("acme", ask("k", outputs=Outputs(logit_bias={42: 4.0}))),
              cache_key("acme", GatewayRequest("k", 6, prompt_ids=[1, 2, 3], sampling=GREEDY, model="m")),
              cache_key("acme", GatewayRequest("k", 6, prompt_ids=[1, 2, 4], sampling=GREEDY, model="m"))]
    assert len({key, *others}) == len(others) + 1
    # who asks and how the answer is delivered are not part of it
    assert cache_key("acme", ask("other-key", stream=True, user="u1", request_id="r1")) == key


def test_a_hit_does_no_engine_work_and_passes_limits_metrics_and_ledger():
    gw, reg, ledger = gateway(config(cache=True))
    first_text, first = asyncio.run(answer(gw, ask("k-acme")))
    second_text, second = asyncio.run(answer(gw, ask("k-acme")))
    assert gw.backend.engine_calls == 1
    assert second_text == first_text and (second.num_input_tokens, second.num_output_tokens, second.finish_reason) \
        == (first.num_input_tokens, first.num_output_tokens, first.finish_reason)
    assert [reg.value("gateway_response_cache_requests_total", tenant="acme", result=r)
            for r in ("miss", "stored", "hit")] == [1, 1, 1]
    assert reg.value("gateway_requests_total", tenant="acme", model="m", outcome="success") == 2
    a, b = ledger.lines
    assert (b.outcome, b.tenant, b.prompt_tokens, b.completion_tokens, b.cost) == \
        ("success", "acme", a.prompt_tokens, a.completion_tokens, a.cost) and a.cost > 0
    assert (a.served_from, b.served_from) == ("", "response_cache")
    # the limits count a hit's tokens, and nothing stays held
    level, _ = gw.limiter.buckets[("acme", "tpm")]  # (the limiter's clock stands still: no refill)
    assert level == 10_000 - 2 * (first.num_input_tokens + first.num_output_tokens)
    assert gw.limiter.inflight["acme"] == 0 and gw.limiter.reserved["acme"] == 0


def test_per_token_requests_are_never_cached_and_a_logit_bias_is_part_of_the_key():
    from contracts.generation import Outputs

    gw, reg, _ = gateway(config(cache=True))
    asyncio.run(answer(gw, ask("k-acme")))
    for outputs in (Outputs(num_return_sequences=2), Outputs(logit_bias={5: 1.0})):
        asyncio.run(answer(gw, ask("k-acme", outputs=outputs)))
    assert gw.backend.engine_calls == 3  # none of them is the first request's cached answer
    assert reg.value("gateway_response_cache_requests_total", tenant="acme", result="hit") == 0
    asyncio.run(answer(gw, ask("k-acme", outputs=Outputs(logit_bias={5: 1.0}))))
    assert gw.backend.engine_calls == 3  # the same bias: its own entry
    with pytest.raises(ServingError) as e:  # which of n choices would the session keep? refused
        asyncio.run(answer(gw, GatewayRequest("k-acme", 6, messages='[{"role": "user", "content": "hi"}]',
                                              model="m", session_id="s1", outputs=Outputs(num_return_sequences=2))))
    assert e.value.field == "session_id" and e.value.status == 400


def test_a_ledger_made_before_served_from_gets_the_column_and_keeps_hits_apart(tmp_path):
    from ledger.store import Store

    store = Store.open(tmp_path / "ledger.sqlite3").init()
    with store.tx() as cur:
        cur.execute("ALTER TABLE usage DROP COLUMN served_from")  # as a ledger made before the cache
    store.close()
    store = Store.open(tmp_path / "ledger.sqlite3").init()
    gw, _, ledger = gateway(config(cache=True))
    for _ in range(2):
        asyncio.run(answer(gw, ask("k-acme")))
    assert store.insert_usage(ledger.lines) == 2
    assert [store.usage_by_id(r.request_id)["served_from"] for r in ledger.lines] == ["", "response_cache"]


def test_billing_free_and_the_rate_limit_still_applies_to_hits():
    cfg = config(cache={"billing": "free"})
    gw, reg, ledger = gateway(cfg)
    asyncio.run(answer(gw, ask("k-acme")))
    asyncio.run(answer(gw, ask("k-acme")))
    assert ledger.lines[1].cost == 0 and ledger.lines[0].cost > 0
    gw.limiter.buckets[("acme", "tpm")] = (1.0, gw.limiter.clock())  # the tenant's tokens are spent
    with pytest.raises(ServingError) as e:
        asyncio.run(answer(gw, ask("k-acme")))
    assert e.value.kind == "rate_limited" and gw.backend.engine_calls == 1
    assert ledger.lines[-1].outcome == "error" and ledger.lines[-1].error_kind == "rate_limited"


def test_how_a_request_travels_is_not_part_of_the_key():
    """The caller's name for a request (stream_id, which the front gives every request) and its request id
    are delivery, not content: the same ask under new names is a hit."""
    gw, reg, _ = gateway(config(cache=True))
    asyncio.run(answer(gw, ask("k-acme", stream_id="first", request_id="r-1")))
    asyncio.run(answer(gw, ask("k-acme", stream_id="second", request_id="r-2", stream=True)))
    assert gw.backend.engine_calls == 1
    assert reg.value("gateway_response_cache_requests_total", tenant="acme", result="hit") == 1


def test_no_cache_for_sampled_requests_or_tenants_without_it():
    gw, reg, _ = gateway(config(cache=True))
    for _ in range(2):
        asyncio.run(answer(gw, ask("k-acme", sampling=Sampling(temperature=0.8))))
    assert gw.backend.engine_calls == 2
    gw, reg, _ = gateway(config())
    for _ in range(2):
        asyncio.run(answer(gw, ask("k-acme")))
    assert gw.backend.engine_calls == 2 and reg.value("gateway_response_cache_requests_total",
                                                      tenant="acme", result="miss") == 0


def test_redis_cache_is_shared_by_gateways_and_never_across_tenants(redis_server):
    cfg = config(cache={"ttl_s": 60})
    one, _, _ = gateway(cfg, RedisKV(redis_server.url))
    two, reg, _ = gateway(cfg, RedisKV(redis_server.url))
    text, _ = asyncio.run(answer(one, ask("k-acme")))
    assert asyncio.run(answer(two, ask("k-acme")))[0] == text and two.backend.engine_calls == 0
    asyncio.run(answer(two, ask("k-globex")))  # the same request of another tenant: its own entry
    assert two.backend.engine_calls == 1
    assert reg.value("gateway_response_cache_requests_total", tenant="globex", result="miss") == 1
    import redis
    ttls = [redis.Redis.from_url(redis_server.url).pttl(k) for k in
            redis.Redis.from_url(redis_server.url).keys("llm:rcache:*")]
    assert len(ttls) == 2 and all(0 < t <= 60_000 for t in ttls)


def test_an_unreachable_store_is_a_miss_not_a_failure():
    gw, reg, _ = gateway(config(cache=True), RedisKV("redis://127.0.0.1:1/0?timeout=0.2"))
    text, last = asyncio.run(answer(gw, ask("k-acme")))
    assert last.final and gw.backend.engine_calls == 1
    assert reg.value("gateway_response_cache_requests_total", tenant="acme", result="error") == 2  # get, put


# -- sessions ------------------------------------------------------------------------------------------
def chat(key, session, content, max_tokens=4, **kw):
    return GatewayRequest(key, max_tokens, messages=json.dumps([{"role": "user", "content": content}]),
                          model="m", session_id=session, sampling=GREEDY, **kw)


def test_fit_window_keeps_the_system_prompt_and_whole_recent_turns():
    async def count(ms):
        return sum(len(m["content"]) for m in ms)
    msgs = [{"role": "system", "content": "S" * 10}]
    for i in range(5):
        msgs += [{"role": "user", "content": f"u{i}" + "x" * 18}, {"role": "assistant", "content": f"a{i}" + "y" * 18}]
    msgs.append({"role": "user", "content": "now"})
    fitted = asyncio.run(fit_window(msgs, 1, 100, count))
    assert fitted[0]["role"] == "system" and fitted[-1]["content"] == "now"
    assert fitted[1]["role"] == "user" and sum(len(m["content"]) for m in fitted) <= 100
    assert [m["content"][:2] for m in fitted[1:-1]] == ["u3", "a3", "u4", "a4"]  # the newest that fit
    assert asyncio.run(fit_window(msgs, 1, 10_000, count)) == msgs


def test_a_session_keeps_its_turns_and_belongs_to_its_tenant(redis_server):
    gw, reg, _ = gateway(config(sessions={"ttl_s": 30}), RedisKV(redis_server.url))
    for content in ("one", "two", "three"):
        asyncio.run(answer(gw, chat("k-acme", "s1", content)))
    sent = json.loads(gw.backend.seen[-1])
    assert [m["content"] for m in sent if m["role"] == "user"] == ["one", "two", "three"]
    assert gw.backend.retention == (80, 30_000)  # the engine keeps a session's KV ahead of one-off prompts
    assert [m["role"] for m in sent] == ["user", "assistant"] * 2 + ["user"]
    stored = asyncio.run(gw.session_operation("session_get", GatewayRequest("k-acme", 1, session_id="s1")))
    assert len(stored["messages"]) == 6 and stored["messages"][-1]["role"] == "assistant"
    # another tenant with the same id: a session of its own, empty; it can neither read nor delete acme's
    asyncio.run(answer(gw, chat("k-globex", "s1", "hello")))
    assert json.loads(gw.backend.seen[-1]) == [{"role": "user", "content": "hello"}]
    with pytest.raises(ServingError) as e:
        asyncio.run(gw.session_operation("session_delete", GatewayRequest("k-globex", 1, session_id="nope")))
    assert e.value.kind == "not_found"
    asyncio.run(gw.session_operation("session_delete", GatewayRequest("k-globex", 1, session_id="s1")))
    assert len(asyncio.run(gw.session_operation("session_get", GatewayRequest("k-acme", 1, session_id="s1")))
               ["messages"]) == 6
    asyncio.run(gw.session_operation("session_delete", GatewayRequest("k-acme", 1, session_id="s1")))
    with pytest.raises(ServingError) as e:
        asyncio.run(gw.session_operation("session_get", GatewayRequest("k-acme", 1, session_id="s1")))
    assert e.value.kind == "not_found"


def test_concurrent_turns_of_a_session_are_all_kept(redis_server):
    """Two turns of one session at once, each answered from the history as it was when it began (here,
    none), on one gateway and on two replicas sharing a real Redis: both are stored, the later to end
    after the earlier (each written over the version it read, or after what was stored since)."""
    for stores in ([MemoryKV()], [RedisKV(redis_server.url), RedisKV(redis_server.url)]):
        replicas = [gateway(config(sessions={"ttl_s": 30}), store)[0] for store in stores]

        async def both():
            await asyncio.gather(*(answer(replicas[i % len(replicas)], chat("k-acme", "s-both", text))
                                   for i, text in enumerate(("first", "second"))))
        asyncio.run(both())
        stored = asyncio.run(replicas[0].session_operation(
            "session_get", GatewayRequest("k-acme", 1, session_id="s-both")))["messages"]
        assert [m["role"] for m in stored] == ["user", "assistant"] * 2
        assert sorted(m["content"] for m in stored if m["role"] == "user") == ["first", "second"]
        asyncio.run(answer(replicas[-1], chat("k-acme", "s-both", "third")))
        sent = json.loads(replicas[-1].backend.seen[-1])
        assert [m["content"] for m in sent if m["role"] == "user"][-1] == "third" and len(sent) == 5


def test_past_the_window_the_session_slides_and_keeps_answering():
    gw, reg, _ = gateway(config(context=120))
    system = GatewayRequest("k-acme", 4, model="m", session_id="long", sampling=GREEDY, messages=json.dumps(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q" * 30}]))
    asyncio.run(answer(gw, system))
    for i in range(6):
        _, last = asyncio.run(answer(gw, chat("k-acme", "long", f"{i}" + "w" * 30)))
        assert last.final and last.num_input_tokens + 4 <= 120
    sent = json.loads(gw.backend.seen[-1])
    assert sent[0] == {"role": "system", "content": "Be brief."} and sent[-1]["content"].startswith("5")
    assert reg.value("gateway_session_turns_total", tenant="acme", window="slid") >= 3


def test_session_errors_are_400s_naming_the_field():
    off, _, _ = gateway(config(sessions=False))
    on, _, _ = gateway(config())
    for gw, req, says in ((off, chat("k-acme", "s", "hi"), "not enabled"),
                          (on, GatewayRequest("k-acme", 4, text="a prompt", model="m", session_id="s"), "not a prompt"),
                          (on, chat("k-acme", "bad id!", "hi"), "letters, digits")):
        with pytest.raises(ServingError, match=says) as e:
            asyncio.run(answer(gw, req))
        assert (e.value.kind, e.value.field) == ("invalid_argument", "session_id")
        assert gw.backend.engine_calls == 0


def test_a_session_store_that_does_not_answer_is_a_503_and_holds_nothing():
    gw, reg, ledger = gateway(config(), RedisKV("redis://127.0.0.1:1/0?timeout=0.2"))
    with pytest.raises(ServingError) as e:
        asyncio.run(answer(gw, chat("k-acme", "s1", "hello")))
    assert (e.value.kind, e.value.status, e.value.retry_after) == ("unavailable", 503, 1.0)
    assert gw.backend.engine_calls == 0 and gw.limiter.inflight.get("acme", 0) == 0
    assert ledger.lines[-1].outcome == "error" and ledger.lines[-1].error_kind == "unavailable"


def test_a_prompt_the_front_tokenized_has_the_entry_of_the_same_prompt_tokenized_by_the_gateway():
    """`prepared` (the front's tokens of the prompt, front/prompt_prep.py) is the prompt in another form:
    a request tokenized by the front and the same request tokenized by the gateway share one entry."""
    from gateway.edges import Preprocessed
    from gateway.response_cache import cache_key

    prep = Preprocessed(np.array([[5, 6]], np.int32), np.array([[2]], np.int32))
    assert cache_key("acme", ask("k-acme")) == cache_key("acme", ask("k-acme", prepared=prep))


# -- stored responses (the Responses API's store / previous_response_id) -----------------------------
def stored(response_id="resp_abc", text="hi"):
    return {"response": {"id": response_id, "object": "response", "output": []},
            "input": [{"type": "message", "id": "msg_1", "role": "user", "content": [{"type": "input_text", "text": text}]}],
            "items": []}


def response_op(gw, operation, key="k-acme", response_id="resp_abc", front_key=None, doc=None):
    return asyncio.run(gw.stored_operation(operation, GatewayRequest(
        key, 1, stored_id=response_id, front_key=front_key, stored_object=doc)))


def test_a_stored_response_is_the_fronts_to_write_and_its_tenants_to_read(redis_server):
    for store in (MemoryKV(), RedisKV(redis_server.url)):
        gw, reg, _ = gateway(config(sessions={"ttl_s": 30}), store)
        with pytest.raises(ServingError) as e:  # a tenant's own key cannot write one
            response_op(gw, "response_put", doc=stored())
        assert e.value.kind == "permission_denied"
        assert response_op(gw, "response_put", front_key=FRONT_KEY, doc=stored()) == {"id": "resp_abc", "stored": True}
        assert response_op(gw, "response_get") == {k: v for k, v in stored().items()}
        for operation in ("response_get", "response_delete"):  # another tenant: not found, and nothing deleted
            with pytest.raises(ServingError) as e:
                response_op(gw, operation, key="k-globex")
            assert (e.value.kind, e.value.field) == ("not_found", "response_id")
        # the same id stored for another tenant is that tenant's own
        response_op(gw, "response_put", key="k-globex", front_key=FRONT_KEY, doc=stored(text="globex"))
        assert response_op(gw, "response_get")["input"][0]["content"][0]["text"] == "hi"
        assert response_op(gw, "response_delete") == {"id": "resp_abc", "deleted": True}
        with pytest.raises(ServingError) as e:
            response_op(gw, "response_get")
        assert e.value.kind == "not_found"
        assert response_op(gw, "response_get", key="k-globex")["input"][0]["content"][0]["text"] == "globex"
        # a session and a stored response with the same id are different things
        assert asyncio.run(gw.sessions.load("globex", "resp_abc")) is None


def test_what_cannot_be_stored_is_refused_naming_the_field():
    off, _, _ = gateway(config(sessions=False))
    small, reg, _ = gateway(config(sessions={"max_bytes": 300}))
    for gw, kw, field, says in (
            (off, {"doc": stored()}, "response", "keeps no conversations"),
            (small, {"doc": stored(text="x" * 400)}, "response", "over the tenant's 300"),
            (small, {"doc": {"response": {}}}, "response", "response, input, items"),
            (small, {"doc": stored(), "response_id": "resp_../x"}, "response_id", "a response id"),
            (small, {"doc": stored(), "response_id": None}, "response_id", "a response id")):
        with pytest.raises(ServingError, match=says) as e:
            response_op(gw, "response_put", front_key=FRONT_KEY, **kw)
        assert (e.value.kind, e.value.field) == ("invalid_argument", field)
    assert reg.value("gateway_rejections_total", tenant="acme", reason="invalid_argument") >= 2


def test_a_conversation_store_that_does_not_answer_is_a_503():
    gw, reg, _ = gateway(config(), RedisKV("redis://127.0.0.1:1/0?timeout=0.2"))
    for operation in ("response_get", "response_put", "response_delete"):
        with pytest.raises(ServingError) as e:
            response_op(gw, operation, front_key=FRONT_KEY, doc=stored())
        assert (e.value.kind, e.value.status, e.value.retry_after) == ("unavailable", 503, 1.0)
    assert reg.value("gateway_rejections_total", tenant="acme", reason="response_store_error") == 1


def test_whoami_says_whether_the_tenant_keeps_conversations():
    assert asyncio.run(gateway(config())[0].whoami("k-acme"))["stores_conversations"] is True
    assert asyncio.run(gateway(config(sessions=False))[0].whoami("k-acme"))["stores_conversations"] is False


# -- truncation "auto": the gateway slides a request's own conversation --------------------------------
def test_a_conversation_that_may_slide_drops_its_oldest_turns_to_fit():
    """slide_keep (the Responses API's truncation auto): whole turns go from the oldest, the system message
    and the last slide_keep messages stay; a conversation that fits is sent as it is."""
    gw, reg, _ = gateway(config(context=120))
    turns = [{"role": "system", "content": "Be brief."}]
    for i in range(5):
        turns += [{"role": "user", "content": f"u{i}" + "w" * 20}, {"role": "assistant", "content": f"a{i}" + "x" * 20}]
    turns += [{"role": "user", "content": "now"}]
    _, last = asyncio.run(answer(gw, GatewayRequest("k-acme", 4, model="m", sampling=GREEDY, slide_keep=1,
                                                    messages=json.dumps(turns))))
    sent = json.loads(gw.backend.seen[-1])
    assert sent[0] == turns[0] and sent[-1] == turns[-1] and sent[1]["role"] == "user" and len(sent) < len(turns)
    assert last.num_input_tokens + 4 <= 120
    short = turns[:1] + turns[-1:]
    asyncio.run(answer(gw, GatewayRequest("k-acme", 4, model="m", sampling=GREEDY, slide_keep=1,
                                          messages=json.dumps(short))))
    assert json.loads(gw.backend.seen[-1]) == short
    assert reg.value("gateway_truncations_total", tenant="acme", window="slid") == 1
    assert reg.value("gateway_truncations_total", tenant="acme", window="fit") == 1
    # without slide_keep the same conversation is over the window: a 400, as before
    with pytest.raises(ServingError) as e:
        asyncio.run(answer(gw, GatewayRequest("k-acme", 4, model="m", sampling=GREEDY, messages=json.dumps(turns))))
    assert e.value.kind == "context_too_long"
    # what must stay is over the window alone: the usual 400 too
    with pytest.raises(ServingError) as e:
        asyncio.run(answer(gw, GatewayRequest("k-acme", 4, model="m", sampling=GREEDY, slide_keep=len(turns) - 1,
                                              messages=json.dumps(turns))))
    assert e.value.kind == "context_too_long"


def test_slide_keep_errors_are_400s_naming_the_field():
    from gateway.request import parse_gateway_request

    gw, _, _ = gateway(config())
    for req, field in ((GatewayRequest("k-acme", 4, model="m", text="a prompt", slide_keep=1), "slide_keep"),
                       (GatewayRequest("k-acme", 4, model="m", slide_keep=1, session_id="s",
                                       messages=json.dumps([{"role": "user", "content": "hi"}])), "slide_keep")):
        with pytest.raises(ServingError) as e:
            asyncio.run(answer(gw, req))
        assert (e.value.kind, e.value.field) == ("invalid_argument", field)
    for bad in ("0", "-1", "x", 1.5, True):
        with pytest.raises(ServingError) as e:
            parse_gateway_request({}, {"slide_keep": bad})
        assert e.value.field == "slide_keep"
    assert parse_gateway_request({}, {"slide_keep": "3"})[0].slide_keep == 3


def test_a_store_replaces_only_the_value_read(redis_server):
    """kv_store's compare and set, in the process and in a real Redis: written over what was read, never over
    what another writer put there since, nor where the key has expired or was deleted; with nothing read,
    only where there is still nothing."""
    clock = Clock()
    for store in (MemoryKV(clock=clock), RedisKV(redis_server.url)):
        async def run():
            await store.set("k", b"one", 60)
            assert await store.replace("k", b"one", b"two", 60) and await store.get("k") == b"two"
            assert not await store.replace("k", b"one", b"three", 60) and await store.get("k") == b"two"
            await store.delete("k")
            assert not await store.replace("k", b"two", b"four", 60) and await store.get("k") is None
            # expected None: only where the key holds nothing
            assert await store.replace("n", None, b"x", 60) and await store.get("n") == b"x"
            assert not await store.replace("n", None, b"y", 60) and await store.get("n") == b"x"
            await store.delete("n")
            await store.set("k", b"short", 0.05)
        asyncio.run(run())
        if isinstance(store, MemoryKV):
            clock.t += 1
        else:
            time.sleep(0.2)
        assert not asyncio.run(store.replace("k", b"short", b"late", 60)) and asyncio.run(store.get("k")) is None


def test_appends_to_a_conversation_keep_every_writers_items(redis_server):
    """conversation_append: items added in the gateway, each written only over what it read (compare and
    set), so concurrent responses in one conversation all keep theirs: in one gateway, and in two gateway
    replicas sharing a real Redis, where each read and write is a round trip another replica's append can
    come between; front key only; an unknown conversation is a 404."""
    conv = {"conversation": {"id": "conv_a", "object": "conversation", "created_at": 0, "metadata": {}}, "items": []}
    for stores in ([MemoryKV()], [RedisKV(redis_server.url)], [RedisKV(redis_server.url), RedisKV(redis_server.url)]):
        replicas = [gateway(config(), store)[0] for store in stores]

        def op(operation, doc=None, key="k-acme", front_key=FRONT_KEY, object_id="conv_a", gw=replicas[0]):
            return gw.stored_operation(operation, GatewayRequest(key, 1, stored_id=object_id, front_key=front_key,
                                                                 stored_object=doc))

        asyncio.run(op("conversation_put", conv))

        async def many():
            await asyncio.gather(*(op("conversation_append", {"items": [{"id": f"msg_{i}"}]},
                                      gw=replicas[i % len(replicas)]) for i in range(12)))
        asyncio.run(many())
        items = asyncio.run(op("conversation_get"))["items"]
        assert sorted(i["id"] for i in items) == sorted(f"msg_{i}" for i in range(12))
        for kw, kind in (({"front_key": None}, "permission_denied"), ({"object_id": "conv_b"}, "not_found"),
                         ({"key": "k-globex"}, "not_found"), ({"doc": {"things": []}}, "invalid_argument")):
            with pytest.raises(ServingError) as e:
                asyncio.run(op("conversation_append", **{"doc": {"items": [{"id": "x"}]}, **kw}))
            assert e.value.kind == kind
        with pytest.raises(ServingError) as e:  # a response is not appended to
            asyncio.run(replicas[0].operation("response_append", GatewayRequest("k-acme", 1)))
        assert e.value.field == "operation"


def test_a_put_with_a_revision_writes_only_over_that_version(redis_server):
    """conversation_put with stored_revision (the SHA-256 of the version the front read, as
    contracts/tensors.py stored_revision computes it): written only over that version, "stored": false when
    an append came between (the appended items kept), a 404 when there is none, a 400 for a revision that
    is not one."""
    from gateway.request import parse_gateway_request

    conv = {"conversation": {"id": "conv_r", "object": "conversation", "created_at": 0, "metadata": {}},
            "items": [{"id": "msg_0"}]}
    for store in (MemoryKV(), RedisKV(redis_server.url)):
        gw, _, _ = gateway(config(), store)

        def op(operation, doc=None, revision=None, object_id="conv_r"):
            params = {"stored_revision": revision} if revision is not None else {}
            req, _ = parse_gateway_request({"operation": np.array([operation.encode()], dtype=object)},
                                           {"authorization": "Bearer k-acme", "conversation_id": object_id,
                                            "front_key": FRONT_KEY, **params,
                                            **({"stored_object": json.dumps(doc)} if doc is not None else {})})
            return asyncio.run(gw.stored_operation(operation, req))

        op("conversation_put", conv)
        read = op("conversation_get")
        renamed = {**read, "conversation": {**read["conversation"], "metadata": {"topic": "a"}}}
        assert op("conversation_put", renamed, stored_revision(read)) == {"id": "conv_r", "stored": True}
        assert op("conversation_get") == renamed
        # an append between the front's read and its write: the write is refused, the items stay
        op("conversation_append", {"items": [{"id": "msg_1"}]})
        again = {**renamed, "conversation": {**renamed["conversation"], "metadata": {"topic": "b"}}}
        assert op("conversation_put", again, stored_revision(renamed)) == {"id": "conv_r", "stored": False}
        now = op("conversation_get")
        assert [i["id"] for i in now["items"]] == ["msg_0", "msg_1"] and now["conversation"]["metadata"] == {"topic": "a"}
        assert op("conversation_put", {**now, "items": now["items"][:1]}, stored_revision(now))["stored"] is True
        with pytest.raises(ServingError) as e:
            op("conversation_put", conv, stored_revision(conv), object_id="conv_none")
        assert (e.value.kind, e.value.field) == ("not_found", "conversation_id")
        for bad in ("abc", "A" * 64, stored_revision(conv) + "0"):
            with pytest.raises(ServingError) as e:
                op("conversation_put", conv, bad)
            assert e.value.field == "stored_revision"


def test_a_prompt_cache_key_keeps_the_prompts_kv_as_a_sessions_turn():
    """OpenAI's prompt_cache_key: the engine's KV retention of a session's turns (priority, the session TTL),
    for tenants without sessions too; not part of the response cache's key (the answer is the same)."""
    for sessions, retention in (({"ttl_s": 30}, (80, 30_000)), (False, (80, 3_600_000))):
        gw, _, _ = gateway(config(sessions=sessions))
        asyncio.run(answer(gw, ask("k-acme", prompt_cache_key="agent-session-1")))
        assert gw.backend.retention == retention
        asyncio.run(answer(gw, ask("k-acme")))
        assert gw.backend.retention is None
    assert cache_key("acme", ask("k-acme")) == cache_key("acme", ask("k-acme", prompt_cache_key="x"))
