"""Speculative decoding (prompt lookup, `decoding_mode lookahead`): the same tokens as plain decoding,
greedy and seeded; the paged KV cache rolled back on rejection (refcounts, free lists and prefix
registrations consistent after every step); per-request (w, n, g) honoured or refused naming the input;
acceptance counted per request and in the metrics."""
import numpy as np
import pytest

from cpu_engine import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from cpu_engine.config import ConfigError
from cpu_engine.metrics import metric_samples
from cpu_engine.speculation import LookaheadConfig, NgramIndex, next_draft_len, request_lookahead
from tests.engine.conftest import run_all

PLAIN = {"lookahead_window_size": 1, "lookahead_ngram_size": 1, "lookahead_verification_set_size": 0}


def repetitive_prompts(seed=3):
    """Prompts that repeat themselves, so that the tiny random model's greedy output (which loops) and the
    prompt give lookups that are accepted and lookups that are rejected."""
    rng = np.random.default_rng(seed)
    motif = rng.integers(0, 256, 7).tolist()
    return [motif * 4, rng.integers(0, 256, 5).tolist() + motif * 2, rng.integers(0, 256, 23).tolist(),
            motif * 2 + rng.integers(0, 256, 9).tolist() + motif, [motif[0]] * 3]


def checked(engine):
    """Check the pool and every running sequence's blocks after each step: no block past the sequence's
    tokens is kept (rejected drafts' blocks went back), each registered block holds exactly the
    sequence's own (accepted) tokens at its positions."""
    inner = engine.step

    def step():
        inner()
        pool, bs = engine.kv_manager.pool, engine.kv_manager.block_size
        pool.check_invariants()
        for seq in engine.scheduler.running:
            assert len(seq.block_table) <= engine.kv_manager.blocks_for(seq.num_tokens), seq.request_id
            assert seq.num_computed <= seq.num_tokens - 1
            for i, block in enumerate(seq.block_table[:seq.num_registered]):
                entry = pool.entry_of[block]
                if entry is not None and pool.key_of[block] is not None and seq.last_serial is not None:
                    assert entry[3] == tuple(seq.all_ids[i * bs:(i + 1) * bs]), f"{seq.request_id} block {i}"
            assert seq.num_registered * bs <= seq.num_computed
        steps.append(1)

    steps = []
    engine.step = step
    return steps


# -- the proposer ---------------------------------------------------------------------------------
def test_ngram_index_proposes_what_followed_the_latest_longest_match():
    index = NgramIndex(max_ngram=3)
    ids = [1, 2, 3, 9, 9, 1, 2, 3, 7, 7, 5, 2, 3]
    # the tail (5?) 2, 3: "2 3" occurred at 1-2 (then 9) and 6-7 (then 7): the latest wins
    assert index.propose(ids, 3) == [7, 7, 5]
    assert index.propose(ids, 1) == [7]
    assert index.propose(ids + [4], 3) == []  # "3 4" never occurred, and single-token matches do not count
    longer = ids + [7, 7]  # tail 3 7 7 occurred once: 7 7 followed "2 3" ... "3 7 7" -> 5
    assert index.propose(longer, 2) == [5, 2]
    assert index.propose([4, 4], 5) == []  # nothing before the tail


def test_draft_length_doubles_after_full_acceptance_and_shrinks_after_a_rejection():
    assert next_draft_len(drafted=2, accepted=2, current=2, limit=7) == 4
    assert next_draft_len(drafted=4, accepted=4, current=4, limit=7) == 7
    assert next_draft_len(drafted=7, accepted=2, current=7, limit=7) == 3
    assert next_draft_len(drafted=7, accepted=0, current=7, limit=7) == 1
    assert next_draft_len(drafted=0, accepted=0, current=5, limit=7) == 5


def test_request_lookahead_is_bounded_by_the_engine_and_named_when_refused():
    engine_max = LookaheadConfig(2, 8, 1)
    config, problems = request_lookahead(engine_max)
    assert config == engine_max and not problems and config.max_draft_len == 7
    config, problems = request_lookahead(engine_max, 1, 4, 1)
    assert config.max_draft_len == 3 and not problems
    assert not request_lookahead(engine_max, 1, 1, 0)[0].speculates
    assert [f for f, _ in request_lookahead(engine_max, 3, 8, 1)[1]] == ["lookahead_window_size"]
    assert [f for f, _ in request_lookahead(engine_max, 1, 9, 1)[1]] == ["lookahead_ngram_size"]
    assert [f for f, _ in request_lookahead(engine_max, 1, 4, 2)[1]] == ["lookahead_verification_set_size"]
    assert [f for f, _ in request_lookahead(engine_max, 0, 4, 1)[1]] == ["lookahead_window_size"]
    assert [f for f, _ in request_lookahead(engine_max, 1, 4, -1)[1]] == ["lookahead_verification_set_size"]
    # an engine without lookahead accepts only a plain configuration
    assert not request_lookahead(None)[1] and not request_lookahead(None, 1, 1, 0)[1]
    assert [f for f, _ in request_lookahead(None, 1, 4, 1)[1]] == ["lookahead_ngram_size"]


