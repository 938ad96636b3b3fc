"""Issue 18: a bounded, seeded fuzz of bad requests against one real stack (tritonserver + gateway + CPU
engine + the OpenAI-compatible front), over the three surfaces a client or an operator can reach:

- the front (`/v1/chat/completions`, `/v1/completions`, `/v1/responses`, `/v1/tokenize`, `/v1/detokenize`,
  `/v1/models`):
  every error is 4xx JSON in OpenAI's shape with `param` naming the field the request got wrong, never
  a 5xx; hostile bodies (invalid UTF-8, deep nesting, absurd array lengths, huge strings) are refused;
- Triton's internal HTTP (`/generate` on `ensemble` and `gateway`, `/infer` on `preprocessing` and
  `postprocessing`): a 400 whose `[kind=invalid_argument ... field=...]` prefix names the field for
  model-level validation errors. Triton 2.51's own JSON reader answers a wrong JSON *type* with a 500
  "Unable to parse ..." before any model runs: that is accepted (and counted) only for those exact
  texts, on the mistyped test only, because Triton is internal and the front turns the same bodies into
  400s naming the field (checked by the front tests here);
- Triton's gRPC (streams on `ensemble`, `gateway`, `tensorrt_llm`; unary infer on `preprocessing` and
  `postprocessing`): INVALID_ARGUMENT-class errors, with the contract prefix naming the field.

Never sent to Triton's own ports: deep JSON nesting and absurd shapes (both crash Triton 2.51 itself;
that is why Triton is internal). Those go through the front, which must refuse them.

After every example the stack must still be alive: tritonserver and the front running, no model stub
reloaded by the supervisor, `/v2/health/ready` and `/health/ready` 200. Every request must be answered
within TIMEOUT (no hang). Generation is kept cheap: wherever a request could be valid, `max_tokens` is
1 or 2 (values in [3, 8192] are never generated for an output length).
"""
from __future__ import annotations

import json
import math
import queue
import re
import uuid
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.utils import InferenceServerException

from contracts.tensors import CONTRACTS
from contracts.errors import parse
from gateway.tenants import DEFAULT_TIERS
from front.app import tier_body_bytes
from tests.support.server import TritonServer

pytestmark = pytest.mark.integration

KEY = "k-fuzz"
TIMEOUT = 30  # seconds: an answer later than this is a hang
SENT: Counter = Counter()  # requests actually sent, per surface
OUTCOMES: Counter = Counter()  # (surface, answer): printed at the end, to see what the fuzz reached
EXAMPLES = {  # max_examples per test; the total of requests is checked at the end (>= 2,000)
    "front_fields": 900, "front_raw": 300, "front_http": 200,
    "triton_http_typed": 400, "triton_http_mistyped": 250, "triton_http_infer": 300,
    "grpc_stream": 500, "grpc_infer": 250,
}
MIN_REQUESTS = 2000


def fuzz(name):
    return settings(max_examples=EXAMPLES[name], deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=True)


@dataclass
class Target:
    """The session's shared stack (its tenant "fuzz": enterprise, limits that never refuse for volume;
    tests/support/tenants.py) with this module's HTTP session and gRPC client, and the model stub reloads
    the supervisor had made before the fuzz began."""
    server: TritonServer
    session: requests.Session
    grpc: grpcclient.InferenceServerClient
    reloads_before: int

    def __getattr__(self, name):  # the stack's own attributes: urls, ports, proc, stack, log_tail
        return getattr(self.server, name)


@pytest.fixture(scope="module")
def stack(shared_stack):
    target = Target(shared_stack, requests.Session(), grpcclient.InferenceServerClient(shared_stack.grpc_url),
                    len(shared_stack.stack.reloads))
    yield target
    target.grpc.close()
    target.session.close()


def assert_alive(stack):
    """No server death: both processes up, no model stub died and was reloaded, both ready."""
    assert stack.proc.poll() is None, f"tritonserver died ({stack.proc.returncode}):\n{stack.log_tail()}"
    assert stack.stack.front.poll() is None, f"the front died ({stack.stack.front.returncode}):\n{stack.log_tail()}"
    reloads = stack.stack.reloads[stack.reloads_before:]
    assert not reloads, f"model stubs died and were reloaded: {reloads}\n{stack.log_tail()}"
    r = stack.session.get(f"http://{stack.http_url}/v2/health/ready", timeout=TIMEOUT)
    assert r.status_code == 200, f"Triton not ready: {r.status_code}"
    r = stack.session.get(f"{stack.front_url}/health/ready", timeout=TIMEOUT)
    assert r.status_code == 200, f"the front not ready: {r.status_code} {r.text}"


# -- JSON values ---------------------------------------------------------------------------------------
class Raw:
    """JSON text put into a body verbatim (deep nesting, invalid UTF-8, huge numbers): `body_level` when
    it may make the whole body unreadable, so the error may name no field."""

    def __init__(self, text: bytes, body_level: bool = True):
        self.text, self.body_level = text, body_level

    def __repr__(self):
        return f"Raw({self.text[:60]!r}{'...' if len(self.text) > 60 else ''}, {len(self.text)} bytes)"


class Huge:
    """`unit` repeated `n` times, as a string or a list: short in a falsifying example's printout."""

    def __init__(self, unit, n: int):
        self.unit, self.n = unit, n

    def value(self):
        return self.unit * self.n if isinstance(self.unit, (str, bytes)) else [self.unit] * self.n

    def __repr__(self):
        return f"Huge({self.unit!r} * {self.n})"


class Long(str):
    """A long string that prints short in a falsifying example."""

    def __repr__(self):
        return f"Long({str.__repr__(self[:24])}..., {len(self)} chars)"


def dump(value) -> bytes:
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, Huge):
        if isinstance(value.unit, (str, bytes)):
            return dump(value.value())
        return b"[" + b",".join([dump(value.unit)] * value.n) + b"]"
    if isinstance(value, dict):
        return b"{" + b",".join(dump(str(k)) + b":" + dump(v) for k, v in value.items()) + b"}"
    if isinstance(value, list):
        return b"[" + b",".join(dump(v) for v in value) + b"]"
    return json.dumps(value).encode()  # lone surrogates as \ud800 escapes, NaN / Infinity as such


def has_raw(value) -> bool:
    if isinstance(value, Raw):
        return value.body_level
    if isinstance(value, dict):
        return any(has_raw(v) for v in value.values())
    if isinstance(value, list):
        return any(has_raw(v) for v in value)
    return False


