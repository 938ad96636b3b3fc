"""clients/ against the shared real server: streamed pieces concatenate to the non-streamed text on
`ensemble` over gRPC and HTTP, typed errors from real error responses."""
import pytest

from clients import BadRequestError, HTTPClient, LLMClient, NotFoundError

pytestmark = pytest.mark.integration
PROMPT = "The capital of France is"
GREEDY = {"temperature": 0.0, "max_tokens": 12}


def test_streamed_text_equals_non_streamed_on_ensemble_grpc_and_http(server):
    grpc, http = LLMClient(server.grpc_url, model="ensemble", timeout_s=60), HTTPClient(server.http_url, model="ensemble",
                                                                                      timeout_s=60)
    streamed = list(grpc.stream(PROMPT, **GREEDY))
    whole = grpc.generate(PROMPT, streaming=False, **GREEDY)
    assert len(streamed) >= 2 and len(whole.pieces) == 1  # really streamed / really one response
    assert "".join(streamed) == whole.text and whole.text.startswith(" Paris")
    http_streamed = http.generate(PROMPT, **GREEDY)
    http_whole = http.generate(PROMPT, streaming=False, **GREEDY)  # POST /generate
    assert len(http_streamed.pieces) >= 2 and len(http_whole.pieces) == 1
    assert http_streamed.text == http_whole.text == whole.text
    assert http_streamed.ttft_s is not None and 0 < http_streamed.ttft_s <= http_streamed.latency_s


def test_real_error_responses_are_typed(server):
    with pytest.raises(NotFoundError):
        LLMClient(server.grpc_url, model="no_such_model", timeout_s=30).generate(PROMPT, max_tokens=2)
    with pytest.raises(NotFoundError):
        HTTPClient(server.http_url, model="no_such_model", timeout_s=30).generate(PROMPT, max_tokens=2)
    with pytest.raises(BadRequestError):  # max_tokens must be positive
        HTTPClient(server.http_url, model="ensemble", timeout_s=30).generate(PROMPT, max_tokens=0)