def test_config_validates_the_decoding_mode_and_lookahead_knobs(tiny_dir):
    for bad in ({"decoding_mode": "medusa"}, {"decoding_mode": "lookahead", "lookahead_ngram_size": 1},
                {"decoding_mode": "lookahead", "lookahead_verification_set_size": 0},
                {"max_matching_ngram_size": 1}):
        with pytest.raises(ConfigError, match=next(iter(bad)) if "decoding_mode" not in bad or len(bad) == 1
                           else "lookahead"):
            EngineConfig(str(tiny_dir), **bad)
    config = EngineConfig.from_parameters({"gpt_model_path": str(tiny_dir), "decoding_mode": "lookahead",
                                           "lookahead_ngram_size": "5"})
    assert config.lookahead == LookaheadConfig(1, 5, 1)


# -- exactness and the KV cache -------------------------------------------------------------------
BACKENDS = [pytest.param({"matmul_backend": "numpy", "attention_backend": "numpy"}, id="numpy"),
            pytest.param({"matmul_backend": "onnxruntime", "attention_backend": "numba"}, id="compiled")]


@pytest.mark.parametrize("backends", BACKENDS)
@pytest.mark.parametrize("reuse", [True, False], ids=["reuse", "no-reuse"])
def test_greedy_output_is_identical_token_for_token(make_engine, backends, reuse):
    prompts = repetitive_prompts()
    requests = {f"r{i}": (p, SamplingParams(max_new_tokens=30 + 3 * i, temperature=0.0), None)
                for i, p in enumerate(prompts)}
    arrivals = {f"r{i}": i % 3 for i in range(len(prompts))}  # joins at different steps
    kw = dict(max_num_tokens=24, enable_kv_cache_reuse=reuse, **backends)
    plain = run_all(make_engine(**kw), requests, arrivals)
    engine = make_engine(decoding_mode="lookahead", lookahead_ngram_size=6, **kw)
    steps = checked(engine)
    spec = run_all(engine, requests, arrivals)
    for rid in requests:
        assert spec[rid][0] == plain[rid][0], rid
        assert spec[rid][1].finish_reason == plain[rid][1].finish_reason == "length"
    drafted = sum(f.perf["total_draft_tokens"] for _, f in spec.values())
    accepted = sum(f.perf["total_accepted_draft_tokens"] for _, f in spec.values())
    assert 0 < accepted < drafted, "the workload must see both accepted and rejected drafts"
    assert engine.totals["draft_tokens"] == drafted and engine.totals["accepted_draft_tokens"] == accepted
    # fewer steps than tokens: verified drafts produced several tokens per step
    assert len(steps) < sum(len(t) for t, _ in plain.values())
    pool = engine.kv_manager.pool
    pool.check_invariants()
    assert pool.num_free == pool.num_blocks and all(r == 0 for r in pool.ref) and not engine.sequences


def test_prefix_blocks_registered_by_a_speculating_request_are_right_for_the_next(make_engine):
    """A request that speculated registered its full blocks (accepted tokens only); a second request
    whose prompt is the first one's prompt + output reuses them and still decodes as plain decoding does."""
    prompt = repetitive_prompts()[0]
    engine = make_engine(decoding_mode="lookahead", max_num_tokens=24)
    first = engine.generate(prompt, SamplingParams(max_new_tokens=40, temperature=0.0))
    assert first.perf["total_accepted_draft_tokens"] > 0
    follow = prompt + first.new_token_ids + [7, 8]
    second = engine.generate(follow, SamplingParams(max_new_tokens=20, temperature=0.0))
    assert second.kv_cache_reused_blocks >= (len(prompt) + 40) // engine.config.tokens_per_block - 1
    want = make_engine(max_num_tokens=24, enable_kv_cache_reuse=False).generate(
        follow, SamplingParams(max_new_tokens=20, temperature=0.0))
    assert second.new_token_ids == want.new_token_ids
    assert engine.kv_manager.pool.num_used == 0


def test_seeded_sampling_draws_the_same_tokens_as_plain_decoding(make_engine):
    """One draw per output token from the same distribution, in order, accepted while it equals the
    draft: a seed gives plain decoding's tokens, and so the same distribution."""
    prompts = repetitive_prompts(seed=5)
    requests = {f"r{i}": (p, SamplingParams(max_new_tokens=40, temperature=0.7, top_k=20, seed=11 + i), None)
                for i, p in enumerate(prompts)}
    plain = run_all(make_engine(max_num_tokens=24), requests)
    engine = make_engine(decoding_mode="lookahead", max_num_tokens=24)
    checked(engine)
    spec = run_all(engine, requests)
    assert {r: t for r, (t, _) in spec.items()} == {r: t for r, (t, _) in plain.items()}
    assert engine.totals["draft_tokens"] > 0


