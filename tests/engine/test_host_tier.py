"""The host KV tier (cpu_engine/host_tier.py, kv_cache_host_memory_bytes): a prefix the pool evicted comes
back from the tier instead of being computed again, answers as a recompute does (within float16), stays
within its tenant, and the pool stays whole."""
import numpy as np

from cpu_engine.host_tier import HostTier
from cpu_engine.metrics import metric_samples
from tests.engine.conftest import run_all
from tests.engine.test_engine import assert_same_or_tie, greedy, reference_greedy


def churn(engine, salt="x"):
    """A long request of another prefix that needs every block of the pool: all cached prefixes are evicted."""
    pool = engine.kv_manager.pool
    filler = list(range(100, 100 + 4 * pool.num_blocks - 1))  # with its one output token: every block
    run_all(engine, {"fill": (filler, greedy(1), salt)})


def test_an_evicted_prefix_is_onboarded_not_recomputed(make_engine):
    engine = make_engine(enable_kv_cache_reuse=True, tokens_per_block=4, max_tokens_in_paged_kv_cache=64,
                         kv_cache_host_memory_bytes=1 << 20)
    session = list(range(1, 30))  # 7 full blocks
    first = run_all(engine, {"a": (session, greedy(4), "acme")})["a"]
    churn(engine)
    host = engine.kv_manager.host
    assert host.offloaded_total >= 7 and len(host) >= 7
    prefill_before = engine.totals["prefill_tokens"]
    back = run_all(engine, {"b": (session, greedy(4), "acme")})["b"]
    assert back[1].perf["kv_cache_reused_blocks"] == 7 and host.onboarded_total >= 7
    assert engine.totals["prefill_tokens"] - prefill_before <= len(session) - 7 * 4
    want, gaps = reference_greedy(engine, session, 4)
    assert_same_or_tie(back[0], want, gaps, "onboarded prefix")
    assert back[0] == first[0] or gaps[0] < 1e-2
    engine.kv_manager.pool.check_invariants()
    assert engine.kv_manager.pool.num_used == 0
    stats = {(f, v): x for f, _, _, v, x in metric_samples(engine.stats())}
    assert stats[("cpu_engine_kv_host_tier_metrics", "onboarded")] == host.onboarded_total


def test_without_the_tier_the_same_prefix_is_computed_again(make_engine):
    engine = make_engine(enable_kv_cache_reuse=True, tokens_per_block=4, max_tokens_in_paged_kv_cache=64)
    session = list(range(1, 30))
    run_all(engine, {"a": (session, greedy(4), "acme")})
    churn(engine)
    assert engine.kv_manager.host is None
    assert run_all(engine, {"b": (session, greedy(4), "acme")})["b"][1].perf["kv_cache_reused_blocks"] == 0


def test_the_tier_keeps_tenants_apart(make_engine):
    engine = make_engine(enable_kv_cache_reuse=True, tokens_per_block=4, max_tokens_in_paged_kv_cache=64,
                         kv_cache_host_memory_bytes=1 << 20)
    session = list(range(1, 30))
    run_all(engine, {"a": (session, greedy(2), "acme")})
    churn(engine)
    offloaded = len(engine.kv_manager.host)
    other = run_all(engine, {"o": (session, greedy(2), "globex")})["o"]
    assert other[1].perf["kv_cache_reused_blocks"] == 0 and engine.kv_manager.host.onboarded_total == 0
    assert len(engine.kv_manager.host) >= offloaded - 7  # acme's blocks were not taken by globex
    engine.kv_manager.pool.check_invariants()


def test_the_tier_is_bounded_and_checks_what_it_returns():
    tier = HostTier(capacity_bytes=2 * 2 * 8 * 2)  # two blocks of K and V, [1, 4, 1, 2] float16 each
    k = np.ones((1, 4, 1, 2), np.float32)
    for i in range(3):
        tier.put(bytes([i]) * 32, (i + 1, 0, "s", (i,)), k * i, k * i)
    assert len(tier) == 2 and tier.bytes <= tier.capacity_bytes
    assert tier.take(bytes([0]) * 32, 0, "s", (0,)) is None  # the oldest went first
    assert tier.take(bytes([1]) * 32, 0, "other", (1,)) is None  # another salt: a miss
    assert tier.take(bytes([1]) * 32, 0, "s", (2,)) is None  # other tokens: a miss
    serial, got_k, _ = tier.take(bytes([2]) * 32, 0, "s", (2,))
    assert serial == 3 and got_k.dtype == np.float16 and float(got_k.max()) == 2.0 and len(tier) == 1
