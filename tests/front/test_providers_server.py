"""Upstream OpenAI-compatible providers through the front, on a real stack, against a real upstream: the
same stack's own front, called with another tenant's key (the provider's account), behind a fault proxy
(tests/support/fault_proxy.py: a test double of a failing network, not of the API). The openai SDK is
the client. Streams and usage in the ledger with the provider and the model's prices; retries only before
the first token; fallbacks; the circuit opening on a killed upstream and closing after it recovers;
Retry-After honoured; a stall that never hangs a request; cancellation reaching the upstream; the key
never in an answer or a log."""
import time

import openai
import pytest

from ledger.store import Store
from tests.support.fault_proxy import FaultProxy
from tests.support.server import TritonServer, metric_value
from tests.support.wait import wait_until
from tests.support.tenants import Tenant, gateway_config, write_config

pytestmark = pytest.mark.integration

UPSTREAM_KEY = "sk-upstream-account-7f3a9c21d4"  # the provider account's key: must never show anywhere
PRICE_IN, PRICE_OUT = 2.0, 4.0
CODE = [{"role": "user", "content": "```python\nprint(sum(range(10)))\n```\nWhat does this print?"}]
SIMPLE = [{"role": "user", "content": "What is the capital of France?"}]


def config(proxy_url: str, open_s: float = 6.0) -> dict:
    provider = {"name": "loopback-cloud", "base_url": proxy_url, "model": "tensorrt_llm",
                "api_key_env": "TEST_UPSTREAM_KEY", "first_byte_timeout_s": 3, "idle_timeout_s": 10,
                "max_retries": 2, "backoff_base_s": 0.05, "backoff_max_s": 0.2, "max_retry_after_s": 5,
                "breaker": {"window_s": 60, "min_requests": 3, "error_rate": 0.5, "open_s": open_s,
                            "probe_interval_s": 0.5}}
    models = {
        "tensorrt_llm": {"max_context_tokens": 2048, "capability": 1},
        "cloud": {"max_context_tokens": 2048, "capability": 3, "price_per_1k_input_tokens": PRICE_IN,
                  "price_per_1k_output_tokens": PRICE_OUT, "fallback": ["tensorrt_llm"],
                  "provider": provider},
        # the same upstream under another name, whose circuit never opens: the retry and fault tests
        "flaky": {"max_context_tokens": 2048, "auto": False, "fallback": ["tensorrt_llm"],
                  "provider": {**provider, "name": "flaky-cloud", "breaker": {"min_requests": 1000}}},
        "badkey": {"max_context_tokens": 2048, "auto": False,
                   "provider": {**provider, "name": "badkey-cloud", "api_key_env": "TEST_WRONG_KEY",
                                "breaker": {"min_requests": 100}}},
    }
    return gateway_config([
        Tenant("acme", price_in_per_1k=0.5, price_out_per_1k=1.5),
        # the provider's account on the upstream: it may use the engine model only (no loop back)
        Tenant("upstream-acct", key=UPSTREAM_KEY, allowed_models=("tensorrt_llm",)),
    ], models=models, auto_policy="classifier")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, data_dir):
    cfg = tmp_path_factory.mktemp("providers") / "tenants.yaml"
    s = TritonServer(overrides={"gateway_config": str(cfg)}, front=True,
                     env={"LLM_DATA_DIR": str(data_dir), "TEST_UPSTREAM_KEY": UPSTREAM_KEY,
                          "TEST_WRONG_KEY": "sk-wrong-key-0000"})
    proxy = FaultProxy(s.front_port).start()  # the stack's ports are chosen: the proxy points at its front
    write_config(cfg, config(proxy.url))
    s.proxy = proxy
    s.start()
    yield s
    s.stop()
    proxy.stop()


@pytest.fixture
def proxy(stack):
    stack.proxy.set("pass")
    yield stack.proxy
    stack.proxy.set("pass")


def sdk(stack, key="k-acme"):
    return openai.OpenAI(base_url=f"{stack.front_url}/v1", api_key=key, max_retries=0, timeout=120)


def rows(stack, data_dir, tenant, n, timeout=20.0):
    store = Store.open(data_dir / "ledger.sqlite3")
    deadline = time.monotonic() + timeout
    while True:
        got = store.usage_rows(tenant, 0, time.time() + 60)
        if len(got) >= n or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def new_rows(data_dir, tenant, since: float, n: int, timeout: float = 20.0) -> list[dict]:
    """The records of `tenant` of requests that arrived after `since` (unix time), once there are `n`."""
    store = Store.open(data_dir / "ledger.sqlite3")
    deadline = time.monotonic() + timeout
    while True:
        got = store.usage_rows(tenant, since, time.time() + 60)
        if len(got) >= n or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def front_metric(stack, name, **labels):
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{stack.front_metrics_port}/metrics", timeout=5) as r:
        return metric_value(r.read().decode(), name, **labels) or 0


