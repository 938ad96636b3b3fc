"""What OpenAI's log probs, echo, n, penalties and logit_bias need of the engine, on a tiny float32 Llama:
log probs and logits equal to the model's float32 reference forward; n sequences that share the prompt's
KV blocks; presence / frequency penalties and an embedding bias that change what is sampled."""
import numpy as np

from contracts.logprobs import log_softmax, top_logprobs
from cpu_engine import SamplingParams


def collect(engine, rid, prompt, params, salt=None):
    """Every output of one request, stepped to the end; (outputs by sequence index, all outputs)."""
    outs = []
    engine.submit(rid, prompt, params, outs.append, cache_salt=salt)
    steps = 0
    while not any(o.ends_request for o in outs):
        engine.step()
        steps += 1
        assert steps < 5000
    by_index = {}
    for o in outs:
        by_index.setdefault(o.sequence_index, []).append(o)
    return by_index, outs


def tokens(outs):
    return [t for o in outs for t in o.new_token_ids]


def test_log_probs_and_logits_equal_the_float32_reference_at_the_requests_temperature(make_engine):
    engine = make_engine()
    prompt = [5, 17, 99, 3, 250, 8, 41]
    params = SamplingParams(max_new_tokens=6, temperature=0.7, top_k=20, seed=3, return_log_probs=True,
                            return_context_logits=True, return_generation_logits=True)
    by_index, outs = collect(engine, "a", prompt, params)
    got = tokens(by_index[0])
    lps = [lp for o in by_index[0] for lp in o.new_log_probs]
    gen = [row for o in by_index[0] for row in o.generation_logits]
    context = [o.context_logits for o in outs if o.context_logits is not None]
    assert len(context) == 1  # sent once, with the first output
    ref = engine.model.forward_reference(prompt + got)  # [T, V] float32, no cache, no batching
    np.testing.assert_allclose(context[0], ref[:len(prompt)], rtol=1e-4, atol=1e-4)
    for i, token in enumerate(got):
        row = ref[len(prompt) - 1 + i]
        np.testing.assert_allclose(gen[i], row, rtol=1e-4, atol=1e-4)
        want = log_softmax(row, 0.7)
        assert abs(lps[i] - want[token]) < 1e-4  # the sampled token's log prob, after temperature
        assert want[token] >= top_logprobs(want, 20)[1][-1] - 1e-6  # top_k=20 drew from the top 20
    engine.kv_manager.pool.check_invariants()
    assert engine.kv_manager.pool.num_used == 0


def test_greedy_log_probs_are_the_models_own_distribution(make_engine):
    engine = make_engine()
    prompt = [9, 8, 7, 6]
    out = engine.generate(prompt, SamplingParams(max_new_tokens=4, temperature=0.0, return_log_probs=True))
    ref = engine.model.forward_reference(prompt + out.new_token_ids)
    for i, (t, lp) in enumerate(zip(out.new_token_ids, out.new_log_probs)):
        assert abs(lp - log_softmax(ref[len(prompt) - 1 + i])[t]) < 1e-4


def test_context_logits_turn_prefix_reuse_off_for_that_request(make_engine):
    engine = make_engine(enable_kv_cache_reuse=True, tokens_per_block=4)
    prompt = list(range(20, 40))
    collect(engine, "warm", prompt, SamplingParams(max_new_tokens=2))
    by_index, outs = collect(engine, "b", prompt, SamplingParams(max_new_tokens=1, return_context_logits=True))
    context = next(o.context_logits for o in outs if o.context_logits is not None)
    np.testing.assert_allclose(context, engine.model.forward_reference(prompt), rtol=1e-4, atol=1e-4)
    assert by_index[0][-1].perf["kv_cache_reused_blocks"] == 0


