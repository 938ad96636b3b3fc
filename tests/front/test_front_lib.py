"""The front's library without a server: OpenAI bodies -> GatewayCall, stop strings, error bodies."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.errors import ServingError
from front.app import _SseText
from front.choices import Choices
from front.connections import DIRECT_BODY
from front.openai_schema import (
    Choice, ResponseBuilder, Completion, GatewayCall, error_body, parse_json, parse_request, parse_token_ids, retry_after_header,
)
from front.stop import StopMatcher

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def bad(body, chat=True):
    with pytest.raises(ServingError) as e:
        parse_request(body, chat, 256)
    assert e.value.kind == "invalid_argument" and e.value.status == 400
    return e.value


def test_a_chat_body_becomes_one_gateway_call():
    call = parse_request({**CHAT, "model": "tensorrt_llm", "max_completion_tokens": 9, "max_tokens": 3,
                          "temperature": 0, "top_p": 0.5, "seed": 7, "stop": "\n", "stream": True,
                          "stream_options": {"include_usage": True}, "min_tokens": 2, "ignore_eos": True}, True, 256)
    assert call.max_tokens == 9 and call.model == "tensorrt_llm" and call.stop == ["\n"]
    assert call.sampling == {"temperature": 0.0, "top_p": 0.5, "seed": 7, "min_tokens": 2}
    assert call.stream and call.include_usage and call.ignore_eos
    assert parse_request(CHAT, True, 256).max_tokens == 256 and parse_request(CHAT, True, 256).model == "auto"


def test_content_parts_and_the_developer_role_are_understood():
    call = parse_request({"messages": [{"role": "developer", "content": "be brief"},
                                       {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                    {"type": "text", "text": "b"}]}]}, True, 8)
    assert call.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]


@pytest.mark.parametrize("body,param", [
    ({**CHAT, "n": 0}, "n"),
    ({**CHAT, "n": 129}, "n"),
    ({**CHAT, "temperature": float("nan")}, "temperature"),
    ({**CHAT, "temperature": True}, "temperature"),
    ({**CHAT, "temperature": "hot"}, "temperature"),
    ({**CHAT, "top_p": 1.5}, "top_p"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "max_tokens": True}, "max_tokens"),
    ({**CHAT, "max_tokens": 1.5}, "max_tokens"),
    ({**CHAT, "seed": -1}, "seed"),
    ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({**CHAT, "stop": [1]}, "stop"),
    ({**CHAT, "stream": "yes"}, "stream"),
    ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    ({**CHAT, "top_logprobs": 3}, "top_logprobs"),  # needs logprobs: true
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({**CHAT, "logit_bias": {"x": 1}}, "logit_bias"),
    ({**CHAT, "logit_bias": {"5": 101}}, "logit_bias"),
    ({**CHAT, "presence_penalty": 2.5}, "presence_penalty"),
    ({**CHAT, "frequency_penalty": "much"}, "frequency_penalty"),
    ({**CHAT, "functions": [{"name": "f"}]}, "functions"),  # deprecated by OpenAI: refused
    ({**CHAT, "some_field_nobody_knows": 1}, "some_field_nobody_knows"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"messages": ["hi"]}, "messages[0]"),
])
def test_each_bad_field_is_a_400_naming_it(body, param):
    assert bad(body).field == param


def test_completions_take_one_prompt_as_text_or_token_ids():
    assert parse_request({"prompt": ["one"]}, False, 4).text == "one"
    for prompt in ([1, 2, 3], [[1, 2, 3]]):  # lm-evaluation-harness sends [[ids]]
        call = parse_request({"prompt": prompt}, False, 4)
        assert call.prompt_ids == [1, 2, 3] and call.text is None
    for prompt in (["a", "b"], [[1], [2]], [-1], [True], []):
        assert bad({"prompt": prompt}, chat=False).field == "prompt"


def test_best_of_is_n_or_refused():
    assert parse_request({"prompt": "x", "n": 2, "best_of": 2}, False, 4).n == 2
    assert bad({"prompt": "x", "n": 2, "best_of": 3}, chat=False).field == "best_of"
    assert bad({**CHAT, "best_of": 1}).field == "best_of"  # not a chat field


def test_temperature_samples_over_the_whole_distribution_unless_top_p_or_top_k_is_given():
    assert parse_request({**CHAT, "temperature": 0.7}, True, 4).sampling == {"temperature": 0.7, "top_p": 1.0}
    assert parse_request({**CHAT, "temperature": 0.7, "top_k": 5}, True, 4).sampling == {"temperature": 0.7,
                                                                                         "top_k": 5}
    assert parse_request({**CHAT, "temperature": 0}, True, 4).sampling == {"temperature": 0.0}


def test_bodies_are_bounded_before_parsing():
    for raw in (b"[" * 100_000, b"\xff", b"[1]", b"x" * 11):
        with pytest.raises(ServingError) as e:
            parse_json(raw, 10 if raw == b"x" * 11 else 1 << 20)
        assert e.value.status == 400
    assert parse_json(b'{"a": 1}', 100) == {"a": 1}


def test_token_ids_must_be_integers():
    assert parse_token_ids({"tokens": [1, 2]}) == [1, 2]
    for tokens in ([True], [-1], ["1"], "12", [1.5]):
        with pytest.raises(ServingError):
            parse_token_ids({"tokens": tokens})


def test_stop_matcher_cuts_at_the_first_stop_and_holds_a_possible_start():
    m = StopMatcher(["END", "\n\n"])
    assert m.push("Paris.") == "Paris."
    assert m.push(" E") == " "  # "E" may start "END"
    assert m.push("N") == ""
    assert m.push("x") == "ENx"  # it did not
    assert m.push("\n") == ""
    assert m.push("\nmore") == "" and m.stopped
    assert m.finish() == "" and m.push("later") == ""
    tail = StopMatcher(["END"])
    assert tail.push("abc EN") == "abc " and tail.finish() == "EN"


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.text(alphabet="ab\n", max_size=30), st.lists(st.integers(1, 5), max_size=10),
       st.lists(st.text(alphabet="ab\n", min_size=1, max_size=3), min_size=1, max_size=3))
def test_stop_matcher_equals_cutting_the_whole_text(text, cuts, stops):
    """However the text is split into pieces, the output is the text up to the first stop string."""
    m, out, i = StopMatcher(stops), [], 0
    for n in cuts:
        out.append(m.push(text[i:i + n]))
        i += n
    out.append(m.push(text[i:]))
    out.append(m.finish())
    first = min((text.find(s) for s in stops if s in text), default=len(text))
    assert "".join(out) == text[:first]


def test_errors_are_openai_bodies_with_retry_after_rounded_up():
    err = ServingError("rate_limited", "slow down", field=None, retry_after=2.1)
    assert error_body(err) == {"error": {"message": "slow down", "type": "rate_limit_error", "param": None,
                                         "code": "rate_limit_exceeded"}}
    assert retry_after_header(err) == {"Retry-After": "3"}
    assert retry_after_header(ServingError("invalid_argument", "x")) == {}
    assert error_body(ServingError("context_too_long", "long", field="max_tokens"))["error"]["code"] == \
        "context_length_exceeded"


def test_chunks_share_one_id_and_the_usage_chunk_has_no_choices():
    b = ResponseBuilder(chat=True)
    first, last = b.chunk("m", "Hi", first=True), b.chunk("m", None, "stop")
    assert first["id"] == last["id"] and first["choices"][0]["delta"] == {"role": "assistant", "content": "Hi"}
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"
    usage = b.usage_chunk(Completion([Choice(0, "Hi", "stop")], "m", 3, 1))
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 1,
                                                         "total_tokens": 4}


def test_an_unknown_engine_model_on_a_direct_stream_is_unavailable_not_a_404():
    """The gateway routed the stream to this model: Triton not knowing it means it is being reloaded
    (its stub died; issue 27), a 503 with Retry-After, never the client's 404."""
    from front.engine_direct import _engine_error
    from front.gateway_client import to_serving_error
    from tritonclient.utils import InferenceServerException

    raw = InferenceServerException("Request for unknown model: 'tensorrt_llm' has no available versions",
                                   status="StatusCode.UNAVAILABLE")
    err = _engine_error(to_serving_error(raw), "tensorrt_llm")
    assert err.kind == "unavailable" and err.status == 503 and err.retry_after
    other = ServingError("invalid_argument", "bad", field="temperature")
    assert _engine_error(other, "tensorrt_llm") is other