NAN, INF = math.nan, math.inf
EDGE_INTS = [0, -1, 1, 2, -2, 2**31 - 1, 2**31, -2**31, -2**31 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63,
             -2**63 - 1, 2**64 - 1, 2**64, 10**30, -10**30, 49151, 49152, 2**40]
EDGE_FLOATS = [0.0, -0.0, 0.5, 1.5, -1.5, 1.0, 2.0, 1e-45, 1e-320, 1e-38, 3.4e38, 1e39, 1e308, -1e308, NAN, INF,
               -INF, 1e9, -7.0]
EDGE_TEXT = ["", " ", "\x00", "\ud800", "x\udfffy", "\ud83d", "\ufeff", "auto", "tensorrt_llm", "NaN", "1", "true",
             "null", "\u202e\u0000\uffff", "<|im_start|>", "<|endoftext|>", "😀" * 3, "é", "[", "{}", "\\", "\n" * 5]
HUGE_CHARS = ["a", "é", "😀", "word ", "\x00", "<|im_end|>", "\ud800"]


def cheap_int(v: int) -> int:
    """Output lengths are never in [3, 8192]: a valid request must not run a long generation."""
    return 2 if 3 <= v <= 8192 else v


def cheap_float(v: float) -> float:
    return 2.0 if math.isfinite(v) and 3 <= v <= 8192 else v


ints = st.one_of(st.sampled_from(EDGE_INTS), st.integers()).map(cheap_int)
floats = st.one_of(st.sampled_from(EDGE_FLOATS), st.floats()).map(cheap_float)
short_text = st.one_of(st.sampled_from(EDGE_TEXT), st.text(max_size=24),
                       st.text(st.characters(codec="utf-8"), max_size=8).map(lambda s: s + "\udc80"))
# A prompt is either short enough to prefill at once or far over the 8,192-token window: one just under it
# is valid and takes ~35 s to prefill on 2 cores, which is a cost, not what this fuzz is after.
HUGE_SIZES = st.one_of(st.sampled_from([100, 300]), st.integers(200_000, 300_000))  # <= 1,200 or > 40,000 tokens
huge_text = st.builds(lambda n, c: Huge(c, n), HUGE_SIZES, st.sampled_from(HUGE_CHARS))
deep = st.builds(  # nested far past any parser's recursion, balanced or not: through the front only
    lambda n, kind, close: Raw((kind * n).encode() + ((b"]" if kind == "[" else b"}") * n if close else b"")),
    st.sampled_from([10, 500, 990, 1100, 5000, 100_000, 500_000]), st.sampled_from(["[", '{"a":']),
    st.booleans())
raw_bad = st.sampled_from([
    Raw(b'"\xff\xfe"'), Raw(b'"\xed\xa0\x80"'), Raw(b'"\xc0\xaf"'), Raw(b'"ab\x80cd"'), Raw(b"NaN", False),
    Raw(b"-Infinity", False), Raw(b"1e999", False), Raw(b"9" * 5000), Raw(b"-" + b"9" * 4000, False),
    Raw(b"0x10"), Raw(b"'single'"), Raw(b"undefined"), Raw(b""), Raw(b'"unterminated'), Raw(b"[1,]"),
    Raw(b"{,}"), Raw(b'"\\ud800\\udc00"', False), Raw(b'"\\u0000"', False),
])
scalars = st.one_of(st.none(), st.booleans(), ints, floats, short_text)


def nested(children):
    return st.one_of(st.lists(children, max_size=4), st.dictionaries(st.text(max_size=6), children, max_size=4))


plain_values = st.recursive(scalars, nested, max_leaves=8)


def _pick(k, plain):
    if k < 4:
        return huge_text
    if k < 9:
        return deep
    if k < 16:
        return raw_bad
    if k < 20:  # absurd lengths (shapes): thousands to a million small items
        return st.builds(lambda n, v: Huge(v, n), st.sampled_from([1000, 70_000, 1_000_001]), st.sampled_from([0, "a"]))
    return plain


values = st.integers(0, 99).flatmap(lambda k: _pick(k, plain_values))


# -- the front -----------------------------------------------------------------------------------------
CHAT = [{"role": "user", "content": "Hi"}]
FRONT_BASE = {
    "/v1/chat/completions": {"model": "auto", "messages": CHAT, "max_tokens": 1, "temperature": 0},
    "/v1/completions": {"model": "auto", "prompt": "Hi", "max_tokens": 1, "temperature": 0},
    "/v1/tokenize": {"prompt": "Hi"},
    "/v1/detokenize": {"tokens": [1, 2, 3]},
    "/v1/responses": {"model": "auto", "input": "Hi", "max_output_tokens": 1, "temperature": 0},
    "/v1/conversations": {"items": CHAT, "metadata": {"k": "v"}},
}
SAMPLING_FIELDS = ["model", "max_tokens", "temperature", "top_p", "top_k", "seed", "min_tokens", "n", "best_of",
                   "stream", "stream_options", "stop", "ignore_eos", "user", "logprobs", "logit_bias"]
FRONT_FIELDS = {
    "/v1/chat/completions": SAMPLING_FIELDS + ["messages", "messages[0]", "messages[0].role", "messages[0].content",
                                               "messages[0].content[0]", "max_completion_tokens", "top_logprobs",
                                               "tools", "tool_choice", "parallel_tool_calls", "response_format",
                                               "messages[0].tool_calls", "prompt_cache_key", "safety_identifier",
                                               "zz_unknown"],
    "/v1/completions": SAMPLING_FIELDS + ["prompt", "echo", "suffix", "zz_unknown"],
    "/v1/tokenize": ["prompt", "messages", "messages[0].content", "model", "zz_unknown"],
    "/v1/detokenize": ["tokens", "tokens[0]", "zz_unknown"],
    "/v1/responses": ["model", "input", "input[0]", "input[0].role", "input[0].content", "input[0].content[0]",
                      "instructions", "max_output_tokens", "temperature", "top_p", "stream", "tools", "tool_choice",
                      "parallel_tool_calls", "text", "metadata", "user", "top_k", "min_tokens", "ignore_eos",
                      "store", "truncation",
                      "previous_response_id", "conversation", "include", "reasoning", "top_logprobs",
                      "prompt_cache_key", "safety_identifier", "zz_unknown"],
    "/v1/conversations": ["items", "items[0]", "items[0].role", "items[0].content", "items[0].content[0]", "metadata",
                          "zz_unknown"],
}
OUTPUT_LENGTHS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def set_field(body: dict, path: str, value) -> None:
    """`messages[0].content[0]` style paths; a missing container is made on the way."""
    m = re.fullmatch(r"(\w+)(?:\[0\])?(?:\.(\w+))?(?:\[0\])?", path)
    name, sub = m.group(1), m.group(2)
    if path != name and not (isinstance(body.get(name), list) and body[name] and isinstance(body[name][0], dict)):
        body[name] = json.loads(json.dumps(CHAT if name in ("messages", "input", "items") else [1, 2, 3]))
    if path == name:
        body[name] = value
    elif path == f"{name}[0]":
        body[name] = [value] + list(body.get(name, [])[1:])
    elif path.endswith("content[0]"):
        body[name] = [{**body[name][0], "content": [value]}]
    else:
        body[name] = [{**body[name][0], sub: value}]


