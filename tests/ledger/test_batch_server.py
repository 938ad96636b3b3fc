"""The Batch API on the real stack with the openai SDK: a 50-line batch ends with one output line per
custom_id, also when the front (and its worker) is killed with SIGKILL midway and restarted; bad lines go
to the error file while the rest run; cancel; another tenant sees none of it (404)."""
import json
import os
import signal
import time
import urllib.error
import urllib.request

import openai
import pytest

from ledger.store import Store
from tests.support.server import TritonServer, metric_value
from tests.support.tenants import Tenant, write_tenants

pytestmark = pytest.mark.integration

TENANTS = [
    Tenant("acme"),
    Tenant("globex", tier="standard"),
    Tenant("tiny", tier="standard", limits={"max_concurrent": 1}),
]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("batchdata")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, data_dir):
    cfg = tmp_path_factory.mktemp("batch") / "tenants.yaml"
    write_tenants(cfg, TENANTS, models={"tensorrt_llm": 2048})
    s = TritonServer(overrides={"gateway_config": str(cfg)}, front=True, env={"LLM_DATA_DIR": str(data_dir)})
    s.start()
    yield s
    s.stop()


def sdk(stack, key="k-acme"):
    return openai.OpenAI(base_url=f"{stack.front_url}/v1", api_key=key, max_retries=2, timeout=60)


def chat_line(i, max_tokens=6, **body):
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "auto", "messages": [{"role": "user", "content": f"Count to {i}."}],
                     "max_tokens": max_tokens, "temperature": 0, **body}}


def upload(client, lines) -> str:
    data = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines).encode()
    return client.files.create(file=("batch.jsonl", data), purpose="batch").id


def wait(client, batch_id, until, timeout=300):
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if until(b) or time.monotonic() > deadline:
            return b
        time.sleep(0.3)


def results(client, file_id):
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()] if file_id else []


def test_fifty_lines_complete_exactly_once_across_a_kill_9_of_the_worker(stack, data_dir):
    client = sdk(stack)
    batch = client.batches.create(input_file_id=upload(client, [chat_line(i) for i in range(50)]),
                                  endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"job": "nightly"})
    assert batch.status == "in_progress" and batch.request_counts.total == 50
    mid = wait(client, batch.id, lambda b: b.request_counts.completed >= 15)
    assert 15 <= mid.request_counts.completed < 50, "the batch finished before the kill"
    front = stack.stack.front
    os.kill(front.pid, signal.SIGKILL)
    front.wait(timeout=10)
    store = Store.open(data_dir / "ledger.sqlite3")
    with store.tx() as cur:
        cur.execute("SELECT state, COUNT(*) FROM batch_lines WHERE batch_id = ? GROUP BY state", (batch.id,))
        states = dict(cur.fetchall())
    assert states.get("pending", 0) > 0 and states.get("done", 0) >= 15
    stack.stack.start_front()  # the same replica id: it resumes the lines its predecessor held
    done = wait(sdk(stack), batch.id, lambda b: b.status in ("completed", "failed", "cancelled", "expired"))
    assert done.status == "completed" and done.metadata == {"job": "nightly"}
    assert (done.request_counts.completed, done.request_counts.failed) == (50, 0)
    assert done.error_file_id is None
    out = results(client, done.output_file_id)
    assert len(out) == 50 and sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(50))
    for o in out:
        body = o["response"]["body"]
        assert o["response"]["status_code"] == 200 and o["error"] is None
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]
        assert body["usage"]["completion_tokens"] > 0
    # the ledger: every line ran at the batch tier, under the batch's id
    deadline = time.monotonic() + 20
    while True:
        recs = [r for r in store.usage_rows("acme", 0, time.time() + 60) if r["batch_id"] == batch.id]
        if len({r["request_id"] for r in recs if r["outcome"] == "success"}) >= 50 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert all(r["tier"] == "batch" for r in recs) and sum(r["outcome"] == "success" for r in recs) >= 50


