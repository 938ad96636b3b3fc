"""Draft-target speculation (`decoding_mode draft_tokens_external`): a draft model's greedy proposals
verified in the step's one forward pass give plain decoding's tokens, greedy and seeded, whether the draft
agrees with the model (the same checkpoint) or rarely does (another random model with the same
vocabulary); the draft's own K/V follow the sequence's blocks (caught up after a prompt, a preemption, a
full acceptance) and nothing leaks (the small-cache and preemption test runs both methods:
test_speculation.py)."""
import pytest

from cpu_engine import EngineConfig, LLMEngine, SamplingParams
from cpu_engine.config import ConfigError
from tests.engine.conftest import run_all, write_tiny_checkpoint
from tests.engine.test_speculation import checked, repetitive_prompts


def drafted(engine):
    return engine.totals["draft_tokens"], engine.totals["accepted_draft_tokens"]


@pytest.fixture(scope="module")
def other_vocab_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_vocab"), vocab=300)


@pytest.mark.parametrize("draft", ["same", "other"])
@pytest.mark.parametrize("reuse", [True, False], ids=["reuse", "no-reuse"])
def test_greedy_output_is_identical_token_for_token(make_engine, tiny_untied_dir, draft, reuse):
    prompts = repetitive_prompts() + [list(range(40, 90))]  # a prompt caught up in several draft passes
    requests = {f"r{i}": (p, SamplingParams(max_new_tokens=30 + 3 * i, temperature=0.0), None)
                for i, p in enumerate(prompts)}
    arrivals = {f"r{i}": i % 3 for i in range(len(prompts))}
    kw = dict(max_num_tokens=24, enable_kv_cache_reuse=reuse)
    plain = run_all(make_engine(**kw), requests, arrivals)
    engine = make_engine(decoding_mode="draft_tokens_external", lookahead_ngram_size=5, draft_weight_dtype="float32",
                         draft_model_dir="" if draft == "same" else str(tiny_untied_dir), draft_model_max_batch_size=0,
                         **kw)
    steps = checked(engine)
    spec = run_all(engine, requests, arrivals)
    for rid in requests:
        assert spec[rid][0] == plain[rid][0], rid
    total, accepted = drafted(engine)
    if draft == "same":  # the model drafting for itself: (nearly) every draft accepted, several tokens a step
        assert accepted >= 0.9 * total > 0
        assert len(steps) < sum(len(t) for t, _ in plain.values()) / 2
    else:  # an unrelated model: drafts rejected, one-token drafts, the output still the model's own
        assert 0 <= accepted < 0.5 * total
    assert sum(f.perf["total_draft_tokens"] for _, f in spec.values()) == total
    pool = engine.kv_manager.pool
    pool.check_invariants()
    assert pool.num_free == pool.num_blocks and not engine.sequences


def test_seeded_sampling_draws_the_same_tokens_as_plain_decoding(make_engine, tiny_untied_dir):
    prompts = repetitive_prompts(seed=5)
    requests = {f"r{i}": (p, SamplingParams(max_new_tokens=40, temperature=0.8, top_k=30, seed=7 + i), None)
                for i, p in enumerate(prompts)}
    plain = run_all(make_engine(max_num_tokens=24), requests)
    for draft_dir in ("", str(tiny_untied_dir)):
        engine = make_engine(decoding_mode="draft_tokens_external", draft_weight_dtype="float32",
                             draft_model_dir=draft_dir, max_num_tokens=24, draft_model_max_batch_size=0)
        checked(engine)
        spec = run_all(engine, requests)
        assert {r: t for r, (t, _) in spec.items()} == {r: t for r, (t, _) in plain.items()}
        assert drafted(engine)[0] > 0


