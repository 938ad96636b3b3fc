"""The foundation's contract against a real tritonserver, through tritonclient and HTTP generate."""
import json
import queue
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from contracts.tensors import ENSEMBLE
from tests.support.server import metric_value

pytestmark = pytest.mark.integration

GREEDY = {"temperature": 0.0}
# answers with spaces, punctuation and multi-byte characters (checked below, not assumed)
STREAM_PROMPTS = [
    "The capital of France is",
    "Prices in euros: bread 2 €, milk 1 €, cheese",
    "Common French words with accents: café, naïve, déjà vu, résumé,",
]


def http_generate(server, body, stream=False):
    url = f"http://{server.http_url}/v2/models/ensemble/generate" + ("_stream" if stream else "")
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())
    if not stream:
        return status, json.loads(raw)
    events = [json.loads(line[len("data: "):]) for line in raw.splitlines() if line.startswith("data: ")]
    return status, events


def grpc_inputs(**values):
    out = []
    for name, value in values.items():
        spec = ENSEMBLE.input(name)
        arr = np.array([[value] if not isinstance(value, list) else value], dtype=spec.numpy_dtype)
        t = grpcclient.InferInput(name, list(arr.shape), spec.wire_dtype)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def grpc_stream(server, **values):
    """Send one request on a gRPC stream; return the text pieces (or raise the stream's error)."""
    results = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer("ensemble", grpc_inputs(**values), enable_empty_final_response=True)
        pieces = []
        while True:
            result, error = results.get(timeout=120)
            if error is not None:
                raise error
            resp = result.get_response()
            out = result.as_numpy("text_output")
            if out is not None:
                pieces.append(b"".join(out.reshape(-1)).decode())
            if resp.parameters["triton_final_response"].bool_param:
                return pieces
    finally:
        client.stop_stream()
        client.close()


def test_greedy_capital_of_france(server):
    status, body = http_generate(server, {"text_input": "The capital of France is", "max_tokens": 8, **GREEDY})
    assert status == 200, body
    assert body["text_output"].startswith(" Paris"), body


@pytest.mark.parametrize("prompt", STREAM_PROMPTS)
def test_streaming_pieces_concatenate_to_the_full_text(server, prompt):
    _, full = http_generate(server, {"text_input": prompt, "max_tokens": 24, **GREEDY})
    full_text = full["text_output"]
    pieces = grpc_stream(server, text_input=prompt, max_tokens=24, stream=True, temperature=0.0)
    assert len([p for p in pieces if p]) >= 3
    assert "".join(pieces) == full_text
    status, events = http_generate(server, {"text_input": prompt, "max_tokens": 24, "stream": True, **GREEDY},
                                   stream=True)
    assert status == 200
    assert "".join(e["text_output"] for e in events) == full_text
    assert " " in full_text and "\ufffd" not in full_text


def test_some_streamed_answer_has_multibyte_characters(server):
    texts = [http_generate(server, {"text_input": p, "max_tokens": 24, **GREEDY})[1]["text_output"]
             for p in STREAM_PROMPTS]
    assert any(len(t.encode()) > len(t) for t in texts), texts


def test_chat_prompt_stops_at_end_of_turn(server):
    prompt = "<|im_start|>user\nSay hello in one short sentence.<|im_end|>\n<|im_start|>assistant\n"
    pieces = grpc_stream(server, text_input=prompt, max_tokens=200, stream=True, temperature=0.0)
    text = "".join(pieces)
    assert text.strip() and "<|im_end|>" not in text
    assert len(pieces) < 150  # ended by <|im_end|>, far before max_tokens


BAD = [
    ({"max_tokens": 8}, "text_input"),
    ({"text_input": "", "max_tokens": 8}, "text_input"),
    ({"text_input": "hi", "max_tokens": 0}, "max_tokens"),
    ({"text_input": "hi", "max_tokens": -5}, "max_tokens"),
    ({"text_input": "hi", "max_tokens": 10**6}, "max_tokens"),
    ({"text_input": "hello " * 40, "max_tokens": 8190}, "max_tokens"),  # prompt + max_tokens > context
    ({"text_input": "hi", "max_tokens": 8, "top_p": 2.0}, "top_p"),
    ({"text_input": "hi", "max_tokens": 8, "temperature": -1.0}, "temperature"),
    ({"text_input": "hi", "max_tokens": 8, "nested": {"a": 1}}, "nested"),  # unknown parameter of a bad type
    # wrong JSON type for an input: Triton's HTTP front end rejects it before any model runs, with
    # its own message (500, no field name); the model cannot choose the code or the text here
    ({"text_input": "hi", "max_tokens": "eight"}, None),
]


