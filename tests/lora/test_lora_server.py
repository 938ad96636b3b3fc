"""LoRA adapters through a real stack (issue 20): tritonserver + gateway + CPU engine + the OpenAI-compatible
front, with the demo adapters the renderer writes. The adapter changes the answer, an unknown adapter is
refused (404), a tenant not allowed the adapter gets 403, /v1/models lists what each tenant may use, the
engine's own contract takes `lora_task_id`, and the metrics name the adapter."""

import openai
import pytest

from cpu_engine.lora import task_id
from tests.support.engine_stream import engine_call
from tests.support.server import TritonServer, metric_value
from tests.support.tenants import Tenant, write_tenants

pytestmark = pytest.mark.integration

TENANTS = [
    Tenant("acme", allowed_adapters=("demo-support",)),
    Tenant("wild", allowed_adapters=("*",)),
    Tenant("globex", tier="standard"),
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    cfg = tmp_path_factory.mktemp("lora") / "tenants.yaml"
    write_tenants(cfg, TENANTS, models={"tensorrt_llm": 2048})
    # float32: greedy answers then do not depend on how a prompt was chunked or reused (int8 rounds each
    # chunk's activations, docs/engine.md), so asking twice may be compared token for token
    s = TritonServer(overrides={"gateway_config": str(cfg), "weight_dtype": "float32"}, front=True).start()
    yield s
    s.stop()


def sdk(stack, key):
    return openai.OpenAI(base_url=f"{stack.front_url}/v1", api_key=key, max_retries=0, timeout=120)


def answer(stack, key, model):
    out = sdk(stack, key).chat.completions.create(model=model, messages=CHAT, max_tokens=12, temperature=0)
    return out.choices[0].message.content


def test_the_demo_tenants_adapter_changes_the_answer(stack):
    base = answer(stack, "k-acme", "auto")
    tuned = answer(stack, "k-acme", "demo-support")
    assert "Paris" in base
    assert tuned != base
    assert answer(stack, "k-acme", "demo-support") == tuned  # greedy: the adapter, applied the same way again
    assert answer(stack, "k-wild", "demo-legal") not in (base, tuned)


def test_an_unknown_adapter_is_refused_with_404_naming_it(stack):
    with pytest.raises(openai.NotFoundError) as e:
        answer(stack, "k-wild", "demo-nope")
    assert "demo-nope" in str(e.value)


def test_an_adapter_the_tenant_may_not_use_answers_as_one_that_does_not_exist(stack):
    """No existence oracle: another tenant's adapter gets the very 404 of a name never configured."""
    with pytest.raises(openai.NotFoundError) as denied:
        answer(stack, "k-globex", "demo-support")
    with pytest.raises(openai.NotFoundError) as unknown:
        answer(stack, "k-globex", "demo-nonexistent")
    assert "demo-support" in str(denied.value)
    assert str(denied.value).replace("demo-support", "NAME") == str(unknown.value).replace("demo-nonexistent", "NAME")
    with pytest.raises(openai.NotFoundError):
        answer(stack, "k-acme", "demo-legal")  # acme has demo-support only


def test_models_lists_the_adapters_each_tenant_may_use(stack):
    acme = {m.id: getattr(m, "parent", None) for m in sdk(stack, "k-acme").models.list()}
    assert acme.get("demo-support") == "tensorrt_llm" and "demo-legal" not in acme
    wild = {m.id for m in sdk(stack, "k-wild").models.list()}
    assert {"demo-support", "demo-legal", "demo-medical", "demo-finance"} <= wild
    assert not any(m.id.startswith("demo-") for m in sdk(stack, "k-globex").models.list())


def test_the_engine_contract_takes_lora_task_id_and_refuses_an_unknown_one(stack):
    prompt = dict(input_ids=[1, 504, 3458, 282, 4649, 314], input_lengths=6, request_output_len=8,
                  temperature=0.0, streaming=True)
    base = engine_call(stack.grpc_url, **prompt)
    tuned = engine_call(stack.grpc_url, **prompt, lora_task_id=task_id("demo-medical"))
    assert len(base) == len(tuned) == 8 and base != tuned
    with pytest.raises(Exception) as e:
        engine_call(stack.grpc_url, **prompt, lora_task_id=12345)
    assert "kind=not_found" in str(e.value) and "12345" in str(e.value)


def test_metrics_name_the_adapter(stack):
    answer(stack, "k-acme", "demo-support")
    text = stack.metrics()
    assert (metric_value(text, "cpu_engine_lora_requests", adapter="demo-support") or 0) >= 1
    assert (metric_value(text, "gateway_adapter_requests_total", tenant="acme", model="tensorrt_llm",
                         adapter="demo-support", outcome="success") or 0) >= 1
    assert (metric_value(text, "cpu_engine_lora_metrics", lora_metric="loaded") or 0) >= 1