def test_the_channels_own_error_on_a_stream_keeps_its_grpc_status():
    """tritonclient's aio stream raises the channel's AioRpcError as it is (not an InferenceServerException):
    tritonserver gone mid-stream is UNAVAILABLE, a 503 the client may retry, not a 500 (seen when the
    launcher replaced tritonserver during a stream)."""
    import grpc
    from front.gateway_client import to_serving_error

    raw = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                               details='pb_stub.cc:930] "Cannot remove future from background; KeyError"')
    err = to_serving_error(raw)
    assert err.kind == "unavailable" and err.status == 503 and "KeyError" not in err.message
    raw = grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                               details="Internal error from Core")  # a server killed mid-stream (3-kill test)
    err = to_serving_error(raw)
    assert err.kind == "unavailable" and err.status == 503 and err.retry_after
    raw = grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(),
                               details="bad input")
    assert to_serving_error(raw).kind == "invalid_argument"


def test_each_choice_keeps_the_reason_its_stream_gave_unless_a_stop_string_ended_it_first():
    from front.gateway_client import Piece
    call = parse_request({**CHAT, "n": 3, "stop": "!", "max_tokens": 4}, True, 256)
    choices = Choices(call)
    for piece in (Piece("ab", False, index=0), Piece("", False, index=0, finish_reason="stop"),
                  Piece("abcd", False, index=1), Piece("", False, index=1, finish_reason="length"),
                  Piece("a!cd", False, index=2), Piece("", False, index=2, finish_reason="length")):
        choices.push(piece)
    last = Piece("", True, finish_reason="length")  # the request's: one of its sequences was cut
    choices.push(last)
    choices.flush()
    done = choices.completion(last)
    assert [(c.text, c.finish_reason) for c in done.choices] == [("ab", "stop"), ("abcd", "length"), ("a", "stop")]


