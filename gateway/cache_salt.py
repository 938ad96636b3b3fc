"""The engine's prefix-cache salt for a tenant: a value no client can choose or guess.

The engine shares KV blocks only between requests with the same `cache_salt` request parameter. Any
client that reaches `ensemble` or `tensorrt_llm` can set that parameter, so the salt must not be
something a client knows (a tenant's name was: a direct request with `cache_salt=acme` reused acme's
blocks). The gateway sends HMAC-SHA256(secret, tenant) instead, with a secret drawn at random once per
gateway process and never shown: a direct client cannot produce a tenant's salt, so it shares nothing
with any tenant, and requests without a salt share only with each other.

One gateway process serves one Triton server, whose engine owns its own cache, so a per-process
secret loses no reuse; replicas each have their own engine and cache anyway. A restarted gateway
draws a new secret: its tenants simply start a new namespace (the old blocks age out by LRU).
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import os

_SECRET = os.urandom(32)


def tenant_cache_salt(tenant: str, secret: bytes | None = None) -> str:
    """Hex HMAC-SHA256 of the tenant's name under the gateway's secret (or `secret`, for tests)."""
    if secret is None:
        return _salt(tenant)
    return hmac.new(secret, tenant.encode("utf-8"), hashlib.sha256).hexdigest()


@functools.lru_cache(maxsize=4096)
def _salt(tenant: str) -> str:
    """A tenant's salt under the process's secret, computed once: every admit asks for it."""
    return hmac.new(_SECRET, tenant.encode("utf-8"), hashlib.sha256).hexdigest()
