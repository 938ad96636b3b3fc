"""The usage ledger on the real stack (tritonserver + gateway + CPU engine + front, SQLite in the data
directory; PostgreSQL in its own test): one record per request from either door with the gateway's own
token counts, for success, each error kind and a cancel; GET /v1/usage scoped to the caller; records
survive a restart; a PostgreSQL outage while serving loses nothing."""
import json
import time
import urllib.error
import urllib.request

import openai
import pytest

from clients import LLMClient
from clients.llm import LLMError
from ledger.store import Store
from tests.support.postgres import PostgresServer
from tests.support.server import TritonServer, metric_value
from tests.support.tenants import Tenant, write_tenants

pytestmark = pytest.mark.integration

TENANTS = [
    Tenant("acme", price_in_per_1k=0.5, price_out_per_1k=1.5),
    Tenant("globex", tier="standard", allowed_models=("other",)),
    Tenant("solo", tier="free", limits={"requests_per_minute": 2, "max_output_tokens": 64}),
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def start_stack(tmp_path_factory, name, env):
    cfg = tmp_path_factory.mktemp(name) / "tenants.yaml"
    write_tenants(cfg, TENANTS, models={"tensorrt_llm": 2048})
    return TritonServer(overrides={"gateway_config": str(cfg)}, front=True, env=env).start()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, data_dir):
    s = start_stack(tmp_path_factory, "ledger", {"LLM_DATA_DIR": str(data_dir)})
    yield s
    s.stop()


def sdk(stack, key="k-acme"):
    return openai.OpenAI(base_url=f"{stack.front_url}/v1", api_key=key, max_retries=0, timeout=120)