def test_bad_lines_go_to_the_error_file_and_the_rest_run(stack):
    client = sdk(stack)
    lines = [chat_line(0), "{not json", chat_line(1) | {"url": "/v1/completions"}, chat_line(0),
             chat_line(2, max_tokens=100000), chat_line(3, temperature=9), chat_line(4)]
    b = client.batches.create(input_file_id=upload(client, lines), endpoint="/v1/chat/completions",
                              completion_window="24h")
    # JSON, URL, duplicate and the front's own body checks fail at once; the quota is the gateway's, later
    assert b.request_counts.total == 7 and b.request_counts.failed == 4
    done = wait(client, b.id, lambda x: x.status == "completed")
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 5)
    assert sorted(o["custom_id"] for o in results(client, done.output_file_id)) == ["req-0", "req-4"]
    errors = {e["error"]["code"]: e for e in results(client, done.error_file_id)}
    assert set(errors) == {"invalid_json", "invalid_url", "duplicate_custom_id", "context_too_long",
                           "invalid_argument"}
    assert "max_tokens" in errors["context_too_long"]["error"]["message"]
    assert errors["context_too_long"]["response"]["status_code"] == 400
    assert "temperature" in errors["invalid_argument"]["error"]["message"]
    assert "line 2" in errors["invalid_json"]["error"]["message"]


def test_upload_and_create_errors_are_clear(stack):
    client = sdk(stack)
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("x.jsonl", b'{"a": 1}\n'), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError, match="empty"):
        client.files.create(file=("x.jsonl", b"\n"), purpose="batch")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file_nope", endpoint="/v1/chat/completions", completion_window="24h")
    fid = upload(client, [chat_line(0)])
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=fid, endpoint="/v1/chat/completions", completion_window="1h")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=fid, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.AuthenticationError):
        sdk(stack, "k-nobody").batches.list()
    for ctype, body in (("multipart/form-data; boundary=zz", b"--zz\r\ngarbage"), ("application/json", b"{}"),
                        ("multipart/form-data; boundary=zz", b"--zz\r\nContent-Disposition: form-data; "
                                                             b"name=\"purpose\"\r\n\r\nbatch\r\n--zz--\r\n")):
        req = urllib.request.Request(f"{stack.front_url}/v1/files", data=body, method="POST",
                                     headers={"authorization": "Bearer k-acme", "content-type": ctype})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        err = json.loads(e.value.read())["error"]
        assert e.value.code == 400 and err["param"] == "file" and err["type"] == "invalid_request_error", err


