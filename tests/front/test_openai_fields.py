"""The field table (front/openai_fields.py) is what the parser does and what docs/openai-api.md says:
every field of every endpoint is honoured (parsed and used) or refused (a 400 naming it) unless it carries
its neutral value; an unknown field is refused. The real server answers the same (test_openai_logprobs_n.py)."""
from pathlib import Path

import pytest

from contracts.errors import ServingError
from front.openai_fields import ENDPOINTS, HONOURED, REFUSED, STREAM_OPTIONS, markdown
from front.openai_schema import parse_request
from front.responses_api import parse_responses
from tests.support.openai_fields import BASE, SAMPLES

ROOT = Path(__file__).resolve().parents[2]
FIELDS = [(route, name) for route, table in ENDPOINTS.items() for name in table]


def parse(route, body):
    if route == "/v1/responses":
        return parse_responses(body, 16)
    return parse_request(body, route == "/v1/chat/completions", 16)


def test_the_docs_print_the_table():
    text = (ROOT / "docs" / "openai-api.md").read_text()
    between = text.split("<!-- fields:begin -->\n", 1)[1].split("<!-- fields:end -->", 1)[0]
    assert between == markdown(), "docs/openai-api.md is stale: paste `python -m front.openai_fields` in"


def test_every_field_has_a_sample_and_every_sample_a_field():
    for route, table in ENDPOINTS.items():
        assert set(SAMPLES[route]) == set(table), route


@pytest.mark.parametrize("route,name", FIELDS)
def test_each_field_is_honoured_or_refused_by_name(route, name):
    body = {**BASE[route], **SAMPLES[route][name]}
    spec = ENDPOINTS[route][name]
    if spec.status == HONOURED:
        parse(route, body)  # accepted
    else:
        assert spec.status == REFUSED
        with pytest.raises(ServingError) as e:
            parse(route, body)
        assert e.value.status == 400 and e.value.field == name and "not supported" in e.value.message


@pytest.mark.parametrize("route,name", [(r, n) for r, n in FIELDS if ENDPOINTS[r][n].status == REFUSED])
def test_a_refused_field_with_its_neutral_value_is_accepted(route, name):
    for value in ENDPOINTS[route][name].neutral:
        parse(route, {**BASE[route], name: value})


@pytest.mark.parametrize("route", list(ENDPOINTS))
def test_an_unknown_field_is_refused_by_name(route):
    with pytest.raises(ServingError) as e:
        parse(route, {**BASE[route], "frobnicate": 1})
    assert e.value.status == 400 and e.value.field == "frobnicate"


OPTION_SAMPLES = {"include_usage": True, "include_obfuscation": True, "continuous_usage_stats": True}


@pytest.mark.parametrize("route", list(ENDPOINTS))
@pytest.mark.parametrize("name", list(STREAM_OPTIONS))
def test_each_stream_option_is_honoured_or_refused_by_name(route, name):
    spec = STREAM_OPTIONS[name]
    body = {**BASE[route], "stream": True, "stream_options": {name: OPTION_SAMPLES[name]}}
    if spec.status == HONOURED:
        parse(route, body)
    else:
        with pytest.raises(ServingError) as e:
            parse(route, body)
        assert e.value.status == 400 and e.value.field == f"stream_options.{name}" and "not supported" in e.value.message
        for value in spec.neutral:  # its neutral value asks for nothing
            parse(route, {**body, "stream_options": {name: value}})


def test_stream_options_are_read_and_an_unknown_one_is_refused_by_name():
    assert set(OPTION_SAMPLES) == set(STREAM_OPTIONS)
    route = "/v1/chat/completions"
    on = parse(route, {**BASE[route], "stream": True, "stream_options": {"include_usage": True,
                                                                        "include_obfuscation": False}})
    off = parse(route, {**BASE[route], "stream": True, "stream_options": {"include_usage": False}})
    assert on.include_usage and not off.include_usage
    for route in ENDPOINTS:
        for options, field in (({"frobnicate": True}, "stream_options.frobnicate"),
                               ({"include_usage": "yes"}, "stream_options.include_usage")):
            with pytest.raises(ServingError) as e:
                parse(route, {**BASE[route], "stream": True, "stream_options": options})
            assert e.value.status == 400 and e.value.field == field, e.value.message
        with pytest.raises(ServingError) as e:  # a stream's options without a stream
            parse(route, {**BASE[route], "stream_options": {"include_usage": True}})
        assert e.value.field == "stream_options", route


def test_vllm_extras_reach_the_call_on_every_endpoint():
    """Benchmark clients (aiperf's --extra-inputs) send ignore_eos, min_tokens, top_k to any endpoint."""
    extras = {"ignore_eos": True, "min_tokens": 3, "top_k": 5}
    for route in ENDPOINTS:
        call = parse(route, {**BASE[route], **extras})
        call = getattr(call, "call", call)  # /v1/responses: its chat call
        assert call.ignore_eos and call.sampling["min_tokens"] == 3 and call.sampling["top_k"] == 5, route


def test_honoured_fields_reach_the_call():
    """Spot checks that an honoured field is not merely accepted: it lands in what goes to the gateway."""
    chat = parse("/v1/chat/completions", {**BASE["/v1/chat/completions"], "n": 3, "logprobs": True,
                                          "top_logprobs": 4, "presence_penalty": 0.5, "frequency_penalty": -1,
                                          "logit_bias": {"7": -100}, "user": "u1"})
    assert (chat.n, chat.logprobs, chat.user) == (3, 4, "u1")
    assert chat.sampling["presence_penalty"] == 0.5 and chat.sampling["frequency_penalty"] == -1
    assert chat.outputs().logit_bias == {7: -100.0} and chat.outputs().num_return_sequences == 3
    done = parse("/v1/completions", {"prompt": [[1, 2]], "echo": True, "logprobs": 1, "max_tokens": 1})
    assert done.prompt_ids == [1, 2] and done.echo and done.echo_logprobs and done.logprobs == 1
