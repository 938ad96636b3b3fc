"""An upstream no one here wrote: llama.cpp's `llama-server` (built from the pinned sdist by `make bench-peer`)
serving the project's GGUF with its own API key, as an upstream provider of a real stack, driven by the
openai SDK through the front. Killed (SIGKILL), stalled (SIGSTOP), answering 500 (through the fault proxy):
the breaker opens and closes, fallbacks answer, nothing is double-billed, nothing hangs, a cancel stops its
generation. Skipped where llama-server is not built."""
import time

import openai
import pytest

from ledger.store import Store
from tests.support.fault_proxy import FaultProxy
from tests.support.llama_server import BINARY, LlamaServer
from tests.support.server import TritonServer, metric_value
from tests.support.wait import wait_until
from tests.support.tenants import Tenant, gateway_config, write_config

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not BINARY.is_file(), reason=f"llama-server not built at {BINARY}: make bench-peer")]

LLAMA_KEY = "sk-llama-upstream-5be0c7d1a2"
SIMPLE = [{"role": "user", "content": "What is the capital of France?"}]
CODE = [{"role": "user", "content": "```python\nprint(sum(range(10)))\n```\nWhat does this print?"}]


def provider(name: str, base_url: str, **kw) -> dict:
    return {"name": name, "base_url": base_url, "model": "smollm2", "api_key_env": "LLAMA_KEY",
            "first_byte_timeout_s": 20, "idle_timeout_s": 20, "max_retries": 1, "backoff_base_s": 0.05,
            "backoff_max_s": 0.2, "breaker": {"min_requests": 1000}, **kw}


def config(llama_url: str, proxy_url: str) -> dict:
    local = {"max_context_tokens": 2048, "capability": 1}
    models = {
        "tensorrt_llm": local,
        # `auto` sends code here; its circuit opens on 2 failed tries of 3 outcomes and stays open 4 s
        "llama": {"max_context_tokens": 4096, "capability": 3, "fallback": ["tensorrt_llm"],
                  "provider": provider("llama-cpp", llama_url, breaker={
                      "window_s": 60, "min_requests": 2, "error_rate": 0.5, "open_s": 4, "probe_interval_s": 0.5})},
        "llama_direct": {"max_context_tokens": 4096, "auto": False, "price_per_1k_input_tokens": 1.0,
                         "price_per_1k_output_tokens": 2.0, "fallback": ["tensorrt_llm"],
                         "provider": provider("llama-direct", llama_url)},
        "llama_stall": {"max_context_tokens": 4096, "auto": False, "fallback": ["tensorrt_llm"],
                        "provider": provider("llama-stall", llama_url, first_byte_timeout_s=2)},
        "llama_proxied": {"max_context_tokens": 4096, "auto": False, "fallback": ["tensorrt_llm"],
                          "provider": provider("llama-proxied", proxy_url)},
    }
    return gateway_config([Tenant("acme", price_in_per_1k=0.5, price_out_per_1k=1.5)], models=models,
                          auto_policy="classifier")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def llama():
    server = LlamaServer(LLAMA_KEY).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, data_dir, llama):
    proxy = FaultProxy(llama.port).start()
    cfg = tmp_path_factory.mktemp("llama") / "tenants.yaml"
    write_config(cfg, config(f"{llama.url}/v1", proxy.url))
    s = TritonServer(overrides={"gateway_config": str(cfg)}, front=True,
                     env={"LLM_DATA_DIR": str(data_dir), "LLAMA_KEY": LLAMA_KEY}).start()
    s.proxy = proxy
    yield s
    s.stop()
    proxy.stop()


def sdk(stack):
    return openai.OpenAI(base_url=f"{stack.front_url}/v1", api_key="k-acme", max_retries=0, timeout=120)


