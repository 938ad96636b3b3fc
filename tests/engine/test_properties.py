"""Property tests: random arrivals, lengths, cancellations and preemptions never leak or double-free
a KV block, every request settles exactly once, and the pool is whole when idle."""
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpu_engine import SamplingParams
from tests.engine.conftest import run_all

request = st.tuples(
    st.integers(1, 40),  # prompt length
    st.integers(1, 20),  # max new tokens
    st.integers(0, 6),  # arrival step
    st.one_of(st.none(), st.integers(0, 12)),  # cancel step
    st.sampled_from([None, "a", "b"]),  # cache salt
    st.integers(0, 3),  # prompt family (shared prefixes)
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reqs=st.lists(request, min_size=1, max_size=8),
       policy=st.sampled_from(["guaranteed_no_evict", "max_utilization"]),
       kv_tokens=st.sampled_from([64, 96, 256]),
       reuse=st.booleans())
def test_pool_is_whole_after_random_traffic(make_engine, reqs, policy, kv_tokens, reuse):
    engine = make_engine(max_tokens_in_paged_kv_cache=kv_tokens, batch_scheduler_policy=policy,
                         enable_kv_cache_reuse=reuse, max_num_tokens=12)
    requests, arrivals, cancels = {}, {}, {}
    for i, (plen, new, arrive, cancel, salt, family) in enumerate(reqs):
        if engine.kv_manager.blocks_for(plen + new) > engine.num_blocks:
            new = 1
            plen = min(plen, engine.num_blocks * engine.config.tokens_per_block - 1)
        prompt = [(family * 7 + j) % 200 for j in range(plen)]
        rid = f"r{i}"
        requests[rid] = (prompt, SamplingParams(max_new_tokens=new, temperature=0.0), salt)
        arrivals[rid] = arrive
        if cancel is not None:
            cancels[rid] = arrive + cancel
    original_step = engine.step

    def checked_step():
        original_step()
        engine.kv_manager.pool.check_invariants()

    engine.step = checked_step
    results = run_all(engine, requests, arrivals, cancels)
    for rid, (tokens, final) in results.items():
        assert final is not None and final.finished, f"{rid} never settled"
        if final.finish_reason == "length":
            assert len(tokens) == requests[rid][1].max_new_tokens
    pool = engine.kv_manager.pool
    pool.check_invariants()
    assert pool.num_free == pool.num_blocks and all(r == 0 for r in pool.ref)
    assert not engine.sequences


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reqs=st.lists(request, min_size=1, max_size=8),
       policy=st.sampled_from(["guaranteed_no_evict", "max_utilization"]),
       kv_tokens=st.sampled_from([64, 96, 256]),
       reuse=st.booleans(), ngram=st.integers(2, 8), draft_budget=st.integers(0, 12))
def test_speculation_keeps_the_pool_whole_after_random_traffic(make_engine, reqs, policy, kv_tokens, reuse, ngram,
                                                               draft_budget):
    """The same random traffic with prompt-lookup drafts (speculation.py): drafts accepted and rejected,
    blocks taken for drafts and given back, preemptions and cancellations mid-draft never leak a block."""
    engine = make_engine(max_tokens_in_paged_kv_cache=kv_tokens, batch_scheduler_policy=policy,
                         enable_kv_cache_reuse=reuse, max_num_tokens=12, decoding_mode="lookahead",
                         lookahead_ngram_size=ngram, max_draft_tokens_per_step=draft_budget)
    requests, arrivals, cancels = {}, {}, {}
    for i, (plen, new, arrive, cancel, salt, family) in enumerate(reqs):
        if engine.kv_manager.blocks_for(plen + new) > engine.num_blocks:
            new = 1
            plen = min(plen, engine.num_blocks * engine.config.tokens_per_block - 1)
        prompt = [(family * 7 + j % 5) % 200 for j in range(plen)]  # repeats itself: lookups find drafts
        rid = f"r{i}"
        requests[rid] = (prompt, SamplingParams(max_new_tokens=new, temperature=0.0), salt)
        arrivals[rid] = arrive
        if cancel is not None:
            cancels[rid] = arrive + cancel
    original_step = engine.step

    def checked_step():
        original_step()
        engine.kv_manager.pool.check_invariants()
        for seq in engine.scheduler.running:
            assert len(seq.block_table) <= engine.kv_manager.blocks_for(seq.num_tokens)

    engine.step = checked_step
    results = run_all(engine, requests, arrivals, cancels)
    for rid, (tokens, final) in results.items():
        assert final is not None and final.finished, f"{rid} never settled"
        if final.finish_reason == "length":
            assert len(tokens) == requests[rid][1].max_new_tokens
    pool = engine.kv_manager.pool
    pool.check_invariants()
    assert pool.num_free == pool.num_blocks and all(r == 0 for r in pool.ref)
    assert not engine.sequences
