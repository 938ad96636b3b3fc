"""Issue 29 against a real stack (tritonserver + gateway + CPU engine + front with its ledger): work is
charged before it is done, every endpoint is metered, slow or idle clients are bounded at the door, and
the smaller findings (an 8 KB key, a far `end`, a disconnect mid-body, the adapter oracle, another
tenant's batch id as `after`, a 404's ledger row, /v1/models' context) stay fixed."""
import http.client
import json
import socket
import time
import urllib.error
import urllib.request

import openai
import psutil
import pytest

from ledger.store import Store
from tests.support.server import TritonServer, metric_value
from tests.support.wait import wait_until
from tests.support.tenants import Tenant, write_tenants

pytestmark = pytest.mark.integration

TENANTS = [
    Tenant("acme", allowed_adapters=("demo-support",)),
    Tenant("globex", tier="standard"),
    # free tier: 32 KiB prompts, 2048 context tokens; a few requests a minute so refusals run out
    Tenant("bytes", tier="free", limits={"requests_per_minute": 4}),
    Tenant("tokens", tier="free", limits={"requests_per_minute": 4}),
    Tenant("tok", tier="free", limits={"requests_per_minute": 5}),
    Tenant("door", tier="free", limits={"requests_per_minute": 3}),
    Tenant("free", tier="free"),
    Tenant("chunky", tier="free", limits={"requests_per_minute": 3}),
    Tenant("flood", tier="free", limits={"requests_per_minute": 1}),
]
HEADER_TIMEOUT_S, BODY_TIMEOUT_S = 2.0, 4.0


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, data_dir):
    cfg = tmp_path_factory.mktemp("isolation") / "tenants.yaml"
    write_tenants(cfg, TENANTS)
    s = TritonServer(overrides={"gateway_config": str(cfg)}, front=True, env={"LLM_DATA_DIR": str(data_dir)},
                     front_args=("--header-timeout-s", str(HEADER_TIMEOUT_S), "--body-timeout-s", str(BODY_TIMEOUT_S),
                                 "--idle-timeout-s", "2")).start()
    yield s
    s.stop()


def sdk(stack, key="k-acme"):
    return openai.OpenAI(base_url=f"{stack.front_url}/v1", api_key=key, max_retries=0, timeout=120)


