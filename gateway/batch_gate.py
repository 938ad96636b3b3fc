"""Batch-tier requests fill idle capacity and stay out of interactive traffic's way.

Admission priority alone (`gateway/admission.py`) only orders requests once every engine slot is
taken; below that, a batch request runs beside interactive ones and each engine step gets slower for all
of them (on 2 CPU cores batch lines beside 4 interactive streams roughly doubled their TTFT p95, and
still took it to 1.8x with one batch line at a time). So, per engine model: while any interactive request
is in flight, at most `when_busy` batch requests start (default 0: batch only on idle capacity); once no
interactive request has run there for `quiet_s` (0.5 s: longer than the gap between one client's
requests), batch requests take whatever slots are free. A batch request that waits
longer than `max_wait_s` is refused `overloaded` with `retry_after`, which the batch worker waits out and
retries (a line never fails for it). Running batch requests are never preempted.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from contracts.errors import ServingError
from gateway.admission import wait_unless_stopped


@dataclass
class _Model:
    interactive: int = 0
    batch: int = 0
    last_interactive: float = -1e9  # when the last interactive request ended (monotonic)
    waiters: list = field(default_factory=list)


class BatchGate:
    def __init__(self, when_busy: int = 0, max_wait_s: float = 30.0, quiet_s: float = 0.5):
        self.when_busy, self.max_wait_s, self.quiet_s = when_busy, max_wait_s, quiet_s
        self.models: dict[str, _Model] = {}

    def _m(self, model: str) -> _Model:
        return self.models.setdefault(model, _Model())

    def _wake(self, m: _Model) -> None:
        waiters, m.waiters = m.waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)

    def open_for_batch(self, model: str) -> bool:
        m = self._m(model)
        idle = m.interactive == 0 and time.monotonic() - m.last_interactive >= self.quiet_s
        return idle or m.batch < self.when_busy

    async def enter_batch(self, model: str, stopped: asyncio.Event | None = None) -> float:
        """Wait until a batch request may start on `model`; returns the seconds waited. `stopped` set
        while it waits: raises Stopped (gateway/admission.py)."""
        m, start = self._m(model), time.monotonic()
        while not self.open_for_batch(model):
            left = self.max_wait_s - (time.monotonic() - start)
            if left <= 0:
                raise ServingError("overloaded", f"{model}: batch requests wait while interactive traffic runs "
                                   f"(waited {self.max_wait_s:.0f} s)", retry_after=max(1.0, self.max_wait_s / 4))
            f = asyncio.get_running_loop().create_future()
            m.waiters.append(f)
            quiet_left = self.quiet_s - (time.monotonic() - m.last_interactive)
            try:  # woken by a change, or when the quiet period may have passed
                await wait_unless_stopped(f, min(left, quiet_left) if quiet_left > 0 else left, stopped)
            except asyncio.TimeoutError:
                pass
        m.batch += 1
        return time.monotonic() - start

    def leave_batch(self, model: str) -> None:
        m = self._m(model)
        m.batch -= 1
        self._wake(m)

    def enter_interactive(self, model: str) -> None:
        self._m(model).interactive += 1

    def leave_interactive(self, model: str) -> None:
        m = self._m(model)
        m.interactive -= 1
        m.last_interactive = time.monotonic()
        if m.interactive == 0:
            self._wake(m)
