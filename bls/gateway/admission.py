"""Admission to the engine under saturation: by tier, fair across the tenants of a tier.

Each engine model has `max_inflight` slots, counted by the gateway itself (it starts and settles
every request it sends, so its count is exact and needs no polling of the engine). While slots are
free, requests go straight through. When they are all taken, requests wait: a release hands the slot
to the highest tier with waiters, and within that tier to its tenants in round robin, so a tenant that
sends ten times more still cannot starve another. A full queue or a wait past `max_wait_s` becomes an
`overloaded` rejection with `retry_after`.
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from bls.serving.errors import ServingError


@dataclass
class _Waiter:
    tenant: str
    future: asyncio.Future
    since: float = field(default_factory=time.monotonic)


class EngineSlots:
    """Slots and the waiting room of one engine model."""

    def __init__(self, model: str, max_inflight: int, max_queue: int, max_wait_s: float):
        self.model = model
        self.max_inflight = max_inflight
        self.max_queue = max_queue
        self.max_wait_s = max_wait_s
        self.inflight = 0
        # priority -> tenant -> FIFO of waiters; tenants rotate within a priority
        self.waiting: dict[int, OrderedDict[str, deque[_Waiter]]] = {}

    @property
    def queued(self) -> int:
        return sum(len(q) for tier in self.waiting.values() for q in tier.values())

    @property
    def saturated(self) -> bool:
        return self.inflight >= self.max_inflight

    async def acquire(self, tenant: str, priority: int) -> float:
        """Wait for a slot; returns the seconds waited."""
        if self.inflight < self.max_inflight and not self.queued:
            self.inflight += 1
            return 0.0
        if self.queued >= self.max_queue:
            raise ServingError("overloaded", f"{self.model}: admission queue full ({self.max_queue} waiting)",
                               retry_after=1.0)
        waiter = _Waiter(tenant, asyncio.get_running_loop().create_future())
        self.waiting.setdefault(priority, OrderedDict()).setdefault(tenant, deque()).append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), self.max_wait_s)
        except asyncio.TimeoutError:
            if waiter.future.done():  # granted at the last moment: keep it
                return time.monotonic() - waiter.since
            self._drop(priority, waiter)
            raise ServingError("overloaded", f"{self.model}: no engine slot within {self.max_wait_s:.0f} s",
                               retry_after=max(1.0, self.max_wait_s / 4)) from None
        except asyncio.CancelledError:
            if waiter.future.done():
                self.release()
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

    def release(self) -> None:
        """Free a slot, or hand it straight to the next waiter (the count stays)."""
        for priority in sorted(self.waiting):
            tier = self.waiting[priority]
            while tier:
                tenant, q = next(iter(tier.items()))
                waiter = q.popleft()
                if q:
                    tier.move_to_end(tenant)  # round robin: this tenant goes to the back
                else:
                    del tier[tenant]
                if not waiter.future.done():
                    waiter.future.set_result(True)
                    return
        self.inflight -= 1


class Admission:
    def __init__(self, max_inflight: int, max_queue: int, max_wait_s: float):
        self.args = (max_inflight, max_queue, max_wait_s)
        self.models: dict[str, EngineSlots] = {}

    def slots(self, model: str) -> EngineSlots:
        if model not in self.models:
            self.models[model] = EngineSlots(model, *self.args)
        return self.models[model]
