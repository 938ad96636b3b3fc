"""The scheduler's chunks packed into one forward pass (`llama.StepBatch`): which rows are decodes over the
paged cache, which are prefill segments, where each row's K/V go, and which rows' logits are sampled.
Kept apart from the engine loop so the step reads schedule -> pack -> run -> sample -> deliver."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from cpu_engine.llama import PrefillSegment, StepBatch
from cpu_engine.scheduler import ScheduledChunk
from cpu_engine.sequence import Sequence


@dataclass
class Sampler:
    """A sequence that samples this step: its draft (verified row by row) and its first logits row in the
    step's sampled rows (1 + len(draft) rows)."""
    seq: Sequence
    draft: list[int]
    row: int


@dataclass
class ContextLogits:
    """Prompt rows whose logits a request asked for (`return_context_logits`): `count` prompt positions
    from `start`, at `row` in the step's sampled rows."""
    seq: Sequence
    start: int
    row: int
    count: int


@dataclass
class PackedStep:
    batch: StepBatch
    samplers: list[Sampler]
    contexts: list[ContextLogits]


@dataclass
class _Rows:
    """The step's rows as they are added, chunk by chunk."""
    slots_of: object  # KVCacheManager.slots: (sequence, start, end) -> slot indices
    tokens: list = field(default_factory=list)
    positions: list = field(default_factory=list)
    write_slots: list = field(default_factory=list)
    decode_rows: list = field(default_factory=list)
    decode_ctx: list = field(default_factory=list)
    prefills: list = field(default_factory=list)
    sample_rows: list = field(default_factory=list)
    samplers: list = field(default_factory=list)
    contexts: list = field(default_factory=list)

    @property
    def row(self) -> int:
        return len(self.tokens)

    def _take(self, ids, start: int) -> int:
        row = self.row
        self.tokens.extend(ids)
        self.positions.extend(range(start, start + len(ids)))
        return row

    def verification(self, chunk: ScheduledChunk) -> None:
        """The last token and the draft, each row a decode over the cache up to itself (all rows' K/V are
        written before any row attends), each row sampled."""
        seq, start, n = chunk.seq, chunk.seq.num_computed, chunk.num_tokens
        row = self._take([seq.all_ids[start]] + chunk.draft, start)
        ctx = self.slots_of(seq, 0, start + n)
        self.write_slots.append(ctx[start:])
        self.samplers.append(Sampler(seq, chunk.draft, len(self.sample_rows)))
        for i in range(n):
            self.decode_rows.append(row + i)
            self.decode_ctx.append(ctx[:start + i + 1])
            self.sample_rows.append(row + i)

    def chunk(self, chunk: ScheduledChunk) -> None:
        """A decode or a prompt chunk. A single token that ends its sequence attends as one decode row
        (a decode, or a prompt's last token once the rest came from the prefix cache)."""
        seq, start, n = chunk.seq, chunk.seq.num_computed, chunk.num_tokens
        row = self._take(seq.all_ids[start:start + n], start)
        self.write_slots.append(self.slots_of(seq, start, start + n))
        if n == 1 and start == seq.num_tokens - 1:
            self.decode_rows.append(row)
            self.decode_ctx.append(self.slots_of(seq, 0, start + 1))
        else:
            self.prefills.append(PrefillSegment(slice(row, row + n), start, self.slots_of(seq, 0, start + n)))
        prompt_rows = min(start + n, len(seq.prompt_ids)) - start
        if seq.params.return_context_logits and prompt_rows > 0:
            self.contexts.append(ContextLogits(seq, start, len(self.sample_rows), prompt_rows))
            self.sample_rows.extend(range(row, row + prompt_rows))
        if start + n == seq.num_tokens:
            last = row + n - 1
            if self.sample_rows and self.sample_rows[-1] == last:  # the prompt's last row samples too
                self.samplers.append(Sampler(seq, [], len(self.sample_rows) - 1))
            else:
                self.samplers.append(Sampler(seq, [], len(self.sample_rows)))
                self.sample_rows.append(last)

    def packed(self) -> PackedStep:
        batch = StepBatch(
            tokens=np.asarray(self.tokens, dtype=np.int64),
            positions=np.asarray(self.positions, dtype=np.int64),
            write_slots=np.concatenate(self.write_slots),
            decode_rows=np.asarray(self.decode_rows, dtype=np.int64),
            prefills=self.prefills,
            sample_rows=np.asarray(self.sample_rows, dtype=np.int64),
        )
        set_decode_contexts(batch, self.decode_ctx)
        return PackedStep(batch, self.samplers, self.contexts)


def set_decode_contexts(batch: StepBatch, contexts: list) -> None:
    """Each decode row's context slots, padded to the longest ([B, Lmax]), and their lengths."""
    if not contexts:
        return
    lens = [len(c) for c in contexts]
    batch.decode_slots = np.zeros((len(lens), max(lens)), dtype=np.int64)
    for i, c in enumerate(contexts):
        batch.decode_slots[i, :len(c)] = c
    batch.decode_lens = np.asarray(lens, dtype=np.int64)


def pack_step(chunks: list[ScheduledChunk], slots_of) -> PackedStep:
    """The step's rows in the scheduler's order (decodes first, then prompt chunks); `slots_of` maps a
    sequence's positions to KV slots (KVCacheManager.slots)."""
    rows = _Rows(slots_of)
    for chunk in chunks:
        if chunk.draft:
            rows.verification(chunk)
        else:
            rows.chunk(chunk)
    return rows.packed()
