"""The scheduler's boundary: a SchedulerOutput per step, block accounting only through the KV manager."""
from __future__ import annotations

from pathlib import Path

from cpu_engine.config import EngineConfig
from cpu_engine.kv_cache_manager import KVCacheManager
from cpu_engine.scheduler import Scheduler
from cpu_engine.sequence import SamplingParams, Sequence, Status


def _seq(rid: str, prompt_len: int, new: int = 8) -> Sequence:
    return Sequence(rid, list(range(1, prompt_len + 1)), SamplingParams(max_new_tokens=new), lambda out: None)


def _step(sched: Scheduler, out) -> None:
    """What the engine does after a forward pass: positions computed, one sampled token per finished prompt."""
    for chunk in out.chunks:
        chunk.seq.num_computed += chunk.num_tokens
        if chunk.seq.num_computed == chunk.seq.num_tokens:
            chunk.seq.output_ids.append(7)


def test_decodes_come_first_and_prefills_are_chunked_to_the_budget(tiny_dir):
    config = EngineConfig(checkpoint_dir=str(tiny_dir), max_num_tokens=10, tokens_per_block=4)
    sched = Scheduler(config, KVCacheManager(num_blocks=64, block_size=4, enable_reuse=False))
    a, b = _seq("a", 6), _seq("b", 30)
    sched.waiting.extend([a, b])
    out = sched.schedule()
    assert [(c.seq.request_id, c.num_tokens, c.is_decode) for c in out.chunks] == [("a", 6, False), ("b", 4, False)]
    assert out.num_decodes == 0 and out.num_context_tokens == 10 and not out.preempted
    _step(sched, out)
    out = sched.schedule()
    assert [(c.seq.request_id, c.num_tokens, c.is_decode) for c in out.chunks] == [("a", 1, True), ("b", 9, False)]
    assert out.num_decodes == 1 and out.num_context_tokens == 9


def test_max_utilization_reports_the_sequence_it_preempted(tiny_dir):
    config = EngineConfig(checkpoint_dir=str(tiny_dir), max_num_tokens=64, tokens_per_block=4, batch_scheduler_policy="max_utilization")
    kv_manager = KVCacheManager(num_blocks=4, block_size=4, enable_reuse=False)
    sched = Scheduler(config, kv_manager)
    old, new = _seq("old", 8, new=16), _seq("new", 8, new=16)
    sched.waiting.extend([old, new])
    _step(sched, sched.schedule())  # both prompts fill the 4 blocks
    assert kv_manager.pool.num_free == 0
    out = sched.schedule()  # the decode of `old` needs a fifth block: `new` goes back to waiting
    assert out.preempted == [new] and new.status is Status.WAITING and new.block_table == []
    assert [c.seq for c in out.chunks] == [old] and out.chunks[0].is_decode
    assert sched.preempted_total == 1 and list(sched.waiting) == [new]


def test_scheduler_reads_blocks_only_through_the_kv_manager():
    source = (Path(__file__).parents[2] / "cpu_engine" / "scheduler.py").read_text()
    assert ".pool" not in source and "block_pool" not in source


def _decoding(rid: str, salt, context: int) -> Sequence:
    seq = Sequence(rid, list(range(1, context + 1)), SamplingParams(max_new_tokens=64), lambda out: None,
                   cache_salt=salt)
    return seq


def _decoders(sched: Scheduler, out) -> list[str]:
    return [c.seq.request_id for c in out.chunks if c.is_decode]


def test_tenants_share_a_step_by_context_and_a_heavy_tenants_rows_take_turns(tiny_dir):
    """acme's four long streams and globex's short one decode together: acme's rows in each step hold at most
    the share (its longest-waiting row first), globex's row runs every step; alone, acme runs all four."""
    config = EngineConfig(checkpoint_dir=str(tiny_dir), max_num_tokens=4096, tokens_per_block=4,
                          decode_context_share_tokens=200)
    sched = Scheduler(config, KVCacheManager(num_blocks=1024, block_size=4, enable_reuse=False))
    heavy = [_decoding(f"acme{i}", "acme", 90) for i in range(4)]
    sched.waiting.extend(heavy)
    _step(sched, sched.schedule())  # the four prompts
    for _ in range(2):
        out = sched.schedule()
        assert _decoders(sched, out) == ["acme0", "acme1", "acme2", "acme3"]  # one tenant: no share applies
        _step(sched, out)
    light = _decoding("globex", "globex", 8)
    sched.waiting.append(light)
    _step(sched, sched.schedule())  # acme's four decode beside globex's prompt (globex is not decoding yet)
    turns = []
    for _ in range(4):
        out = sched.schedule()
        rows = _decoders(sched, out)
        assert "globex" in rows
        acme = [r for r in rows if r != "globex"]
        assert sum(c.seq.num_tokens for c in out.chunks if c.seq.cache_salt == "acme") <= 200 and len(acme) == 2
        turns.append(acme)
        _step(sched, out)
    # each acme row ran every other step: none starved, none favoured
    assert turns == [["acme0", "acme1"], ["acme2", "acme3"], ["acme0", "acme1"], ["acme2", "acme3"]]


def test_a_tenants_row_over_the_share_still_runs_and_no_share_means_every_row(tiny_dir):
    for share, want in ((50, ["a", "b0", "c"]), (0, ["a", "b0", "b1", "c"])):
        config = EngineConfig(checkpoint_dir=str(tiny_dir), max_num_tokens=4096, tokens_per_block=4,
                              decode_context_share_tokens=share)
        sched = Scheduler(config, KVCacheManager(num_blocks=1024, block_size=4, enable_reuse=False))
        sched.waiting.extend([_decoding("a", "t1", 10), _decoding("b0", "t2", 100), _decoding("b1", "t2", 100),
                              _decoding("c", None, 10)])
        _step(sched, sched.schedule())
        assert _decoders(sched, sched.schedule()) == want  # b0 alone exceeds 50 and runs: a row always does


def test_turns_between_tenants_change_no_token_and_leave_no_block(make_engine):
    """Rows that wait a step for their tenant's turn produce the same greedy tokens as when every row runs every
    step, and every block goes back."""
    from tests.engine.conftest import run_all

    prompts = {f"acme{i}": ([5 + i] * 30, "acme") for i in range(3)}
    prompts["globex"] = ([40, 41, 42], "globex")
    requests = {rid: (p, SamplingParams(max_new_tokens=12, temperature=0.0), salt) for rid, (p, salt) in prompts.items()}
    results, steps = {}, {}
    for share in (0, 40):
        engine = make_engine(decode_context_share_tokens=share, enable_kv_cache_reuse=False)
        results[share] = {rid: got for rid, (got, _) in run_all(engine, requests).items()}
        steps[share] = engine.iteration
        assert engine.kv_manager.pool.num_free == engine.kv_manager.pool.num_blocks
    assert results[40] == results[0]
    assert steps[40] > steps[0]  # acme's rows did take turns
