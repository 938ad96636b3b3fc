from contracts import errors


def test_wire_round_trip_keeps_kind_status_field_and_retry_after():
    e = errors.ServingError("rate_limited", "tokens/min limit reached", field="max_tokens", retry_after=2.5)
    text = e.wire()
    assert text.startswith("[kind=rate_limited status=429 field=max_tokens retry_after=2.500] ")
    back = errors.parse("Failed to process the request(s) for model 'gateway_0_0', message: " + text)
    assert (back.kind, back.status, back.field, back.retry_after) == ("rate_limited", 429, "max_tokens", 2.5)
    assert back.message == "tokens/min limit reached"


def test_parse_ignores_text_without_the_prefix():
    assert errors.parse("Exceeds maximum queue size") is None
    assert errors.parse("[kind=bogus] x") is None


def test_invalid_names_the_field():
    e = errors.invalid("max_tokens", "must be at least 1, got 0")
    assert e.status == 400 and e.triton_code == "INVALID_ARG" and e.field == "max_tokens"
    assert "max_tokens: must be at least 1" in str(e)


def test_triton_and_tensorrt_llm_words_without_the_prefix_are_their_kind():
    """What the engine's backend says in its own words: a full queue or LoRA cache is a 503 to retry shortly
    (Retry-After), an unknown model a 404, anything else internal."""
    for text, kind, retry in (
            ("[request id: 7] Exceeds maximum queue size", "queue_full", 1.0),
            ("Encountered an error in forwardAsync: " + errors.LORA_CACHE_FULL, "overloaded", 1.0),
            ("Request for unknown model: 'x' is not found", "not_found", None),
            ("CUDA error: an illegal memory access was encountered", "internal", None)):
        e = errors.from_transport(text)
        assert (e.kind, e.retry_after, e.message) == (kind, retry, text), text
    busy = errors.from_transport("x", "StatusCode.RESOURCE_EXHAUSTED")  # a 503 says when to retry, however learnt
    assert (busy.kind, busy.retry_after) == ("overloaded", 1.0)