def expected_params(path: str) -> set[str]:
    top = re.match(r"\w+", path).group(0)
    return {path, top, re.sub(r"\[0\]$", "", path)} | ({"prompt"} if top == "messages" and path != top else set())


def names_field(param: str, mutated: list[str]) -> bool:
    for path in mutated:
        for want in expected_params(path):
            if param == want or param.startswith((want + "[", want + ".")):
                return True
    return False


@st.composite
def front_requests(draw):
    path = draw(st.sampled_from(list(FRONT_BASE)))
    body = json.loads(json.dumps(FRONT_BASE[path]))
    mutated = draw(st.lists(st.sampled_from(FRONT_FIELDS[path]), min_size=1, max_size=3, unique=True))
    for field in mutated:
        if field in OUTPUT_LENGTHS:  # a wrong value, or 1-2: never a long generation
            value = draw(st.one_of(ints, floats, short_text, st.none().map(lambda _: 1), values))
        elif field in ("messages[0].role", "input[0].role"):
            value = draw(st.one_of(st.sampled_from(["user", "system", "assistant", "developer", "tool", "USER",
                                                    "function", ""]), values))
        else:
            value = draw(values)
        if field != "zz_unknown" and "[" not in field and field not in OUTPUT_LENGTHS and draw(st.integers(0, 9)) == 0:
            body.pop(field, None)  # missing
            continue
        set_field(body, field, value)
    if body.get("max_tokens") is None and path in ("/v1/chat/completions", "/v1/completions"):
        body["max_tokens"] = 1  # null or missing means 256 tokens: not a cheap request
    if body.get("max_output_tokens") is None and path == "/v1/responses":
        body["max_output_tokens"] = 1
    return path, body, mutated


# a larger body is refused unread, so no field can be named: over the front's max_body_bytes (4 MiB), or, from
# issue 29, over the key's tier bound (front/app.py tier_body_bytes of the fuzz tenant's enterprise tier)
BODY_LIMIT = min(4 * 1024 * 1024, tier_body_bytes(DEFAULT_TIERS["enterprise"]["max_prompt_bytes"]))


def front_post(stack, path: str, data: bytes, headers: dict | None = None):
    """(status, parsed JSON or None, raw body text, SSE events) for one POST to the front; status None:
    a body over the limit was cut off while the client still sent it (the front answers and closes)."""
    SENT["front"] += 1
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"} if headers is None else headers
    try:
        r = stack.session.post(stack.front_url + path, data=data, headers=headers, timeout=TIMEOUT, stream=True)
    except requests.Timeout:
        pytest.fail(f"the front did not answer {path} within {TIMEOUT} s (hang): {data[:200]!r}")
    except requests.ConnectionError:
        assert len(data) > BODY_LIMIT, f"connection broken for a {len(data)}-byte body: {data[:200]!r}"
        return None, None, "", []
    with r:
        events = []
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            try:
                for line in r.iter_lines():
                    if line.startswith(b"data: "):
                        events.append(line[6:])
            except requests.exceptions.RequestException as e:
                pytest.fail(f"the stream of {path} broke or hung: {e}")
            return r.status_code, None, "", events
        text = r.content.decode("utf-8", "replace")
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    return r.status_code, body, text, events


def check_front(status, body, text, events, mutated: list[str] | None, allow_no_param: bool, what):
    OUTCOMES[("front", status if not body or status < 400 else f"{status} {body['error'].get('param')}")] += 1
    if status is None:
        return
    assert status < 500, f"5xx from the front for {what}: {status} {text[:400]}"
    if events:
        assert status == 200, f"a stream answered {status} for {what}"
        if b'"sequence_number"' in events[-1]:  # the Responses API: typed events, the last one ends the response
            kinds = [json.loads(e).get("type") for e in events]
            assert kinds[-1] in ("response.completed", "response.incomplete") and "error" not in kinds, \
                f"the response stream did not complete for {what}: {events[-2:]}"
            return
        assert events[-1] == b"[DONE]", f"stream did not end with [DONE]: {events[-3:]}"
        for e in events[:-1]:
            assert "error" not in json.loads(e), f"error event in a stream for {what}: {e[:300]}"
        return
    assert body is not None, f"not JSON ({status}) for {what}: {text[:300]}"
    if status < 400:
        return
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, \
        f"not OpenAI's error shape for {what}: {text[:400]}"
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), text
    assert err["param"] is None or isinstance(err["param"], str), text
    assert err["code"] is None or isinstance(err["code"], str), text
    if mutated is None or status not in (400, 404):
        return
    param = err["param"]
    if param is None:
        assert allow_no_param, f"{status} names no field for {what}: {text[:400]}"
    elif param in ("max_tokens", "max_output_tokens") and ("context" in err["message"]
                                                          or err["code"] == "context_length_exceeded"):
        pass  # prompt + max_tokens over the window: both are named by max_tokens (Responses: max_output_tokens)
    else:
        assert names_field(param, mutated), f"param {param!r} is not the field that was wrong ({mutated}) " \
                                            f"for {what}: {text[:400]}"


@fuzz("front_fields")
@given(req=front_requests())
def test_front_fields_wrong_types_values_and_shapes_are_4xx_naming_the_field(stack, req):
    path, body, mutated = req
    data = dump(body)
    status, parsed, text, events = front_post(stack, path, data)
    check_front(status, parsed, text, events, mutated, has_raw(body) or len(data) > BODY_LIMIT, f"{path} {mutated}")
    assert_alive(stack)


def raw_bodies():
    return _raw_bodies().map(Raw)


