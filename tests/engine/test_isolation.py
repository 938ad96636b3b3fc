"""One request never reads another's cache or brings another down (issue 18, findings 1 and 4).

Prefix-cache keys are SHA-256 chains and every hit is checked against the cached block's content, so
even a forced key collision shares nothing; salts are namespaces; degenerate sampling values are
refused naming the field; a failure while sampling one sequence ends that sequence alone, after the
tokens it already produced.
"""
import hashlib
import math

import numpy as np
import pytest

from cpu_engine import InvalidRequestError, SamplingParams
from cpu_engine import engine as engine_module
from cpu_engine.block_pool import ROOT_SERIAL, BlockPool
from cpu_engine.kv_cache_manager import ROOT_KEY, KVCacheManager, block_key
from tests.engine.conftest import run_all


def greedy(n, **kw):
    return SamplingParams(max_new_tokens=n, temperature=0.0, **kw)


def fresh_tokens(make_engine, prompt, n):
    """What a prompt generates with nothing cached."""
    return run_all(make_engine(enable_kv_cache_reuse=False), {"x": (prompt, greedy(n), None)})["x"][0]


# -- keys -------------------------------------------------------------------------------------------
def test_block_key_is_sha256_of_parent_salt_and_int32_tokens():
    tokens = [1, 2, 3, 70000]
    want = hashlib.sha256(ROOT_KEY + b"\x01" + (4).to_bytes(8, "little") + b"acme"
                          + np.asarray(tokens, "<i4").tobytes()).digest()
    assert block_key(ROOT_KEY, "acme", tokens) == want
    k = block_key(ROOT_KEY, None, tokens)
    assert len(k) == 32
    # every input matters, and no two salts (None, "", "a", ...) or token splits encode alike
    assert len({k, block_key(ROOT_KEY, "", tokens), block_key(ROOT_KEY, "acme", tokens),
                block_key(ROOT_KEY, "acme ", tokens), block_key(k, None, tokens),
                block_key(ROOT_KEY, None, tokens[::-1]), block_key(ROOT_KEY, None, tokens[:3])}) == 7


# -- forced collisions: the key is only an index ------------------------------------------------------
@pytest.fixture
def constant_key(monkeypatch):
    """Every block of every prefix gets the same key: the worst collision a hash could have."""
    monkeypatch.setattr(KVCacheManager, "_key", lambda self, parent, salt, tokens: b"\x00" * 32)


def test_a_forced_key_collision_shares_no_blocks_between_different_tokens(make_engine, constant_key):
    engine = make_engine(enable_kv_cache_reuse=True, tokens_per_block=4)
    victim = list(range(10, 30))
    attacker = list(range(100, 120))
    run_all(engine, {"attacker": (attacker, greedy(4), None)})
    got, final = run_all(engine, {"victim": (victim, greedy(6), None)})["victim"]
    assert final.perf["kv_cache_reused_blocks"] == 0
    assert got == fresh_tokens(make_engine, victim, 6)
    again, final = run_all(engine, {"again": (victim, greedy(6), None)})["again"]
    assert final.perf["kv_cache_reused_blocks"] == 1  # the same tokens still hit (one key: one block)
    assert again == got
    engine.kv_manager.pool.check_invariants()


def test_a_forced_key_collision_shares_nothing_across_salts(make_engine, constant_key):
    engine = make_engine(enable_kv_cache_reuse=True, tokens_per_block=4)
    prompt = list(range(10, 30))
    run_all(engine, {"a": (prompt, greedy(3), "acme")})
    for salt in ("other", None, "", "acme "):
        out = run_all(engine, {"b": (prompt, greedy(3), salt)})["b"][1]
        assert out.perf["kv_cache_reused_blocks"] == 0, salt


def test_a_hit_needs_the_very_parent_block_it_was_computed_on():
    """A block registered on top of another prefix is a miss even when key, salt and tokens match
    (what a colliding parent key would otherwise let through)."""
    pool = BlockPool(4)
    a, b = pool.allocate(), pool.allocate()
    parent = pool.register(a, b"k0", ROOT_SERIAL, None, (1, 2))
    child = pool.register(b, b"k1", parent + 100, None, (3, 4))  # computed on some other prefix
    assert child is not None
    assert pool.lookup(b"k0", ROOT_SERIAL, None, (1, 2)) == a
    assert pool.lookup(b"k1", parent, None, (3, 4)) is None
    assert pool.lookup(b"k1", parent + 100, None, (3, 4)) == b
    assert pool.lookup(b"k0", ROOT_SERIAL, "s", (1, 2)) is None  # salt compared
    assert pool.lookup(b"k0", ROOT_SERIAL, None, (1, 3)) is None  # tokens compared


