"""Adapter requests streamed by the front, on an engine with TensorRT-LLM's LoRA cache (issue 28): the
SIMULATED GPU engine (a test double: no GPU here) with `sim_lora_cache` keeps TensorRT-LLM's rule, a task id
whose weights it does not hold is refused "not found in cache", and only the gateway's stream sends the
weights. The front streams an adapter's request itself while the engine holds the adapter and hands the
lease back to the gateway otherwise: at once on its first use, after the engine's refusal once evicted.
Every request is answered, counted once, and leaves nothing held."""
import threading
import time
import urllib.request

import numpy as np
import openai
import pytest

from tests.support.server import TritonServer, metric_value
from tests.support.tenants import Tenant, write_tenants
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration
ENGINE = "tensorrt_llm"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    loras = tmp_path_factory.mktemp("loras")
    for name in ("tuned-a", "tuned-b"):  # what build/trtllm.py lora-convert leaves beside the PEFT files
        (loras / name).mkdir()
        (loras / name / "adapter_config.json").write_text("{}")
        np.save(loras / name / "model.lora_weights.npy", np.zeros((1, 2, 6), np.float16))
        np.save(loras / name / "model.lora_config.npy", np.zeros((1, 2, 3), np.int32))
    cfg = write_tenants(tmp_path_factory.mktemp("tenants") / "tenants.yaml",
                        [Tenant("acme", allowed_adapters=("*",))], models={ENGINE: 8192})
    with TritonServer(overrides={"gateway_config": str(cfg), "simulated_engine": "true", "sim_lora_cache": "1",
                                 "lora_dir": str(loras), "sim_ttft_ms": "5", "sim_itl_ms": "2"},
                      front=True) as s:
        yield s


def front_metric(stack, name) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.front_metrics_port}/metrics", timeout=5) as r:
        return metric_value(r.read().decode(), name) or 0.0


def gateway_metric(stack, name, **labels) -> float:
    return metric_value(stack.metrics(), name, **labels) or 0.0


def ask(stack, model, stream):
    sdk = openai.OpenAI(base_url=f"{stack.front_url}/v1", api_key="k-acme", max_retries=0, timeout=60)
    kw = dict(model=model, messages=[{"role": "user", "content": "Say something."}], max_tokens=6)
    if not stream:
        out = sdk.chat.completions.create(**kw)
        return out.choices[0].message.content, out.usage.completion_tokens
    chunks = list(sdk.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage.completion_tokens


def test_an_adapter_streams_through_the_front_while_the_engine_holds_it_and_through_the_gateway_until_then(stack):
    hand_backs = lambda: front_metric(stack, "llm_front_lease_hand_backs_total")  # noqa: E731
    base = ask(stack, ENGINE, stream=False)

    def engine_requests():  # what the engine model got (Triton counts an error a decoupled model sends as a success)
        return gateway_metric(stack, "nv_inference_request_success_total", model=ENGINE, version="1")

    def tokenized_by_preprocessing():
        return gateway_metric(stack, "nv_inference_request_success_total", model="preprocessing", version="1")

    assert wait_until(lambda: engine_requests() > 0, 5)  # Triton counts a request once it is released
    before, preprocessed = engine_requests(), tokenized_by_preprocessing()
    steps = [("tuned-a", False, 1),  # first use: the gateway never sent its weights, the grant says hand back
             ("tuned-a", True, 1),  # the engine holds it: the front streams it with the task id alone
             ("tuned-a", False, 1),
             ("tuned-b", True, 2),  # first use of b, which evicts a from the engine's cache of one
             ("tuned-a", True, 3),  # the gateway's note says sent: the engine refuses, the front hands it back
             ("tuned-a", False, 3)]
    for model, stream, expected in steps:
        assert ask(stack, model, stream) == base, (model, stream)  # the simulated engine ignores the weights
        assert hand_backs() == expected, (model, stream)
    # one engine request each and one refusal: a first use goes straight to the gateway, which sends the weights
    assert wait_until(lambda: engine_requests() == before + len(steps) + 1, 5)
    time.sleep(0.5)
    assert engine_requests() == before + len(steps) + 1
    # the key has a lease by now: the front tokenized every adapter's prompt, handed back or not
    assert tokenized_by_preprocessing() == preprocessed
    # one request each, counted once, whichever way it went
    assert wait_until(lambda: gateway_metric(stack, "gateway_adapter_requests_total", tenant="acme", model=ENGINE,
                                             adapter="tuned-a", outcome="success") == 5, 5)
    assert gateway_metric(stack, "gateway_adapter_requests_total", tenant="acme", model=ENGINE, adapter="tuned-b",
                          outcome="success") == 1
    assert gateway_metric(stack, "gateway_requests_total", tenant="acme", model=ENGINE, outcome="error") == 0
    # the weights went three times: each adapter's first use, and a's again once the engine had evicted it
    sent = {(adapter, reason): gateway_metric(stack, "gateway_lora_weights_sent_total", model=ENGINE, adapter=adapter,
                                              reason=reason)
            for adapter in ("tuned-a", "tuned-b") for reason in ("first_use", "evicted")}
    assert sent == {("tuned-a", "first_use"): 1, ("tuned-a", "evicted"): 1, ("tuned-b", "first_use"): 1,
                    ("tuned-b", "evicted"): 0}
    assert wait_until(lambda: gateway_metric(stack, "gateway_reserved_tokens", tenant="acme") == 0, 5)
    assert wait_until(lambda: gateway_metric(stack, "gateway_inflight_requests", model=ENGINE) == 0, 5)


def test_an_adapter_the_full_lora_cache_cannot_take_is_a_503_to_retry_and_holds_nothing(stack):
    """TensorRT-LLM keeps the adapters of requests in flight: with its LoRA cache full of them, another
    adapter's weights are refused ("Cache is full"). That is the server full for now: a 503 with Retry-After
    (the openai SDK retries it), not a 500, and once the request in flight ends the adapter is taken."""
    sdk = openai.OpenAI(base_url=f"{stack.front_url}/v1", api_key="k-acme", max_retries=0, timeout=60)
    first_chunk, long_done = threading.Event(), []

    def long_stream():  # tuned-a in flight for ~0.8 s (2 ms a token)
        chunks = sdk.chat.completions.create(model="tuned-a", messages=[{"role": "user", "content": "Hi."}],
                                             max_tokens=400, stream=True)
        for c in chunks:
            first_chunk.set()
        long_done.append(True)

    t = threading.Thread(target=long_stream)
    t.start()
    assert first_chunk.wait(10)
    with pytest.raises(openai.APIStatusError) as e:
        sdk.chat.completions.create(model="tuned-b", messages=[{"role": "user", "content": "Hi."}], max_tokens=4)
    t.join(30)
    assert long_done
    assert e.value.status_code == 503 and e.value.response.headers.get("retry-after")
    assert e.value.body["code"] == "overloaded" and "Cache is full" in e.value.body["message"]
    assert ask(stack, "tuned-b", stream=False)[1] > 0  # tuned-a's request ended: its adapter can go now
    assert wait_until(lambda: gateway_metric(stack, "gateway_reserved_tokens", tenant="acme") == 0, 5)
    assert wait_until(lambda: gateway_metric(stack, "gateway_inflight_requests", model=ENGINE) == 0, 5)
