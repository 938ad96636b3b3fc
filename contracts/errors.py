"""The error contract between the models and `clients/`.

Triton 2.51 lets a Python model pick only a Triton error code (no 429, every `/generate*` error is 400,
gRPC stream errors carry no code), so every error message starts with a stable machine-readable prefix:

    [kind=rate_limited status=429 retry_after=2.5] tokens/min limit of tenant 'acme' reached

`kind` names the error, `status` is the HTTP status it stands for, `field` names the offending input
and `retry_after` (seconds) says when to try again. `parse()` reads the prefix back.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

@dataclass(frozen=True)
class ErrorKind:
    """One error kind everywhere: its HTTP status (the OpenAI-compatible front answers with it, `clients/`
    maps it back), the closest Triton 2.51 error code, and OpenAI's error `type` and `code`."""
    status: int
    triton_code: str
    openai_type: str
    openai_code: str | None = None


KINDS = {
    "invalid_argument": ErrorKind(400, "INVALID_ARG", "invalid_request_error"),
    "unauthenticated": ErrorKind(401, "INVALID_ARG", "authentication_error", "invalid_api_key"),
    "permission_denied": ErrorKind(403, "INVALID_ARG", "permission_error", "permission_denied"),
    # the code of a model or adapter not found; anything else not found has none (front/openai_schema.py)
    "not_found": ErrorKind(404, "NOT_FOUND", "invalid_request_error", "model_not_found"),
    # 400 as OpenAI answers a prompt + max_tokens over the context window
    "context_too_long": ErrorKind(400, "INVALID_ARG", "invalid_request_error", "context_length_exceeded"),
    "rate_limited": ErrorKind(429, "UNAVAILABLE", "rate_limit_error", "rate_limit_exceeded"),
    "queue_full": ErrorKind(503, "UNAVAILABLE", "server_error", "queue_full"),
    "overloaded": ErrorKind(503, "UNAVAILABLE", "server_error", "overloaded"),
    "unavailable": ErrorKind(503, "UNAVAILABLE", "server_error", "engine_unavailable"),
    # an upstream provider failed before its first token and no fallback could answer (front/providers.py)
    "upstream_unavailable": ErrorKind(503, "UNAVAILABLE", "server_error", "upstream_unavailable"),
    "cancelled": ErrorKind(499, "CANCELLED", "cancelled"),
    "internal": ErrorKind(500, "INTERNAL", "server_error", "internal_error"),
}

# the kinds a client should wait out and retry (Retry-After); the batch worker does, and the gateway records
# no ledger row for a batch line's attempt refused so (the line's last attempt is its one row)
RETRYABLE_KINDS = ("rate_limited", "queue_full", "overloaded", "unavailable", "upstream_unavailable")

_PREFIX = re.compile(r"\[kind=(?P<kind>[a-z_]+)(?P<rest>[^\]]*)\]\s?(?P<message>.*)", re.S)


@dataclass
class ServingError(Exception):
    kind: str
    message: str
    field: str | None = None
    retry_after: float | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown error kind {self.kind!r}")
        super().__init__(self.wire())

    @property
    def status(self) -> int:
        return KINDS[self.kind].status

    @property
    def triton_code(self) -> str:
        return KINDS[self.kind].triton_code

    def wire(self) -> str:
        attrs = [f"kind={self.kind}", f"status={self.status}"]
        if self.field:
            attrs.append(f"field={self.field}")
        if self.retry_after is not None:
            attrs.append(f"retry_after={self.retry_after:.3f}")
        return f"[{' '.join(attrs)}] {self.message}"

    def __str__(self) -> str:
        return self.wire()


def invalid(field: str, message: str) -> ServingError:
    return ServingError("invalid_argument", f"{field}: {message}", field=field)


def parse(text: str) -> ServingError | None:
    """Find the contract prefix anywhere in an error text (Triton may wrap it); None if absent."""
    idx = text.find("[kind=")
    if idx < 0:
        return None
    m = _PREFIX.match(text[idx:])
    if not m or m["kind"] not in KINDS:
        return None
    attrs = dict(kv.split("=", 1) for kv in m["rest"].split() if "=" in kv)
    retry = attrs.get("retry_after")
    return ServingError(
        m["kind"], m["message"].strip(), field=attrs.get("field"),
        retry_after=float(retry) if retry is not None else None,
    )