def test_cancel_and_another_tenant_cannot_see_anything(stack):
    client = sdk(stack)
    fid = upload(client, [chat_line(i, max_tokens=48) for i in range(30)])
    b = client.batches.create(input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h")
    other = sdk(stack, "k-globex")
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(b.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.cancel(b.id)
    with pytest.raises(openai.NotFoundError):
        other.files.content(fid)
    with pytest.raises(openai.NotFoundError):
        other.files.retrieve(fid)
    assert b.id not in [x.id for x in other.batches.list()]
    with pytest.raises(openai.NotFoundError):
        other.batches.create(input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h")
    wait(client, b.id, lambda x: x.request_counts.completed >= 1)
    c = client.batches.cancel(b.id)
    assert c.status in ("cancelling", "cancelled")
    done = wait(client, b.id, lambda x: x.status == "cancelled", timeout=120)
    counts = done.request_counts
    assert counts.completed >= 1 and counts.completed + counts.failed == 30 and counts.failed > 0
    out, err = results(client, done.output_file_id), results(client, done.error_file_id)
    assert len(out) + len(err) == 30
    assert len({x["custom_id"] for x in out + err}) == 30
    assert all(e["error"]["code"] == "batch_cancelled" for e in err)
    with pytest.raises(openai.NotFoundError):
        other.files.content(done.output_file_id)
    assert b.id in [x.id for x in client.batches.list(limit=100)]


def test_lines_refused_for_now_are_retried_after_retry_after_not_failed(stack):
    """tiny may run 1 request at a time; the worker runs 2 lines at once, so the gateway refuses every
    other one (429, retry_after 1 s): each waits and runs, none fails."""
    front_metrics = lambda: urllib.request.urlopen(  # noqa: E731
        f"http://127.0.0.1:{stack.front_metrics_port}/metrics").read().decode()
    admits = lambda: sum(metric_value(front_metrics(), "llm_front_admits_total", sent=s) or 0  # noqa: E731
                         for s in ("alone", "grouped"))
    retries = lambda: metric_value(front_metrics(), "llm_batch_retries_total", kind="rate_limited") or 0  # noqa: E731
    before, retried = admits(), retries()
    client = sdk(stack, "k-tiny")
    b = client.batches.create(input_file_id=upload(client, [chat_line(i, max_tokens=12) for i in range(6)]),
                              endpoint="/v1/chat/completions", completion_window="24h")
    done = wait(client, b.id, lambda x: x.status == "completed", timeout=180)
    assert (done.request_counts.completed, done.request_counts.failed) == (6, 0)
    assert len(results(client, done.output_file_id)) == 6 and done.error_file_id is None
    assert retries() >= retried + 1
    # the lines took leases (the front streamed them from the engine), the refused tries among them
    assert admits() >= before + 6 + retries() - retried


def test_batch_lines_wait_while_interactive_requests_run(stack):
    """The batch gate: no batch line starts on a model while interactive requests run there."""
    import threading

    started, done = threading.Barrier(3), []

    def interactive():
        stream = sdk(stack).chat.completions.create(
            model="auto", max_tokens=200, stream=True, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": "Tell a long story."}])
        it = iter(stream)
        next(it)
        started.wait()
        done.append(sum(1 for _ in it))

    threads = [threading.Thread(target=interactive) for _ in range(2)]
    for t in threads:
        t.start()
    started.wait(timeout=60)
    client = sdk(stack, "k-globex")
    b = client.batches.create(input_file_id=upload(client, [chat_line(i, max_tokens=4) for i in range(3)]),
                              endpoint="/v1/chat/completions", completion_window="24h")
    seen = []
    while any(t.is_alive() for t in threads):
        seen.append(client.batches.retrieve(b.id).request_counts.completed)
        time.sleep(0.2)
    assert len(done) == 2 and len(seen) >= 3, "the interactive requests ended too soon to tell"
    assert max(seen) == 0, f"batch lines completed beside interactive traffic: {seen}"
    finished = wait(client, b.id, lambda x: x.status == "completed", timeout=120)
    assert (finished.request_counts.completed, finished.request_counts.failed) == (3, 0)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}


def test_tools_structured_outputs_and_responses_bodies_run_in_a_batch(stack):
    """The Batch API takes the bodies the front takes: tools and response_format on chat lines (the same
    guided decoding), and /v1/responses lines answered as response objects."""
    client = sdk(stack)
    schema = {"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"],
              "additionalProperties": False}
    lines = [chat_line(0, max_tokens=40, response_format={"type": "json_schema",
                                                          "json_schema": {"name": "c", "schema": schema}}),
             chat_line(1, max_tokens=40, tools=[WEATHER], tool_choice="required")]
    b = client.batches.create(input_file_id=upload(client, lines), endpoint="/v1/chat/completions",
                              completion_window="24h")
    done = wait(client, b.id, lambda x: x.status == "completed")
    out = {o["custom_id"]: o["response"]["body"] for o in results(client, done.output_file_id)}
    assert set(json.loads(out["req-0"]["choices"][0]["message"]["content"])) == {"capital"}
    call = out["req-1"]["choices"][0]
    assert call["finish_reason"] == "tool_calls" and call["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert isinstance(json.loads(call["message"]["tool_calls"][0]["function"]["arguments"])["city"], str)

    def response_line(i, **body):
        return {"custom_id": f"r-{i}", "method": "POST", "url": "/v1/responses",
                "body": {"model": "auto", "input": "What is the capital of France?", "max_output_tokens": 8,
                         "temperature": 0, **body}}

    lines = [response_line(0), response_line(1, store=True),
             response_line(2, tools=[{"type": "function", **WEATHER["function"]}], tool_choice="required",
                           max_output_tokens=40), response_line(3, previous_response_id="resp_1"),
             response_line(4, conversation="conv_1")]
    b = client.batches.create(input_file_id=upload(client, lines), endpoint="/v1/responses", completion_window="24h")
    assert b.request_counts.failed == 3  # a line stands alone: neither stored nor following stored items
    done = wait(client, b.id, lambda x: x.status == "completed")
    out = {o["custom_id"]: o["response"]["body"] for o in results(client, done.output_file_id)}
    assert out["r-0"]["object"] == "response" and "Paris" in out["r-0"]["output"][0]["content"][0]["text"]
    assert 0 < out["r-0"]["usage"]["output_tokens"] <= 8
    assert [o["type"] for o in out["r-2"]["output"]] == ["function_call"]
    errors = {e["custom_id"]: e["error"]["message"] for e in results(client, done.error_file_id)}
    assert set(errors) == {"r-1", "r-3", "r-4"}
    assert "store" in errors["r-1"] and "previous_response_id" in errors["r-3"] and "conversation" in errors["r-4"]
    assert out["r-0"]["store"] is False
