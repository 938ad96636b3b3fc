"""Admission to the engine: engine slots and KV cache, by tier, fair across the tenants of a tier.

Each engine model has `max_inflight` slots and, when the engine's KV cache size is known, that many
tokens of KV, both counted by the gateway itself (it starts and settles every request it sends, so its
counts are exact and need no polling of the engine). A request holds a slot and the KV its prompt plus
`max_tokens` could ever fill (in whole blocks), so what the gateway lets through always fits in the
engine at once: the engine's own queue (FIFO in TensorRT-LLM's C++ backend, blind to tenants) stays
empty, and the waiting happens here, where tier and tenant are known. A tenant's requests may together
hold at most its `kv_share_percent` of the cache (one request larger than that runs alone), so one
tenant's long streams can never take the engine from another's short request.

While a request fits, it goes straight through. Otherwise it waits: each release grants, highest tier
first and within a tier its tenants in round robin, every waiter that now fits (one that does not fit
yet, or whose tenant is at its share, does not hold back the others behind it). A full queue or a wait
past `max_wait_s` becomes an `overloaded` rejection with `retry_after`. A waiter whose caller sends
`stop` (gateway/core.py Streams) leaves the queue at once (`Stopped`).
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from contracts.errors import ServingError


class Stopped(Exception):
    """The caller stopped a request while it waited for admission; it holds nothing of that wait."""


async def wait_unless_stopped(fut: asyncio.Future, timeout: float | None, stopped: asyncio.Event | None):
    """`asyncio.wait_for(fut, timeout)`, except that `stopped` being set (now or meanwhile) cancels `fut` and
    raises Stopped."""
    if stopped is None:
        return await asyncio.wait_for(fut, timeout)
    if not stopped.is_set():
        stop = asyncio.ensure_future(stopped.wait())
        try:
            done, _ = await asyncio.wait((fut, stop), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            fut.cancel()
            raise
        finally:
            stop.cancel()
        if fut in done and not stopped.is_set():
            return fut.result()
        if not stopped.is_set():
            fut.cancel()
            raise asyncio.TimeoutError
    fut.cancel()  # a stop wins over what fut got in the same turn: the caller gives that back
    raise Stopped


@dataclass
class _Waiter:
    tenant: str
    future: asyncio.Future
    kv: int = 0
    kv_cap: int | None = None
    since: float = field(default_factory=time.monotonic)


class EngineSlots:
    """Slots, KV and the waiting room of one engine model."""

    def __init__(self, model: str, max_inflight: int, max_queue: int, max_wait_s: float,
                 kv_tokens: int | None = None, tokens_per_block: int = 1):
        self.model = model
        self.max_inflight = max_inflight
        self.max_queue = max_queue
        self.max_wait_s = max_wait_s
        self.kv_tokens = kv_tokens  # None: the engine's KV size is unknown, only slots are counted
        self.tokens_per_block = max(1, tokens_per_block)
        self.inflight = 0
        self.kv_held = 0
        self.kv_by_tenant: Counter = Counter()
        self.slots_by_tenant: Counter = Counter()
        # priority -> tenant -> FIFO of waiters; tenants rotate within a priority
        self.waiting: dict[int, OrderedDict[str, deque[_Waiter]]] = {}

    @property
    def queued(self) -> int:
        return sum(len(q) for tier in self.waiting.values() for q in tier.values())

    @property
    def saturated(self) -> bool:
        return self.inflight >= self.max_inflight

    def kv_need(self, tokens: int) -> int:
        """The KV a request of `tokens` (prompt + max_tokens) may fill: whole blocks."""
        if self.kv_tokens is None or tokens <= 0:
            return 0
        return -(-tokens // self.tokens_per_block) * self.tokens_per_block

    def kv_cap(self, share_percent: int | None) -> int | None:
        """The KV tokens a tenant of this share may hold (slots, when the KV size is unknown); None: no cap."""
        if share_percent is None or share_percent >= 100:
            return None
        if self.kv_tokens is None:
            return max(1, self.max_inflight * share_percent // 100)
        return max(self.kv_need(1), self.kv_tokens * share_percent // 100)

    def _fits(self, w: _Waiter) -> bool:
        if self.inflight >= self.max_inflight:
            return False
        if self.kv_tokens is None:  # no KV size known (a GPU engine sized by the memory fraction): the
            # share bounds the tenant's slots instead (build/engine_admission.py sizes the slots to the KV)
            return w.kv_cap is None or self.slots_by_tenant[w.tenant] < w.kv_cap
        if self.kv_held + w.kv > self.kv_tokens:
            return False
        # one request larger than the share runs alone (the engine could hold it: engine_limits checked)
        held = self.kv_by_tenant[w.tenant]
        return w.kv_cap is None or held + w.kv <= w.kv_cap or held == 0

    def _take(self, w: _Waiter) -> None:
        self.inflight += 1
        self.slots_by_tenant[w.tenant] += 1
        self.kv_held += w.kv
        self.kv_by_tenant[w.tenant] += w.kv

    async def acquire(self, tenant: str, priority: int, tokens: int = 0, kv_share_percent: int | None = None,
                      stopped: asyncio.Event | None = None) -> float:
        """Wait for a slot and the KV of `tokens` (prompt + max_tokens) within the tenant's share; returns
        the seconds waited. `release(tenant, tokens)` gives both back. `stopped` set while it waits: it
        leaves the queue and raises Stopped."""
        waiter = _Waiter(tenant, asyncio.get_running_loop().create_future(), self.kv_need(tokens),
                         self.kv_cap(kv_share_percent))
        if not self.queued and self._fits(waiter):
            self._take(waiter)
            return 0.0
        if self.queued >= self.max_queue:
            raise ServingError("overloaded", f"{self.model}: admission queue full ({self.max_queue} waiting)",
                               retry_after=1.0)
        self.waiting.setdefault(priority, OrderedDict()).setdefault(tenant, deque()).append(waiter)
        self._grant()  # it may fit behind waiters that do not
        try:
            await wait_unless_stopped(asyncio.shield(waiter.future), self.max_wait_s, stopped)
        except asyncio.TimeoutError:
            if waiter.future.done():  # granted at the last moment: keep it
                return time.monotonic() - waiter.since
            self._drop(priority, waiter)
            raise ServingError("overloaded", f"{self.model}: no engine slot within {self.max_wait_s:.0f} s",
                               retry_after=max(1.0, self.max_wait_s / 4)) from None
        except (asyncio.CancelledError, Stopped):
            if waiter.future.done():  # granted as it was stopped: given back
                self.release(tenant, tokens)
            else:
                self._drop(priority, waiter)
            raise
        return time.monotonic() - waiter.since

    def _drop(self, priority: int, waiter: _Waiter) -> None:
        tier = self.waiting.get(priority, {})
        q = tier.get(waiter.tenant)
        if q and waiter in q:
            q.remove(waiter)
            if not q:
                del tier[waiter.tenant]

    def release(self, tenant: str = "", tokens: int = 0) -> None:
        """Give back a slot and the KV of `tokens`, and grant whatever waits and now fits."""
        kv = self.kv_need(tokens)
        self.inflight -= 1
        self.kv_held -= kv
        for held, amount in ((self.kv_by_tenant, kv), (self.slots_by_tenant, 1)):
            held[tenant] -= amount
            if held[tenant] <= 0:
                del held[tenant]
        self._grant()

    def _grant(self) -> None:
        """Grant waiters that fit: highest tier first, its tenants in round robin (a granted tenant goes to
        the back), the head of each tenant's queue only (a tenant's own requests keep their order)."""
        granted = True
        while granted and self.inflight < self.max_inflight:
            granted = False
            for priority in sorted(self.waiting):
                tier = self.waiting[priority]
                for tenant in list(tier):
                    q = tier[tenant]
                    while q and q[0].future.done():  # timed out or cancelled meanwhile
                        q.popleft()
                    if not q:
                        del tier[tenant]
                        continue
                    if self._fits(q[0]):
                        waiter = q.popleft()
                        self._take(waiter)
                        waiter.future.set_result(True)
                        if q:
                            tier.move_to_end(tenant)
                        else:
                            del tier[tenant]
                        granted = True
                        break
                if granted:
                    break
            for priority in [p for p, tier in self.waiting.items() if not tier]:
                del self.waiting[priority]


class Admission:
    def __init__(self, max_inflight: int, max_queue: int, max_wait_s: float, engine_limits=None):
        """`engine_limits(model)`: the engine's EngineLimits (gateway/engine_limits.py), for its KV size;
        None: slots only."""
        self.args = (max_inflight, max_queue, max_wait_s)
        self.engine_limits = engine_limits
        self.models: dict[str, EngineSlots] = {}

    def slots(self, model: str) -> EngineSlots:
        if model not in self.models:
            limits = self.engine_limits(model) if self.engine_limits is not None else None
            kv = limits.kv_cache_tokens if limits is not None else None
            block = (limits.tokens_per_block or 1) if limits is not None else 1
            self.models[model] = EngineSlots(model, *self.args, kv_tokens=kv, tokens_per_block=block)
        return self.models[model]
