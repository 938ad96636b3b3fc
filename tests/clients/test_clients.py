"""clients/: typed errors from the error contract, retries, usage parsing, and the CLI against a
real server."""
import subprocess
import sys

import pytest

from contracts.errors import ServingError
from clients import (AuthenticationError, ContextTooLongError, HTTPClient, LLMClient, OverloadedError, RateLimitError,
                     with_retries)
from clients.llm import error_from_text
from clients.usage import format_usage, usage_from_metrics


def test_errors_map_to_typed_exceptions():
    e = error_from_text("in ensemble 'x', " + ServingError("rate_limited", "slow down", retry_after=2.5).wire())
    assert isinstance(e, RateLimitError) and e.retry_after == 2.5 and e.status == 429
    assert isinstance(error_from_text(ServingError("unauthenticated", "who?").wire()), AuthenticationError)
    assert isinstance(error_from_text(ServingError("context_too_long", "big").wire()), ContextTooLongError)
    assert type(error_from_text("Socket closed")).__name__ == "LLMError"


def test_retry_helper_honours_retry_after_and_gives_up():
    calls, slept = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise RateLimitError("wait", "rate_limited", retry_after=0.25)
        return "ok"
    assert with_retries(flaky, sleep=slept.append) == "ok" and slept == [0.25, 0.25]

    def always():
        raise OverloadedError("busy", "overloaded", retry_after=100)
    with pytest.raises(OverloadedError):
        with_retries(always, attempts=2, max_wait_s=5, sleep=slept.append)
    assert slept[-1] == 5


def test_usage_from_prometheus_text():
    text = """# TYPE gateway_input_tokens_total counter
gateway_input_tokens_total{model="m",tenant="acme"} 10
gateway_output_tokens_total{model="m",tenant="acme"} 20
gateway_cost_total{model="m",tenant="acme"} 0.5
gateway_requests_total{model="m",outcome="success",tenant="acme"} 2
gateway_requests_total{model="m",outcome="cancelled",tenant="acme"} 1
nv_inference_count{model="m",version="1"} 3
"""
    u = usage_from_metrics(text)
    assert u == {"acme": {"requests": 3.0, "input_tokens": 10.0, "output_tokens": 20.0, "cost": 0.5}}
    assert "acme" in format_usage(u)


@pytest.mark.integration
def test_client_streams_and_cli_reports_usage(server):
    c = LLMClient(server.grpc_url, api_key="sk-demo-acme-enterprise")
    r = c.generate("The capital of France is", max_tokens=8, temperature=0.0)
    assert r.text.startswith(" Paris") and r.model_used == "tensorrt_llm" and r.num_output_tokens == 8
    assert "".join(r.pieces) == r.text and len(r.pieces) >= 2
    chat = c.generate(messages=[{"role": "user", "content": "Say hello."}], max_tokens=32, temperature=0.0)
    assert chat.text.strip() and chat.finish_reason in ("stop", "length")
    with pytest.raises(AuthenticationError):
        LLMClient(server.grpc_url, api_key="wrong").generate("hi", max_tokens=2)
    run = lambda *a: subprocess.run([sys.executable, "-m", "clients", "--grpc", server.grpc_url,  # noqa: E731
                                     "--http", server.http_url, "--metrics", server.metrics_url, *a],
                                    capture_output=True, text=True, timeout=120)
    out = run("usage")
    assert out.returncode == 0 and "acme" in out.stdout
    assert run("health").stdout.strip() == "live=True ready=True"
    models = run("models").stdout
    assert "gateway" in models and "READY" in models
    http = HTTPClient(server.http_url, api_key="sk-demo-acme-enterprise")
    via_http = http.generate("The capital of France is", max_tokens=8, temperature=0.0)
    assert via_http.text == r.text and via_http.num_output_tokens == 8
    with pytest.raises(AuthenticationError):
        HTTPClient(server.http_url, api_key="wrong").generate("hi", max_tokens=2)
    gen = run("--api-key", "sk-demo-acme-enterprise", "generate", "The capital of France is", "--max-tokens", "4",
              "--temperature", "0")
    assert gen.returncode == 0 and "Paris" in gen.stdout