def test_n_sequences_share_the_prompts_full_blocks_and_sample_apart(make_engine):
    engine = make_engine(tokens_per_block=4, enable_kv_cache_reuse=False)
    prompt = list(range(30, 48))  # 18 tokens: 4 full blocks and a partial one
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_k=50, seed=11, num_return_sequences=3,
                            return_log_probs=True)
    used_before = engine.kv_manager.pool.num_used
    by_index, outs = collect(engine, "n", prompt, params)
    assert sorted(by_index) == [0, 1, 2]
    assert sum(o.ends_request for o in outs) == 1 and outs[-1].ends_request
    seqs = [tokens(by_index[i]) for i in range(3)]
    assert all(len(s) == 8 for s in seqs) and len({tuple(s) for s in seqs}) == 3
    for i in (1, 2):  # forked: the 4 full prompt blocks shared, the partial one copied
        final = [o for o in by_index[i] if o.finished][0]
        assert final.perf["kv_cache_reused_blocks"] == 4
    # each sequence is what the model gives its own tokens: a forked one read the right (shared) K/V
    for s, i in zip(seqs, range(3)):
        lps = [lp for o in by_index[i] for lp in o.new_log_probs]
        ref = engine.model.forward_reference(prompt + s)
        for j, t in enumerate(s):
            assert abs(lps[j] - log_softmax(ref[len(prompt) - 1 + j])[t]) < 1e-4
    # seeded: the same n sequences again
    again = collect(engine, "n2", prompt, params)[0]
    assert [tokens(again[i]) for i in range(3)] == seqs
    engine.kv_manager.pool.check_invariants()
    assert engine.kv_manager.pool.num_used == used_before == 0


def test_cancelling_an_n_request_ends_every_sequence_and_frees_every_block(make_engine):
    engine = make_engine(tokens_per_block=4)
    outs = []
    engine.submit("c", list(range(10)), SamplingParams(max_new_tokens=50, num_return_sequences=4), outs.append)
    for _ in range(4):
        engine.step()
    assert len(engine.scheduler.running) == 4
    engine.cancel("c")
    for _ in range(3):
        engine.step()
    assert sum(o.ends_request for o in outs) == 1
    assert {o.sequence_index for o in outs if o.finished} == {0, 1, 2, 3}
    assert engine.kv_manager.pool.num_used == 0 and not engine.sequences


def test_presence_and_frequency_penalties_and_embedding_bias_change_the_tokens(make_engine):
    engine = make_engine()
    prompt = [1, 2, 3]
    plain = engine.generate(prompt, SamplingParams(max_new_tokens=12, temperature=0.0)).new_token_ids
    assert len(set(plain)) < len(plain)  # the tiny model repeats itself greedily
    # a large frequency / presence penalty forbids a repeat that the free run has
    for name in ("presence_penalty", "frequency_penalty"):
        got = engine.generate(prompt, SamplingParams(max_new_tokens=12, temperature=0.0, **{name: 2.0})).new_token_ids
        assert got != plain, name
    bias = np.zeros(256, np.float32)
    bias[123] = 100.0  # OpenAI's logit_bias +100: that token, every time
    got = engine.generate(prompt, SamplingParams(max_new_tokens=5, temperature=0.0, embedding_bias=bias))
    assert got.new_token_ids == [123] * 5
    bias[:] = 0
    bias[plain[0]] = -100.0  # -100: never that token
    got = engine.generate(prompt, SamplingParams(max_new_tokens=5, temperature=0.0, embedding_bias=bias))
    assert plain[0] not in got.new_token_ids


def test_n_sequences_under_speculative_decoding_are_the_plain_engines(make_engine):
    """Forked sequences draft and verify on their own (prompt lookup): seeded, they give the very tokens
    the plain engine gives, and every block comes back."""
    prompt = np.random.default_rng(3).integers(0, 256, 7).tolist() * 4  # repetitive: prompt lookup finds drafts
    params = SamplingParams(max_new_tokens=40, temperature=0.0, num_return_sequences=3)
    plain = collect(make_engine(), "p", prompt, params)[0]
    engine = make_engine(decoding_mode="lookahead", lookahead_ngram_size=6)
    spec, outs = collect(engine, "s", prompt, params)
    assert [tokens(spec[i]) for i in range(3)] == [tokens(plain[i]) for i in range(3)]
    assert sum(o.ends_request for o in outs) == 1
    finals = [o for o in outs if o.finished]
    assert {o.sequence_index for o in finals if o.perf["total_draft_tokens"]} == {0, 1, 2}  # each one drafted
    pool = engine.kv_manager.pool
    pool.check_invariants()
    assert pool.num_used == 0 and not engine.sequences