@st.composite
def _raw_bodies(draw):
    base = dump(FRONT_BASE[draw(st.sampled_from(list(FRONT_BASE)))])
    kind = draw(st.sampled_from(["binary", "utf8", "nest", "truncate", "garbage", "not_object", "huge",
                                 "dup_keys", "empty"]))
    if kind == "binary":
        return draw(st.binary(max_size=200))
    if kind == "utf8":  # invalid UTF-8 spliced into a string value
        bad = draw(st.sampled_from([b"\xff", b"\xfe\xff", b"\xed\xa0\x80", b"\xc0\xaf", b"\x80", b"\xf4\x90\x80\x80"]))
        return base.replace(b'"Hi"', b'"H' + bad + b'i"').replace(b"[1, 2, 3]", b'["' + bad + b'"]')
    if kind == "nest":
        n = draw(st.sampled_from([50, 1000, 3000, 150_000, 1_000_000]))
        where = draw(st.sampled_from(["top", "value"]))
        opener = draw(st.sampled_from([b"[", b'{"a":', b'{"messages":[']))
        inner = opener * n
        if draw(st.booleans()):
            inner += (b"]" if opener == b"[" else b"}" if opener == b'{"a":' else b"]}") * n
        return inner if where == "top" else base[:-1] + b', "messages": ' + inner + b"}"
    if kind == "truncate":
        return base[: draw(st.integers(0, len(base) - 1))]
    if kind == "garbage":
        return base + draw(st.sampled_from([b"x", b"}", b",", b"\x00", b" {}", b"\n\n\n"]))
    if kind == "not_object":
        return draw(st.sampled_from([b"[]", b"null", b"1", b'"x"', b"true", b"[{}]", b"NaN", b"-0", b"1e999"]))
    if kind == "huge":  # at and over the 4 MiB body limit
        n = draw(st.sampled_from([4 * 1024 * 1024 - 40, 4 * 1024 * 1024 + 1, 6 * 1024 * 1024]))
        return b'{"prompt": "' + b"a" * n + b'", "max_tokens": 1}'
    if kind == "dup_keys":
        return base[:-1] + b', "max_tokens": "x", "max_tokens": 1}'
    return b""


@fuzz("front_raw")
@given(path=st.sampled_from(list(FRONT_BASE)), data=raw_bodies(),
       ctype=st.sampled_from(["application/json", "text/plain", "", "application/json; charset=latin-1"]))
def test_front_hostile_bodies_are_400_json(stack, path, data, ctype):
    headers = {"authorization": f"Bearer {KEY}"} | ({"content-type": ctype} if ctype else {})
    status, parsed, text, events = front_post(stack, path, data.text, headers)
    check_front(status, parsed, text, events, None, True, f"{path} {data!r}")
    assert_alive(stack)


KEYS = [None, "", "Bearer", "Bearer ", "Bearer k-wrong", "Basic " + KEY, "bearer " + KEY, KEY, "Bearer " + "k" * 6000,
        "Bearer " + KEY + "\t", "Bearer \x7f", b"Bearer \xff\xfe", "Bearer " + KEY.upper(),
        "Bearer sk-demo-acme-enterprise"]  # the demo tenant is not in this stack's config


@fuzz("front_http")
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
       path=st.one_of(st.sampled_from(["/v1/models", "/v1/models/tensorrt_llm", "/v1/models/nope", "/v1/models/",
                                       "/v1/chat/completions", "/v1/completions", "/v1/tokenize", "/v1/detokenize",
                                       "/v2/models/ensemble/generate", "/v2/logging", "/metrics", "/v1/models/%00",
                                       "/v1/models/" + "x" * 3000, "/v1/models/..%2f..%2fetc", "/%ff", "/v1//models"]),
                      st.text(st.characters(codec="ascii", exclude_characters="?#"), max_size=30)
                      .map(lambda s: "/v1/" + s.lstrip("/"))),
       key=st.sampled_from(KEYS), header=st.sampled_from(["authorization", "x-api-key"]))
def test_front_keys_methods_and_paths_never_5xx_and_nothing_served_without_a_key(stack, method, path, key, header):
    headers = {} if key is None else {header: key}
    body = dump(FRONT_BASE.get(path, {"prompt": "Hi", "max_tokens": 1}))
    SENT["front"] += 1
    try:
        r = stack.session.request(method, stack.front_url + path, data=body if method != "GET" else None,
                                  headers=headers, timeout=TIMEOUT)
    except requests.Timeout:
        pytest.fail(f"the front did not answer {method} {path} within {TIMEOUT} s")
    except requests.exceptions.InvalidHeader:
        SENT["front"] -= 1  # the client library refused to send it
        return
    assert r.status_code < 500, f"{method} {path} {key!r}: {r.status_code} {r.text[:300]}"
    if r.status_code >= 400:
        try:
            body = r.json()
        except ValueError:
            body = None
        check_front(r.status_code, body, r.text, [], None, True, f"{method} {path} {key!r}")
    elif path.startswith("/v1/"):
        assert valid_key(header, key), f"{method} {path} answered {r.status_code} to key {key!r} in {header}"
    assert_alive(stack)


def valid_key(header, key) -> bool:
    if not isinstance(key, str):
        return False
    if header == "authorization":
        return key.lower().startswith("bearer ") and key[7:].strip() == KEY
    return key.strip() == KEY


# -- Triton's internal HTTP ----------------------------------------------------------------------------
def kinds_of(model: str) -> dict[str, str]:
    return {t.name: t.data_type for t in CONTRACTS[model].inputs}


MODEL_FIELDS = {  # the field names a model-level error may use, per model (contract names and aliases)
    "ensemble": set(kinds_of("ensemble")),
    "gateway": set(kinds_of("gateway")) | {"api_key"},
    "preprocessing": set(kinds_of("preprocessing")) | {"text_input", "max_tokens", "bad_words", "stop_words",
                                                       "end_id", "pad_id", "messages", "tools", "min_tokens",
                                                       "min_length"},
    "postprocessing": set(kinds_of("postprocessing")),
    # the engine names request_output_len `max_tokens`, as clients of the ensemble and the gateway know it
    "tensorrt_llm": set(kinds_of("tensorrt_llm")) | {"top_k", "top_p", "stop_words", "bad_words", "max_tokens"},
}
ALIASES = {"runtime_top_k": "top_k", "runtime_top_p": "top_p", "stop_words_list": "stop_words",
           "bad_words_list": "bad_words", "QUERY": "text_input", "REQUEST_OUTPUT_LEN": "max_tokens",
           "BAD_WORDS_DICT": "bad_words", "STOP_WORDS_DICT": "stop_words", "END_ID": "end_id", "PAD_ID": "pad_id",
           "MESSAGES": "messages", "TOOLS": "tools", "MIN_TOKENS": "min_tokens", "MIN_LENGTH": "min_length",
           "request_output_len": "max_tokens"}