@pytest.mark.parametrize("chat", [True, False])
def test_a_tokens_sse_event_is_byte_for_byte_the_chunks(chat):
    """The per-token fast path (ResponseBuilder.text_event: only the text encoded) writes what sse(chunk)
    writes, whatever the text, the model name, the choice and include_usage."""
    from front.app import sse

    out = ResponseBuilder(chat)
    for model in ("tensorrt_llm", 'odd "name"\\'):
        for usage in (False, True):
            for index in (0, 2):
                for text in ("a", " word", 'quote " and \\ backslash', "new\nline\t\x00", "é😀\u2028", "\x00TEXT\x00"):
                    assert out.text_event(model, text, index, usage) == \
                        sse(out.chunk(model, text, index=index, include_usage=usage)), (model, usage, index, text)


def test_the_gateways_small_inputs_are_shared_and_a_requests_own_are_not():
    """gateway_inputs shares the InferInputs of small values (stream, model, operation, a lease call's
    inputs) across requests, each what a fresh input is on the wire; text and user stay a request's own."""
    from contracts.grpc_inputs import grpc_input
    from contracts.tensors import GATEWAY
    from front.gateway_client import gateway_inputs
    from front.openai_schema import GatewayCall

    def wire(t):
        return t._get_tensor().SerializeToString(), t._get_content()

    call = GatewayCall(max_tokens=7, text="hello", stream=True, ignore_eos=True, user="u1",
                       sampling={"temperature": 0.0, "seed": 1})
    values = {"max_tokens": 7, "text_input": "hello", "stream": True, "model": "auto", "ignore_eos": True,
              "operation": "admit", "user": "u1", "temperature": 0.0, "seed": 1}
    first, again = gateway_inputs(call, "admit"), gateway_inputs(call, "admit")
    assert sorted(t.name() for t in first) == sorted(values)
    for t in first:
        assert wire(t) == wire(grpc_input(GATEWAY, t.name(), [[values[t.name()]]])), t.name()
    shared = {t.name() for t, u in zip(first, again) if t is u}
    assert shared == set(values) - {"text_input", "user"}
    # True and 1 are equal dict keys but different values here: one is not served for the other
    one = {t.name(): t for t in gateway_inputs(GatewayCall(max_tokens=1, ignore_eos=True), "admit")}
    assert wire(one["max_tokens"]) == wire(grpc_input(GATEWAY, "max_tokens", [[1]]))
    assert wire(one["ignore_eos"]) == wire(grpc_input(GATEWAY, "ignore_eos", [[True]]))