def rows(store, tenant, n, timeout=20.0):
    """The tenant's ledger rows once there are at least n (the spool is sealed every second)."""
    deadline = time.monotonic() + timeout
    while True:
        got = store.usage_rows(tenant, 0, time.time() + 60)
        if len(got) >= n or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def get(stack, path, key):
    req = urllib.request.Request(f"{stack.front_url}{path}", headers={"authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_every_request_leaves_one_record_with_the_gateways_counts(stack, data_dir):
    store = Store.open(data_dir / "ledger.sqlite3")
    client = sdk(stack)
    chat = client.chat.completions.create(model="auto", messages=CHAT, max_tokens=8, temperature=0)
    streamed = list(client.completions.create(model="tensorrt_llm", prompt="The capital of France is",
                                              max_tokens=6, stream=True, stream_options={"include_usage": True}))
    direct = LLMClient(stack.grpc_url, api_key="k-acme").generate(messages=CHAT, max_tokens=5, temperature=0)
    # a cancel: the client leaves a long stream after its first chunk
    stream = client.chat.completions.create(model="auto", messages=CHAT, max_tokens=400, stream=True,
                                            extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    got = rows(store, "acme", 4)
    assert len(got) == 4, got
    ok = sorted((r["prompt_tokens"], r["completion_tokens"]) for r in got if r["outcome"] == "success")
    usage = streamed[-1].usage
    assert ok == sorted([(chat.usage.prompt_tokens, chat.usage.completion_tokens),
                         (usage.prompt_tokens, usage.completion_tokens),
                         (direct.num_input_tokens, direct.num_output_tokens)])
    for r in got:
        assert r["tier"] == "enterprise" and r["model"] == "tensorrt_llm" and r["latency_ms"] > 0
        assert r["cost"] == pytest.approx(r["prompt_tokens"] * 0.0005 + r["completion_tokens"] * 0.0015)
    success = [r for r in got if r["outcome"] == "success"]
    assert all(r["ttft_ms"] and r["ttft_ms"] <= r["latency_ms"] and r["finish_reason"] in ("stop", "length")
               for r in success)
    cancelled = [r for r in got if r["outcome"] == "cancelled"]
    assert len(cancelled) == 1 and 0 < cancelled[0]["completion_tokens"] < 400
    assert len({r["request_id"] for r in got}) == 4


def test_each_error_kind_leaves_one_record(stack, data_dir):
    store = Store.open(data_dir / "ledger.sqlite3")
    with pytest.raises(openai.PermissionDeniedError):
        sdk(stack, "k-globex").chat.completions.create(model="tensorrt_llm", messages=CHAT, max_tokens=4)
    solo = sdk(stack, "k-solo")
    with pytest.raises(openai.BadRequestError):  # over the tenant's output quota
        solo.completions.create(model="auto", prompt="x", max_tokens=65)
    solo.completions.create(model="auto", prompt="x", max_tokens=2)
    with pytest.raises(openai.RateLimitError):  # 2 requests a minute
        for _ in range(3):
            solo.completions.create(model="auto", prompt="x", max_tokens=2)
    with pytest.raises(LLMError) as e:  # the gRPC door: a bad request there is recorded too
        LLMClient(stack.grpc_url, api_key="k-solo").generate("x", max_tokens=0)
    assert e.value.kind == "invalid_argument"
    with pytest.raises(openai.AuthenticationError):
        sdk(stack, "k-nobody").completions.create(model="auto", prompt="x", max_tokens=2)
    globex = rows(store, "globex", 1)
    assert [(r["outcome"], r["error_kind"]) for r in globex] == [("error", "permission_denied")]
    solo_rows = rows(store, "solo", 5)
    kinds = sorted((r["outcome"], r["error_kind"]) for r in solo_rows)
    assert kinds == sorted([("error", "context_too_long"), ("success", ""), ("success", ""),
                            ("error", "rate_limited"), ("error", "invalid_argument")]), kinds
    assert all(r["completion_tokens"] == 0 and r["cost"] == 0 for r in solo_rows if r["outcome"] == "error")
    assert [r["error_kind"] for r in rows(store, "unknown", 1)] == ["unauthenticated"]


def test_usage_report_is_the_callers_own(stack, data_dir):
    rows(Store.open(data_dir / "ledger.sqlite3"), "acme", 4)
    status, acme = get(stack, "/v1/usage", "k-acme")
    assert status == 200 and acme["tenant"] == "acme" and acme["group_by"] == "day_model"
    (day,) = acme["data"]
    assert day["model"] == "tensorrt_llm" and day["requests"] >= 4 and day["cancelled"] >= 1
    assert day["prompt_tokens"] > 0 and day["ttft_p95_ms"] >= day["ttft_p50_ms"] > 0
    status, globex = get(stack, "/v1/usage?group_by=day", "k-globex")
    assert status == 200 and globex["tenant"] == "globex"
    assert [d["requests"] for d in globex["data"]] == [1]
    status, err = get(stack, "/v1/usage?start=2026-02-30", "k-acme")
    assert status == 400 and err["error"]["param"] == "start" and "YYYY-MM-DD" in err["error"]["message"]
    status, err = get(stack, "/v1/usage", "k-nobody")
    assert status == 401 and err["error"]["code"] == "invalid_api_key"
    status, empty = get(stack, "/v1/usage?start=2020-01-01&end=2020-01-31", "k-acme")
    assert status == 200 and empty["data"] == []


def test_records_survive_a_restart(stack, data_dir, tmp_path_factory):
    store = Store.open(data_dir / "ledger.sqlite3")
    sdk(stack).completions.create(model="auto", prompt="Restart", max_tokens=2)
    before = rows(store, "acme", 5)
    stack.stop()  # the last records are sealed when Triton unloads the gateway and loaded by the launcher
    after_stop = store.usage_rows(None, 0, time.time() + 60)
    assert {r["request_id"] for r in before} <= {r["request_id"] for r in after_stop}
    again = start_stack(tmp_path_factory, "ledger2", {"LLM_DATA_DIR": str(data_dir)})
    try:
        status, report = get(again, "/v1/usage?group_by=day", "k-acme")
        assert status == 200 and report["data"][0]["requests"] == len(before)
        assert not list((data_dir / "spool").glob("*.jsonl"))
    finally:
        again.stop()


def test_postgres_ledger_outage_while_serving_loses_nothing(tmp_path_factory):
    with PostgresServer() as pg:
        data = tmp_path_factory.mktemp("pgdata")
        s = start_stack(tmp_path_factory, "pg", {"LLM_DATA_DIR": str(data), "LLM_LEDGER_URL": pg.url})
        store = Store.open(pg.url)
        try:
            client = sdk(s)
            client.completions.create(model="auto", prompt="before", max_tokens=2)
            assert len(rows(store, "acme", 1)) == 1
            store.close()
            pg.pause()
            try:
                for i in range(6):  # served while the ledger is down
                    assert client.completions.create(model="auto", prompt=f"during {i}", max_tokens=2).usage
                metrics = urllib.request.urlopen(f"http://127.0.0.1:{s.front_metrics_port}/metrics").read().decode()
                deadline = time.monotonic() + 15
                while (metric_value(metrics, "llm_ledger_write_failures_total") or 0) < 1:
                    assert time.monotonic() < deadline, "no write failure reported"
                    time.sleep(0.5)
                    metrics = urllib.request.urlopen(
                        f"http://127.0.0.1:{s.front_metrics_port}/metrics").read().decode()
                assert metric_value(metrics, "llm_ledger_store_up") == 0
                assert metric_value(metrics, "llm_ledger_spool_segments") >= 1
                status, err = get(s, "/v1/usage", "k-acme")
                assert status == 503 and err["error"]["type"] == "server_error"
            finally:
                pg.resume()
            got = rows(store, "acme", 7, timeout=40)
            assert len(got) == 7 and all(r["outcome"] == "success" for r in got)
            status, report = get(s, "/v1/usage", "k-acme")
            assert status == 200 and report["data"][0]["requests"] == 7
        finally:
            store.close()
            s.stop()
