"""Log probs, echo, n, penalties, logit_bias and user on the real stack (tritonserver + gateway + CPU
engine in float32 + front), with the official openai SDK: log probs equal the model's float32 reference
forward at the request's temperature; an lm-evaluation-harness request (token-id prompt, echo, logprobs 1,
max_tokens 1) gets the prompt's per-token log probs; n choices billed per choice with the end user in the
ledger; the Batch API (the gateway's path) answers the same bodies the same way."""
import json
import time
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest

from contracts.logprobs import log_softmax
from text.detokenize import Detokenizer
from text.tokenization import TokenizerBundle
from cpu_engine import EngineConfig, LLMEngine
from front.openai_fields import ENDPOINTS, HONOURED
from ledger.store import Store
from tests.support.openai_fields import BASE, SAMPLES
from tests.support.server import TritonServer
from tests.support.tenants import Tenant, write_tenants

pytestmark = pytest.mark.integration

TENANTS = [Tenant("acme")]
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("logprobs-data")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, data_dir):
    cfg = tmp_path_factory.mktemp("logprobs") / "tenants.yaml"
    write_tenants(cfg, TENANTS, models={"tensorrt_llm": 2048})
    s = TritonServer(overrides={"gateway_config": str(cfg), "weight_dtype": "float32"}, front=True,
                     env={"LLM_DATA_DIR": str(data_dir)}).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(checkpoint):
    """The model in float32, run as one plain sequence (no cache, no batching): logits [T, V]."""
    engine = LLMEngine(EngineConfig(str(checkpoint), weight_dtype="float32", max_tokens_in_paged_kv_cache=256,
                                    matmul_backend="numpy"))
    return engine.model.forward_reference


@pytest.fixture(scope="module")
def tokens(checkpoint):
    """bytes -> token id (for reading the API's token strings back as ids), and the detokenizer."""
    detok = Detokenizer.from_tokenizer(TokenizerBundle.load(str(checkpoint)).tokenizer)
    by_bytes = {}
    for i, b in enumerate(detok.table):
        if b:
            by_bytes.setdefault(b, []).append(i)
    return by_bytes, detok


def sdk(stack, key="k-acme"):
    return openai.OpenAI(base_url=f"{stack.front_url}/v1", api_key=key, max_retries=0, timeout=120)


