"""Per-sequence block tables on top of the block pool: prefix lookup, growth, release, registration.

Prefix keys are SHA-256 chains: a block's key hashes its parent's key, the cache salt and its tokens
(int32 little-endian), so keys cannot be steered to collide (Python's `hash` of a tuple of ints can:
vLLM's CVE-2025-25183). Hits are checked against the cached block's content anyway (block_pool.py).
A request without a salt lives in its own namespace, apart from every salted one. A request with a
LoRA adapter hashes (salt, adapter identity) instead (`Sequence.cache_namespace`: the adapter's name and
the SHA-256 of its files): the same tokens under another adapter, or under none, have other K/V, so
prefix reuse never crosses adapters, nor an adapter replaced on disk under the same name.
"""
from __future__ import annotations

import hashlib

import numpy as np

from cpu_engine.block_pool import ROOT_SERIAL, BlockPool
from cpu_engine.host_tier import HostTier
from cpu_engine.sequence import Sequence

ROOT_KEY = bytes(32)  # the "parent key" of a sequence's first block


def _salt_bytes(salt) -> bytes:
    if salt is None:
        return b"\x00"
    if isinstance(salt, tuple):  # (cache salt, adapter identity): a namespace of its own per adapter
        tenant_salt, adapter = salt
        raw = str(adapter).encode("utf-8", "surrogatepass")
        return b"\x02" + _salt_bytes(tenant_salt) + len(raw).to_bytes(8, "little") + raw
    raw = str(salt).encode("utf-8", "surrogatepass")
    return b"\x01" + len(raw).to_bytes(8, "little") + raw  # length-prefixed: no two salts encode alike