RELATED = [  # fields checked against each other: an error may name the other one
    {"input_ids", "input_lengths"}, {"min_tokens", "min_length"}, {"TOKENS_BATCH", "SEQUENCE_LENGTH"},
    {"max_tokens", "request_output_len", "text_input", "messages", "input_ids"},  # the context window
]
OUTPUT_LEN_FIELDS = {"max_tokens", "request_output_len", "REQUEST_OUTPUT_LEN"}
# Triton's core refusing a request before any model code runs (INVALID_ARG, HTTP 400): no field prefix
CORE_400 = re.compile("|".join([
    r"unexpected inference input '[^']*' for model", r"inference input '[^']*' data-type is '\w+', but model",
    r"unexpected shape for input '[^']*' for model", r"input '[^']*' batch size does not match other inputs",
    r"unexpected number of string elements \d+ for inference input", r"expected \d+ string elements for inference",
    r"invalid datatype for input", r"Request for unknown model", r"expected \d+ inputs but got \d+ inputs",
    r"inference request batch-size must be <=", r"input byte size mismatch for input",
    r"input '[^']*' has no shape but model requires batch dimension",
    r"generate expects model to produce exactly 1 response", r"out of bounds index \d+: request has 0 inputs",
]))
# Triton 2.51's HTTP JSON reader on a wrong JSON type: a 500 before any model runs (known; Triton is internal)
CORE_PARSE_500 = re.compile(r"^(Unable to parse|failed to parse the request JSON buffer)")


def check_contract_error(model: str, message: str, touched: set[str], what: str) -> None:
    """A model-level error: a 4xx kind, and an invalid_argument names a field of this model's contract."""
    err = parse(message)
    core = re.sub(r"\[request id: [^\]]*\] |'[^']*'|\d+", "_", message)[:70]
    OUTCOMES[(model, f"{err.kind} {err.field}" if err else f"core: {core}")] += 1
    if err is None:
        assert CORE_400.search(message), f"an error that is neither Triton's validation nor the contract for " \
                                         f"{what}: {message[:400]}"
        return
    assert 400 <= err.status < 500, f"{err.kind} ({err.status}) for {what}: {message[:400]}"
    if err.kind in ("invalid_argument", "context_too_long"):
        assert err.field, f"invalid_argument names no field for {what}: {message[:400]}"
        fields = MODEL_FIELDS[model]
        assert err.field in fields or ALIASES.get(err.field) in fields, \
            f"field {err.field!r} is not an input of {model} for {what}: {message[:400]}"
        wanted = touched | {ALIASES.get(t, t) for t in touched}
        wanted |= {name for group in RELATED if wanted & group for name in group}
        context = err.field in ("max_tokens", "request_output_len") and "context" in err.message
        assert err.field in wanted or context or not touched, \
            f"field {err.field!r} is not what was wrong ({sorted(touched)}) for {what}: {message[:400]}"


INT32_FIELDS = st.one_of(st.sampled_from(EDGE_INTS), st.integers(-2**31, 2**31 - 1))
INT64_RANGE = st.one_of(st.sampled_from([v for v in EDGE_INTS if -2**63 <= v < 2**63]), st.integers(-2**63, 2**63 - 1))
TYPED = {  # JSON values of the right JSON type for each Triton data type (Triton's reader accepts them)
    "TYPE_INT32": INT64_RANGE.map(cheap_int),
    "TYPE_FP32": st.one_of(st.sampled_from(EDGE_FLOATS), st.floats()).map(cheap_float),
    "TYPE_UINT64": st.one_of(st.sampled_from([0, 1, 2**32, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1)),
    "TYPE_BOOL": st.booleans(),
    "TYPE_STRING": st.one_of(
        st.sampled_from([s for s in EDGE_TEXT if not re.search("[\ud800-\udfff]", s)]),
        st.text(st.characters(codec="utf-8"), max_size=30),
        st.builds(Huge, st.sampled_from(["a", "é", "😀", "word "]), HUGE_SIZES),
        st.builds(json.dumps, plain_values),  # JSON text for `messages`
        st.sampled_from([json.dumps([{"role": "user", "content": "Hi"}]), json.dumps([{"role": 1, "content": []}]),
                         Long("[" * 100_000 + "]" * 100_000),
                         Long(json.dumps([{"role": "user", "content": "x" * 200_000}])), "[]",
                         "tokenize", "detokenize", "models", "generate"])),
}
WRONG_TYPE = st.one_of(  # wrong JSON types (string for a number, null, objects, negatives for UINT64 ...)
    st.none(), st.text(max_size=10), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.lists(st.one_of(st.none(), st.text(max_size=3), st.floats()), min_size=1, max_size=3), st.floats(),
    st.booleans(), st.sampled_from([-1, -2**63, 1.5, "1", [[1]], {"a": 1}]), st.integers(),
)
LIST_FIELDS = {"stop_words", "bad_words", "token_ids"}
GENERATE_BASE = {
    "ensemble": {"text_input": "Hi", "max_tokens": 1, "temperature": 0.0},
    "gateway": {"text_input": "Hi", "max_tokens": 1, "temperature": 0.0, "api_key": KEY},
}


def typed_value(draw, model, field):
    dtype = kinds_of(model).get(field)
    if field == "api_key":
        return draw(st.sampled_from([KEY, "", "k-wrong", Long("x" * 5000), "Bearer " + KEY, "\u00e9"]))
    if dtype is None:  # an unknown key: Triton passes it on as a request parameter
        return draw(st.one_of(st.text(max_size=10), st.integers(-2**63, 2**63 - 1), st.booleans()))
    value = draw(TYPED[dtype])
    if field in LIST_FIELDS and draw(st.booleans()):
        value = draw(st.lists(TYPED[dtype], max_size=4))
    return value


def generate_post(stack, model: str, body: dict, stream: bool):
    SENT["triton_http"] += 1
    url = f"http://{stack.http_url}/v2/models/{model}/generate" + ("_stream" if stream else "")
    try:
        r = stack.session.post(url, data=dump(body), timeout=TIMEOUT)
    except requests.Timeout:
        pytest.fail(f"Triton did not answer {model} within {TIMEOUT} s (hang): {dump(body)[:300]!r}")
    return r


def error_text(r) -> str:
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        for line in r.text.splitlines():
            if line.startswith("data: ") and '"error"' in line:
                return json.loads(line[6:])["error"]
        return ""
    try:
        return r.json().get("error", "")
    except ValueError:
        return r.text


@st.composite
def generate_requests(draw, wrong_types: bool):
    model = draw(st.sampled_from(list(GENERATE_BASE)))
    body = dict(GENERATE_BASE[model])
    fields = sorted(kinds_of(model)) * 3 + ["zz_unknown"] + (["api_key"] * 2 if model == "gateway" else [])
    touched = draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True))
    for field in touched:
        if not wrong_types and draw(st.integers(0, 9)) == 0 and field not in OUTPUT_LEN_FIELDS:
            body.pop(field, None)
            continue
        if wrong_types and field in kinds_of(model):
            body[field] = draw(WRONG_TYPE)
        else:
            body[field] = typed_value(draw, model, field)
        if field in OUTPUT_LEN_FIELDS and not isinstance(body[field], int) and not wrong_types:
            body[field] = 1
    if wrong_types and draw(st.booleans()):  # a wrong type hides among valid ones: keep the output cheap
        body.setdefault("max_tokens", 1)
    if isinstance(body.get("max_tokens"), int) and not isinstance(body.get("max_tokens"), bool):
        body["max_tokens"] = cheap_int(body["max_tokens"])
    return model, body, set(touched), draw(st.integers(0, 9)) == 0