def new_rows(data_dir, since: float, n: int, timeout: float = 20.0) -> list[dict]:
    store = Store.open(data_dir / "ledger.sqlite3")
    deadline = time.monotonic() + timeout
    while True:
        got = store.usage_rows("acme", since, time.time() + 60)
        if len(got) >= n or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def test_llama_server_streams_through_the_front_with_its_own_usage_in_the_ledger(stack, llama, data_dir):
    t0 = time.time()
    chunks = list(sdk(stack).chat.completions.create(model="llama_direct", messages=SIMPLE, max_tokens=16,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert chunks[0].model == "llama_direct" and text
    # llama-server asked directly with the same body: the same greedy text and its own counts
    direct = openai.OpenAI(base_url=f"{llama.url}/v1", api_key=LLAMA_KEY, max_retries=0).chat.completions.create(
        model="smollm2", messages=SIMPLE, max_tokens=16, temperature=0)
    assert text == direct.choices[0].message.content
    assert (usage.prompt_tokens, usage.completion_tokens) == (direct.usage.prompt_tokens,
                                                              direct.usage.completion_tokens)
    (rec,) = new_rows(data_dir, t0, 1)
    assert (rec["model"], rec["provider"], rec["outcome"]) == ("llama_direct", "llama-direct", "success")
    assert (rec["prompt_tokens"], rec["completion_tokens"]) == (usage.prompt_tokens, usage.completion_tokens)
    assert rec["cost"] == pytest.approx(usage.prompt_tokens / 1000 * 1.0 + usage.completion_tokens / 1000 * 2.0)
    assert wait_until(lambda: metric_value(stack.metrics(), "gateway_reserved_tokens", tenant="acme") == 0, 5)


def test_its_500s_are_retried_then_the_fallback_answers_billed_once(stack, data_dir):
    stack.proxy.set("status", status=500)
    try:
        t0, before = time.time(), stack.proxy.requests["status"]
        chat = sdk(stack).chat.completions.create(model="llama_proxied", messages=SIMPLE, max_tokens=6)
        assert chat.model == "tensorrt_llm" and stack.proxy.requests["status"] - before == 2
        failed, answered = sorted(new_rows(data_dir, t0, 2), key=lambda r: r["outcome"])
        assert (failed["provider"], failed["cost"], failed["prompt_tokens"]) == ("llama-proxied", 0, 0)
        assert answered["completion_tokens"] == chat.usage.completion_tokens and answered["provider"] == "local"
    finally:
        stack.proxy.set("pass")


def test_a_stalled_llama_server_times_out_and_the_fallback_answers(stack, llama):
    llama.pause(True)
    try:
        chat = sdk(stack).chat.completions.create(model="llama_stall", messages=SIMPLE, max_tokens=4)
        assert chat.model == "tensorrt_llm"
    finally:
        llama.pause(False)


def test_a_cancel_stops_llama_servers_generation(stack, llama, data_dir):
    decoded = llama.metric("llamacpp:n_decode_total")
    t0 = time.time()
    stream = sdk(stack).chat.completions.create(
        model="llama_direct", max_tokens=1500, temperature=0, stream=True,
        messages=[{"role": "user", "content": "Count from 1 to 2000, one number per line."}])
    next(iter(stream))
    stream.close()
    (rec,) = new_rows(data_dir, t0, 1)
    assert rec["outcome"] == "cancelled" and rec["completion_tokens"] < 1500
    deadline = time.monotonic() + 30
    while llama.metric("llamacpp:requests_processing") > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert llama.metric("llamacpp:requests_processing") == 0
    assert llama.metric("llamacpp:n_decode_total") - decoded < 1500  # it stopped long before max_tokens


def test_a_killed_llama_server_opens_the_circuit_auto_falls_back_and_it_closes_after_a_restart(stack, llama):
    state = lambda: metric_value(stack.metrics(), "gateway_upstream_circuit_state", upstream="llama-cpp")  # noqa: E731
    client = sdk(stack)
    assert client.chat.completions.create(model="auto", messages=CODE, max_tokens=4).model == "llama"
    llama.kill()
    assert client.chat.completions.create(model="auto", messages=CODE, max_tokens=4).model == "tensorrt_llm"
    assert wait_until(lambda: state() == 2, 5)  # two refused tries and one success in the window: open
    opened = time.monotonic()
    llama.start()
    assert client.chat.completions.create(model="auto", messages=CODE, max_tokens=4).model == "tensorrt_llm" \
        or time.monotonic() - opened >= 4  # still open: not tried
    time.sleep(max(0.0, 4.5 - (time.monotonic() - opened)))
    assert client.chat.completions.create(model="auto", messages=CODE, max_tokens=4).model == "llama"
    assert wait_until(lambda: state() == 0, 5)


def test_the_llama_key_is_in_no_log(stack):
    assert LLAMA_KEY not in stack.log_path.read_text(errors="replace")
