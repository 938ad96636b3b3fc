"""A circuit breaker per upstream provider, kept by the gateway.

The front calls the upstreams, but every call begins with the gateway's `admit` and ends with its `settle`,
which reports how the upstream behaved (failed tries, time to the first token). So the breaker lives
here, one per upstream for the whole replica: every front worker of the replica feeds the same one and
sees it at its next admit, and the routing that skips an open upstream (fallbacks, `auto`) is decided in
the same place. It is not shared between replicas (no Redis round trip on every admit): a replica's
breaker opens on what that replica saw, within its own window.

closed --(error rate over the window)--> open --(open_s)--> half-open --(probe ok)--> closed
                                           ^------------------(probe failed)------------'
Half-open lets one request through every `probe_interval_s` (time-based, so a probe whose request is
refused later, by a rate limit say, cannot hold the breaker half-open for ever).
"""
from __future__ import annotations

import time
from collections import deque

from gateway.catalog import BreakerSettings

CLOSED, HALF_OPEN, OPEN = "closed", "half_open", "open"
STATE_VALUE = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}  # the gauge's value


class CircuitBreaker:
    def __init__(self, name: str, settings: BreakerSettings, clock=time.monotonic, on_change=None):
        self.name, self.settings, self.clock = name, settings, clock
        self.on_change = on_change or (lambda name, state: None)
        self._state = CLOSED
        self.outcomes: deque[tuple[float, bool]] = deque()  # (when, failed) within the window
        self.open_until = 0.0
        self.next_probe = 0.0

    @property
    def state(self) -> str:
        if self._state == OPEN and self.clock() >= self.open_until:
            self._set(HALF_OPEN)
            self.next_probe = self.clock()
        return self._state

    def _set(self, state: str) -> None:
        if state != self._state:
            self._state = state
            self.on_change(self.name, state)

    def allows(self) -> bool:
        """May a request go to this upstream now? Half-open: one probe per probe_interval_s (this call takes it)."""
        state = self.state
        if state == CLOSED:
            return True
        if state == HALF_OPEN and self.clock() >= self.next_probe:
            self.next_probe = self.clock() + self.settings.probe_interval_s
            return True
        return False

    def retry_after(self) -> float:
        """Seconds until this upstream may be tried again (0 when it may now)."""
        state = self.state
        if state == OPEN:
            return max(0.0, self.open_until - self.clock())
        if state == HALF_OPEN:
            return max(0.0, self.next_probe - self.clock())
        return 0.0

    def record(self, failures: int, succeeded: bool, ttft_s: float | None = None) -> None:
        """One request's tries: `failures` tries failed, then it succeeded (or not). A success slower to its
        first token than slow_ttft_s counts as a failure."""
        now, s = self.clock(), self.settings
        slow = succeeded and ttft_s is not None and ttft_s > s.slow_ttft_s
        state = self.state
        if state == HALF_OPEN:
            if succeeded and not slow:
                self.outcomes.clear()
                self._set(CLOSED)
            elif failures or slow:
                self._open(now)
            return
        if state == OPEN:
            return  # what was in flight when it opened says nothing new
        self.outcomes.extend([(now, True)] * failures)
        if succeeded:
            self.outcomes.append((now, slow))
        while self.outcomes and self.outcomes[0][0] < now - s.window_s:
            self.outcomes.popleft()
        n = len(self.outcomes)
        if n >= s.min_requests and sum(1 for _, failed in self.outcomes if failed) / n >= s.error_rate:
            self._open(now)

    def _open(self, now: float) -> None:
        self.open_until = now + self.settings.open_s
        self.outcomes.clear()
        self._set(OPEN)


class BreakerBoard:
    """The breakers of every upstream, by upstream name; settings follow config reloads."""

    def __init__(self, metrics=None, clock=time.monotonic):
        self.metrics, self.clock = metrics, clock
        self.breakers: dict[str, CircuitBreaker] = {}

    def get(self, name: str, settings: BreakerSettings) -> CircuitBreaker:
        b = self.breakers.get(name)
        if b is None:
            b = self.breakers[name] = CircuitBreaker(name, settings, self.clock, self._changed)
            if self.metrics is not None:
                self.metrics.circuit_state(name, STATE_VALUE[CLOSED])
        b.settings = settings
        return b

    def _changed(self, name: str, state: str) -> None:
        if self.metrics is not None:
            self.metrics.circuit_state(name, STATE_VALUE[state])
            self.metrics.circuit_transition(name, state)