def test_stop_words_end_id_and_log_probs_inside_a_verified_draft(make_engine):
    prompt = repetitive_prompts()[0]
    base = make_engine(max_num_tokens=24).generate(prompt, SamplingParams(max_new_tokens=30, temperature=0.0))
    stop, end = base.new_token_ids[10:12], base.new_token_ids[15]
    for params in (SamplingParams(30, temperature=0.0, stop_words=[stop], return_log_probs=True),
                   SamplingParams(30, temperature=0.0, end_id=end, return_log_probs=True),
                   SamplingParams(30, temperature=0.0, end_id=end, min_tokens=20, return_log_probs=True)):
        want = make_engine(max_num_tokens=24).generate(prompt, params)
        engine = make_engine(decoding_mode="lookahead", max_num_tokens=24)
        got = engine.generate(prompt, params)
        assert got.new_token_ids == want.new_token_ids and got.finish_reason == want.finish_reason
        np.testing.assert_allclose(got.new_log_probs, want.new_log_probs, rtol=1e-4, atol=1e-4)
        assert engine.kv_manager.pool.num_used == 0


# prompt lookup, and a draft model (draft_model.py): the model's own float32 copy, so it agrees with itself
MODES = [pytest.param({"decoding_mode": "lookahead"}, id="lookup"),
         pytest.param({"decoding_mode": "draft_tokens_external", "draft_weight_dtype": "float32",
                       "draft_model_max_batch_size": 0}, id="draft-model")]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "max_utilization"])
def test_a_small_cache_cancellations_and_preemption_leak_nothing(make_engine, policy, mode):
    """Preempted sequences lose their blocks (and a draft model's K/V with them: it catches up again)."""
    prompts = repetitive_prompts()
    requests = {f"r{i}": (p, SamplingParams(max_new_tokens=24, temperature=0.0), "salt" if i % 2 else None)
                for i, p in enumerate(prompts * 2)}
    arrivals = {rid: i % 4 for i, rid in enumerate(requests)}
    kw = dict(max_num_tokens=20, max_tokens_in_paged_kv_cache=64, batch_scheduler_policy=policy)
    engine = make_engine(**mode, **kw)
    checked(engine)
    spec = run_all(engine, requests, arrivals, cancel_at={"r1": 6, "r6": 9})
    plain = run_all(make_engine(**kw), requests, arrivals, cancel_at={"r1": 6, "r6": 9})
    for rid, (tokens, final) in spec.items():
        assert final is not None and final.finished
        if rid not in ("r1", "r6"):
            assert tokens == plain[rid][0], rid
    if policy == "max_utilization":
        assert engine.scheduler.preempted_total > 0
    if engine.draft_model is not None:
        # the model drafting for itself from K/V it wrote for each sequence's own tokens agrees with itself:
        # a draft read from another sequence's or a preempted one's stale K/V would not
        assert engine.totals["accepted_draft_tokens"] >= 0.95 * engine.totals["draft_tokens"] > 0
    pool = engine.kv_manager.pool
    pool.check_invariants()
    assert pool.num_free == pool.num_blocks and not engine.sequences


# -- the per-request switch and the metrics -------------------------------------------------------
def test_per_request_switch_and_acceptance_outputs(make_engine):
    engine = make_engine(decoding_mode="lookahead", max_num_tokens=24)
    prompt = repetitive_prompts()[0]
    outs = {}
    for name, la in (("default", None), ("plain", PLAIN), ("short", {"lookahead_ngram_size": 2})):
        got, final = [], []
        engine.submit(name, prompt, SamplingParams(30, temperature=0.0),
                      lambda o, got=got, final=final: (got.extend(o.new_token_ids), o.finished and final.append(o)),
                      lookahead=la)
        while not final:
            engine.step()
        outs[name] = (got, final[0])
    assert outs["plain"][1].perf["total_draft_tokens"] == 0 and outs["plain"][1].perf["acceptance_rate"] == 0
    default = outs["default"][1].perf
    assert default["total_draft_tokens"] > 0
    assert default["acceptance_rate"] == pytest.approx(
        default["total_accepted_draft_tokens"] / default["total_draft_tokens"])
    assert outs["short"][1].perf["total_draft_tokens"] > 0
    assert outs["default"][0] == outs["plain"][0] == outs["short"][0]
    with pytest.raises(InvalidRequestError, match="lookahead_ngram_size") as e:
        engine.submit("x", prompt, SamplingParams(5), lambda o: None, lookahead={"lookahead_ngram_size": 9})
    assert e.value.field == "lookahead_ngram_size"
    plain_engine = make_engine()
    with pytest.raises(InvalidRequestError, match="decoding_mode"):
        plain_engine.submit("y", prompt, SamplingParams(5), lambda o: None, lookahead={"lookahead_ngram_size": 4,
                                                                                         "lookahead_verification_set_size": 1})
    plain_engine.submit("z", prompt, SamplingParams(5), lambda o: None, lookahead=PLAIN)  # plain is accepted