class _AbandonedCall:
    """What end_abandoned needs of a stream: drain (ends within the bound or not) and cancel."""

    def __init__(self, ends_after_s: float | None):
        self.ends_after_s, self.cancelled, self.drained_for = ends_after_s, False, None

    async def drain(self, timeout_s: float) -> bool:
        self.drained_for = timeout_s
        return self.ends_after_s is not None and self.ends_after_s <= timeout_s

    def cancel(self) -> None:
        self.cancelled = True


@pytest.mark.parametrize("known,ends_after_s,sent,how,drained_for", [
    (True, 2.0, True, "stop", "max"),       # stopped, read to its end: never cancelled
    (True, None, True, "cancel", "max"),    # stopped but never ended within DRAIN_MAX_S
    (False, 0.5, True, "stop", 1.0),        # the server did not know it, and it ended (it had just finished)
    (False, 5.0, True, "cancel", 1.0),      # did not know it (not started yet) and it goes on: cancelled
    (True, 2.0, False, "cancel", None),     # the stop could not be sent
])
def test_an_abandoned_stream_is_stopped_and_read_to_its_end_cancelled_only_as_a_last_resort(
        known, ends_after_s, sent, how, drained_for):
    import asyncio

    from front.gateway_client import DRAIN_MAX_S, end_abandoned

    call, seen = _AbandonedCall(ends_after_s), []

    async def send_stop() -> bool:
        if not sent:
            raise ConnectionError("the gateway is gone")
        return known

    asyncio.run(end_abandoned(call, send_stop, seen.append))
    assert seen == [how] and call.cancelled == (how == "cancel")
    assert call.drained_for == (DRAIN_MAX_S if drained_for == "max" else drained_for)


class _QueuedAdmission:
    """The gateway's lease operations as DirectEngine.admit sees them: an admit that waits (the admission
    queue) until `stop` names it, or until `grant` lets it through with a lease."""

    def __init__(self, stop_finds_it: bool):
        import asyncio
        self.stop_finds_it, self.granted, self.calls = stop_finds_it, asyncio.Event(), []

    async def call(self, call, api_key, operation, parameters=None):
        import json

        from front.gateway_client import Piece
        self.calls.append((operation, api_key, dict(parameters or {})))
        if operation == "admit":
            self.admission = parameters["stream_id"]
            await self.granted.wait()
            if self.stopped:
                raise ServingError("cancelled", "stopped by its caller while it waited for admission")
            return Piece(text=json.dumps({"lease": "lease-9", "model": "m"}), final=True)
        if operation == "stop":
            self.stopped = self.stop_finds_it and parameters["stream_id"] == self.admission
            self.granted.set()
            return Piece(text=json.dumps({"stopped": self.stopped}), final=True)
        if operation == "settle":
            leases = json.loads(parameters["lease"])["leases"]
            return Piece(text=json.dumps({"settled": [{"settled": r["id"]} for r in leases]}), final=True)
        return Piece(text="{}", final=True)