def test_the_draft_model_drafts_only_while_few_requests_decode(make_engine):
    """Past draft_model_max_batch_size decoding requests a step is compute-bound and a draft pass costs more
    than it saves: no drafts then; once fewer decode, drafts again (caught up on what it missed)."""
    engine = make_engine(decoding_mode="draft_tokens_external", draft_weight_dtype="float32", max_num_tokens=64,
                         draft_model_max_batch_size=2)
    seen = []
    inner = engine.step

    def step():
        decoding = sum(not s.in_prefill for s in engine.scheduler.running)
        inner()
        seen.append((decoding, engine.last_step["draft_tokens"]))

    engine.step = step
    prompts = repetitive_prompts()[:3]
    requests = {f"r{i}": (p, SamplingParams(max_new_tokens=12 + 12 * i, temperature=0.0), None)
                for i, p in enumerate(prompts)}
    spec = run_all(engine, requests)
    plain = run_all(make_engine(max_num_tokens=64), requests)
    assert {r: t for r, (t, _) in spec.items()} == {r: t for r, (t, _) in plain.items()}
    assert all(drafts == 0 for decoding, drafts in seen if decoding > 2)
    assert any(decoding == 3 for decoding, _ in seen) and any(drafts for decoding, drafts in seen if decoding <= 2)


def test_per_request_switch_and_config(make_engine, tiny_dir, other_vocab_dir):
    engine = make_engine(decoding_mode="draft_tokens_external", draft_weight_dtype="float32", max_num_tokens=24)
    prompt = repetitive_prompts()[0]
    plain = engine.generate(prompt, SamplingParams(30, temperature=0.0),
                            lookahead={"lookahead_ngram_size": 1, "lookahead_verification_set_size": 0})
    assert plain.perf["total_draft_tokens"] == 0
    spec = engine.generate(prompt, SamplingParams(30, temperature=0.0))
    assert spec.new_token_ids == plain.new_token_ids and spec.perf["total_draft_tokens"] > 0
    assert "draft model" in engine.describe()
    with pytest.raises(ConfigError, match="vocabulary"):
        LLMEngine(EngineConfig(str(tiny_dir), decoding_mode="draft_tokens_external",
                               draft_model_dir=str(other_vocab_dir), max_tokens_in_paged_kv_cache=256))
    with pytest.raises(ConfigError, match="draft_model_dir"):
        EngineConfig(str(tiny_dir), decoding_mode="draft_tokens_external", draft_model_dir=str(tiny_dir / "nope"))
    with pytest.raises(ConfigError, match="draft_model_max_batch_size"):
        EngineConfig(str(tiny_dir), decoding_mode="draft_tokens_external", draft_model_max_batch_size=-1)
    with pytest.raises(ConfigError, match="draft_weight_dtype"):
        EngineConfig(str(tiny_dir), decoding_mode="draft_tokens_external", draft_weight_dtype="int4")
    with pytest.raises(ConfigError, match="draft_tokens_external"):
        EngineConfig(str(tiny_dir), decoding_mode="draft_tokens_external", lookahead_ngram_size=1)


def test_smollm2_in_float32_drafted_by_its_own_int8_copy(checkpoint):
    """The real model at full precision with its 8-bit copy as the draft (the configuration the benchmark
    measures): the float32 model's own greedy tokens, most of them from accepted drafts."""
    from text.tokenization import TokenizerBundle

    bundle = TokenizerBundle.load(checkpoint)
    prompt = bundle.encode(bundle.render_chat([{"role": "user", "content": "Write three sentences about the sea."}]))
    params = SamplingParams(max_new_tokens=40, end_id=bundle.eos_id, temperature=0.0)
    engine = LLMEngine(EngineConfig(str(checkpoint), weight_dtype="float32", decoding_mode="draft_tokens_external",
                                    draft_weight_dtype="int8", max_tokens_in_paged_kv_cache=1024))
    plain = engine.generate(prompt, params, lookahead={"lookahead_ngram_size": 1, "lookahead_verification_set_size": 0})
    spec = engine.generate(prompt, params)
    assert spec.new_token_ids == plain.new_token_ids
    assert spec.perf["total_accepted_draft_tokens"] >= 0.6 * spec.perf["total_draft_tokens"] > 0
