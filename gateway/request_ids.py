"""Ids of the gateway's requests: a usage record's `request_id`, the engine request's id, a lease's id.

Unique, not secret: each is a random 64-bit prefix drawn once per process and a 64-bit counter. uuid4
drew 16 bytes from the OS for each (two per request on the gateway's one event loop, each a syscall that
hands the GIL to the stub's other threads and waits to get it back: 4.6% of the loop's samples,
benchmarks/results/2026-11-27-loop-profiles.json). Nothing is authorised by knowing an id: lease
operations need the front's key, and a stream is stopped only by the key that started it."""
from __future__ import annotations

import itertools
import os
import secrets

_pid, _prefix, _count = 0, "", itertools.count()


def new_request_id() -> str:
    """32 hex characters, as uuid4().hex; a process made by fork draws its own prefix."""
    global _pid, _prefix, _count
    if os.getpid() != _pid:
        _pid, _prefix, _count = os.getpid(), secrets.token_hex(8), itertools.count()
    return f"{_prefix}{next(_count):016x}"