@pytest.mark.parametrize("stop_finds_it", [True, False], ids=["taken-out-of-the-queue", "granted-before-the-stop"])
def test_a_caller_gone_during_admission_stops_it_and_settles_a_lease_granted_meanwhile(stop_finds_it):
    """Its admission named and stopped with the caller's key, never cancelled; a lease that was granted
    anyway is settled at once, cancelled with nothing generated."""
    import asyncio
    import json

    from front.engine_direct import DirectEngine
    from front.openai_schema import GatewayCall

    gateway = _QueuedAdmission(stop_finds_it)
    engine = DirectEngine(gateway, "fk", detokenizer=None)

    async def main():
        waiting = asyncio.ensure_future(engine.admit(GatewayCall(max_tokens=5), "k-client"))
        await asyncio.sleep(0.01)
        waiting.cancel()  # the client left
        with pytest.raises(asyncio.CancelledError):
            await waiting
        for _ in range(100):  # the stop and the settle run in the background
            if not engine._settling:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    ops = [(op, key) for op, key, _ in gateway.calls]
    admit, stop = gateway.calls[0][2], gateway.calls[1][2]
    assert stop["stream_id"] == admit["stream_id"] and len(admit["stream_id"]) == 32
    if stop_finds_it:
        assert ops == [("admit", "k-client"), ("stop", "k-client")]
    else:
        assert ops == [("admit", "k-client"), ("stop", "k-client"), ("settle", None)]
        settled = json.loads(gateway.calls[2][2]["lease"])
        assert settled == {"leases": [{"id": "lease-9", "num_output_tokens": 0, "outcome": "cancelled"}]}


# -- the SSE body's fast lane (front/app.py _SseText) ------------------------------------------------------
class RecordingBody:
    """front/connections.py DirectBody's side the fast lane uses: what it adds, whether it is writable."""

    def __init__(self):
        self.parts, self.open = [], True

    def writable(self):
        return self.open

    def add(self, data):
        self.parts.append(data)

    def flush(self):
        pass


def test_the_fast_lane_writes_the_event_send_would_and_keeps_to_the_stop_matcher():

    call = GatewayCall(max_tokens=16, stream=True, include_usage=True, stop=["\n\n"])
    choices, out, body = Choices(call), ResponseBuilder(True), RecordingBody()
    sink = _SseText(body)
    assert not sink.ready()  # not before the choice's first chunk is out
    state = choices.state(0)
    state.started = True
    sink.bind(choices, state, out.text_event_parts("m", 0, True))
    assert sink.ready()
    for text in ["Hello", " wörld \u2028\"", "\n", "\nThe", " rest"]:
        sink.write(text)
    assert body.parts == [out.text_event("m", "Hello", 0, True), out.text_event("m", " wörld \u2028\"", 0, True)]
    assert "".join(state.parts) == "Hello wörld \u2028\"" and state.sent == len("Hello wörld \u2028\"")
    assert sink.events == 2
    body.open = False  # the client went, or pushes back: the pieces' path takes the text
    assert not sink.ready()


@pytest.mark.parametrize("fields,has_lane", [
    ({}, True), ({"n": 2}, False), ({"logprobs": 0}, False), ({"stream": False}, False)])
def test_only_a_streamed_single_choice_without_log_probs_gets_the_fast_lane(fields, has_lane):

    class Request:
        scope = {"extensions": {DIRECT_BODY: RecordingBody()}}

    call = GatewayCall(**{"max_tokens": 8, "stream": True, **fields})
    assert (_SseText.of(Request(), call, chat=False) is not None) == has_lane
    assert _SseText.of(type("NoBody", (), {"scope": {}})(), GatewayCall(max_tokens=8, stream=True), False) is None


def test_the_collectors_passes_are_timed_once_per_process_whatever_the_registries():
    """llm_front_gc_pause_seconds: each pass of the cyclic collector, by generation, from one gc callback
    however many FrontMetrics the process makes (tests make many)."""
    import gc

    from prometheus_client import generate_latest

    from clients.prometheus import metric_value
    from front.metrics import FrontMetrics, GcPauses

    first, second = FrontMetrics(), FrontMetrics()
    assert sum(cb == GcPauses.of_process()._on_pass for cb in gc.callbacks) == 1

    def passes(metrics, generation):
        text = generate_latest(metrics.registry).decode()
        return metric_value(text, "llm_front_gc_pause_seconds_count", generation=generation)

    before = passes(second, "2")
    gc.collect()
    assert passes(first, "2") == passes(second, "2") == before + 1
    text = generate_latest(first.registry).decode()
    assert metric_value(text, "llm_front_gc_pause_seconds_bucket", generation="2", le="+Inf") == before + 1
    assert metric_value(text, "python_gc_collections_total", generation="2") >= before + 1