def post(stack, path, body, key="k-acme"):
    req = urllib.request.Request(f"{stack.front_url}{path}", json.dumps(body).encode(),
                                 {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def chat_prompt_ids(stack):
    return post(stack, "/v1/tokenize", {"messages": CHAT})[1]["tokens"]


def ids_of(entries, by_bytes):
    """The token ids of the API's entries (their bytes name one token each in this vocabulary)."""
    out = []
    for e in entries:
        candidates = by_bytes[bytes(e.bytes)]
        assert len(candidates) == 1, e
        out.append(candidates[0])
    return out


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_chat_logprobs_equal_the_float32_reference_at_the_requests_temperature(stack, reference, tokens,
                                                                              temperature):
    by_bytes, _ = tokens
    r = sdk(stack).chat.completions.create(model="auto", messages=CHAT, max_tokens=8, temperature=temperature,
                                           seed=5, logprobs=True, top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    generated = ids_of(content, by_bytes)
    prompt = chat_prompt_ids(stack)
    assert len(prompt) == r.usage.prompt_tokens
    logits = reference(prompt + generated)
    for j, entry in enumerate(content):
        want = log_softmax(logits[len(prompt) - 1 + j], temperature)  # greedy (0): the model's own, T = 1
        assert entry.logprob == pytest.approx(want[generated[j]], abs=2e-3)
        best = np.argsort(-want)[:5]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(want[best].tolist(), abs=2e-3)
        assert len(entry.top_logprobs) == 5 and entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        if temperature == 0:
            assert generated[j] == best[0]  # greedy: the chosen token is the first alternative
    assert "".join(e.token for e in content) == r.choices[0].message.content


def test_streamed_logprobs_are_the_non_streamed_ones(stack):
    client = sdk(stack)
    whole = client.chat.completions.create(model="auto", messages=CHAT, max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=2)
    chunks = list(client.chat.completions.create(model="auto", messages=CHAT, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == \
        [(e.token, round(e.logprob, 4)) for e in whole.choices[0].logprobs.content]


def test_an_lm_eval_harness_request_gets_the_prompts_log_probs(stack, reference, tokens):
    """What lm-evaluation-harness sends for log-likelihood tasks: token ids, echo, logprobs 1, max_tokens 1."""
    _, detok = tokens
    ids = post(stack, "/v1/tokenize", {"prompt": "The capital of France is Paris"})[1]["tokens"]
    status, body = post(stack, "/v1/completions", {"model": "auto", "prompt": [ids], "echo": True,
                                                   "logprobs": 1, "max_tokens": 1, "temperature": 0})
    assert status == 200, body
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert choice["text"].startswith(detok.decode(ids)) and lp["text_offset"][0] == 0
    logits = reference(ids)
    for i in range(1, len(ids)):
        want = log_softmax(logits[i - 1])
        assert lp["token_logprobs"][i] == pytest.approx(want[ids[i]], abs=2e-3)
        (alt, value), = lp["top_logprobs"][i].items()  # one alternative: is the prompt token the greedy one?
        assert value == pytest.approx(want.max(), abs=2e-3) and alt == detok.decode([int(np.argmax(want))])
    assert lp["tokens"][:len(ids)] == [detok.decode([t]) for t in ids]
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 1
    # the SDK's way of sending the same request
    sdk_body = sdk(stack).completions.create(model="auto", prompt=ids, echo=True, logprobs=1, max_tokens=1,
                                             temperature=0)
    rounded = [None if v is None else round(v, 3) for v in lp["token_logprobs"]]
    assert [None if v is None else round(v, 3) for v in sdk_body.choices[0].logprobs.token_logprobs] == rounded


def test_n_choices_differ_are_billed_per_choice_and_the_user_reaches_the_ledger(stack, data_dir):
    client = sdk(stack)
    r = client.chat.completions.create(model="auto", messages=CHAT, max_tokens=6, temperature=1.0, seed=3, n=3,
                                       user="end-user-42", extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1  # sampled apart
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 3 * 6
    again = client.chat.completions.create(model="auto", messages=CHAT, max_tokens=6, temperature=1.0, seed=3, n=3,
                                           extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]  # seeded
    store = Store.open(data_dir / "ledger.sqlite3")
    deadline = time.monotonic() + 20
    while True:
        rows = [x for x in store.usage_rows("acme", 0, time.time() + 60) if x["end_user"] == "end-user-42"]
        if rows or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert len(rows) == 1 and rows[0]["completion_tokens"] == 18 and rows[0]["finish_reason"] == "length"
    # OpenAI's safety_identifier (which replaces user) is the ledger's end user too, on chat and Responses
    client.chat.completions.create(model="auto", messages=CHAT, max_tokens=2, safety_identifier="end-user-43")
    client.responses.create(model="auto", input="Hi", max_output_tokens=2, safety_identifier="end-user-43", store=False)
    while True:
        rows = [x for x in store.usage_rows("acme", 0, time.time() + 60) if x["end_user"] == "end-user-43"]
        if len(rows) >= 2 or time.monotonic() > deadline + 20:
            break
        time.sleep(0.3)
    assert len(rows) == 2
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="auto", messages=CHAT, max_tokens=2, user="a", safety_identifier="b")
    assert e.value.body["param"] == "safety_identifier"
    # streamed: each choice's deltas, by index, make that choice
    chunks = list(client.completions.create(model="auto", prompt="Once upon a time", max_tokens=5, temperature=1.0,
                                            seed=9, n=2, stream=True, stream_options={"include_usage": True}))
    whole = client.completions.create(model="auto", prompt="Once upon a time", max_tokens=5, temperature=1.0,
                                      seed=9, n=2)
    for c in whole.choices:
        assert "".join(x.choices[0].text for x in chunks if x.choices and x.choices[0].index == c.index) == c.text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_penalties_and_logit_bias_change_the_answer(stack, tokens):
    by_bytes, detok = tokens
    client = sdk(stack)
    prompt = "one one one one one one one"
    plain = client.completions.create(model="auto", prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    for name in ("presence_penalty", "frequency_penalty"):
        got = client.completions.create(model="auto", prompt=prompt, max_tokens=12, temperature=0,
                                        **{name: 2.0}).choices[0].text
        assert got != plain, name
    forced = by_bytes[b" Paris"][0]
    got = client.completions.create(model="auto", prompt=prompt, max_tokens=3, temperature=0,
                                    logit_bias={str(forced): 100}).choices[0].text
    assert got == " Paris" * 3
    status, body = post(stack, "/v1/completions", {"prompt": prompt, "logit_bias": {"99999999": 1}})
    assert status == 400 and body["error"]["param"] == "logit_bias"


def test_refusals_name_the_field(stack):
    for body, param in (({"prompt": "x", "n": 2, "best_of": 3}, "best_of"), ({"prompt": "x", "suffix": "y"}, "suffix"),
                        ({"prompt": "x", "frobnicate": 1}, "frobnicate")):
        status, err = post(stack, "/v1/completions", body)
        assert status == 400 and err["error"]["param"] == param, err
    status, err = post(stack, "/v1/completions", {"prompt": "x", "response_format": {"type": "json_object"}})
    assert status == 400 and err["error"]["param"] == "response_format"  # a chat field only
    status, err = post(stack, "/v1/chat/completions", {"messages": CHAT, "audio": {"voice": "alloy"}})
    assert status == 400 and err["error"]["param"] == "audio"


def test_the_batch_api_answers_the_same_bodies_through_the_gateway(stack):
    client = sdk(stack)
    body = {"model": "auto", "messages": CHAT, "max_tokens": 4, "temperature": 0, "n": 2, "logprobs": True,
            "top_logprobs": 2}
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}
    file_id = client.files.create(file=("b.jsonl", json.dumps(line).encode()), purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while batch.status not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    out = json.loads(client.files.content(batch.output_file_id).text)["response"]["body"]
    direct = client.chat.completions.create(**body)
    assert len(out["choices"]) == 2 and out["usage"]["completion_tokens"] == direct.usage.completion_tokens
    for got, want in zip(out["choices"], direct.choices):
        assert got["message"]["content"] == want.message.content
        assert [round(e["logprob"], 3) for e in got["logprobs"]["content"]] == \
            [round(e.logprob, 3) for e in want.logprobs.content]


def test_every_field_of_the_table_is_honoured_or_refused_by_the_server(stack):
    """docs/openai-api.md's table against the real server: each field with a value that asks for something
    (previous_response_id, conversation: a response and a conversation stored just before)."""
    stored = {"previous_response_id": sdk(stack).responses.create(model="auto", input="Hi", max_output_tokens=2).id,
              "conversation": sdk(stack).conversations.create().id}
    for route, table in ENDPOINTS.items():
        for name, spec in table.items():
            sample = {name: stored[name]} if name in stored else SAMPLES[route][name]
            body = {**BASE[route], **sample}
            req = urllib.request.Request(f"{stack.front_url}{route}", json.dumps(body).encode(),
                                         {"Authorization": "Bearer k-acme", "Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    status, raw = r.status, r.read()
            except urllib.error.HTTPError as e:
                status, raw = e.code, e.read()
            if spec.status == HONOURED:
                assert status == 200, (route, name, raw[:300])
                if body.get("stream"):
                    responses = route == "/v1/responses"  # ends with response.completed / .incomplete
                    end, error = (b'"type":"response.', b'"type":"error"') if responses else \
                        (b"data: [DONE]", b'data: {"error"')
                    assert end in raw.rstrip().rsplit(b"\n", 1)[-1] and error not in raw, (route, name)
            else:
                assert status == 400 and json.loads(raw)["error"]["param"] == name, (route, name, raw[:300])