@pytest.mark.parametrize("body, field", BAD)
def test_bad_input_gets_a_clear_error_and_the_server_keeps_serving(server, body, field):
    status, err = http_generate(server, {**body, **GREEDY} if "temperature" not in body else body)
    assert status in (400, 500) and "error" in err, (status, err)
    if field is None:
        assert status == 500 and "Unable to parse" in err["error"], err
    else:
        assert status == 400 and field in err["error"], err
    if "[kind=" in err["error"]:  # the model chose the code: 400 and the contract prefix
        assert status == 400 and "kind=invalid_argument" in err["error"]
    status, ok = http_generate(server, {"text_input": "The capital of France is", "max_tokens": 2, **GREEDY})
    assert status == 200 and ok["text_output"]


def test_non_utf8_text_over_grpc_is_invalid_argument(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    inputs = grpc_inputs(text_input=b"\xff\xfe bad", max_tokens=4)
    with pytest.raises(InferenceServerException) as e:
        client.infer("preprocessing", [_renamed(i) for i in inputs])
    assert "INVALID_ARGUMENT" in str(e.value.status()) and "UTF-8" in e.value.message()
    assert "text_input" in e.value.message()


def _renamed(inp):
    """ensemble input -> the preprocessing input it maps to."""
    names = {"text_input": "QUERY", "max_tokens": "REQUEST_OUTPUT_LEN"}
    inp._input.name = names[inp.name()]
    return inp


def test_log_probs_and_perf_metrics_pass_through_the_ensemble(server):
    prompt = "Shared context for reuse: " + "the quick brown fox jumps over the lazy dog. " * 12
    body = {"text_input": prompt, "max_tokens": 4, "return_log_probs": True, "return_perf_metrics": True, **GREEDY}
    status, first = http_generate(server, body)
    assert status == 200
    lps = first["output_log_probs"]
    assert len(lps) == 4 and all(lp <= 0 for lp in lps) and abs(sum(lps) - first["cum_log_probs"]) < 1e-3
    assert first["arrival_time_ns"] <= first["first_scheduled_time_ns"] <= first["first_token_time_ns"] \
        <= first["last_token_time_ns"]
    assert first["kv_cache_alloc_new_blocks"] > 0
    _, second = http_generate(server, body)  # same long prefix: its full blocks are reused
    assert second["kv_cache_reused_blocks"] > 0 and second["text_output"] == first["text_output"]
    metrics = server.metrics()
    for family in ("nv_trt_llm_request_metrics", "nv_trt_llm_kv_cache_block_metrics",
                   "nv_trt_llm_inflight_batcher_metrics", "nv_trt_llm_general_metrics"):
        assert family + "{" in metrics
    # the precision the engine chose at load, from its self-check on this host's integer GEMM
    from cpu_engine.checkpoint import resolve_weight_dtype
    from cpu_engine.onnx_graphs import int8_weight_limit

    dtype = resolve_weight_dtype("auto")
    bits = {"int8": int8_weight_limit().bit_length() + 1, "bfloat16": 16}.get(dtype, 32)
    assert metric_value(metrics, "cpu_engine_weight_bits", weight_dtype=dtype) == bits


@pytest.fixture(scope="module")
def interval_server(checkpoint):
    from tests.support.server import TritonServer

    with TritonServer(overrides={"stream_interval": "4"},
                      models=("preprocessing", "tensorrt_llm", "postprocessing", "ensemble")) as s:
        yield s


def test_stream_interval_sends_fewer_responses_with_the_same_text(server, interval_server):
    prompt = STREAM_PROMPTS[2]  # multi-byte characters too
    per_token = grpc_stream(server, text_input=prompt, max_tokens=24, stream=True, temperature=0.0)
    grouped = grpc_stream(interval_server, text_input=prompt, max_tokens=24, stream=True, temperature=0.0)
    assert "".join(grouped) == "".join(per_token)
    assert len(grouped) < len(per_token) / 2  # the first token alone, then ~4 a response
    assert grouped[0] == per_token[0]  # the first piece is not held back


def test_guided_decoding_passes_through_the_ensemble(server):
    """`guided_decoding_guide_type` / `guided_decoding_guide` on the ensemble reach the engine, as upstream's
    ensemble passes them: the answer follows the schema and ends there; a bad guide is a clear 400."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}
    body = {"text_input": "The capital of France as JSON:", "max_tokens": 30, "temperature": 0.0,
            "guided_decoding_guide_type": "json_schema", "guided_decoding_guide": json.dumps(schema)}
    status, out = http_generate(server, body)
    assert status == 200 and set(json.loads(out["text_output"])) == {"city"}
    status, out = http_generate(server, {**body, "guided_decoding_guide": "{nope"})
    assert status == 400 and "guided_decoding_guide" in out["error"]
    assert http_generate(server, {"text_input": "Hi", "max_tokens": 2})[0] == 200
