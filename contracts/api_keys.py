"""Where a caller's API key travels and what no key of this stack can be: read once, the same way by the
front (HTTP headers) and the gateway (Triton's forwarded headers and request parameters)."""
from __future__ import annotations

from collections.abc import Mapping

from contracts.errors import ServingError

MAX_API_KEY_CHARS = 512  # far above any key this stack issues; gRPC metadata over 8 KiB fails in transport


def api_key_from(fields: Mapping) -> str | None:
    """`authorization: Bearer <key>`, else `x-api-key`, else an `api_key` parameter (names in any case); None
    when there is none. A key of characters gRPC metadata cannot carry, or longer than MAX_API_KEY_CHARS, is
    refused as `unauthenticated` naming why."""
    lowered = {str(k).lower(): v for k, v in fields.items()}
    auth = lowered.get("authorization")
    key = None
    if isinstance(auth, str) and auth.lower().startswith("bearer "):
        key = auth[7:].strip() or None
    else:
        key = next((lowered[name] for name in ("x-api-key", "api_key")
                    if isinstance(lowered.get(name), str) and lowered[name]), None)
    if key is not None and not (key.isascii() and key.isprintable()):
        raise ServingError("unauthenticated", "malformed API key: it must be printable ASCII")
    if key is not None and len(key) > MAX_API_KEY_CHARS:
        raise ServingError("unauthenticated", f"malformed API key: longer than {MAX_API_KEY_CHARS} characters")
    return key