def check_generate(r, model, touched, what, allow_core_parse_500: bool):
    text = error_text(r)
    if r.status_code == 200 and not text:
        OUTCOMES[(model, "200 / ok")] += 1
        return
    if r.status_code == 500 and allow_core_parse_500 and CORE_PARSE_500.search(text):
        OUTCOMES[(model, "Triton's JSON reader: 500 " + text.split(":")[0])] += 1
        return
    assert r.status_code in (200, 400), f"{r.status_code} for {what}: {r.text[:400]}"
    check_contract_error(model, text, {t for t in touched if t != "zz_unknown"}, what)


@fuzz("triton_http_typed")
@given(req=generate_requests(wrong_types=False))
def test_triton_http_generate_bad_values_are_400_naming_the_field(stack, req):
    model, body, touched, stream = req
    r = generate_post(stack, model, body, stream)
    check_generate(r, model, touched, f"{model} {body!r:.300}", allow_core_parse_500=False)
    assert_alive(stack)


@fuzz("triton_http_mistyped")
@given(req=generate_requests(wrong_types=True))
def test_triton_http_generate_wrong_json_types_never_kill_or_hang_it(stack, req):
    model, body, touched, stream = req
    r = generate_post(stack, model, body, stream)
    check_generate(r, model, touched, f"{model} {body!r:.300}", allow_core_parse_500=True)
    assert_alive(stack)


WIRE = {"TYPE_STRING": "BYTES", "TYPE_BOOL": "BOOL", "TYPE_INT32": "INT32", "TYPE_INT64": "INT64",
        "TYPE_UINT64": "UINT64", "TYPE_FP32": "FP32"}
SMALL_SHAPES = [[1, 1], [1], [1, 2], [2, 1], [1, 0], [0, 1], [1, 1, 1], [1, 3], [1, 2, 3], [1, 1, 4], [1, 2, 1], []]


def tensor_values(dtype: str, n: int):
    if dtype in ("BYTES",):
        return st.lists(TYPED["TYPE_STRING"].filter(lambda s: not isinstance(s, Huge)), min_size=n, max_size=n)
    if dtype == "BOOL":
        return st.lists(st.booleans(), min_size=n, max_size=n)
    if dtype in ("FP32", "FP64"):
        return st.lists(TYPED["TYPE_FP32"], min_size=n, max_size=n)
    if dtype == "UINT64":
        return st.lists(TYPED["TYPE_UINT64"], min_size=n, max_size=n)
    return st.lists(st.one_of(INT64_RANGE, st.integers(-5, 50_000)).map(cheap_int), min_size=n, max_size=n)


INFER_BASE = {
    "preprocessing": {"QUERY": ("BYTES", [1, 1], ["Hi"]), "REQUEST_OUTPUT_LEN": ("INT32", [1, 1], [1])},
    "postprocessing": {"TOKENS_BATCH": ("INT32", [1, 1, 3], [4879, 85, 2]), "SEQUENCE_LENGTH": ("INT32", [1, 1], [3])},
}


@st.composite
def infer_tensors(draw, model):
    """{name: (datatype, shape, values)}: a valid base with 1-3 tensors made wrong (small shapes only)."""
    tensors = dict(INFER_BASE[model])
    names = sorted(kinds_of(model)) * 4 + ["FOO", "query"]
    touched = draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True))
    for name in touched:
        how = draw(st.sampled_from(["value"] * 7 + ["dtype", "shape", "drop"]))
        dtype = WIRE.get(kinds_of(model).get(name), "BYTES")
        shape = [1, 1] if name not in ("TOKENS_BATCH",) else [1, 1, draw(st.integers(1, 4))]
        if name in ("BAD_WORDS_DICT", "STOP_WORDS_DICT"):
            shape = [1, draw(st.integers(1, 4))]
        if how == "drop":
            tensors.pop(name, None)
            continue
        if how == "dtype":
            dtype = draw(st.sampled_from(["BYTES", "INT32", "INT64", "FP32", "FP64", "BOOL", "UINT64", "INT8"]))
        if how == "shape":
            shape = draw(st.sampled_from(SMALL_SHAPES))
        n = math.prod(shape)
        if how == "shape" and draw(st.booleans()):
            n = draw(st.integers(0, 4))  # data that may not fill the shape
        tensors[name] = (dtype, shape, draw(tensor_values(dtype if dtype != "INT8" else "INT32", n)))
    if model == "preprocessing" and "REQUEST_OUTPUT_LEN" in tensors:
        dtype, shape, vals = tensors["REQUEST_OUTPUT_LEN"]
        tensors["REQUEST_OUTPUT_LEN"] = (dtype, shape, [cheap_int(v) if isinstance(v, int) else v for v in vals])
    return tensors, set(touched)


@fuzz("triton_http_infer")
@given(data=st.data(), model=st.sampled_from(["preprocessing", "postprocessing", "nosuchmodel"]))
def test_triton_http_infer_bad_tensors_are_4xx(stack, data, model):
    tensors, touched = data.draw(infer_tensors("preprocessing" if model == "nosuchmodel" else model))
    body = {"inputs": [{"name": n, "datatype": d, "shape": s, "data": v} for n, (d, s, v) in tensors.items()]}
    SENT["triton_http"] += 1
    try:
        r = stack.session.post(f"http://{stack.http_url}/v2/models/{model}/infer", data=dump(body), timeout=TIMEOUT)
    except requests.Timeout:
        pytest.fail(f"Triton did not answer {model}/infer within {TIMEOUT} s: {dump(body)[:300]!r}")
    what = f"{model}/infer {dump(body)[:300]!r}"
    if model == "nosuchmodel":
        assert r.status_code in (400, 404), f"{r.status_code} for {what}: {r.text[:300]}"
    elif r.status_code != 200:
        misshaped = any(len(v) != math.prod(s) for _, s, v in tensors.values())
        if r.status_code == 500 and misshaped and CORE_PARSE_500.search(r.json()["error"]):
            OUTCOMES[(model, "Triton's JSON reader: 500, data does not fill shape")] += 1
        else:
            assert r.status_code == 400, f"{r.status_code} for {what}: {r.text[:400]}"
            check_contract_error(model, r.json()["error"], touched & set(kinds_of(model)), what)
    assert_alive(stack)


