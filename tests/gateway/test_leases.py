"""The front's direct engine streams and the gateway's leases (gateway/core.py Leases,
front/engine_direct.py), against a real stack: only the front may take a lease, a stream through the
front settles its lease once with the tokens it got, and a front killed mid-stream holds nothing once
its lease expires, and a client gone while its request waits for admission takes it out of the queue."""
import asyncio
import http.client
import json
import stat
import threading
import time
import urllib.request
from pathlib import Path

import httpx
import openai
import orjson
import psutil
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from contracts.errors import ServingError
from front.engine_direct import _parameters
from front.engine_http import body_fields
from front.gateway_client import gateway_values
from front.lease_socket import LeaseSocketClient
from front.openai_schema import GatewayCall
from tests.support.engine_stream import gateway_operation
from tests.support.server import TritonServer, metric_value
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration
KEY = "sk-demo-acme-enterprise"
TENANT = "acme"


@pytest.fixture(scope="module", params=["http", "http-through-triton", "grpc"])
def stack(checkpoint, request):
    """The front's engine reads over Triton's HTTP generate_stream (its default) or gRPC; its lease operations
    on the gateway's lease socket once it is open (the launcher's default with HTTP), over Triton's HTTP
    generate_stream without it (`http-through-triton`), or over gRPC. Through Triton they are answered from
    the gateway's responder threads (gateway_response_threads): every other module's stack answers them from
    the event loop, the default; one engine slot, so a second request waits in the gateway's admission
    queue."""
    protocol = request.param.split("-")[0]
    with TritonServer(front=True, front_args=("--engine-protocol", protocol),
                      env={"LLM_GATEWAY_SOCKET": ""} if request.param == "http-through-triton" else {},
                      overrides={"gateway_lease_ttl_s": "3", "gateway_response_threads": "2",
                                 "gateway_max_inflight": "1"}) as s:
        s.lease_path = request.param
        yield s


def gateway_call(server, operation, parameters=None, key=KEY):
    """One call of a gateway operation; raises its error."""
    return gateway_operation(server.grpc_url, operation, key, parameters, text_input="hello", max_tokens=4)


def gauge(server, name, **labels):
    """A gateway metric now; the gateway applies its updates every 50 ms (gateway/metrics.py), so a test waits
    for the value it expects (wait_until)."""
    return metric_value(server.metrics(), name, **labels) or 0.0


@pytest.mark.parametrize("front_key", [None, "fk-guessed"])
def test_lease_operations_are_reserved_to_the_front(stack, front_key):
    params = {"front_key": front_key} if front_key else None
    for operation in ("admit", "settle", "renew", "engine_check"):
        with pytest.raises(InferenceServerException, match="reserved to the front"):
            gateway_call(stack, operation, params)
    assert wait_until(lambda: gauge(stack, "gateway_reserved_tokens", tenant=TENANT) == 0, 5)


def front_metric(stack, name, **labels) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.front_metrics_port}/metrics", timeout=5) as r:
        return metric_value(r.read().decode(), name, **labels) or 0.0


def front_admits(stack) -> float:
    """The admits the front has sent the gateway, alone or grouped (llm_front_admits_total)."""
    return sum(front_metric(stack, "llm_front_admits_total", sent=sent) for sent in ("alone", "grouped"))


def lease_answers(stack) -> tuple[float, float]:
    """The gateway's answers to the front's admits and settles, as the front timed them."""
    return tuple(front_metric(stack, "llm_front_lease_operation_seconds_count", operation=op)
                 for op in ("admit", "settle"))


