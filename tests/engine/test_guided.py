"""Guided decoding in the CPU engine (cpu_engine/guided.py): every token follows the guide's grammar, the
answer ends where the grammar does, a bad guide is refused at submit, and guided and free requests
share a batch without touching each other."""
import json
import re

import numpy as np
import pytest

from cpu_engine import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from cpu_engine.guided import GuideSpec, constrain
from cpu_engine.triton_contract import parse_engine_request
from text.tokenization import TokenizerBundle

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                           "population": {"type": "integer"}, "capital": {"type": "boolean"}},
          "required": ["city", "population", "capital"], "additionalProperties": False}


@pytest.fixture(scope="module")
def smol(checkpoint):
    return LLMEngine(EngineConfig(str(checkpoint), max_tokens_in_paged_kv_cache=4096)), TokenizerBundle.load(checkpoint)


def _prompt(tok, text):
    return tok.encode(tok.render_chat([{"role": "user", "content": text}]))


def _params(tok, guide, n=60, **kw):
    return SamplingParams(max_new_tokens=n, temperature=0.0, end_id=tok.end_of_turn_id, guide=guide, **kw)


def test_a_json_schema_guide_gives_an_object_that_validates_and_ends_there(smol):
    engine, tok = smol
    out = engine.generate(_prompt(tok, "Describe Paris as JSON."), _params(tok, GuideSpec("json_schema", json.dumps(SCHEMA))))
    value = json.loads(tok.tokenizer.decode(out.new_token_ids))
    assert set(value) == {"city", "population", "capital"} and isinstance(value["population"], int)
    assert isinstance(value["capital"], bool) and isinstance(value["city"], str)
    assert out.finish_reason == "end_id"  # the grammar was complete: the end id was the only token left
    free = engine.generate(_prompt(tok, "Describe Paris as JSON."), _params(tok, None))
    with pytest.raises(ValueError):  # unguided, the same greedy request does not answer in JSON
        json.loads(tok.tokenizer.decode(free.new_token_ids))


@pytest.mark.parametrize("kind,guide,pattern", [
    ("regex", "(yes|no)", r"(yes|no)"),
    ("ebnf_grammar", 'root ::= "A" [0-9] [0-9]', r"A[0-9][0-9]"),
])
def test_regex_and_ebnf_guides_match_their_pattern(smol, kind, guide, pattern):
    engine, tok = smol
    out = engine.generate(_prompt(tok, "Is Paris in France?"), _params(tok, GuideSpec(kind, guide), n=20))
    assert re.fullmatch(pattern, tok.tokenizer.decode(out.new_token_ids)), tok.tokenizer.decode(out.new_token_ids)
    assert out.finish_reason == "end_id"


def test_sampled_guided_tokens_follow_the_grammar_too(smol):
    engine, tok = smol
    for seed in range(3):
        out = engine.generate(_prompt(tok, "Describe Paris as JSON."),
                              SamplingParams(max_new_tokens=80, temperature=1.0, top_p=0.95, seed=seed,
                                             end_id=tok.end_of_turn_id, guide=GuideSpec("json_schema", json.dumps(SCHEMA))))
        text = tok.tokenizer.decode(out.new_token_ids)
        if out.finish_reason == "end_id":
            assert set(json.loads(text)) == set(SCHEMA["properties"])
        else:  # cut by max_tokens: still a prefix the grammar allows
            assert text.startswith('{"city": ')


@pytest.mark.parametrize("guide,field", [
    (GuideSpec("json_schema", "{not json"), "guided_decoding_guide"),
    (GuideSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "nonsense"}}})),
     "guided_decoding_guide"),
    (GuideSpec("regex", ""), "guided_decoding_guide"),
    (GuideSpec("structural_tag", "{}"), "guided_decoding_guide_type"),
    (GuideSpec("yaml", "a: b"), "guided_decoding_guide_type"),
])
def test_a_bad_guide_is_refused_at_submit_and_holds_nothing(smol, guide, field):
    engine, tok = smol
    free_before = engine.kv_manager.pool.num_free
    with pytest.raises(InvalidRequestError) as e:
        engine.submit("bad", _prompt(tok, "hi"), _params(tok, guide), lambda out: None)
    assert e.value.field == field
    assert "bad" not in engine.sequences and engine.kv_manager.pool.num_free == free_before


