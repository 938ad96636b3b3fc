"""The KV block pool: free blocks, reference counts and the prefix-reuse cache.

A full block of a sequence is keyed by a hash chain (parent block's key, cache salt, its tokens), so a
key names a whole prefix. Blocks whose last reference is dropped keep their key and stay reusable
until they are needed: free blocks without a key are handed out first, then cached ones in LRU order.
"""
from __future__ import annotations

from collections import OrderedDict


class BlockPoolError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.key_of: list[int | None] = [None] * num_blocks
        self.block_of: dict[int, int] = {}  # prefix key -> block
        self.free_plain: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out block 0 first
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # LRU: oldest first
        self.reused_total = 0

    @property
    def num_free(self) -> int:
        return len(self.free_plain) + len(self.free_cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def allocate(self) -> int:
        if self.free_plain:
            block = self.free_plain.pop()
        elif self.free_cached:
            block, _ = self.free_cached.popitem(last=False)  # evict the least recently used prefix
            del self.block_of[self.key_of[block]]
            self.key_of[block] = None
        else:
            raise BlockPoolError("no free KV block")
        self.ref[block] = 1
        return block

    def lookup(self, key: int) -> int | None:
        return self.block_of.get(key)

    def acquire_cached(self, block: int) -> None:
        """Take a reference on a cached block found by `lookup`."""
        if self.ref[block] == 0:
            del self.free_cached[block]
        self.ref[block] += 1
        self.reused_total += 1

    def register(self, block: int, key: int) -> None:
        """Make a full block reusable under `key` (first writer wins)."""
        if self.key_of[block] is None and key not in self.block_of:
            self.key_of[block] = key
            self.block_of[key] = block

    def release(self, block: int) -> None:
        if self.ref[block] <= 0:
            raise BlockPoolError(f"block {block} released more often than acquired")
        self.ref[block] -= 1
        if self.ref[block] == 0:
            if self.key_of[block] is not None:
                self.free_cached[block] = None  # most recently used at the end
            else:
                self.free_plain.append(block)

    def check_invariants(self) -> None:
        free = set(self.free_plain) | set(self.free_cached)
        if len(free) != len(self.free_plain) + len(self.free_cached):
            raise BlockPoolError("a block is on a free list twice")
        for b in range(self.num_blocks):
            if (self.ref[b] == 0) != (b in free):
                raise BlockPoolError(f"block {b}: refcount {self.ref[b]} but free={b in free}")
            if self.ref[b] < 0:
                raise BlockPoolError(f"block {b}: negative refcount")
        for key, b in self.block_of.items():
            if self.key_of[b] != key:
                raise BlockPoolError(f"cache map and block {b} disagree")
        for b in self.free_cached:
            if self.key_of[b] is None:
                raise BlockPoolError(f"block {b} is cached-free without a key")

    assert_consistent = check_invariants
