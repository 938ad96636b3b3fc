"""Request validation in the libraries (issue 18, findings 1, 4, 9 and 11), without a server: engine
tensors, preprocessing, the gateway's cache salt."""
import json
import math

import numpy as np
import pytest

from gateway.cache_salt import tenant_cache_salt
from cpu_engine.triton_contract import EngineCall, ResponseAssembler, parse_engine_request
from contracts.errors import ServingError
from text.preprocess import Preprocessor, parse_messages, resolve_min_tokens
from text.tokenization import TokenizerBundle
from cpu_engine import RequestOutput, SamplingParams

GOOD = dict(input_ids=np.array([[1, 2, 3]], np.int32), input_lengths=np.array([[3]], np.int32),
            request_output_len=np.array([[4]], np.int32))


def engine_request(**values):
    x = dict(GOOD)
    for name, value in values.items():
        x[name] = value if isinstance(value, np.ndarray) else np.array([[value]])
    return parse_engine_request(x)


@pytest.mark.parametrize("values, field", [
    (dict(temperature=np.array([[math.nan]], np.float32)), "temperature"),
    (dict(temperature=np.array([[math.inf]], np.float32)), "temperature"),
    (dict(temperature=np.array([[-math.inf]], np.float32)), "temperature"),
    (dict(temperature=np.array([[1e6]], np.float32)), "temperature"),
    (dict(runtime_top_p=np.array([[math.nan]], np.float32)), "top_p"),
    (dict(runtime_top_p=np.array([[-0.1]], np.float32)), "top_p"),
    (dict(runtime_top_k=np.array([[-3]], np.int32)), "top_k"),
    (dict(min_length=np.array([[-1]], np.int32)), "min_length"),
    (dict(min_tokens=np.array([[2]], np.int32), min_length=np.array([[3]], np.int32)), "min_length"),
    (dict(stop_words_list=np.array([[[1, 2, 3]]], np.int32)), "stop_words"),  # not [2, L]
    (dict(bad_words_list=np.array([[[1, 2, 3]]], np.int32)), "bad_words"),
])
def test_engine_request_refuses_degenerate_values_naming_the_field(values, field):
    with pytest.raises(ServingError) as e:
        engine_request(**values)
    assert e.value.kind == "invalid_argument" and e.value.field == field, e.value


def test_min_length_is_the_older_name_of_min_tokens():
    assert engine_request(min_length=np.array([[5]], np.int32)).params.min_tokens == 5
    assert engine_request(min_tokens=np.array([[6]], np.int32)).params.min_tokens == 6
    both = engine_request(min_tokens=np.array([[7]], np.int32), min_length=np.array([[7]], np.int32))
    assert both.params.min_tokens == 7
    assert engine_request().params.min_tokens == 0
    assert resolve_min_tokens(None, None) == 0 and resolve_min_tokens(None, 3) == 3


def output(ids, finished=False, error=None):
    return RequestOutput("r", ids, None, 0.0, finished, "error" if error else None, error, 3, len(ids), {})


def test_an_engine_error_goes_out_after_the_tokens_it_held_back():
    asm = ResponseAssembler(EngineCall([9], SamplingParams(8), streaming=True), stream_interval=4)
    assert len(asm.feed(output([1]))) == 1  # the first token at once
    assert asm.feed(output([2, 3])) == []  # held: stream_interval
    sent = asm.feed(output([], finished=True, error="sampling failed"))
    assert [final for _, final in sent] == [False, True]
    assert sent[0][0]["output_ids"].reshape(-1).tolist() == [2, 3] and sent[1][0] is None
    plain = ResponseAssembler(EngineCall([9], SamplingParams(8)))  # not streaming: only the error
    plain.feed(output([1]))
    assert plain.feed(output([], finished=True, error="boom")) == [(None, True)]


# -- preprocessing -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pre(checkpoint):
    return Preprocessor(TokenizerBundle.load(checkpoint), max_seq_len=256, max_output_len=128)


@pytest.mark.parametrize("kwargs, field", [
    (dict(query=b"hi", request_output_len=None), "max_tokens"),
    (dict(query=None, request_output_len=4, messages=("[" * 100_000).encode()), "messages"),
    (dict(query=None, request_output_len=4, messages=("[" * 5000 + "]" * 5000).encode()), "messages"),
    (dict(query=None, request_output_len=4,
          messages=json.dumps([{"role": "user", "content": "x", "extra": "X"}]).replace(
              '"X"', "[" * 50_000 + "]" * 50_000).encode()), "messages"),
    (dict(query=b"hi", request_output_len=4, stop_words=np.array([[b"ok", b"\xff\xfe"]], object)), "stop_words"),
    (dict(query=b"hi", request_output_len=4, bad_words=np.array([[b"\xc3"]], object)), "bad_words"),
    (dict(query=b"hi \xe2\x82", request_output_len=4), "text_input"),
    (dict(query=b"hi", request_output_len=4, min_length=-2), "min_length"),
    (dict(query=b"hi", request_output_len=4, min_tokens=1, min_length=2), "min_length"),
])
def test_preprocessing_refuses_bad_input_naming_the_field(pre, kwargs, field):
    with pytest.raises(ServingError) as e:
        pre(**kwargs)
    assert e.value.kind == "invalid_argument" and e.value.field == field, e.value


def test_preprocessing_turns_min_length_into_min_tokens(pre):
    assert pre(b"hi", 8)["OUT_MIN_TOKENS"].tolist() == [[0]]
    assert pre(b"hi", 8, min_length=5)["OUT_MIN_TOKENS"].tolist() == [[5]]
    assert pre(b"hi", 8, min_tokens=6)["OUT_MIN_TOKENS"].tolist() == [[6]]
    assert pre(b"hi", 8, min_tokens=4, min_length=4)["OUT_MIN_TOKENS"].tolist() == [[4]]


def test_messages_nested_just_within_the_parser_are_refused_by_shape():
    with pytest.raises(ServingError) as e:
        parse_messages(("[" * 200 + "]" * 200).encode())
    assert e.value.field == "messages"


# -- cache salt ----------------------------------------------------------------------------------------
def test_tenant_cache_salt_is_an_hmac_no_client_can_compute():
    salt = tenant_cache_salt("acme")
    assert salt == tenant_cache_salt("acme") and len(salt) == 64 and int(salt, 16) >= 0
    assert salt != "acme" and "acme" not in salt
    assert tenant_cache_salt("acme") != tenant_cache_salt("acme2")
    # keyed: the same tenant under another secret (another gateway process) is another namespace
    assert tenant_cache_salt("acme", b"a" * 32) != tenant_cache_salt("acme", b"b" * 32)
    import hashlib
    import hmac
    assert tenant_cache_salt("acme", b"k" * 32) == hmac.new(b"k" * 32, b"acme", hashlib.sha256).hexdigest()
    assert salt not in {hmac.new(k, b"acme", hashlib.sha256).hexdigest() for k in (b"", b"acme", bytes(32))}