def test_identical_content_adopts_the_cached_registration_and_a_stale_one_is_replaced():
    pool = BlockPool(4)
    a, b = pool.allocate(), pool.allocate()
    first = pool.register(a, b"k", ROOT_SERIAL, None, (1, 2))
    assert pool.register(b, b"k", ROOT_SERIAL, None, (1, 2)) == first  # same content computed twice
    assert pool.key_of[b] is None  # the duplicate stays private; its children chain to `first`
    c = pool.allocate()
    assert pool.register(c, b"k", ROOT_SERIAL, None, (9, 9)) is None  # key held by a live other block
    for blk in (a, b, c):
        pool.release(blk)
    d = pool.allocate()  # a plain free block (cached ones are evicted last)
    assert pool.key_of[d] is None
    new = pool.register(d, b"k", ROOT_SERIAL, None, (9, 9))  # the unused colliding block gives way
    assert new not in (None, first) and pool.lookup(b"k", ROOT_SERIAL, None, (9, 9)) == d
    assert pool.lookup(b"k", ROOT_SERIAL, None, (1, 2)) is None
    pool.check_invariants()


def test_salts_are_namespaces_and_no_salt_is_one_too(make_engine):
    engine = make_engine(enable_kv_cache_reuse=True, tokens_per_block=4)
    prompt = list(range(40, 70))  # 7 full blocks
    run_all(engine, {"a": (prompt, greedy(3), "acme")})
    reused = {salt: run_all(engine, {"r": (prompt, greedy(3), salt)})["r"][1].perf["kv_cache_reused_blocks"]
              for salt in ("acme", "other", "")}
    assert reused == {"acme": 7, "other": 0, "": 0}
    assert run_all(engine, {"n": (prompt, greedy(3), None)})["n"][1].perf["kv_cache_reused_blocks"] == 0
    assert run_all(engine, {"m": (prompt, greedy(3), None)})["m"][1].perf["kv_cache_reused_blocks"] == 7


def test_lru_eviction_still_prefers_plain_blocks_then_the_oldest_prefix(make_engine):
    engine = make_engine(enable_kv_cache_reuse=True, tokens_per_block=4, max_tokens_in_paged_kv_cache=64)
    old, new = list(range(1, 10)), list(range(50, 59))  # 2 full blocks each
    run_all(engine, {"old": (old, greedy(2), None)})
    run_all(engine, {"new": (new, greedy(2), None)})
    # a long request takes every plain block and then evicts the oldest cached prefix first
    pool = engine.kv_manager.pool
    filler = list(range(100, 100 + 4 * (pool.num_blocks - 2) - 3))
    run_all(engine, {"fill": (filler, greedy(1), "x")})
    assert run_all(engine, {"new2": (new, greedy(2), None)})["new2"][1].perf["kv_cache_reused_blocks"] == 2
    assert run_all(engine, {"old2": (old, greedy(2), None)})["old2"][1].perf["kv_cache_reused_blocks"] == 0
    pool.check_invariants()


# -- degenerate sampling values -------------------------------------------------------------------------
@pytest.mark.parametrize("kw, field", [
    (dict(temperature=math.nan, top_k=5), "temperature"),
    (dict(temperature=math.inf, top_p=0.9), "temperature"),
    (dict(temperature=1e39, top_k=5), "temperature"),  # over FP32 (it arrives as inf over the wire)
    (dict(temperature=1e5, top_k=5), "temperature"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=math.nan, top_k=3), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(seed=-1, top_k=3), "seed"),
    (dict(max_new_tokens=0), "max_tokens"),
])
def test_degenerate_sampling_values_are_refused_naming_the_field(make_engine, kw, field):
    engine = make_engine()
    params = SamplingParams(**{"max_new_tokens": 4, **kw})
    with pytest.raises(InvalidRequestError) as e:
        engine.submit("r", [1, 2, 3], params, lambda o: None)
    assert e.value.field == field and str(e.value).startswith(field)
    assert not engine.has_work()


