"""Waiting for a condition instead of sleeping a guessed time."""
from __future__ import annotations

import time


def wait_until(condition, timeout: float, interval: float = 0.1) -> bool:
    """Poll `condition()` until it is true or `timeout` seconds passed; its last value, as a bool."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return bool(condition())
        time.sleep(interval)
    return True
