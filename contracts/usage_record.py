"""The usage record: the one definition of what the ledger keeps per finished request.

Stdlib only: the gateway (inside the Triton Python stub) builds these; the writer and the reports read them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

OUTCOMES = ("success", "error", "cancelled")


@dataclass
class UsageRecord:
    request_id: str  # the gateway's own id (unique): the ledger's primary key, so replays are idempotent
    ts: float  # unix seconds when the request arrived at the gateway
    tenant: str  # "unknown" when the key was not recognised
    tier: str  # the tier it was served at ("batch" for batch lines)
    model: str  # the engine model used ("" when refused before routing)
    adapter: str
    prompt_tokens: int
    completion_tokens: int
    cost: float
    ttft_ms: float | None  # None when no text was produced
    latency_ms: float  # arrival to the end (last token, error or cancel); a lease's from the front's arrival, as ttft_ms
    outcome: str  # OUTCOMES
    error_kind: str  # contracts/errors.py kind ("" unless outcome == "error")
    finish_reason: str  # "stop" | "length" | ""
    batch_id: str = ""  # the batch the request belongs to ("" for interactive traffic)
    provider: str = ""  # "local" (an engine model) or the upstream provider's name ("" before routing)
    end_user: str = ""  # the end user the caller named (OpenAI's `user`), "" when none
    served_from: str = ""  # "response_cache": answered by the gateway's response cache, no engine; else ""

    def to_json(self) -> str:
        # its fields as they are (flat scalars): `asdict` would deep-copy each, per finished request
        return json.dumps({name: getattr(self, name) for name in COLUMNS}, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict) -> "UsageRecord":
        names = {f.name for f in fields(cls)}
        missing = names - set(d) - {"batch_id", "provider", "end_user", "served_from"}
        if missing:
            raise ValueError(f"usage record without {', '.join(sorted(missing))}")
        return cls(**{k: v for k, v in d.items() if k in names})

    def row(self) -> tuple:
        return tuple(getattr(self, f) for f in COLUMNS)


COLUMNS = tuple(f.name for f in fields(UsageRecord))
