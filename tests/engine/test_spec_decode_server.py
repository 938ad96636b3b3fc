"""Speculative decoding through a real stack (issue 35): tritonserver + gateway + the CPU engine with
`decoding_mode lookahead` (prompt lookup) or `draft_tokens_external` (its own int8 copy drafting for it) +
the OpenAI-compatible front. A tenant whose config turns speculation off and one
that keeps the engine's default get the same greedy answer; the engine's own contract takes TensorRT-LLM's
per-request `lookahead_*` inputs, returns the acceptance outputs, refuses a value over the engine's maximum
naming the input; the speculative-decoding metrics count the drafts."""
import time

import openai
import pytest

from tests.support.engine_stream import engine_call
from tests.support.server import TritonServer, metric_value
from tests.support.tenants import Tenant, write_tenants

pytestmark = pytest.mark.integration

TENANTS = [
    Tenant("fast"),  # the engine's default (W, N, G)
    Tenant("plain", extra={"speculative_decoding": "off"}),
]
CODE = "def area(width, height):\n    result = width * height\n    print('area is', result)\n    return result\n"
COPY = [{"role": "user", "content": "Repeat this Python function exactly, nothing else:\n\n" + CODE}]


@pytest.fixture(scope="module", params=["lookahead", "draft_tokens_external"])
def stack(request, tmp_path_factory):
    cfg = tmp_path_factory.mktemp("spec") / "tenants.yaml"
    write_tenants(cfg, TENANTS, models={"tensorrt_llm": 2048})
    # float32: a greedy answer does not depend on how its prompt was chunked (int8 rounds each chunk's
    # activations, docs/engine.md), so the two tenants' answers may be compared token for token
    s = TritonServer(overrides={"gateway_config": str(cfg), "weight_dtype": "float32", "decoding_mode": request.param,
                                "lookahead_ngram_size": "6", "enable_kv_cache_reuse": "false"}, front=True).start()
    yield s
    s.stop()


def drafts(stack) -> float:
    """The engine's running total of verified draft tokens, once the exporter has published it."""
    time.sleep(0.3)  # the engine model exports its gauges every stats_check_period_ms (100 ms)
    return metric_value(stack.metrics(), "nv_trt_llm_spec_decoding_metrics",
                        spec_decoding_metric="total_draft_tokens") or 0.0


def answer(stack, key):
    client = openai.OpenAI(base_url=f"{stack.front_url}/v1", api_key=key, max_retries=0, timeout=120)
    out = client.chat.completions.create(model="auto", messages=COPY, max_tokens=48, temperature=0)
    return out.choices[0].message.content


def test_a_tenant_without_speculation_gets_the_same_answer_and_verifies_no_drafts(stack):
    before = drafts(stack)
    plain = answer(stack, "k-plain")
    after_plain = drafts(stack)
    fast = answer(stack, "k-fast")
    after_fast = drafts(stack)
    assert "area" in plain and fast == plain
    assert after_plain == before  # speculation off for this tenant
    assert after_fast > after_plain  # the engine's default: drafts verified
    text = stack.metrics()
    accepted = metric_value(text, "nv_trt_llm_spec_decoding_metrics", spec_decoding_metric="total_accepted_draft_tokens")
    assert 0 < accepted <= after_fast


SPEC_OUTPUTS = ("acceptance_rate", "total_draft_tokens", "total_accepted_draft_tokens")


def test_the_engine_contract_takes_lookahead_inputs_and_returns_acceptance(stack):
    prompt = [504, 3458, 282, 4649, 314, 504, 3458, 282, 4649, 314, 504, 3458, 282]
    call = dict(input_ids=prompt, input_lengths=len(prompt), request_output_len=24, temperature=0.0, streaming=False,
                return_perf_metrics=True)
    plain, plain_perf = engine_call(stack.grpc_url, SPEC_OUTPUTS, **call, lookahead_window_size=1, lookahead_ngram_size=1,
                                    lookahead_verification_set_size=0)
    spec, perf = engine_call(stack.grpc_url, SPEC_OUTPUTS, **call, lookahead_ngram_size=4)
    assert spec == plain and len(spec) == 24
    assert int(plain_perf["total_draft_tokens"].reshape(-1)[0]) == 0
    drafted, accepted = (int(perf[n].reshape(-1)[0]) for n in ("total_draft_tokens", "total_accepted_draft_tokens"))
    assert drafted > 0 and float(perf["acceptance_rate"].reshape(-1)[0]) == pytest.approx(accepted / drafted)
    with pytest.raises(Exception) as e:
        engine_call(stack.grpc_url, SPEC_OUTPUTS, **call, lookahead_ngram_size=7)  # over the engine's N (6)
    assert "kind=invalid_argument" in str(e.value) and "lookahead_ngram_size" in str(e.value)