def block_key(parent: bytes, salt, tokens) -> bytes:
    """SHA-256 over the parent block's key (32 bytes), the salt and the block's token ids."""
    h = hashlib.sha256(parent)
    h.update(_salt_bytes(salt))
    h.update(np.asarray(tokens, dtype="<i4").tobytes())
    return h.digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_reuse: bool):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_reuse = enable_reuse
        self.host: HostTier | None = None
        self.kv = None  # llama.KVCache, with a host tier

    def attach_host_tier(self, host: HostTier, kv) -> None:
        """Evicted prefix blocks go to `host` (K and V copied out of `kv`); a prefix lookup that misses in
        the pool onboards them from there."""
        self.host, self.kv = host, kv
        self.pool.on_evict = self._offload

    def _slots(self, block: int) -> slice:
        return slice(block * self.block_size, (block + 1) * self.block_size)

    def _offload(self, block: int, key: bytes, entry: tuple) -> None:
        s = self._slots(block)
        self.host.put(key, entry, self.kv.k[:, s], self.kv.v[:, s])

    def _onboard(self, key: bytes, parent_serial: int, salt, tokens: tuple, keep: list[int]) -> int | None:
        """A free block holding the host tier's copy of this prefix block, registered in the pool as it
        was (ref 0, reusable); None when the tier has no such block or the pool no block to spare beyond
        `keep` (this lookup's blocks so far, which the allocation must not evict)."""
        if self.pool.num_free - sum(1 for b in keep if self.pool.ref[b] == 0) < 1:
            return None
        found = self.host.take(key, parent_serial, salt, tokens)
        if found is None:
            return None
        serial, k, v = found
        held = [b for b in keep if self.pool.ref[b] == 0]
        for b in held:
            self.pool.hold(b)
        try:
            block = self.pool.allocate()
        finally:
            for b in held:
                self.pool.release(b)
        s = self._slots(block)
        self.kv.k[:, s] = k
        self.kv.v[:, s] = v
        if self.pool.register(block, key, parent_serial, salt, tokens, serial=serial) is None:
            self.pool.release(block)  # the key is taken by a block in use: nothing to reuse
            return None
        self.pool.release(block)  # cached and free, as any prefix block nobody holds
        return block

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _key(self, parent: bytes, salt, tokens) -> bytes:
        return block_key(parent, salt, tokens)

    def match_prefix(self, seq: Sequence) -> list[tuple[int, bytes]]:
        """(block, key) of cached blocks covering the longest full-block prompt prefix (not acquired)."""
        if not self.enable_reuse or seq.params.return_context_logits:  # every prompt row must be computed
            return []
        bs, found, parent, serial = self.block_size, [], ROOT_KEY, ROOT_SERIAL
        # leave at least one prompt token to compute: its logits give the first output token
        usable = (len(seq.prompt_ids) - 1) // bs
        for i in range(usable):
            tokens = tuple(seq.prompt_ids[i * bs:(i + 1) * bs])
            parent = self._key(parent, seq.cache_namespace, tokens)
            block = self.pool.lookup(parent, serial, seq.cache_namespace, tokens)
            if block is None and self.host is not None:
                block = self._onboard(parent, serial, seq.cache_namespace, tokens, [b for b, _ in found])
            if block is None:
                break
            found.append((block, parent))
            serial = self.pool.serial(block)
        return found

    def _retain(self, seq: Sequence, index: int, block: int) -> None:
        """The block's retention priority from the request's (retention.py), when it has one."""
        if seq.retention is not None and self.pool.key_of[block] is not None:
            bs = self.block_size
            p, expires = seq.retention.block_priority(index * bs, (index + 1) * bs, len(seq.prompt_ids),
                                                      self.pool.clock())
            self.pool.set_priority(block, p, expires)

    def admit(self, seq: Sequence, cached: list[tuple[int, bytes]]) -> None:
        for i, (b, _) in enumerate(cached):
            self.pool.acquire_cached(b)
            self._retain(seq, i, b)
        seq.block_table = [b for b, _ in cached]
        seq.last_key = cached[-1][1] if cached else ROOT_KEY
        seq.last_serial = self.pool.serial(cached[-1][0]) if cached else ROOT_SERIAL
        seq.num_computed = len(cached) * self.block_size
        seq.num_registered = len(cached)
        seq.reused_blocks = len(cached)
        seq.new_blocks = 0

    def num_free_after_admit(self, cached: list[tuple[int, bytes]]) -> int:
        """Free blocks left once `cached` is acquired: a cached block nobody holds leaves the free list."""
        return self.pool.num_free - sum(1 for b, _ in cached if self.pool.ref[b] == 0)

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
        ids = seq.all_ids
        while (seq.num_registered + 1) * bs <= seq.num_computed:
            i = seq.num_registered
            tokens = tuple(ids[i * bs:(i + 1) * bs])
            key = self._key(seq.last_key, seq.cache_namespace, tokens)
            if seq.last_serial is not None:  # None: a block before is private, so is this one
                seq.last_serial = self.pool.register(seq.block_table[i], key, seq.last_serial, seq.cache_namespace, tokens)
                self._retain(seq, i, seq.block_table[i])
            seq.last_key = key
            seq.num_registered += 1

    def truncate(self, seq: Sequence, upto_tokens: int) -> None:
        """Give back the blocks past those covering `upto_tokens` positions: after a speculative step,
        the blocks only rejected draft tokens wrote (never registered: registration needs computed,
        accepted tokens)."""
        keep = self.blocks_for(upto_tokens)
        while len(seq.block_table) > keep:
            block = seq.block_table.pop()
            if self.pool.key_of[block] is not None and len(seq.block_table) < seq.num_registered:
                raise RuntimeError(f"block {block} of {seq.request_id} is registered: it holds accepted tokens")
            self.pool.release(block)
            seq.new_blocks -= 1

    def fork(self, parent: Sequence, child: Sequence) -> int | None:
        """Give `child` the parent's computed prompt: its full blocks shared (read only from now on: new
        positions go past them), the partial last block a fresh copy's block; returns that block (for the
        caller to copy the K/V into) or None when the prompt fills whole blocks. Raises BlockPoolError
        when no block is free."""
        full = parent.num_computed // self.block_size
        copy = self.pool.allocate() if parent.num_computed % self.block_size else None
        for b in parent.block_table[:full]:
            self.pool.share(b)
        child.block_table = parent.block_table[:full] + ([copy] if copy is not None else [])
        child.num_computed = parent.num_computed
        child.num_registered, child.last_key, child.last_serial = \
            parent.num_registered, parent.last_key, parent.last_serial
        child.reused_blocks, child.new_blocks = full, int(copy is not None)
        return copy

    def release(self, seq: Sequence) -> None:
        # tail first, so a prefix's head blocks are the most recently used and are evicted last
        for b in reversed(seq.block_table):
            self.pool.release(b)
        seq.block_table = []
        seq.num_computed = seq.draft_computed = 0
        seq.num_registered = 0
        seq.last_key = ROOT_KEY
        seq.last_serial = ROOT_SERIAL

    def slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        """KV slot index of positions [start, end) of the sequence."""
        pos = np.arange(start, end)
        table = np.asarray(seq.block_table, dtype=np.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size
