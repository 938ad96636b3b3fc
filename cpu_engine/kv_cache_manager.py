"""Per-sequence block tables on top of the block pool: prefix lookup, growth, release, registration."""
from __future__ import annotations

import numpy as np

from cpu_engine.block_pool import BlockPool
from cpu_engine.sequence import Sequence


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_reuse: bool):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_reuse = enable_reuse

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _key(self, parent: int, salt, tokens) -> int:
        return hash((parent, salt, tuple(tokens)))

    def match_prefix(self, seq: Sequence) -> list[tuple[int, int]]:
        """(block, key) of cached blocks covering the longest full-block prompt prefix (not acquired)."""
        if not self.enable_reuse:
            return []
        bs, found, parent = self.block_size, [], 0
        # leave at least one prompt token to compute: its logits give the first output token
        usable = (len(seq.prompt_ids) - 1) // bs
        for i in range(usable):
            parent = self._key(parent, seq.cache_salt, seq.prompt_ids[i * bs:(i + 1) * bs])
            block = self.pool.lookup(parent)
            if block is None:
                break
            found.append((block, parent))
        return found

    def admit(self, seq: Sequence, cached: list[tuple[int, int]]) -> None:
        for b, _ in cached:
            self.pool.acquire_cached(b)
        seq.block_table = [b for b, _ in cached]
        seq.last_key = cached[-1][1] if cached else 0
        seq.num_computed = len(cached) * self.block_size
        seq.num_registered = len(cached)
        seq.reused_blocks = len(cached)
        seq.new_blocks = 0

    def grow(self, seq: Sequence, upto_tokens: int) -> bool:
        """Make the table cover `upto_tokens` positions; False (nothing taken) if blocks run out."""
        need = self.blocks_for(upto_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        for _ in range(need):
            seq.block_table.append(self.pool.allocate())
        seq.new_blocks += need
        return True

    def register_full_blocks(self, seq: Sequence) -> None:
        """After a step: full blocks with computed KV become reusable prefixes."""
        if not self.enable_reuse:
            return
        bs = self.block_size
        tokens = seq.all_ids
        parent = seq.last_key
        while (seq.num_registered + 1) * bs <= seq.num_computed:
            i = seq.num_registered
            parent = self._key(parent, seq.cache_salt, tokens[i * bs:(i + 1) * bs])
            self.pool.register(seq.block_table[i], parent)
            seq.num_registered += 1
            seq.last_key = parent

    def release(self, seq: Sequence) -> None:
        # tail first, so a prefix's head blocks are the most recently used and are evicted last
        for b in reversed(seq.block_table):
            self.pool.release(b)
        seq.block_table = []
        seq.num_computed = 0
        seq.num_registered = 0
        seq.last_key = 0

    def slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        """KV slot index of positions [start, end) of the sequence."""
        pos = np.arange(start, end)
        table = np.asarray(seq.block_table, dtype=np.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size