def test_an_upstream_model_streams_through_the_front_with_its_usage_and_cost_in_the_ledger(stack, proxy, data_dir):
    client = sdk(stack)
    assert {(m.id, m.owned_by) for m in client.models.list()} >= {("cloud", "loopback-cloud"),
                                                                  ("tensorrt_llm", "local")}
    raw = client.chat.completions.with_raw_response.create(
        model="cloud", messages=SIMPLE, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True})
    assert raw.headers["x-model-used"] == "cloud"
    chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    # the upstream itself, asked directly with the provider's key: the same greedy answer and counts
    direct = sdk(stack, UPSTREAM_KEY).chat.completions.create(model="tensorrt_llm", messages=SIMPLE, max_tokens=12,
                                                              temperature=0)
    assert text == direct.choices[0].message.content and "Paris" in text
    assert (usage.prompt_tokens, usage.completion_tokens) == (direct.usage.prompt_tokens,
                                                              direct.usage.completion_tokens)
    (rec,) = [r for r in rows(stack, data_dir, "acme", 1) if r["model"] == "cloud"]
    assert rec["provider"] == "loopback-cloud" and rec["outcome"] == "success"
    assert (rec["prompt_tokens"], rec["completion_tokens"]) == (usage.prompt_tokens, usage.completion_tokens)
    assert rec["cost"] == pytest.approx(usage.prompt_tokens / 1000 * PRICE_IN + usage.completion_tokens / 1000 * PRICE_OUT)
    assert rec["ttft_ms"] and rec["ttft_ms"] <= rec["latency_ms"]
    upstream_side = rows(stack, data_dir, "upstream-acct", 2)  # the upstream's own records of both calls
    assert all(r["provider"] == "local" and r["model"] == "tensorrt_llm" for r in upstream_side)
    # the tenant's reservation was settled from the upstream's usage: nothing stays held
    assert wait_until(lambda: metric_value(stack.metrics(), "gateway_reserved_tokens", tenant="acme") == 0, 5)
    done = client.completions.create(model="cloud", prompt="The capital of France is", max_tokens=6, temperature=0)
    assert done.model == "cloud" and " Paris" in done.choices[0].text and done.usage.completion_tokens == 6


def test_fields_an_upstream_cannot_honour_are_refused_naming_them(stack, proxy):
    with pytest.raises(openai.BadRequestError) as e:
        sdk(stack).chat.completions.create(model="cloud", messages=SIMPLE, max_tokens=4, extra_body={"top_k": 5})
    assert e.value.body["param"] == "top_k"


def test_5xx_is_retried_before_the_first_token_then_the_fallback_answers_uncharged_for_the_failure(
        stack, proxy, data_dir):
    proxy.set("status", status=500)
    before, t0 = proxy.requests["status"], time.time()
    tries = front_metric(stack, "llm_front_upstream_tries_total", upstream="flaky-cloud", result="status_500")
    raw = sdk(stack).chat.completions.with_raw_response.create(model="flaky", messages=SIMPLE, max_tokens=8,
                                                               temperature=0)
    chat = raw.parse()
    assert raw.headers["x-model-used"] == "tensorrt_llm" == chat.model and "Paris" in chat.choices[0].message.content
    assert proxy.requests["status"] - before == 3  # the first try and max_retries = 2 more
    assert front_metric(stack, "llm_front_upstream_tries_total", upstream="flaky-cloud",
                        result="status_500") - tries == 3
    failed, answered = sorted(new_rows(data_dir, "acme", t0, 2), key=lambda r: r["outcome"])
    assert (failed["outcome"], failed["error_kind"], failed["model"], failed["provider"]) == (
        "error", "upstream_unavailable", "flaky", "flaky-cloud")
    assert failed["cost"] == 0 and failed["prompt_tokens"] == failed["completion_tokens"] == 0  # not billed
    assert (answered["outcome"], answered["model"], answered["provider"]) == ("success", "tensorrt_llm", "local")
    assert (answered["prompt_tokens"], answered["completion_tokens"]) == (chat.usage.prompt_tokens,
                                                                          chat.usage.completion_tokens)


