"""The shipped demo config (deploy/gateway.example.yaml) on the repository `make serve` renders (the default
engine plus the smaller one, Makefile SMALL_ENGINE): when the default engine is saturated, a tier that
allows degradation is answered by the small engine, and the model used says so."""
import pytest

from clients import LLMClient
from tests.support.server import TritonServer

pytestmark = pytest.mark.integration

SMALL = {"max_seq_len": "1024", "max_num_tokens": "128", "max_tokens_in_paged_kv_cache": "4096"}  # as the Makefile


@pytest.fixture(scope="module")
def demo():
    s = TritonServer(overrides={"gateway_max_inflight": "1"}, extra_engines={"tensorrt_llm_small": SMALL}).start()
    yield s
    s.stop()


def test_a_saturated_default_engine_degrades_the_free_tier_to_the_small_one(demo):
    acme = LLMClient(demo.grpc_url, api_key="sk-demo-acme-enterprise")
    hobbyist = LLMClient(demo.grpc_url, api_key="sk-demo-hobbyist-free")
    assert hobbyist.generate("Hi", max_tokens=2, model="tensorrt_llm").model_used == "tensorrt_llm"  # not saturated
    busy = acme.stream("Count: one, two,", max_tokens=400, min_tokens=400, model="tensorrt_llm")
    next(busy)  # the default engine's only gateway slot is held
    try:
        assert hobbyist.generate("Hi", max_tokens=2, model="tensorrt_llm").model_used == "tensorrt_llm_small"
    finally:
        busy.close()
