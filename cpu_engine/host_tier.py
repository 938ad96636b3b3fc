"""A second, cheaper KV tier: blocks the pool evicts are kept here instead of lost, so a prefix that comes
back (a session's returning turn) is copied in rather than computed again.

TensorRT-LLM's counterpart is its host-memory KV offload (`kv_cache_host_memory_bytes`: evicted GPU blocks
go to host memory and are onboarded on reuse); the CPU engine takes the same knob. Here both tiers are RAM,
so this one is cheaper by its format: K and V as float16, half the bytes of the pool's float32 (an
onboarded block is therefore within float16 rounding of what a recompute gives, not bit-identical).
Bounded by `capacity_bytes`, least recently stored first out. An entry keeps what the pool kept of the
block (its registration number, its parent's, the salt and the tokens), and a lookup must match all of
them, exactly as in the pool (block_pool.py): a key collision is a miss, and nothing crosses tenants.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

HOST_DTYPE = np.float16


class HostTier:
    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[bytes, tuple[tuple, np.ndarray, np.ndarray]] = OrderedDict()
        self.bytes = 0
        self.offloaded_total = 0  # blocks stored here on eviction
        self.onboarded_total = 0  # blocks copied back for reuse

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: bytes, entry: tuple, k: np.ndarray, v: np.ndarray) -> None:
        """Keep an evicted block: `entry` (serial, parent serial, salt, tokens), its K and V ([layers, slots, ...])."""
        k16, v16 = k.astype(HOST_DTYPE), v.astype(HOST_DTYPE)
        size = k16.nbytes + v16.nbytes
        if size > self.capacity_bytes:
            return
        self._drop(key)
        while self.bytes + size > self.capacity_bytes and self._entries:
            self._drop(next(iter(self._entries)))
        self._entries[key] = (entry, k16, v16)
        self.bytes += size
        self.offloaded_total += 1

    def take(self, key: bytes, parent_serial: int, salt, tokens: tuple):
        """(serial, K, V) of the block under `key` if it holds exactly `tokens` with `salt` on top of the
        registration `parent_serial` (removed from this tier: it goes back to the pool); else None."""
        found = self._entries.get(key)
        if found is None:
            return None
        (serial, parent, block_salt, block_tokens), k, v = found
        if parent != parent_serial or block_salt != salt or block_tokens != tokens:
            return None
        self._drop(key)
        self.onboarded_total += 1
        return serial, k, v

    def _drop(self, key: bytes) -> None:
        found = self._entries.pop(key, None)
        if found is not None:
            self.bytes -= found[1].nbytes + found[2].nbytes
