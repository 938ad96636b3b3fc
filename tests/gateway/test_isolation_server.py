"""Issue 18 against a real server: the prefix cache is not readable with a guessed salt (finding 1),
a degenerate sampling value fails alone (4), validation gaps are 400s naming the field (9), and
genai-perf's `min_length` works (11)."""
import json
import queue
import threading
import time
import urllib.error
import urllib.request
import uuid

import pytest
import tritonclient.grpc as grpcclient

from contracts.tensors import ENSEMBLE, GATEWAY
from clients import BadRequestError, LLMClient
from tests.support.engine_stream import contract_inputs
from tests.support.server import TritonServer, metric_value
from tests.support.tenants import Tenant, write_tenants

pytestmark = pytest.mark.integration

TENANTS = [Tenant("acme")]
KV_TOKENS = 2048
# > 4 blocks of 32 tokens, the same for every use below
SECRET_PROMPT = ("Internal memo for acme staff only. Quarterly numbers: revenue grew in every region, the "
                 "new product line launches in March, and the board meets on the second Tuesday. " * 6)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    cfg = tmp_path_factory.mktemp("isolation") / "tenants.yaml"
    write_tenants(cfg, TENANTS)
    with TritonServer(overrides={"gateway_config": str(cfg),
                                 "max_tokens_in_paged_kv_cache": str(KV_TOKENS)}) as s:
        yield s


def stream(server, model="ensemble", api_key=None, parameters=None, **values):
    """One request on a gRPC stream: (final response's outputs as numpy, text pieces); raises the error."""
    contract = GATEWAY if model == "gateway" else ENSEMBLE
    events = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: events.put((result, error)),
                        headers={"authorization": f"Bearer {api_key}"} if api_key else None)
    try:
        client.async_stream_infer(model, contract_inputs(contract, values), request_id=uuid.uuid4().hex,
                                  parameters=parameters, enable_empty_final_response=True)
        pieces, outputs = [], {}
        while True:
            result, error = events.get(timeout=120)
            if error is not None:
                raise error
            for out in result.get_response().outputs:
                outputs[out.name] = result.as_numpy(out.name)
            text = result.as_numpy("text_output")
            if text is not None:
                pieces.append(b"".join(text.reshape(-1)).decode())
            if result.get_response().parameters["triton_final_response"].bool_param:
                return outputs, pieces
    finally:
        client.stop_stream()
        client.close()


def reused(server, **values) -> int:
    outputs, _ = stream(server, text_input=SECRET_PROMPT, max_tokens=2, temperature=0.0, stream=True,
                        return_perf_metrics=True, **values)
    return int(outputs["kv_cache_reused_blocks"].reshape(-1)[0])