# -- Triton's gRPC -------------------------------------------------------------------------------------
NUMPY = {"BYTES": np.object_, "BOOL": np.bool_, "INT32": np.int32, "INT64": np.int64, "UINT64": np.uint64,
         "FP32": np.float32, "FP64": np.float64, "INT8": np.int8, "FP16": np.float16, "UINT8": np.uint8}
GRPC_BASE = {
    "ensemble": {"text_input": ("BYTES", [1, 1], [b"Hi"]), "max_tokens": ("INT32", [1, 1], [1]),
                 "stream": ("BOOL", [1, 1], [True])},
    "gateway": {"text_input": ("BYTES", [1, 1], [b"Hi"]), "max_tokens": ("INT32", [1, 1], [1]),
                "stream": ("BOOL", [1, 1], [True])},
    "tensorrt_llm": {"input_ids": ("INT32", [1, 3], [1, 2, 3]), "input_lengths": ("INT32", [1, 1], [3]),
                     "request_output_len": ("INT32", [1, 1], [1]), "streaming": ("BOOL", [1, 1], [True])},
    "preprocessing": {k: (d, s, [x.encode() if isinstance(x, str) else x for x in v])
                      for k, (d, s, v) in INFER_BASE["preprocessing"].items()},
    "postprocessing": INFER_BASE["postprocessing"],
}
BAD_BYTES = [b"", b"\xff\xfe", b"\xed\xa0\x80", b"\xc0\xaf", b"a\x00b", b"\x80" * 10, Huge(b"x", 200_000),
             Huge("😀".encode(), 100_000), Huge(b"[", 200_000),
             json.dumps([{"role": "user", "content": "Hi"}]).encode(),
             b'[{"role": "user", "content": "\\ud800"}]', b'[{"role": "user", "content": 5}]',
             b'[{"role": "' + b"\xff" + b'", "content": "x"}]', b"[]", b"{}", b"null", b"tokenize", b"models",
             b"detokenize", b"auto", b"tensorrt_llm", b"nope"]


def grpc_values(dtype: str, n: int):
    if dtype == "BYTES":
        return st.lists(st.one_of(st.sampled_from(BAD_BYTES), st.binary(max_size=30),
                                  TYPED["TYPE_STRING"].map(lambda s: s if isinstance(s, Huge) else s.encode())),
                        min_size=n, max_size=n)
    return tensor_values(dtype, n)


@st.composite
def grpc_tensors(draw, model):
    tensors = dict(GRPC_BASE[model])
    kinds = kinds_of(model)
    names = sorted(kinds) * 4 + ["FOO", "Text_Input"]
    touched = draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True))
    for name in touched:
        how = draw(st.sampled_from(["value"] * 7 + ["dtype", "shape", "drop"]))
        dtype = WIRE.get(kinds.get(name), "BYTES")
        dims = next((t.dims for t in CONTRACTS[model].inputs if t.name == name), (1,))
        shape = [1] + [d if d > 0 else draw(st.integers(1, 4)) for d in dims]
        if how == "drop":
            tensors.pop(name, None)
            continue
        if how == "dtype":
            dtype = draw(st.sampled_from(["BYTES", "INT32", "INT64", "FP32", "FP64", "BOOL", "UINT64", "INT8", "FP16"]))
        if how == "shape":
            shape = draw(st.sampled_from(SMALL_SHAPES[:-1]))
        values = draw(grpc_values(dtype, math.prod(shape)))
        if name in OUTPUT_LEN_FIELDS:
            values = [cheap_int(int(v)) if isinstance(v, int) and not isinstance(v, bool) else v for v in values]
        tensors[name] = (dtype, shape, values)
    return tensors, {t for t in touched if t in kinds}


def grpc_inputs(tensors):
    out = []
    for name, (dtype, shape, values) in tensors.items():
        npd = NUMPY[dtype]
        if npd is np.object_:
            arr = np.empty(len(values), dtype=object)
            plain = [v.value() if isinstance(v, Huge) else v for v in values]
            arr[:] = [v.encode() if isinstance(v, str) else v for v in plain]
            arr = arr.reshape(shape)
        else:
            with np.errstate(all="ignore"):
                info = np.iinfo(npd) if np.issubdtype(npd, np.integer) else None
                vals = [min(max(int(v), info.min), info.max) if info is not None and not isinstance(v, float)
                        else (0 if info is not None and not math.isfinite(v) else v) for v in values]
                arr = np.array(vals, dtype=npd).reshape(shape)
        t = grpcclient.InferInput(name, shape, dtype)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def grpc_stream(stack, model: str, inputs, headers=None) -> tuple[str | None, int]:
    """One request on a fresh gRPC stream: (error message or None, responses); fails on a hang."""
    events = queue.Queue()
    client = stack.grpc
    client.start_stream(callback=lambda result, error: events.put((result, error)), headers=headers)
    try:
        client.async_stream_infer(model, inputs, request_id=uuid.uuid4().hex, enable_empty_final_response=True)
        SENT["grpc"] += 1
        n = 0
        while True:
            try:
                result, error = events.get(timeout=TIMEOUT)
            except queue.Empty:
                pytest.fail(f"{model}: no answer on the gRPC stream within {TIMEOUT} s (hang)")
            if error is not None:
                return (error.message() if isinstance(error, InferenceServerException) else str(error)), n
            n += 1
            if result.get_response().parameters["triton_final_response"].bool_param:
                OUTCOMES[(model, "200 / ok")] += 1
                return None, n
    finally:
        client.stop_stream(cancel_requests=True)


@fuzz("grpc_stream")
@given(data=st.data(), model=st.sampled_from(["ensemble", "gateway", "tensorrt_llm"]),
       key=st.sampled_from([KEY] * 6 + [None, "", "k-wrong", "x" * 4000]),
       name=st.sampled_from([None] * 12 + ["nosuchmodel", "ENSEMBLE", "gateway ", ""]))