def test_tiny_and_huge_temperatures_sample_without_overflow(make_engine):
    engine = make_engine()
    prompt = [5, 6, 7]
    want = run_all(engine, {"g": (prompt, greedy(8), None)})["g"][0]
    results = run_all(engine, {
        "tiny": (prompt, SamplingParams(max_new_tokens=8, temperature=1e-30, top_k=5, seed=1), None),
        "small": (prompt, SamplingParams(max_new_tokens=8, temperature=2e-5, top_k=5, seed=1,
                                         return_log_probs=True), None),
        "huge": (prompt, SamplingParams(max_new_tokens=8, temperature=1e4, top_p=0.9, seed=1), None),
    })
    assert results["tiny"][0] == want  # below MIN_TEMPERATURE: greedy
    for rid, (tokens, final) in results.items():
        assert final.finish_reason == "length" and len(tokens) == 8, rid
    assert results["small"][0] == want  # 2e-5 sharpens to argmax without inf / NaN on the way


def test_max_tokens_too_big_for_the_cache_names_both_names(make_engine):
    engine = make_engine(max_tokens_in_paged_kv_cache=64, tokens_per_block=4)
    with pytest.raises(InvalidRequestError) as e:
        engine.submit("r", [1] * 10, greedy(100), lambda o: None)
    assert e.value.field == "max_tokens"
    assert "max_tokens (request_output_len)" in str(e.value) and "cache" in str(e.value)


# -- one failing sequence -----------------------------------------------------------------------------
@pytest.mark.parametrize("output_threads", [1, 3])
def test_a_sampling_failure_ends_its_sequence_alone_after_its_tokens(make_engine, monkeypatch, output_threads):
    engine = make_engine(output_threads=output_threads, max_num_tokens=64)
    real_sample = engine_module.sample

    def sample(seq, logits):
        if seq.request_id == "bad" and len(seq.output_ids) == 3:
            raise FloatingPointError("injected")
        return real_sample(seq, logits)

    monkeypatch.setattr(engine_module, "sample", sample)
    events = {}
    prompts = {f"ok{i}": [i + 1, i + 2, i + 3] for i in range(4)} | {"bad": [9, 8, 7]}

    def collector(rid):
        def on_output(out):
            events.setdefault(rid, []).append(out)
        return on_output

    for rounds in range(3):  # the engine keeps serving after each failure
        events.clear()
        for rid, prompt in prompts.items():
            engine.submit(rid, prompt, greedy(12), collector(rid))
        while engine.has_work():
            engine.step()
        for rid in prompts:
            outs = events[rid]
            assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True], rid
            tokens = [t for o in outs for t in o.new_token_ids]
            if rid == "bad":
                assert outs[-1].finish_reason == "error" and "injected" in outs[-1].error
                assert len(tokens) == 3 and outs[-1].new_token_ids == []  # its tokens came first
            else:
                assert outs[-1].finish_reason == "length" and len(tokens) == 12, rid
                assert tokens == fresh_tokens(make_engine, prompts[rid], 12)
        assert engine.kv_manager.pool.num_used == 0
        engine.kv_manager.pool.check_invariants()


def test_deliver_keeps_one_sequences_outputs_in_order_across_threads(make_engine):
    """Several outputs of one sequence in one step (its last tokens, then its error) are delivered
    in order even when a step's outputs are spread over output threads."""
    engine = make_engine(output_threads=4)
    seen = []

    class Seq:
        def __init__(self, name):
            self.request_id, self.cancel_requested, self.cancel_polled, self.is_cancelled = name, False, False, None
            self.siblings = []  # one sequence per request here (n = 1)

        def on_output(self, out):
            seen.append((self.request_id, out))

    seqs = [Seq(f"s{i}") for i in range(6)]
    for k in range(3):
        for s in seqs:
            engine._outbox.append((s, SimpleOut(k, finished=k == 2)))
    engine._deliver()
    for s in seqs:
        assert [o.k for rid, o in seen if rid == s.request_id] == [0, 1, 2]


class SimpleOut:
    def __init__(self, k, finished):
        self.k, self.finished = k, finished