def post(stack, path, body, key, headers=None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"{stack.front_url}{path}", data=data, method="POST",
                                 headers={"authorization": f"Bearer {key}", "content-type": "application/json",
                                          **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def get(stack, path, key) -> tuple[int, dict]:
    req = urllib.request.Request(f"{stack.front_url}{path}", headers={"authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def front_metrics(stack) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.front_metrics_port}/metrics", timeout=5) as r:
        return r.read().decode()


def connect(stack) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", stack.front_port), timeout=30)
    return s


def head(path: str, key: str | None, length: int | None, chunked: bool = False, ctype="application/json") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "host: x", f"content-type: {ctype}"]
    if key:
        lines.append(f"authorization: Bearer {key}")
    if chunked:
        lines.append("transfer-encoding: chunked")
    elif length is not None:
        lines.append(f"content-length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_response(s: socket.socket) -> tuple[int, bytes]:
    """Status and whatever body came before the server closed or the body's declared end."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
    header, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in header.split(b"\r\n") if line.lower().startswith(b"content-length:")), None)
    while length is not None and len(body) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, body


def closed_by_server(s: socket.socket, within_s: float) -> bool:
    """True once the server has closed the connection (EOF or reset), waiting up to within_s."""
    s.settimeout(within_s)
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def front_rss(stack) -> int:
    return psutil.Process(stack.stack.front.pid).memory_info().rss


# -- charged before the work ------------------------------------------------------------------------------
def test_prompts_over_the_tiers_byte_bound_are_refused_untokenized_and_counted(stack):
    """A free-tier prompt over its 32 KiB bound is a 400 naming the prompt; each counts as a request, so
    the tenant's 4 requests/min end in 429s, never in more tokenizer time."""
    big = "word " * 8000  # 40,000 bytes
    answers = [post(stack, "/v1/completions", {"prompt": big, "max_tokens": 4}, "k-bytes") for _ in range(6)]
    assert [a[0] for a in answers[:4]] == [400] * 4, answers[:4]
    assert answers[0][1]["error"]["param"] == "prompt" and "bound" in answers[0][1]["error"]["message"]
    assert [a[0] for a in answers[4:]] == [429, 429], answers[4:]
    assert answers[4][1]["error"]["code"] == "rate_limit_exceeded"


def test_prompts_over_the_context_quota_are_counted_as_requests(stack):
    """Under the byte bound but over the 2048-token context: 400 context_length_exceeded, counted."""
    long = "one two three four " * 700  # ~2,800 tokens, 13 KB
    answers = [post(stack, "/v1/completions", {"prompt": long, "max_tokens": 4}, "k-tokens") for _ in range(6)]
    assert [a[0] for a in answers[:4]] == [400] * 4, answers[:4]
    assert answers[0][1]["error"]["code"] == "context_length_exceeded"
    assert [a[0] for a in answers[4:]] == [429, 429], answers[4:]


def test_tokenize_and_detokenize_are_metered(stack):
    """Each is a request of the tenant's and counts its tokens: 5 requests/min allow 5 calls, then 429."""
    codes = [post(stack, "/v1/tokenize", {"prompt": "The capital of France is"}, "k-tok")[0] for _ in range(3)]
    codes += [post(stack, "/v1/detokenize", {"tokens": [504, 3575, 282]}, "k-tok")[0] for _ in range(3)]
    assert codes == [200] * 5 + [429], codes
    status, body = get(stack, "/v1/models", "k-tok")
    assert status == 429 and body["error"]["code"] == "rate_limit_exceeded"


def test_an_unknown_key_is_refused_before_its_large_body_is_read(stack):
    s = connect(stack)
    s.sendall(head("/v1/completions", None, 4 * 1024 * 1024))  # headers only: the body never comes
    status, body = read_response(s)
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    assert closed_by_server(s, 5)  # the unread body is not waited for
    s = connect(stack)
    s.sendall(head("/v1/completions", "sk-not-a-key", 4 * 1024 * 1024))
    assert read_response(s)[0] == 401


def test_a_body_over_the_tiers_bound_is_refused_before_it_is_read_and_counted(stack):
    """A free key declaring a 4 MiB body: 400 before any of it is read; the third such request is a 429."""
    statuses = []
    for _ in range(4):
        s = connect(stack)
        s.sendall(head("/v1/completions", "k-door", 4 * 1024 * 1024))
        statuses.append(read_response(s)[0])
        s.close()
    assert statuses == [400, 400, 400, 429], statuses


def gateway_refusals(stack, tenant: str) -> float:
    return metric_value(stack.metrics(), "gateway_rejections_total", tenant=tenant, reason="rate_limited") or 0


def test_a_refused_key_flooding_large_bodies_is_held_and_costs_no_gateway_call(stack):
    """Once the gateway refused a key's large body as rate_limited, the key's next large bodies that come before
    the Retry-After are held unread (2 s, the default hold) and refused by the front with the time left, without
    a gateway call: a client that ignores Retry-After and loops gets one answer per hold per connection."""
    def declare() -> tuple[int, float, float]:
        s = connect(stack)
        started = time.monotonic()
        s.sendall(head("/v1/completions", "k-flood", 4 * 1024 * 1024))
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(65536)
        took = time.monotonic() - started
        s.close()
        retry = next(float(line.split(b":")[1]) for line in data.split(b"\r\n") if line.lower().startswith(b"retry-after:")) \
            if b"retry-after" in data.lower() else 0.0
        return int(data.split(b" ", 2)[1]), took, retry

    assert [declare()[0] for _ in range(2)] == [400, 429]  # 1 request/min: the second is refused by the gateway
    assert wait_until(lambda: gateway_refusals(stack, "flood") >= 1, 5)  # the gateway applies metrics every 50 ms
    before = gateway_refusals(stack, "flood")
    answers = [declare() for _ in range(3)]
    assert [a[0] for a in answers] == [429] * 3
    assert all(took >= 1.9 for _, took, _ in answers), answers  # held before the answer
    assert all(retry >= 1 for *_, retry in answers), answers  # about a minute: when a request is back
    assert gateway_refusals(stack, "flood") == before


def test_a_keys_large_bodies_in_flight_are_bounded(stack):
    """A free key (body bound 3 x 32 KiB + 64 KiB = 160 KiB) may have 4 bounds' worth of large bodies being
    read at once: four 150,000-byte bodies that trickle hold 600,000 bytes, a fifth is a 429 at once; when
    they end, the key's next body is read again."""
    holders = []
    for _ in range(4):
        s = connect(stack)
        s.sendall(head("/v1/completions", "k-free", 150_000) + b'{"prompt": "')
        holders.append(s)
    time.sleep(0.5)
    extra = connect(stack)
    extra.sendall(head("/v1/completions", "k-free", 150_000) + b'{"prompt": "')
    status, body = read_response(extra)
    assert status == 429 and json.loads(body)["error"]["code"] == "rate_limit_exceeded", body
    for s in holders:
        s.close()
    time.sleep(0.5)
    status, body = post(stack, "/v1/completions", {"prompt": "a " * 50_000, "max_tokens": 2}, "k-free")
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body  # read, then refused


def test_chunked_bodies_over_the_tiers_bound_count_as_requests(stack):
    """A free key's chunked bodies (no content-length) pass its 160 KiB bound mid-stream: each is a 400 and
    one of its 3 requests a minute, the tier bound cached or not, so the fourth is a 429."""
    def chunked() -> int:
        s = connect(stack)
        s.sendall(head("/v1/completions", "k-chunky", None, chunked=True))
        piece = b'{"prompt": "' + b"a" * 50_000
        try:
            for _ in range(8):  # 400 KB in all
                s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                piece = b"a" * 50_000
        except (BrokenPipeError, ConnectionResetError):
            pass
        status = read_response(s)[0]
        s.close()
        return status

    assert [chunked() for _ in range(4)] == [400, 400, 400, 429]


def test_a_chunked_upload_is_refused_once_it_passes_the_file_limit(stack, data_dir):
    """256 MiB sent chunked (no content-length) to /v1/files: refused once past the 16 MiB limit, the rest
    never read or spooled."""
    s = connect(stack)
    s.sendall(head("/v1/files", "k-acme", None, chunked=True, ctype="multipart/form-data; boundary=XyZ"))
    part = (b"--XyZ\r\ncontent-disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--XyZ\r\n"
            b"content-disposition: form-data; name=\"file\"; filename=\"a.jsonl\"\r\n\r\n")
    s.sendall(b"%x\r\n%s\r\n" % (len(part), part))
    block = b"x" * (1024 * 1024)
    sent, refused = 0, False
    s.settimeout(30)
    try:
        while sent < 256 * 1024 * 1024:
            s.sendall(b"%x\r\n%s\r\n" % (len(block), block))
            sent += len(block)
    except (BrokenPipeError, ConnectionResetError, socket.timeout):
        refused = True
    assert refused, "the whole 256 MiB was accepted"
    # what got through is the limit plus what the sockets buffer on the way (a few MiB on loopback)
    assert sent <= 40 * 1024 * 1024, sent


def test_slow_and_idle_clients_are_closed_and_the_fronts_memory_returns(stack):
    """50 connections that send nothing, part of their headers or part of a body: every one is closed by
    the front's header and body timeouts, and its RSS comes back within 10% of where it was."""
    base, before = front_rss(stack), front_metrics(stack)
    conns = []
    for i in range(50):
        s = connect(stack)
        if i % 3 == 1:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer k-acme\r\n")
        elif i % 3 == 2:
            s.sendall(head("/v1/completions", "k-acme", 60_000) + b'{"prompt": "' + b"a" * 30_000)
        conns.append(s)
    deadline = time.monotonic() + HEADER_TIMEOUT_S + BODY_TIMEOUT_S + 10
    open_ = [s for s in conns if not closed_by_server(s, max(0.1, deadline - time.monotonic()))]
    assert not open_, f"{len(open_)} of 50 still open"
    after = front_metrics(stack)

    def closed(text, reason):
        return metric_value(text, "llm_front_connections_closed_total", reason=reason) or 0

    assert closed(after, "header_timeout") - closed(before, "header_timeout") >= 34  # nothing, or half a header
    assert closed(after, "body_timeout") - closed(before, "body_timeout") >= 16
    for s in conns:
        s.close()
    time.sleep(1.0)
    assert front_rss(stack) <= base * 1.10, (base, front_rss(stack))


def test_connections_per_client_address_are_bounded(stack):
    """More than --max-connections-per-client (default 256) from one address: the extra get a 429 and are
    closed before anything is read; the others are served."""
    conns = [connect(stack) for _ in range(256)]
    try:
        extra = connect(stack)
        status, body = read_response(extra)
        assert status == 429 and json.loads(body)["error"]["code"] == "too_many_connections"
        assert metric_value(front_metrics(stack), "llm_front_connections_closed_total", reason="too_many_connections")
    finally:
        for s in conns:
            s.close()
    time.sleep(0.5)
    assert get(stack, "/v1/models", "k-acme")[0] == 200


# -- the smaller findings -----------------------------------------------------------------------------------
def test_a_key_over_8_kb_is_a_plain_401_every_time(stack):
    for _ in range(5):
        status, body = post(stack, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, "k" * 9000)
        assert status == 401, body
        assert "metadata" not in body["error"]["message"] and "limit" not in body["error"]["message"].lower() \
            or "characters" in body["error"]["message"]


def test_a_far_end_date_is_a_400_naming_end(stack):
    status, body = get(stack, "/v1/usage?end=9999-12-31", "k-globex")
    assert status == 400 and body["error"]["param"] == "end"
    status, body = get(stack, "/v1/usage?end=0001-01-05", "k-globex")
    assert status == 400 and body["error"]["param"] == "end"


def test_a_client_that_leaves_mid_body_is_a_disconnect_not_an_internal_error(stack):
    before = front_metrics(stack)
    s = connect(stack)
    s.sendall(head("/v1/completions", "k-acme", 50_000) + b'{"prompt": "' + b"a" * 1000)
    time.sleep(0.3)
    s.close()
    time.sleep(1.0)
    after = front_metrics(stack)

    def value(text, name, **labels):
        return metric_value(text, name, **labels) or 0

    assert value(after, "llm_front_errors_total", kind="internal") == value(before, "llm_front_errors_total",
                                                                              kind="internal")
    assert value(after, "llm_front_client_disconnects_total") > value(before, "llm_front_client_disconnects_total")


def test_an_adapter_the_tenant_may_not_use_looks_like_one_that_does_not_exist(stack):
    """globex may use no adapter: the name of an existing one and a made-up one answer alike (404)."""
    client = sdk(stack, "k-globex")
    errors = []
    for name in ("demo-support", "no-such-adapter"):
        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model=name, prompt="Hi", max_tokens=2)
        errors.append(e.value.body)
    assert errors[0]["code"] == errors[1]["code"] == "model_not_found"
    assert errors[0]["message"].replace("demo-support", "X") == errors[1]["message"].replace("no-such-adapter", "X")
    assert sdk(stack).completions.create(model="demo-support", prompt="Hi", max_tokens=2).model == "tensorrt_llm"


def test_another_tenants_batch_id_as_after_is_unknown(stack):
    f = sdk(stack, "k-acme").files.create(file=("b.jsonl", json.dumps({
        "custom_id": "a", "method": "POST", "url": "/v1/completions",
        "body": {"prompt": "Hi", "max_tokens": 2}}).encode()), purpose="batch")
    batch = sdk(stack, "k-acme").batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                                completion_window="24h")
    status, body = get(stack, f"/v1/batches?after={batch.id}", "k-globex")
    assert status == 404 and body["error"]["param"] == "after"
    status, _ = get(stack, f"/v1/batches?after={batch.id}", "k-acme")
    assert status == 200


def test_an_unknown_model_leaves_a_ledger_row_without_prompt_tokens(stack, data_dir):
    with pytest.raises(openai.NotFoundError):
        sdk(stack, "k-globex").completions.create(model="no-such-model", prompt="The capital of France is",
                                                  max_tokens=2)
    store = Store.open(data_dir / "ledger.sqlite3")
    deadline = time.monotonic() + 20
    rows = []
    while time.monotonic() < deadline:
        rows = [r for r in store.usage_rows("globex", 0, time.time() + 60) if r["error_kind"] == "not_found"]
        if rows:
            break
        time.sleep(0.3)
    store.close()
    assert rows and all(r["prompt_tokens"] == 0 for r in rows), rows


def test_models_show_the_context_the_tenant_may_use(stack):
    models = {m.id: m for m in sdk(stack, "k-free").models.list().data}
    assert models["tensorrt_llm"].max_model_len == 2048 == models["auto"].max_model_len
    models = {m.id: m for m in sdk(stack, "k-acme").models.list().data}
    assert models["tensorrt_llm"].max_model_len == 8192