# TensorRT-LLM's LoRA cache (PeftCacheManager), in its words. A `lora_task_id` whose weights it does not hold
# (evicted, a restarted replica, or never sent): "LoRA task <id> not found in cache. Please send LoRA weights
# with request"; the gateway sends them (gateway/triton_backend.py, front/engine_direct.py's hand-back).
LORA_NOT_CACHED = "not found in cache"
# An adapter's weights refused while it holds only adapters of requests in flight: the server full for now
LORA_CACHE_FULL = "Cache is full. There are no done tasks to evict"
# Errors without the prefix come from Triton, TensorRT-LLM or the transport: read them by their own words
# first, then by the gRPC status (tritonclient.grpc's `status()`) or the HTTP status (an int, or a digit
# string from tritonclient.http)
_TRITON_MESSAGES = (("Request for unknown model", "not_found"), ("Exceeds maximum queue size", "queue_full"),
                    (LORA_CACHE_FULL, "overloaded"))
_GRPC_KINDS = {"StatusCode.INVALID_ARGUMENT": "invalid_argument", "StatusCode.UNAUTHENTICATED": "unauthenticated",
               "StatusCode.PERMISSION_DENIED": "permission_denied", "StatusCode.NOT_FOUND": "not_found",
               "StatusCode.RESOURCE_EXHAUSTED": "overloaded", "StatusCode.UNAVAILABLE": "unavailable",
               "StatusCode.DEADLINE_EXCEEDED": "unavailable", "StatusCode.CANCELLED": "cancelled"}
_HTTP_KINDS: dict[int, str] = {}
for _kind, _spec in KINDS.items():  # the first kind of each status: 400 -> invalid_argument, 503 -> queue_full
    _HTTP_KINDS.setdefault(_spec.status, _kind)


def from_transport(text: str, status: int | str | None = None) -> ServingError:
    """Any error text as the contract: the prefix when present, else Triton's message, else the status."""
    err = parse(text)
    if err is not None:
        return err
    kind = next((k for marker, k in _TRITON_MESSAGES if marker in text), None)
    if kind is None and isinstance(status, str):
        kind = _GRPC_KINDS.get(status) or (_HTTP_KINDS.get(int(status)) if status.isdigit() else None)
    elif kind is None and isinstance(status, int):
        kind = _HTTP_KINDS.get(status)
    kind = kind or "internal"
    # unavailable without the contract's prefix: the server or its channel is gone (tritonserver being
    # replaced after an abort, a socket closed); full: a queue or the LoRA cache: worth another try shortly,
    # as the contract's own say
    return ServingError(kind, text, retry_after=1.0 if kind in ("unavailable", "queue_full", "overloaded") else None)


def as_serving_error(err: Exception) -> ServingError:
    """Any exception as the contract: an unknown one is `internal`, named by its type."""
    return err if isinstance(err, ServingError) else ServingError("internal", f"{type(err).__name__}: {err}")


def item_error(err: Exception) -> dict:
    """One item's failure in a grouped answer (the gateway's settles and admits): the contract's text, so its
    kind, field and retry_after cross as a request's own error would; unknown exceptions become `internal`."""
    return {"error": as_serving_error(err).wire()}


def item_answer(answer) -> dict:
    """A grouped answer's item: its answer, or its failure (item_error) raised as the ServingError it was."""
    if isinstance(answer, dict) and isinstance(answer.get("error"), str):
        raise from_transport(answer["error"])
    if not isinstance(answer, dict):
        raise ServingError("internal", f"the gateway answered an item with {type(answer).__name__}")
    return answer


def to_triton_error(pb_utils, err: Exception):
    """A `pb_utils.TritonError` for any exception; unknown ones become `internal`."""
    err = as_serving_error(err)
    code = getattr(pb_utils.TritonError, err.triton_code)
    return pb_utils.TritonError(err.wire(), code)
