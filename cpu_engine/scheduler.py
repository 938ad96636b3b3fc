"""Which sequences run in the next step, and how many tokens each.

Every step spends at most `max_num_tokens`: decode tokens of running sequences first (with their
speculative drafts, `Sequence.draft`, as far as `max_draft_tokens_per_step`, the budget and free blocks
allow), then prefill
chunks of running sequences (chunked context), then new admissions from the waiting queue, so a long
prompt never stalls running decodes. Policies keep TensorRT-LLM's names:
- `guaranteed_no_evict`: admit only when the blocks for prompt + max_new_tokens are guaranteed;
  nothing is ever preempted.
- `max_utilization`: admit while blocks exist now; when a decode needs a block and none is free,
  preempt the newest running sequence (free its blocks, recompute it later).

Tenants share a step's cost fairly (`decode_context_share_tokens`): a decode step on the CPU costs the
weights once plus every row's context read by attention, so one tenant's long streams make every other
tenant's step slow. While several tenants (cache salts: the gateway gives each tenant its own) decode,
each tenant's rows in a step hold at most that many context tokens (its longest-waiting row always
runs); its other rows take their turn in the next steps. Alone, a tenant's rows all run.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from cpu_engine.config import EngineConfig
from cpu_engine.kv_cache_manager import KVCacheManager
from cpu_engine.sequence import Sequence, Status


class QueueFullError(RuntimeError):
    pass


@dataclass
class ScheduledChunk:
    """One sequence's share of a step: `num_tokens` positions from `seq.num_computed` on. A decode with
    `draft` tokens verifies them in the same step: its last token and the draft, 1 + len(draft) positions."""
    seq: Sequence
    num_tokens: int
    is_decode: bool
    draft: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """What the scheduler hands the engine for one step: decodes first, then prefill chunks, and the
    sequences it preempted to make room (their blocks are already released)."""
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.chunks)

    @property
    def num_decodes(self) -> int:
        return sum(1 for c in self.chunks if c.is_decode)

    @property
    def num_context_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks if not c.is_decode)


class Scheduler:
    def __init__(self, config: EngineConfig, kv_manager: KVCacheManager):
        self.config = config
        self.kv_manager = kv_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preempted_total = 0
        self.steps = 0  # schedule() calls: when each sequence last decoded (round-robin within a tenant)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _max_blocks(self, seq: Sequence) -> int:
        """The most blocks a sequence can hold, and those of the sequences still to fork from it (each
        shares the prompt's full blocks)."""
        own = self.kv_manager.blocks_for(len(seq.prompt_ids) + seq.params.max_new_tokens)
        shared = len(seq.prompt_ids) // self.kv_manager.block_size
        return own + seq.pending_forks * (own - shared)

    def _outstanding(self) -> int:
        """Blocks promised to running sequences but not yet taken (guaranteed_no_evict)."""
        return sum(max(0, self._max_blocks(s) - len(s.block_table)) for s in self.running)

    def _can_admit(self, seq: Sequence, cached: list, first_chunk: int) -> bool:
        free_after = self.kv_manager.num_free_after_admit(cached)
        if self.config.batch_scheduler_policy == "guaranteed_no_evict":
            return free_after - self._outstanding() >= self._max_blocks(seq) - len(cached)
        covered = len(cached) * self.kv_manager.block_size + first_chunk
        return free_after >= self.kv_manager.blocks_for(covered) - len(cached)

    def _preempt_newest(self, out: SchedulerOutput) -> Sequence:
        victim = self.running.pop()
        self.kv_manager.release(victim)
        victim.status = Status.WAITING
        victim.preemptions += 1
        self.preempted_total += 1
        self.waiting.appendleft(victim)
        out.preempted.append(victim)
        return victim

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.steps += 1
        self._schedule_once(out)
        # max_utilization can fill the pool with half-prefilled sequences; free the newest and retry
        while not out and self.running and self.config.batch_scheduler_policy == "max_utilization":
            self._preempt_newest(out)
            self._schedule_once(out)
        return out

    def _decode_candidates(self) -> list[Sequence]:
        """The running sequences that may decode this step, oldest first: all of them, unless several
        tenants decode and `decode_context_share_tokens` bounds each tenant's context in the step."""
        ready = [s for s in self.running if s.status is Status.RUNNING and not s.in_prefill]
        share = self.config.decode_context_share_tokens
        if not share or len({s.cache_salt for s in ready}) < 2:
            return ready
        held: dict = {}
        chosen = set()
        for seq in sorted(ready, key=lambda s: s.last_decode_step):  # longest waiting first (stable: oldest)
            used = held.get(seq.cache_salt)
            if used is None or used + seq.num_tokens <= share:
                held[seq.cache_salt] = (used or 0) + seq.num_tokens
                chosen.add(seq)
        return [s for s in ready if s in chosen]

    def _schedule_once(self, out: SchedulerOutput) -> None:
        budget = self.config.max_num_tokens
        # a step stays memory-bound up to a few dozen rows: drafts beyond that cost more than they save
        draft_budget = self.config.max_draft_tokens_per_step
        chunked = self.config.enable_chunked_context
        decodes, prefills = [], []
        for seq in self._decode_candidates():  # oldest first
            if seq.status is not Status.RUNNING or budget == 0:  # preempted by an earlier one's growth
                continue
            while not self.kv_manager.grow(seq, seq.num_tokens):
                if self.config.batch_scheduler_policy != "max_utilization" or self._preempt_newest(out) is seq:
                    break
            if seq.status is Status.RUNNING and len(seq.block_table) * self.kv_manager.block_size >= seq.num_tokens:
                # a draft takes what the budget leaves and blocks that are free now; never preempts for one
                draft = seq.draft[:min(budget - 1, draft_budget)]
                while draft and not self.kv_manager.grow(seq, seq.num_tokens + len(draft)):
                    draft = draft[:len(draft) // 2]
                decodes.append(ScheduledChunk(seq, 1 + len(draft), True, draft))
                seq.last_decode_step = self.steps
                budget -= 1 + len(draft)
                draft_budget -= len(draft)
        for seq in self.running:
            if not seq.in_prefill or budget == 0:
                continue
            n = seq.num_tokens - seq.num_computed
            if chunked:
                n = min(n, budget)
            elif n > budget:
                continue
            if self.kv_manager.grow(seq, seq.num_computed + n):
                prefills.append(ScheduledChunk(seq, n, False))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_batch_size:
            seq = self.waiting[0]
            if seq.pending_forks and len(self.running) + 1 + seq.pending_forks > self.config.max_batch_size \
                    and self.running:
                break  # its n sequences wait for room in the batch (alone, it runs whatever n is)
            cached = self.kv_manager.match_prefix(seq)
            n = seq.num_tokens - len(cached) * self.kv_manager.block_size
            if chunked:
                n = min(n, budget)
            elif n > budget:
                break
            if not self._can_admit(seq, cached, n):
                break
            self.waiting.popleft()
            self.kv_manager.admit(seq, cached)
            if not self.kv_manager.grow(seq, seq.num_computed + n):  # _can_admit guarantees this
                raise RuntimeError("admission accounting is wrong: blocks vanished")
            seq.status = Status.RUNNING
            self.running.append(seq)
            prefills.append(ScheduledChunk(seq, n, False))
            budget -= n
        out.chunks = decodes + prefills
