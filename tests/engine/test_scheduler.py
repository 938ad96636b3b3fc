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