def test_a_guide_needs_an_end_id(smol):
    engine, tok = smol
    with pytest.raises(InvalidRequestError) as e:
        engine.submit("x", _prompt(tok, "hi"), SamplingParams(max_new_tokens=4, guide=GuideSpec("json")), print)
    assert e.value.field == "end_id"


def test_guided_and_free_requests_in_one_batch_do_not_interfere(smol):
    engine, tok = smol
    prompt = _prompt(tok, "What is the capital of France?")
    alone = engine.generate(prompt, _params(tok, None, n=12)).new_token_ids
    outs: dict[str, list] = {"free": [], "json": []}
    done = set()

    def collect(name):
        def on_output(out):
            outs[name].extend(out.new_token_ids)
            if out.finished:
                done.add(name)
        return on_output

    engine.submit("free", prompt, _params(tok, None, n=12), collect("free"))
    engine.submit("json", prompt, _params(tok, GuideSpec("json_schema", json.dumps(SCHEMA))), collect("json"))
    while len(done) < 2:
        engine.step()
    assert outs["free"] == alone
    assert set(json.loads(tok.tokenizer.decode(outs["json"]))) == set(SCHEMA["properties"])


def test_constrain_masks_everything_the_grammar_forbids(smol):
    engine, tok = smol
    guide = engine.guides.matcher(GuideSpec("regex", "(yes|no)"), tok.end_of_turn_id)
    row = np.zeros(engine.weights.config.vocab_size, np.float32)
    masked = constrain(guide, row)
    allowed = [tok.tokenizer.id_to_token(int(i)) for i in np.flatnonzero(np.isfinite(masked))]
    assert allowed and all("yes".startswith(t) or "no".startswith(t) for t in allowed)
    assert constrain(None, row) is row


def test_the_engine_contract_carries_the_guide_as_upstream_names_it():
    x = {"input_ids": np.array([[1, 2]], np.int32), "request_output_len": np.array([[4]], np.int32),
         "guided_decoding_guide_type": np.array([[b"json_schema"]], object),
         "guided_decoding_guide": np.array([[json.dumps(SCHEMA).encode()]], object)}
    call = parse_engine_request(x)
    assert call.params.guide == GuideSpec("json_schema", json.dumps(SCHEMA))
    assert parse_engine_request({**x, "guided_decoding_guide_type": np.array([[b"json"]], object),
                                 "guided_decoding_guide": np.array([[b""]], object)}).params.guide == GuideSpec("json")
    del x["guided_decoding_guide_type"]
    from contracts.errors import ServingError
    with pytest.raises(ServingError) as e:
        parse_engine_request(x)
    assert e.value.field == "guided_decoding_guide"  # the input that was sent, and what it lacks


def test_a_matcher_that_fails_ends_its_request_alone_as_the_clients_error(smol):
    """A grammar whose matcher fails mid-answer (here: a token it never allowed, forced into it) ends that
    request with invalid_argument naming the guide; its blocks are freed and a free neighbour goes on."""
    engine, tok = smol
    prompt = _prompt(tok, "Is Paris in France?")
    outs: dict[str, list] = {"bad": [], "free": []}

    def collect(name):
        return lambda out: outs[name].append(out)

    free_before = engine.kv_manager.pool.num_free
    engine.submit("bad", prompt, _params(tok, GuideSpec("regex", "(yes|no) indeed"), n=20), collect("bad"))
    engine.submit("free", prompt, _params(tok, None, n=6), collect("free"))
    engine.step()  # both prefilled, one token each
    seq = engine.sequences["bad"]
    seq.guide.matcher.consume_token(tok.tokenizer.token_to_id("Paris"))  # not what the grammar allows
    while not (outs["bad"] and outs["bad"][-1].finished and outs["free"] and outs["free"][-1].finished):
        engine.step()
    last = outs["bad"][-1]
    assert last.finish_reason == "error" and last.error_kind == "invalid_argument"
    assert last.error.startswith("guided_decoding_guide: the grammar could not go on")
    assert outs["free"][-1].finish_reason in ("end_id", "length") and not outs["free"][-1].error
    assert engine.kv_manager.pool.num_free == free_before