def reused_metric(server) -> float:
    return metric_value(server.metrics(), "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="reused") or 0.0


def wait_metric_above(server, value, timeout=5.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = reused_metric(server)
        if now > value:
            return now
        time.sleep(0.1)
    return reused_metric(server)


# -- finding 1: a client-chosen salt reads nothing of a tenant's cache ----------------------------------
def test_a_guessed_tenant_salt_reuses_none_of_the_tenants_blocks(srv):
    acme = LLMClient(srv.grpc_url, api_key="k-acme")
    assert acme.generate(SECRET_PROMPT, max_tokens=2, temperature=0.0).text
    before = reused_metric(srv)
    assert acme.generate(SECRET_PROMPT, max_tokens=2, temperature=0.0).text
    assert wait_metric_above(srv, before) >= before + 4  # the tenant itself does reuse its prefix
    # a client that reaches the ensemble directly and names the tenant gets nothing of its cache
    assert reused(srv, parameters={"cache_salt": "acme"}) == 0
    assert reused(srv, parameters={"cache_salt": "acme"}) >= 4  # the probe works: its own blocks now
    assert reused(srv) == 0  # no salt is a namespace of its own
    assert reused(srv) >= 4
    for guess in ("k-acme", "", "gateway:acme"):
        assert reused(srv, parameters={"cache_salt": guess}) == 0, guess


# -- finding 4: a degenerate value fails alone ----------------------------------------------------------
PROMPTS = ["The capital of France is", "Once upon a time, in a quiet village,", "The best way to learn is",
           "Water boils at"]


def test_a_nan_temperature_fails_alone_while_four_streams_finish(srv):
    n = 40
    solo = {p: "".join(stream(srv, text_input=p, max_tokens=n, min_tokens=n, temperature=0.0, stream=True)[1])
            for p in PROMPTS}
    for round_ in range(8):
        results, threads = {}, []

        def run(p):
            try:
                results[p] = "".join(stream(srv, text_input=p, max_tokens=n, min_tokens=n, temperature=0.0,
                                            stream=True)[1])
            except Exception as e:  # noqa: BLE001 - reported below
                results[p] = e

        threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS]
        for t in threads:
            t.start()
        time.sleep(0.3)  # the streams are running
        bad = [dict(temperature=float("nan"), top_k=5), dict(temperature=float("inf"), top_p=0.5),
               dict(temperature=1e39, top_k=3), dict(temperature=1e-39, top_k=3, top_p=0.9)][round_ % 4]
        if bad["temperature"] == 1e-39:  # a tiny positive temperature is valid: greedy, no overflow
            assert stream(srv, text_input="Hello", max_tokens=8, stream=True, **bad)[1]
        else:
            with pytest.raises(Exception) as e:
                stream(srv, text_input="Hello", max_tokens=8, stream=True, **bad)
            assert "kind=invalid_argument" in str(e.value) and "field=temperature" in str(e.value), e.value
        for t in threads:
            t.join(timeout=120)
        for p in PROMPTS:
            assert results.get(p) == solo[p], (round_, p, results.get(p))
    assert LLMClient(srv.grpc_url, model="ensemble").generate("The capital of France is", max_tokens=4,
                                                              temperature=0.0).text


@pytest.mark.parametrize("bad, field", [
    (dict(top_p=float("nan"), top_k=2), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(top_p=1.5), "top_p"),
    (dict(min_tokens=-3), "min_tokens"),
])
def test_degenerate_sampling_values_are_400s_naming_the_field(srv, bad, field):
    with pytest.raises(BadRequestError) as e:
        LLMClient(srv.grpc_url, model="ensemble").generate("Hello", max_tokens=4, **bad)
    assert e.value.field == field


# -- finding 9: validation gaps ---------------------------------------------------------------------------
def http_post(server, path, body):
    req = urllib.request.Request(f"http://{server.http_url}{path}", data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_missing_max_tokens_is_an_error_naming_it_on_every_path(srv):
    for path, body in (("/v2/models/ensemble/generate_stream", {"text_input": "hi", "stream": True}),
                       ("/v2/models/ensemble/generate", {"text_input": "hi"})):
        status, text = http_post(srv, path, body)
        assert status == 400 and "max_tokens" in text and "kind=invalid_argument" in text, (path, status, text)
    with pytest.raises(BadRequestError) as e:
        LLMClient(srv.grpc_url, model="ensemble").generate("hi", max_tokens=None)
    assert e.value.field == "max_tokens"


def test_deeply_nested_messages_are_a_400_naming_messages(srv):
    for deep in ("[" * 100_000, "[" * 3000 + "]" * 3000,
                 json.dumps([{"role": "user", "content": "hi", "x": "X"}]).replace('"X"', "[" * 50_000 + "]" * 50_000)):
        with pytest.raises(Exception) as e:
            stream(srv, model="gateway", api_key="k-acme", messages=deep, max_tokens=4)
        assert "kind=invalid_argument" in str(e.value) and "field=messages" in str(e.value), str(e.value)[:300]
    assert LLMClient(srv.grpc_url, api_key="k-acme").generate(
        messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0.0).text


@pytest.mark.parametrize("model", ["ensemble", "gateway"])
@pytest.mark.parametrize("field", ["stop_words", "bad_words"])
def test_invalid_utf8_words_are_a_400_naming_the_field(srv, model, field):
    client = LLMClient(srv.grpc_url, api_key="k-acme", model=model)
    with pytest.raises(BadRequestError) as e:
        client.generate("Hello", max_tokens=4, **{field: [b"fine", b"\xff\xfe bad"]})
    assert e.value.field == field and "UTF-8" in str(e.value)


def test_a_request_too_big_for_the_kv_cache_names_max_tokens(srv):
    with pytest.raises(BadRequestError) as e:
        LLMClient(srv.grpc_url, model="ensemble").generate("Hello", max_tokens=KV_TOKENS + 100)
    assert e.value.field == "max_tokens" and "max_tokens (request_output_len)" in str(e.value)


# -- finding 11: min_length, genai-perf's name for min_tokens ---------------------------------------------
def test_min_length_is_accepted_as_min_tokens(srv):
    prompt = "<|im_start|>user\nSay hello in three words.<|im_end|>\n<|im_start|>assistant\n"
    free = stream(srv, text_input=prompt, max_tokens=48, temperature=0.0, stream=True)[1]
    by_tokens = stream(srv, text_input=prompt, max_tokens=48, min_tokens=48, temperature=0.0, stream=True)[1]
    by_length = stream(srv, text_input=prompt, max_tokens=48, min_length=48, temperature=0.0, stream=True)[1]
    assert "".join(by_length) == "".join(by_tokens)
    assert len("".join(by_length)) > len("".join(free))  # it ended at end of turn; min_length held it open
    # genai-perf's payload over HTTP generate too
    status, text = http_post(srv, "/v2/models/ensemble/generate",
                             {"text_input": prompt, "max_tokens": 48, "min_length": 48, "temperature": 0.0,
                              "exclude_input_in_output": True})
    assert status == 200 and json.loads(text)["text_output"] == "".join(by_tokens)
    with pytest.raises(BadRequestError) as e:
        LLMClient(srv.grpc_url, model="ensemble").generate("Hi", max_tokens=8, min_tokens=2, min_length=3)
    assert e.value.field == "min_length"