def test_a_stream_through_the_front_settles_its_lease_with_the_tokens_it_got(stack):
    sdk = openai.OpenAI(base_url=f"{stack.front_url}/v1", api_key=KEY, max_retries=0)
    admits, answered = front_admits(stack), lease_answers(stack)
    before = gauge(stack, "gateway_requests_total", tenant=TENANT, model="tensorrt_llm", outcome="success")
    itl_before = gauge(stack, "gateway_inter_token_latency_seconds_count", tenant=TENANT, model="tensorrt_llm")
    stream = sdk.completions.create(model="auto", prompt="Count: one, two,", max_tokens=12, temperature=0,
                                    stream=True, stream_options={"include_usage": True},
                                    extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 12 and "".join(c.choices[0].text for c in chunks if c.choices)
    assert front_admits(stack) == admits + 1
    assert lease_answers(stack) == (answered[0] + 1, answered[1] + 1)  # one admit and one settle, each timed
    time.sleep(0.5)
    assert wait_until(lambda: gauge(stack, "gateway_requests_total", tenant=TENANT, model="tensorrt_llm",
                                    outcome="success") == before + 1, 5)
    # the front's timings reach the gateway's per-tenant histograms, as a stream through the gateway's do
    assert wait_until(lambda: gauge(stack, "gateway_inter_token_latency_seconds_count", tenant=TENANT,
                                    model="tensorrt_llm") == itl_before + 1, 5)
    # a histogram's series as Prometheus and prometheus-client read them (gateway/metrics.py CountedHistogram)
    assert gauge(stack, "gateway_inter_token_latency_seconds_bucket", tenant=TENANT, model="tensorrt_llm",
                 le="+Inf") == itl_before + 1
    assert wait_until(lambda: gauge(stack, "gateway_reserved_tokens", tenant=TENANT) == 0, 5)
    assert wait_until(lambda: gauge(stack, "gateway_inflight_requests", model="tensorrt_llm") == 0, 5)
    # the admit and the settle ran on the gateway's event loop, whose CPU time Triton's /metrics carries
    assert wait_until(lambda: gauge(stack, "gateway_event_loop_cpu_seconds_total") > 0, 5)


def test_a_client_gone_while_its_request_waits_for_admission_leaves_the_queue_at_once(stack):
    """The front names each admission and sends the gateway's `stop` for it when its client leaves: the
    request leaves the admission queue while the one ahead of it still runs, is counted cancelled, and no
    lease is granted for it (before, the gateway granted one when the slot freed, which held the slot and
    charged every reserved token until the lease expired)."""
    sdk = openai.OpenAI(base_url=f"{stack.front_url}/v1", api_key=KEY, max_retries=0, timeout=60)
    ahead = sdk.completions.create(model="auto", prompt="Tell a very long story.", max_tokens=1500, stream=True,
                                   extra_body={"ignore_eos": True})
    tokens = iter(ahead)
    next(tokens)  # it holds the engine's one slot (gateway_max_inflight 1)
    cancelled = gauge(stack, "gateway_requests_total", tenant=TENANT, model="tensorrt_llm", outcome="cancelled")
    conn = http.client.HTTPConnection("127.0.0.1", stack.front_port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": "auto", "prompt": "Hi", "max_tokens": 50,
                                                        "stream": True}), {"authorization": f"Bearer {KEY}"})
    queue = ("gateway_admission_queue_depth", {"model": "tensorrt_llm"})
    assert wait_until(lambda: gauge(stack, queue[0], **queue[1]) == 1, 10), "the second request never queued"
    conn.sock.shutdown(2)
    conn.close()
    assert wait_until(lambda: gauge(stack, queue[0], **queue[1]) == 0, 5), "it stayed in the admission queue"
    assert wait_until(lambda: gauge(stack, "gateway_requests_total", tenant=TENANT, model="tensorrt_llm",
                                    outcome="cancelled") == cancelled + 1, 5)
    assert next(tokens) and gauge(stack, "gateway_inflight_requests", model="tensorrt_llm") == 1  # still running
    ahead.close()
    assert wait_until(lambda: gauge(stack, "gateway_inflight_requests", model="tensorrt_llm") == 0, 10)
    assert wait_until(lambda: gauge(stack, "gateway_reserved_tokens", tenant=TENANT) == 0, 5)
    # the stream ahead, stopped: one more cancelled, and nothing granted later for the one that left
    assert wait_until(lambda: gauge(stack, "gateway_requests_total", tenant=TENANT, model="tensorrt_llm",
                                    outcome="cancelled") == cancelled + 2, 5)
    time.sleep(4)  # past the 3 s lease time: a lease granted to the gone client would have expired by now
    assert gauge(stack, "gateway_requests_total", tenant=TENANT, model="tensorrt_llm",
                 outcome="cancelled") == cancelled + 2