def test_spec_decoding_metrics_family(make_engine):
    assert not [s for s in metric_samples(make_engine().stats()) if s[0] == "nv_trt_llm_spec_decoding_metrics"]
    engine = make_engine(decoding_mode="lookahead", max_num_tokens=24)
    engine.generate(repetitive_prompts()[0], SamplingParams(30, temperature=0.0))
    samples = {v: x for f, _, label, v, x in metric_samples(engine.stats()) if f == "nv_trt_llm_spec_decoding_metrics"}
    assert set(samples) == {"num_draft_tokens", "num_accepted_tokens", "num_requests_with_draft_tokens",
                            "acceptance_length", "total_draft_tokens", "total_accepted_draft_tokens"}
    assert samples["total_draft_tokens"] == engine.totals["draft_tokens"] > 0
    assert 0 < samples["total_accepted_draft_tokens"] <= samples["total_draft_tokens"]


# -- the real model -------------------------------------------------------------------------------
def test_smollm2_greedy_is_identical_with_prompt_lookup(checkpoint):
    """SmolLM2 in the default precision (int8 where onnxruntime runs it) copying a function it was given:
    the same tokens, many of them from accepted drafts. Prefix reuse is off in both, so both prefill the
    prompt the same way."""
    from text.tokenization import TokenizerBundle

    bundle = TokenizerBundle.load(checkpoint)
    code = "def add(a, b):\n    total = a + b\n    print('sum', total)\n    return total\n"
    # fenced, the code is copied in int8 and float32 alike (unfenced, int8's greedy answer describes it
    # instead on some hosts: a property of the model, not of speculation)
    prompt = bundle.encode(bundle.render_chat([{"role": "user", "content": f"Repeat this code exactly:\n\n```python\n{code}```"}]))
    params = SamplingParams(max_new_tokens=48, end_id=bundle.eos_id, temperature=0.0)
    engine = LLMEngine(EngineConfig(str(checkpoint), decoding_mode="lookahead", enable_kv_cache_reuse=False,
                                    max_tokens_in_paged_kv_cache=2048))
    plain = engine.generate(prompt, params, lookahead=PLAIN)
    assert plain.perf["total_draft_tokens"] == 0
    steps = engine.iteration
    spec = engine.generate(prompt, params)
    assert spec.new_token_ids == plain.new_token_ids
    accepted = spec.perf["total_accepted_draft_tokens"]
    assert accepted >= len(spec.new_token_ids) // 6
    # one step for the prompt, then every step yields one sampled token plus the drafts it accepted (and
    # the end id, which is not returned, took a step of its own)
    assert engine.iteration - steps == len(spec.new_token_ids) - accepted + (spec.finish_reason == "end_id")


def test_a_guided_request_verifies_drafts_under_its_grammar(checkpoint):
    """Guided decoding masks each row with the grammar's state after the tokens accepted before it (the
    guide advances per appended token), so a JSON-schema answer copied from the prompt is the same with
    and without drafts, and drafts were accepted."""
    import json

    from text.tokenization import TokenizerBundle
    from cpu_engine.guided import GuideSpec

    bundle = TokenizerBundle.load(checkpoint)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                               "country": {"type": "string", "maxLength": 40}},
              "required": ["city", "country"], "additionalProperties": False}
    given = '{"city": "Paris", "country": "France"}'
    prompt = bundle.encode(bundle.render_chat([{"role": "user", "content": f"Repeat this JSON exactly: {given}"}]))
    params = SamplingParams(max_new_tokens=40, temperature=0.0, end_id=bundle.end_of_turn_id,
                            guide=GuideSpec("json_schema", json.dumps(schema)))
    engine = LLMEngine(EngineConfig(str(checkpoint), decoding_mode="lookahead", enable_kv_cache_reuse=False,
                                    max_tokens_in_paged_kv_cache=2048))
    plain = engine.generate(prompt, params, lookahead=PLAIN)
    spec = engine.generate(prompt, params)
    assert spec.new_token_ids == plain.new_token_ids and spec.finish_reason == plain.finish_reason == "end_id"
    value = json.loads(bundle.tokenizer.decode(spec.new_token_ids))
    assert set(value) == {"city", "country"}
    assert spec.perf["total_accepted_draft_tokens"] > 0