def test_a_long_retry_after_is_honoured_by_not_hammering_the_upstream(stack, proxy):
    proxy.set("status", status=429, retry_after=60)  # over max_retry_after_s: give this upstream up for now
    before = proxy.requests["status"]
    chat = sdk(stack).chat.completions.create(model="flaky", messages=SIMPLE, max_tokens=4)
    assert chat.model == "tensorrt_llm" and proxy.requests["status"] - before == 1


def test_a_failure_after_the_first_token_is_not_retried(stack, proxy, data_dir):
    proxy.set("cut", cut_after=2)  # the upstream's connection dies after its first events
    before, t0 = proxy.requests["cut"], time.time()
    stream = sdk(stack).chat.completions.create(model="flaky", messages=SIMPLE, max_tokens=40, temperature=0,
                                                stream=True)
    with pytest.raises(openai.APIError):
        for _ in stream:
            pass
    assert proxy.requests["cut"] - before == 1  # one try: text had reached the client
    (rec,) = new_rows(data_dir, "acme", t0, 1)
    assert rec["model"] == "flaky" and rec["outcome"] == "error" and rec["completion_tokens"] > 0  # charged for what was received


def test_a_stalled_upstream_times_out_and_the_fallback_answers(stack, proxy):
    proxy.set("stall")
    chat = sdk(stack).chat.completions.create(model="flaky", messages=SIMPLE, max_tokens=4)
    assert chat.model == "tensorrt_llm"


def test_a_bad_upstream_key_is_a_503_that_never_shows_a_key(stack, proxy):
    with pytest.raises(openai.InternalServerError) as e:
        sdk(stack).chat.completions.create(model="badkey", messages=SIMPLE, max_tokens=4)
    assert e.value.status_code == 503 and "credentials" in e.value.message
    assert "sk-wrong-key-0000" not in str(e.value.body) and UPSTREAM_KEY not in str(e.value.body)


def test_cancelling_reaches_the_upstream(stack, proxy, data_dir):
    t0 = time.time()
    stream = sdk(stack).chat.completions.create(
        model="cloud", max_tokens=400, temperature=0, stream=True,
        messages=[{"role": "user", "content": "Write a very long story about a dragon and a knight."}])
    next(iter(stream))
    stream.close()
    (up,) = new_rows(data_dir, "upstream-acct", t0, 1)  # the upstream's own record of the call
    assert up["outcome"] == "cancelled" and 0 < up["completion_tokens"] < 400
    (ours,) = new_rows(data_dir, "acme", t0, 1)
    assert ours["model"] == "cloud" and ours["outcome"] == "cancelled" and ours["completion_tokens"] < 400


def test_a_killed_upstream_opens_the_circuit_auto_falls_back_and_it_closes_after_recovery(stack, proxy):
    state = lambda: metric_value(stack.metrics(), "gateway_upstream_circuit_state", upstream="loopback-cloud")  # noqa: E731
    client = sdk(stack)
    assert client.chat.completions.create(model="auto", messages=SIMPLE, max_tokens=4).model == "tensorrt_llm"
    assert client.chat.completions.create(model="auto", messages=CODE, max_tokens=4).model == "cloud"
    proxy.set("down")
    first = client.chat.completions.create(model="auto", messages=CODE, max_tokens=4)
    assert first.model == "tensorrt_llm"  # every try refused: the fallback answered
    assert wait_until(lambda: state() == 2, 5)  # open: three refused tries of three in the window
    opened_at = time.monotonic()
    proxy.set("pass")  # the upstream is back, but the circuit stays open for open_s
    before = proxy.requests["pass"]
    assert client.chat.completions.create(model="auto", messages=CODE, max_tokens=4).model == "tensorrt_llm"
    assert proxy.requests["pass"] == before or time.monotonic() - opened_at >= 6  # not even tried while open
    time.sleep(max(0.0, 6.5 - (time.monotonic() - opened_at)))
    probe = client.chat.completions.create(model="auto", messages=CODE, max_tokens=4)
    assert probe.model == "cloud" and wait_until(lambda: state() == 0, 5)  # the half-open probe succeeded: closed
    transitions = lambda: [metric_value(stack.metrics(), "gateway_upstream_circuit_transitions_total",  # noqa: E731
                                        upstream="loopback-cloud", to=to) or 0 for to in ("open", "half_open", "closed")]
    assert wait_until(lambda: min(transitions()) >= 1, 5), transitions()


def test_the_upstream_key_is_in_no_log(stack):
    log = stack.log_path.read_text(errors="replace")
    assert log and UPSTREAM_KEY not in log and "sk-wrong-key-0000" not in log