def model_runs(server, model: str = "preprocessing") -> int:
    """Requests a model has served through Triton (its statistics)."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        stats = client.get_inference_statistics(model, as_json=True)
    finally:
        client.close()
    return int(stats["model_stats"][0]["inference_stats"]["success"].get("count", 0))


def test_the_fronts_lease_operations_take_the_gateways_own_socket_once_it_is_open(stack):
    """With the engine read over HTTP the launcher gives the gateway and the front a lease socket
    (gateway/lease_socket.py): once the gateway has opened it, the front's admits and settles go there, not
    through Triton (whose gateway model then serves none of them); without it, each goes through Triton."""
    sdk = openai.OpenAI(base_url=f"{stack.front_url}/v1", api_key=KEY, max_retries=0, timeout=60)

    def one():
        got = sdk.completions.create(model="auto", prompt="Count: one, two,", max_tokens=4, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in got if c.choices)

    one()  # the gateway's first request opens its socket; the front connects in the background
    if stack.lease_path == "http":
        path = Path(stack.stack.env["LLM_GATEWAY_SOCKET"])
        assert wait_until(path.exists, 10), "the gateway never opened its lease socket"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700

    def triton_runs_of_one() -> int:
        before = model_runs(stack, "gateway")
        one()
        return model_runs(stack, "gateway") - before

    if stack.lease_path == "http":
        assert wait_until(lambda: triton_runs_of_one() == 0, 10), "the front never took the socket"
    channels = lambda: [front_metric(stack, "llm_front_lease_requests_total", channel=c)  # noqa: E731
                        for c in ("socket", "triton")]
    before, answered, sent = model_runs(stack, "gateway"), lease_answers(stack), channels()
    for _ in range(5):
        one()
    through_triton = model_runs(stack, "gateway") - before
    socket, triton = (a - b for a, b in zip(channels(), sent))
    assert [a - b for a, b in zip(lease_answers(stack), answered)] == [5, 5]  # 5 admits and 5 settles answered
    if stack.lease_path == "http":
        assert through_triton == 0 and triton == 0 and socket >= 6  # the front's metric says which way they went
    else:  # through Triton: at least one request for each admit, and the settles (grouped when they queue)
        assert through_triton >= 6 and triton >= 6 and socket == 0
    assert wait_until(lambda: gauge(stack, "gateway_reserved_tokens", tenant=TENANT) == 0, 5)
    assert wait_until(lambda: gauge(stack, "gateway_inflight_requests", model="tensorrt_llm") == 0, 5)


def tokenized(server, messages) -> int:
    """The prompt's tokens as the gateway counts them through `preprocessing` (/v1/tokenize)."""
    r = httpx.post(f"{server.front_url}/v1/tokenize", json={"messages": messages},
                   headers={"authorization": f"Bearer {KEY}"})
    r.raise_for_status()
    return r.json()["count"]


def socket_admit(stack, client, name: str):
    """An admit on the gateway's lease socket, built as the front builds it (front/engine_direct.py)."""
    call = GatewayCall(text="Tell a story.", max_tokens=8)
    values = gateway_values(call, "admit")
    return client.operation(body_fields({k: [v] if isinstance(v, list) else [[v]] for k, v in values.items()},
                                        _parameters(call, KEY, {"front_key": stack.stack.front_key,
                                                                "stream_id": name})))


