"""Draft-target speculation (`decoding_mode draft_tokens_external`): a smaller model proposes each
speculating request's draft greedily, the engine's model verifies it in the step's one forward pass.

The draft model keeps its K/V in a cache of its own with the engine cache's slot numbering, so it needs no
block manager: a sequence's draft K/V live in the same blocks as its own K/V, and are rolled back with them.
`Sequence.draft_computed` counts the positions whose draft K/V this sequence's draft pass wrote; a sequence
whose blocks were released (preempted) starts again from 0. Before drafting, the draft model catches up on
the positions it has not seen (the prompt, at the first draft; afterwards the last sampled token, and the
last accepted draft token when the whole draft was accepted), then proposes one token per pass.

The draft may be any Llama checkpoint with the engine's vocabulary: a smaller model of the same family, or
the engine's own checkpoint at a cheaper precision (`draft_weight_dtype`). A draft is a deterministic
proposal (the argmax), which is what the engine's verification rule needs for sampling to stay exact.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from cpu_engine.checkpoint import load_checkpoint
from cpu_engine.llama import KVCache, LlamaModel, PrefillSegment, StepBatch
from cpu_engine.scheduler import ScheduledChunk
from cpu_engine.step_batch import set_decode_contexts


class DraftModelError(ValueError):
    pass


class DraftModel:
    def __init__(self, folder: str | Path, weight_dtype: str, vocab_size: int, num_slots: int, max_positions: int,
                 max_rows: int, matmul_backend: str, attention_backend: str, num_threads: int | None):
        """`max_rows`: the most rows of one catch-up pass (a long prompt is caught up in several)."""
        self.weights = load_checkpoint(folder, weight_dtype)
        c = self.weights.config
        if c.vocab_size != vocab_size:
            raise DraftModelError(f"draft model {folder}: vocabulary of {c.vocab_size} tokens, the engine's has "
                                  f"{vocab_size} (a draft must share the engine's tokenizer)")
        self.model = LlamaModel(self.weights, max_positions, matmul_backend, attention_backend, num_threads,
                                release_numpy_copies=True)
        self.kv = KVCache(c.num_layers, num_slots, c.num_kv_heads, c.head_dim)
        self.max_rows = max(1, max_rows)
        self.folder = str(folder)

    def describe(self) -> str:
        return f"draft model {Path(self.folder).name} ({self.weights.config.num_layers} layers, {self.weights.precision})"

    def fill(self, chunks: list[ScheduledChunk], slots_of) -> None:
        """Write each chunk's draft (scheduled as placeholders: its length is what the scheduler granted)."""
        if not chunks:
            return
        last = self._catch_up(chunks, slots_of)
        for i in range(max(len(c.draft) for c in chunks)):
            for c in chunks:
                if i < len(c.draft):
                    c.draft[i] = last[c.seq.request_id]
            feeding = [c for c in chunks if i + 1 < len(c.draft)]
            if not feeding:
                break
            # each draft token but the last is fed back for the next one: its K/V go at position num_tokens + i
            segments = [(c.seq, c.seq.num_tokens + i, [c.draft[i]]) for c in feeding]
            last.update(self._argmax(segments, slots_of))
        for c in chunks:
            c.seq.draft_computed = c.seq.num_tokens + len(c.draft) - 1

    def _catch_up(self, chunks, slots_of) -> dict[str, int]:
        """Run the draft model over each sequence's positions it has not seen, up to its last token; ->
        the draft model's next token after each (request id -> token)."""
        pending = {c.seq.request_id: c.seq for c in chunks}
        done: dict[str, int] = {}
        while pending:
            segments, rows = [], 0
            for rid, seq in list(pending.items()):
                start = min(seq.draft_computed, seq.num_tokens - 1)
                take = min(seq.num_tokens - start, self.max_rows - rows)
                if take <= 0:
                    break
                segments.append((seq, start, seq.all_ids[start:start + take]))
                rows += take
                seq.draft_computed = start + take
                if seq.draft_computed == seq.num_tokens:
                    del pending[rid]
            finished = {rid: t for rid, t in self._argmax(segments, slots_of).items() if rid not in pending}
            done.update(finished)
        return done

    def _argmax(self, segments: list[tuple], slots_of) -> dict[str, int]:
        """One draft forward pass over (sequence, first position, token ids) segments: each writes its K/V
        and reads the draft cache up to its own last position. -> request id -> argmax after the segment."""
        order = sorted(segments, key=lambda s: len(s[2]) > 1)  # decodes first
        tokens, positions, write, decode_rows, decode_ctx, prefills, sample_rows = [], [], [], [], [], [], []
        for seq, start, ids in order:
            row, end = len(tokens), start + len(ids)
            ctx = slots_of(seq, 0, end)
            tokens.extend(ids)
            positions.extend(range(start, end))
            write.append(ctx[start:])
            if len(ids) == 1:
                decode_rows.append(row)
                decode_ctx.append(ctx)
            else:
                prefills.append(PrefillSegment(slice(row, row + len(ids)), start, ctx))
            sample_rows.append(row + len(ids) - 1)
        batch = StepBatch(tokens=np.asarray(tokens, np.int64), positions=np.asarray(positions, np.int64),
                          write_slots=np.concatenate(write), decode_rows=np.asarray(decode_rows, np.int64),
                          prefills=prefills, sample_rows=np.asarray(sample_rows, np.int64))
        set_decode_contexts(batch, decode_ctx)
        best = self.model.forward(batch, self.kv).argmax(axis=1)
        return {seq.request_id: int(best[i]) for i, (seq, _, _) in enumerate(order)}
