"""The caller's API key as the front reads it (`authorization: Bearer` or `x-api-key`), checked for what no
key of this stack can be, and its digest (the front keys its per-key state by digest, never by the key)."""
from __future__ import annotations

import hashlib

from starlette.requests import Request

from contracts.errors import ServingError

MAX_API_KEY_CHARS = 512  # far above any key this stack issues; gRPC metadata over 8 KiB fails in transport


def api_key(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        key = auth[7:].strip() or None
    else:
        key = request.headers.get("x-api-key") or None
    if key is not None and not (key.isascii() and key.isprintable()):
        # no key is made of such characters, and gRPC metadata cannot carry them to the gateway
        raise ServingError("unauthenticated", "malformed API key: it must be printable ASCII")
    if key is not None and len(key) > MAX_API_KEY_CHARS:
        raise ServingError("unauthenticated", f"malformed API key: longer than {MAX_API_KEY_CHARS} characters")
    return key


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()