@pytest.mark.parametrize("stack", ["http"], indirect=True)  # the one stack with a lease socket
def test_an_admit_waiting_on_a_lease_socket_that_closes_leaves_the_queue_and_holds_nothing(stack):
    """The gateway cancels what a closed connection of its lease socket still waits for, as it does a
    grouped admit whose caller is gone: the waiting admit leaves the admission queue, settled as cancelled,
    and no lease is granted to no one when the slot frees."""
    path = stack.stack.env["LLM_GATEWAY_SOCKET"]
    queue = ("gateway_admission_queue_depth", {"model": "tensorrt_llm"})
    cancelled = gauge(stack, "gateway_requests_total", tenant=TENANT, model="tensorrt_llm", outcome="cancelled")

    async def main():
        holder, leaver = LeaseSocketClient(path, timeout_s=30), LeaseSocketClient(path, timeout_s=30)
        assert await ready(holder) and await ready(leaver)
        grant = orjson.loads((await socket_admit(stack, holder, "holds-the-slot").next())[0])
        waiting = socket_admit(stack, leaver, "leaves")  # the engine's one slot is held: it queues
        queued = await asyncio.to_thread(wait_until, lambda: gauge(stack, queue[0], **queue[1]) == 1, 10)
        leaver._conn.transport.abort()
        with pytest.raises(ServingError):
            await waiting.next()
        left = await asyncio.to_thread(wait_until, lambda: gauge(stack, queue[0], **queue[1]) == 0, 5)
        settle = holder.operation({"operation": "settle", "front_key": stack.stack.front_key,
                                   "lease": orjson.dumps({"leases": [{"id": grant["lease"], "num_output_tokens": 0,
                                                                      "outcome": "cancelled"}]}).decode()})
        settled = orjson.loads((await settle.next())[0])
        await holder.close()
        return queued, left, settled

    async def ready(client):
        for _ in range(100):
            if client.ready():
                return True
            await asyncio.sleep(0.05)
        return False

    queued, left, settled = asyncio.run(main())
    assert queued and left, "the admit never queued, or stayed in the queue after its connection closed"
    assert settled["settled"][0].get("error") is None
    assert wait_until(lambda: gauge(stack, "gateway_inflight_requests", model="tensorrt_llm") == 0, 5)
    assert wait_until(lambda: gauge(stack, "gateway_reserved_tokens", tenant=TENANT) == 0, 5)
    assert wait_until(lambda: gauge(stack, "gateway_requests_total", tenant=TENANT, model="tensorrt_llm",
                                    outcome="cancelled") == cancelled + 2, 5)  # the one that left, the holder's
    time.sleep(4)  # past the 3 s lease time: nothing was granted for the one that left
    assert gauge(stack, "gateway_inflight_requests", model="tensorrt_llm") == 0


def test_the_front_tokenizes_a_short_prompt_itself_and_leaves_a_long_one_to_preprocessing(stack):
    """Within --tokenize-max-bytes (4096 by default) the admission of a key the gateway granted a lease
    lately carries the prompt the front tokenized (front/prompt_prep.py), so no `preprocessing` request is
    made for it; past the bound, or for a key the front has not seen granted, the gateway asks
    preprocessing as before. Either way the prompt's tokens are the ones /v1/tokenize counts."""
    sdk = openai.OpenAI(base_url=f"{stack.front_url}/v1", api_key=KEY, max_retries=0)
    sdk.completions.create(model="auto", prompt="Hi", max_tokens=1)  # a lease granted: the key is known
    for content, runs in (("Name a colour.", 0), ("Name a colour. " * 300, 1)):
        messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": content}]
        before = model_runs(stack)
        answer = sdk.chat.completions.create(model="auto", messages=messages, max_tokens=4, temperature=0)
        assert model_runs(stack) - before == runs
        assert answer.usage.prompt_tokens == tokenized(stack, messages) and answer.choices[0].message.content
    assert wait_until(lambda: gauge(stack, "gateway_reserved_tokens", tenant=TENANT) == 0, 5)


def test_a_faulty_prep_from_the_front_is_refused_and_holds_nothing(stack):
    prep = {"INPUT_ID": [[1, 2, 10 ** 6]], "REQUEST_INPUT_LEN": [[3]], "STOP_WORDS_IDS": [[[0], [-1]]],
            "BAD_WORDS_IDS": [[[0], [-1]]], "REQUEST_OUTPUT_LEN": [[4]], "OUT_END_ID": [[2]], "OUT_PAD_ID": [[2]]}
    with pytest.raises(InferenceServerException, match="lease"):
        gateway_call(stack, "admit", {"front_key": stack.stack.front_key, "lease": json.dumps({"prep": prep})})
    assert wait_until(lambda: gauge(stack, "gateway_reserved_tokens", tenant=TENANT) == 0, 5)
    assert wait_until(lambda: gauge(stack, "gateway_inflight_requests", model="tensorrt_llm") == 0, 5)


