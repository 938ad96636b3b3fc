"""clients/ without a server: typed errors from every error shape, usage parsing aligned with the
gateway's metric families, retries."""
import pytest

from contracts.errors import ServingError
from clients import (BadRequestError, LLMError, NotFoundError, OverloadedError, PermissionDeniedError,
                     RateLimitError, with_retries)
from clients.llm import error_from_text
from clients.prometheus import metric_value
from clients.usage import REQUESTS_FAMILY, USAGE_FAMILIES, USAGE_PREFIX, families_by_tenant, parse_samples


@pytest.mark.parametrize("kind,cls,status", [
    ("invalid_argument", BadRequestError, 400), ("permission_denied", PermissionDeniedError, 403),
    ("not_found", NotFoundError, 404), ("queue_full", OverloadedError, 503), ("overloaded", OverloadedError, 503),
    ("rate_limited", RateLimitError, 429),
])
def test_contract_kinds_map_to_exceptions_even_when_wrapped(kind, cls, status):
    wire = ServingError(kind, "m", field="max_tokens", retry_after=1.5).wire()
    # Triton wraps model errors ("Failed to process ... message: ...", "in ensemble ...")
    e = error_from_text(f"Failed to process the request(s) for model 'gateway_0_0', message: {wire}\n\nAt: x")
    assert type(e) is cls and e.status == status and e.kind == kind
    assert e.field == "max_tokens" and e.retry_after == 1.5 and str(e).startswith("m")


def test_errors_without_the_prefix_use_the_status_or_tritons_message():
    assert type(error_from_text("bad json", 400)) is BadRequestError
    assert type(error_from_text("busy", "503")) is OverloadedError  # tritonclient.http: status() is a string
    assert type(error_from_text("busy", "StatusCode.UNAVAILABLE")) is OverloadedError  # tritonclient.grpc
    # gRPC stream errors carry no status: Triton's own texts still map
    assert type(error_from_text("Request for unknown model: 'x' is not found")) is NotFoundError
    assert type(error_from_text("[request id: <id_unknown>] Exceeds maximum queue size")) is OverloadedError
    e = error_from_text("Socket closed")
    assert type(e) is LLMError and e.status == 500 and e.kind == "internal"
    # the prefix wins over a status that disagrees (generate endpoints answer 400 for everything)
    assert type(error_from_text(ServingError("rate_limited", "x", retry_after=2).wire(), 400)) is RateLimitError


def test_retry_is_bounded_and_only_for_retryable_errors():
    calls = []

    def bad():
        calls.append(1)
        raise BadRequestError("no", "invalid_argument")
    with pytest.raises(BadRequestError):
        with_retries(bad, sleep=lambda s: None)
    assert len(calls) == 1  # a 400 is not retried
    slept = []

    def limited():
        raise RateLimitError("later", "rate_limited")  # no retry_after: 1 s default
    with pytest.raises(RateLimitError):
        with_retries(limited, attempts=3, sleep=slept.append)
    assert slept == [1.0, 1.0]


def test_usage_families_are_the_gateways():
    from gateway.metrics import FAMILIES

    for name in (*USAGE_FAMILIES, REQUESTS_FAMILY):
        assert name in FAMILIES and name.startswith(USAGE_PREFIX) and FAMILIES[name][0] == "counter"


def test_prometheus_parsing_is_generic_by_prefix():
    text = '''# HELP gateway_requests_total x
# TYPE gateway_requests_total counter
gateway_requests_total{model="m",outcome="success",tenant="a,b \\"q\\""} 2
gateway_requests_total{tenant="acme",model="m",outcome="error"} 1 1700000000000
gateway_time_to_first_token_seconds_bucket{tenant="acme",le="0.5"} 1
gateway_time_to_first_token_seconds_sum{tenant="acme"} 0.25
gateway_time_to_first_token_seconds_count{tenant="acme"} 1
gateway_admission_queue_depth{model="m"} 3
nv_inference_count{model="m",version="1"} 9
gateway_new_family_total{tenant="acme"} 7
'''
    samples = list(parse_samples(text))
    assert samples[0] == ("gateway_requests_total", {"model": "m", "outcome": "success", "tenant": 'a,b "q"'}, 2.0)
    assert samples[1][2] == 1.0  # a timestamp is not the value
    fams = families_by_tenant(text)
    assert fams['a,b "q"'] == {"gateway_requests_total": 2.0}
    assert fams["acme"] == {"gateway_requests_total": 1.0, "gateway_time_to_first_token_seconds_sum": 0.25,
                            "gateway_time_to_first_token_seconds_count": 1.0, "gateway_new_family_total": 7.0}


def test_metric_value_sums_the_matching_samples_only():
    text = '''# TYPE nv_trt_llm_request_metrics gauge
nv_trt_llm_request_metrics{model="a",request_type="active",version="1"} 2
nv_trt_llm_request_metrics{model="b",request_type="active",version="1"} 3
nv_trt_llm_request_metrics{model="a",request_type="waiting",version="1"} 5
nv_trt_llm_request_metrics_other{request_type="active"} 100
'''
    assert metric_value(text, "nv_trt_llm_request_metrics", request_type="active") == 5.0
    assert metric_value(text, "nv_trt_llm_request_metrics", request_type="active", model="b") == 3.0
    assert metric_value(text, "nv_trt_llm_request_metrics") == 10.0
    assert metric_value(text, "nv_trt_llm_request_metrics", request_type="queued") is None
    assert metric_value(text, "absent") is None