def test_grpc_stream_bad_tensors_are_invalid_argument_naming_the_field(stack, data, model, key, name):
    tensors, touched = data.draw(grpc_tensors(model))
    if model == "tensorrt_llm" and data.draw(st.booleans()):  # keep most engine requests past the core checks
        tensors = {**GRPC_BASE[model], **{k: v for k, v in tensors.items() if k in touched}}
    headers = {"authorization": f"Bearer {key}"} if key is not None and model == "gateway" else None
    what = f"{name or model} {sorted(touched)} {tensors!r:.400}"
    try:
        inputs = grpc_inputs(tensors)
    except (ValueError, InferenceServerException, OverflowError):
        return  # the client library refuses it before sending
    message, _ = grpc_stream(stack, name if name is not None else model, inputs, headers)
    if message is not None:
        if name is not None:
            assert "unknown model" in message or "not found" in message, f"{what}: {message[:300]}"
        else:
            check_contract_error(model, message, touched, what)
    assert_alive(stack)


GRPC_4XX = {"StatusCode.INVALID_ARGUMENT", "StatusCode.NOT_FOUND", "StatusCode.UNIMPLEMENTED"}


@fuzz("grpc_infer")
@given(data=st.data(), model=st.sampled_from(["preprocessing", "postprocessing"]))
def test_grpc_infer_bad_tensors_are_invalid_argument(stack, data, model):
    tensors, touched = data.draw(grpc_tensors(model))
    try:
        inputs = grpc_inputs(tensors)
    except (ValueError, InferenceServerException, OverflowError):
        return
    SENT["grpc"] += 1
    what = f"{model} {sorted(touched)} {tensors!r:.400}"
    try:
        stack.grpc.infer(model, inputs, client_timeout=TIMEOUT)
        OUTCOMES[(model, "200 / ok")] += 1
    except InferenceServerException as e:
        assert "Deadline" not in str(e.status()), f"{model}: no answer within {TIMEOUT} s (hang): {what}"
        assert str(e.status()) in GRPC_4XX, f"{e.status()} for {what}: {e.message()[:400]}"
        check_contract_error(model, e.message(), touched, what)
    assert_alive(stack)


# -- what the fuzz found, kept as plain cases ------------------------------------------------------------
SURROGATE = b"\\ud800"  # a JSON escape of a lone surrogate: valid JSON, not text (UTF-8 cannot encode it)
CESU = b"\xed\xa0\x80"  # the same surrogate encoded as bytes: Python's json reads it with surrogatepass


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", b'{"prompt": "a' + SURROGATE + b'", "max_tokens": 1}', "prompt"),
    ("/v1/completions", b'{"prompt": "a' + CESU + b'", "max_tokens": 1}', "prompt"),
    ("/v1/completions", b'{"prompt": ["' + SURROGATE + b'"], "max_tokens": 1}', "prompt"),
    ("/v1/completions", b'{"prompt": "a", "max_tokens": 1, "stop": ["' + SURROGATE + b'"]}', "stop"),
    ("/v1/completions", b'{"prompt": "a", "max_tokens": 1, "model": "' + SURROGATE + b'"}', "model"),
    ("/v1/completions", b'{"prompt": "a", "max_tokens": 1, "user": "' + CESU + b'"}', "user"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x' + SURROGATE + b'y"}], "max_tokens": 1}',
     "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "' + CESU + b'"}]}],'
     b' "max_tokens": 1}', "messages[0].content"),
    ("/v1/tokenize", b'{"messages": [{"role": "user", "content": "' + SURROGATE + b'"}]}', "messages[0].content"),
    ("/v1/detokenize", b'{"tokens": [1, 2147483647]}', "tokens"),  # the gateway's token_ids, as OpenAI's name
])
def test_found_by_the_fuzz_front_errors_name_the_field(stack, path, body, param):
    """Each was a 500 (TypeError or UnicodeEncodeError on the way to the gateway) or named `token_ids`."""
    status, parsed, text, events = front_post(stack, path, body)
    assert status == 400 and parsed["error"]["param"] == param, text
    check_front(status, parsed, text, events, [param], False, path)
    assert_alive(stack)


def test_found_by_the_fuzz_a_key_gRPC_cannot_carry_is_401(stack):
    """A key with a control character was a 500 "Invalid metadata" from the front's gRPC call. A control
    character is no part of a header value (RFC 9110: VCHAR or obs-text), so the front's HTTP parser refuses
    the request; obs-text is a header the parser takes, and a key no tenant has."""
    for key, status, code in (("Bearer \x7f", 400, "invalid_http"), ("Bearer k\x01", 400, "invalid_http"),
                              (b"Bearer \xff\xfe", 401, "invalid_api_key")):
        SENT["front"] += 1
        r = stack.session.get(stack.front_url + "/v1/models", headers={"authorization": key}, timeout=TIMEOUT)
        assert r.status_code == status and r.json()["error"]["code"] == code, r.text
    assert_alive(stack)


@pytest.mark.parametrize("messages", [
    '[{"role": "user", "content": "\\ud800"}]', '[{"role": "\\udfff", "content": "x"}]'])
def test_found_by_the_fuzz_gateway_messages_with_a_lone_surrogate_are_400(stack, messages):
    """Lone surrogates in `messages` reached the chat template: a 500 TypeError from the tokenizer."""
    body = {"messages": messages, "max_tokens": 1, "api_key": KEY}
    r = generate_post(stack, "gateway", body, False)
    err = parse(r.json()["error"])
    assert r.status_code == 400 and err.kind == "invalid_argument" and err.field == "messages", r.text
    message, _ = grpc_stream(stack, "gateway", grpc_inputs({
        "messages": ("BYTES", [1, 1], [messages.encode()]), "max_tokens": ("INT32", [1, 1], [1])}),
        {"authorization": f"Bearer {KEY}"})
    err = parse(message or "")
    assert err is not None and err.kind == "invalid_argument" and err.field == "messages", message
    assert_alive(stack)


def test_zz_at_least_2000_bad_requests_were_sent_and_nothing_died(stack):
    if not {"front", "triton_http", "grpc"} <= set(SENT):
        pytest.skip(f"only part of the fuzz ran: {dict(SENT)}")
    assert_alive(stack)
    total = SENT["front"] + SENT["triton_http"] + SENT["grpc"]
    print(f"fuzz requests: {dict(SENT)}, total {total}")
    for (surface, answer), n in sorted(OUTCOMES.items(), key=lambda kv: (str(kv[0][0]), -kv[1])):
        print(f"  {surface:15} {n:5}  {answer}")
    assert total >= MIN_REQUESTS, dict(SENT)