def test_a_front_killed_mid_stream_holds_nothing_after_its_lease_expires(stack):
    got_tokens = threading.Event()

    def stream():
        sdk = openai.OpenAI(base_url=f"{stack.front_url}/v1", api_key=KEY, max_retries=0, timeout=60)
        try:
            for _ in sdk.completions.create(model="auto", prompt="Tell a very long story.", max_tokens=400,
                                            stream=True, extra_body={"ignore_eos": True}):
                got_tokens.set()
        except Exception:  # noqa: BLE001 - the front is killed under it
            pass

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    assert got_tokens.wait(60)
    assert wait_until(lambda: gauge(stack, "gateway_reserved_tokens", tenant=TENANT) > 0, 5)
    psutil.Process(stack.stack.front.pid).kill()
    killed = time.monotonic()
    stack.stack.front.wait(10)
    while time.monotonic() - killed < 20 and gauge(stack, "gateway_reserved_tokens", tenant=TENANT) > 0:
        time.sleep(0.25)
    held_for = time.monotonic() - killed
    assert wait_until(lambda: gauge(stack, "gateway_reserved_tokens", tenant=TENANT) == 0, 5)
    assert wait_until(lambda: gauge(stack, "gateway_inflight_requests", model="tensorrt_llm") == 0, 5)
    assert held_for >= 2.0  # the lease (3 s), not something else, let go of it
    assert wait_until(lambda: gauge(stack, "gateway_requests_total", tenant=TENANT, model="tensorrt_llm",
                                    outcome="cancelled") >= 1, 5)
    stack.stack.start_front()  # the module's other tests keep their front
    sdk = openai.OpenAI(base_url=f"{stack.front_url}/v1", api_key=KEY, max_retries=0)
    assert sdk.completions.create(model="auto", prompt="The capital of France is", max_tokens=3,
                                  temperature=0).choices[0].text


def test_a_grouped_admit_over_http_answers_each_admit_by_its_stream_id_as_it_is_decided(stack):
    """What the front sends when its admits queue (front/grouped_admits.py), straight to the gateway model
    over Triton's HTTP generate_stream: each admit answered once, as it is decided (a grant, a refused key,
    a bad field); of two admits for the one engine slot, the one decided second waits in a later answer,
    until the first one's lease settles (which of the two gets there first is the tokenizer's race)."""
    def item(stream_id, key=KEY, **inputs):
        values = {"text_input": "hello", "max_tokens": 4, "stream": True, "operation": "admit", **inputs}
        return {"inputs": values, "parameters": {"stream_id": stream_id, "authorization": f"Bearer {key}"}}

    lease = {"admits": [item("one"), item("refused", key="sk-nobody"), item("bad", max_tokens="many"),
                        item("other")]}
    body = {"stream": True, "operation": "admit", "front_key": stack.stack.front_key, "lease": json.dumps(lease),
            "id": "group-1"}
    answers, granted = [], []
    with httpx.stream("POST", f"http://{stack.http_url}/v2/models/gateway/generate_stream", json=body,
                      timeout=30) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            answer = json.loads(json.loads(line[6:])["text_output"])["admits"]
            answers.append(answer)
            granted += [stream_id for stream_id, a in answer.items() if "lease" in a]
            if len(granted) == 1 and granted[0] in answer:  # settle it: its engine slot goes to the other
                gateway_call(stack, "settle", {"front_key": stack.stack.front_key, "lease": json.dumps(
                    {"id": answer[granted[0]]["lease"], "num_output_tokens": 0, "outcome": "cancelled"})})
    merged = {}
    for answer in answers:  # each admit answered once, in the answer of the moment it was decided
        assert not set(answer) & set(merged)
        merged |= answer
    assert set(merged) == {"one", "refused", "bad", "other"} and sorted(granted) == ["one", "other"]
    at = {stream_id: n for n, answer in enumerate(answers) for stream_id in answer}
    assert at[granted[1]] > at[granted[0]]  # it waited for the slot the first one held
    assert "[kind=unauthenticated" in merged["refused"]["error"]
    assert "[kind=invalid_argument" in merged["bad"]["error"] and "field=max_tokens" in merged["bad"]["error"]
    gateway_call(stack, "settle", {"front_key": stack.stack.front_key, "lease": json.dumps(
        {"id": merged[granted[1]]["lease"], "num_output_tokens": 0, "outcome": "cancelled"})})
    assert wait_until(lambda: gauge(stack, "gateway_reserved_tokens", tenant=TENANT) == 0, 5)
    assert wait_until(lambda: gauge(stack, "gateway_inflight_requests", model="tensorrt_llm") == 0, 5)
