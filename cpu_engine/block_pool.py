"""The KV block pool: free blocks, reference counts and the prefix-reuse cache.

A full block of a sequence is indexed by a key chained over its prefix (kv_cache_manager.block_key:
SHA-256 of the parent block's key, the cache salt and the block's tokens), so a key names a whole
prefix. The key is only an index: each cached block also keeps what it holds (the registration of
its parent block, the salt and its tokens), and a lookup is a hit only when all three equal the
request's. Registrations are numbered and never reused, so matching the parent's number proves the
block was computed on top of exactly the block matched one level up: a colliding key, whatever the
hash, is a miss and never shares KV across prefixes or tenants.

Blocks whose last reference is dropped keep their registration and stay reusable until they are
needed: free blocks without a key are handed out first, then cached ones in LRU order. An evicted
block is offered to `on_evict` first (the host tier, host_tier.py, keeps a copy).
"""
from __future__ import annotations

import itertools
import time
from collections import OrderedDict

from cpu_engine.retention import DEFAULT_PRIORITY

ROOT_SERIAL = 0  # the "parent registration" of a sequence's first block


class BlockPoolError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, clock=time.monotonic):
        self.num_blocks = num_blocks
        self.clock = clock
        # retention.py: blocks with a priority other than the default, (priority, expiry or None)
        self.priority_of: dict[int, tuple[int, float | None]] = {}
        self.ref = [0] * num_blocks
        self.key_of: list[bytes | None] = [None] * num_blocks
        # per registered block: (registration number, parent's registration number, salt, tokens)
        self.entry_of: list[tuple | None] = [None] * num_blocks
        self.block_of: dict[bytes, int] = {}  # prefix key -> block
        self.free_plain: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out block 0 first
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # LRU: oldest first
        self.reused_total = 0
        self._serials = itertools.count(ROOT_SERIAL + 1)
        self.on_evict = None  # (block, key, entry) -> None, before an evicted block is forgotten

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
            block = self._victim()  # the lowest retention priority, least recently used among equals
            del self.free_cached[block]
            if self.on_evict is not None:
                self.on_evict(block, self.key_of[block], self.entry_of[block])
            self._forget(block)
        else:
            raise BlockPoolError("no free KV block")
        self.ref[block] = 1
        return block

    def _victim(self) -> int:
        if not self.priority_of:
            return next(iter(self.free_cached))
        now, best, victim = self.clock(), None, None
        for block in self.free_cached:
            p = self.priority(block, now)
            if best is None or p < best:
                best, victim = p, block
        return victim

    def priority(self, block: int, now: float) -> int:
        found = self.priority_of.get(block)
        if found is None:
            return DEFAULT_PRIORITY
        priority, expires = found
        if expires is not None and expires <= now:
            del self.priority_of[block]
            return DEFAULT_PRIORITY
        return priority

    def set_priority(self, block: int, priority: int, expires: float | None) -> None:
        if priority == DEFAULT_PRIORITY:
            self.priority_of.pop(block, None)
        else:
            self.priority_of[block] = (priority, expires)

    def _forget(self, block: int) -> None:
        self.priority_of.pop(block, None)
        del self.block_of[self.key_of[block]]
        self.key_of[block] = None
        self.entry_of[block] = None

    def serial(self, block: int) -> int:
        """The registration number of a cached block (what its children were registered under)."""
        return self.entry_of[block][0]

    def lookup(self, key: bytes, parent_serial: int, salt, tokens: tuple) -> int | None:
        """The cached block under `key` if it holds exactly `tokens` with `salt` on top of the
        registration `parent_serial`; anything else (a key collision) is a miss."""
        block = self.block_of.get(key)
        if block is None:
            return None
        _, parent, block_salt, block_tokens = self.entry_of[block]
        if parent != parent_serial or block_salt != salt or block_tokens != tokens:
            return None
        return block

    def acquire_cached(self, block: int) -> None:
        """Take a reference on a cached block found by `lookup`."""
        if self.ref[block] == 0:
            del self.free_cached[block]
        self.ref[block] += 1
        self.reused_total += 1

    def hold(self, block: int) -> None:
        """A reference that is not a reuse (kept from eviction for a moment; `release` gives it back)."""
        if self.ref[block] == 0:
            del self.free_cached[block]
        self.ref[block] += 1

    def register(self, block: int, key: bytes, parent_serial: int, salt, tokens: tuple,
                 serial: int | None = None) -> int | None:
        """Make a full block reusable under `key`. Returns the registration number that stands for its
        content (its own, or that of an identical block cached first), or None when the key is held by
        a different block in use (the block stays private, and so must its descendants). `serial`: the
        number the content had before it left the pool (a block onboarded from the host tier keeps it,
        so the blocks registered on top of it still match)."""
        if self.key_of[block] is not None:
            return self.serial(block)
        held = self.block_of.get(key)
        if held is not None:
            _, parent, held_salt, held_tokens = self.entry_of[held]
            if parent == parent_serial and held_salt == salt and held_tokens == tokens:
                return self.serial(held)  # first writer wins: the same content is cached already
            if self.ref[held]:
                return None
            # a colliding or orphaned (its parent was evicted) block nobody uses: the new one replaces it
            del self.free_cached[held]
            self._forget(held)
            self.free_plain.append(held)
        serial = next(self._serials) if serial is None else serial
        self.key_of[block] = key
        self.entry_of[block] = (serial, parent_serial, salt, tuple(tokens))
        self.block_of[key] = block
        return serial

    def share(self, block: int) -> None:
        """One more reference on a block in use (a forked sequence reads its parent's prompt blocks)."""
        if self.ref[block] <= 0:
            raise BlockPoolError(f"block {block} is not in use: it cannot be shared")
        self.ref[block] += 1

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
            if (self.key_of[b] is None) != (self.entry_of[b] is None):
                raise BlockPoolError(f"block {b}: key and cached content disagree")
        for key, b in self.block_of.items():
            if self.key_of[b] != key:
                raise BlockPoolError(f"cache map and block {b} disagree")
        if len(self.block_of) != sum(k is not None for k in self.key_of):
            raise BlockPoolError("a block has a key the cache map does not know")
        for b in self.free_cached:
            if self.key_of[b] is None:
                raise BlockPoolError(f"block {b} is cached-free without a key")

    assert_consistent = check_invariants
