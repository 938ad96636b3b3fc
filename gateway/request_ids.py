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



def _draw() -> None:
    global _prefix, _count
    _prefix, _count = secrets.token_hex(8), itertools.count()


_draw()
os.register_at_fork(after_in_child=_draw)  # a process made by fork draws its own prefix


def new_request_id() -> str:
    """32 hex characters, as uuid4().hex."""
    return f"{_prefix}{next(_count):016x}"
