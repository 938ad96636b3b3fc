"""Which per-token path the front runs: the compiled lane (front/token_lane.c, built by `make setup`:
build/token_lane.py) or the Python one (front/engine_direct.py _TakeText.take, front/app.py _SseText).

Why C: at 16 streams each token wakes the front on its own, and its Python per token (about 50 calls for
the engine's event read, the answer's bookkeeping and the client's SSE event) cost about 31 µs of CPU
served, where the same work costs about 5 µs with hot caches (docs/benchmarks.md, the floor). The lane does
that work for every plain token event of a read in one call; whatever it does not know it leaves to the
Python path, which stays the reference (tests/front/test_token_lane.py holds the two to the same bytes and
state).

The build is found in the project (front/_token_lane<ext>) or on the path (`_token_lane`, the GPU image's:
deploy/Dockerfile.trtllm), and used only if it was built from the source beside this file: a build older
than the source (a pull without `make setup`, an image older than the project) is not run.
"""
from __future__ import annotations

import hashlib
import importlib
import logging
from pathlib import Path

SOURCE = Path(__file__).with_name("token_lane.c")
CHOICES = ("auto", "compiled", "python")


def _load():
    """(the Lane class or None, why not)"""
    try:
        from front import _token_lane as built
    except ImportError:
        try:  # the GPU image's build, in the front's virtualenv (a module of its own, not a package)
            built = importlib.import_module("_token_lane")
        except ImportError:
            return None, "not built (make setup compiles front/token_lane.c; it needs a C compiler and Python's headers)"
    if SOURCE.exists() and built.SOURCE_SHA256 != hashlib.sha256(SOURCE.read_bytes()).hexdigest():
        return None, f"built from another source than {SOURCE.name} ({built.__file__}): run make setup"
    return built.Lane, ""


Lane, WHY_NOT = _load()
if Lane is None and "built from another source" in WHY_NOT:
    logging.getLogger(__name__).warning("the front's token lane is stale and not used: %s", WHY_NOT)


def resolve(choice: str):
    """`--token-lane`: the Lane class, or None for the Python path. `compiled` without a usable build is an
    error at start, not a slower front."""
    if choice not in CHOICES:
        raise ValueError(f"--token-lane must be one of {', '.join(CHOICES)}, not {choice!r}")
    if choice == "python":
        return None
    if Lane is None and choice == "compiled":
        raise ValueError(f"--token-lane compiled: the front's token lane is {WHY_NOT}")
    return Lane
