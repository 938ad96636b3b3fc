"""The caller's API key from an HTTP request, and its digest (the front keys its per-key state by digest,
never by the key)."""
from __future__ import annotations

import hashlib

from starlette.requests import Request

from contracts.api_keys import api_key_from


def api_key(request: Request) -> str | None:
    """The request's key from its headers (contracts/api_keys.py: the one reading of it)."""
    return api_key_from(request.headers)


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()
