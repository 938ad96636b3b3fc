"""The gateway's input tensors -> a `GatewayRequest` (the model.py adapter only fetches the tensors).

Every string input a client controls is checked here and a bad one is a 400 `invalid_argument` naming
the field, never a 500 from deep inside: `model`, `adapter` and `operation` must be UTF-8 (they are
compared with configured names, so a lossy decode would turn garbage into a 403 or 404 about a name
the client never sent), and so must every entry of `stop_words` / `bad_words`. The prompt itself
(`text_input`, `messages`) goes to `preprocessing` as bytes, which checks it the same way.
"""
from __future__ import annotations

import json

import numpy as np

from bls.serving.contracts import GATEWAY_OPERATIONS, GUIDE_TYPES, SAMPLING_TO_ENGINE
from bls.serving.errors import invalid
from bls.gateway.core import GatewayRequest, api_key_from
from bls.gateway.edges import Guide, Sampling
from bls.text.preprocess import decode_text
from bls.serving.triton_io import scalar

SAMPLING = tuple(SAMPLING_TO_ENGINE)  # the sampling inputs the gateway passes on


def optional_text(arrays: dict, name: str) -> str | None:
    """A scalar string input as text; None when absent or empty."""
    value = scalar(arrays, name)
    if value is None:
        return None
    return decode_text(name, value) or None


def word_list(arrays: dict, name: str) -> list[str] | None:
    if name not in arrays:
        return None
    return [decode_text(name, w) for w in np.asarray(arrays[name], dtype=object).reshape(-1)]


def parse_gateway_request(arrays: dict, parameters: dict) -> tuple[GatewayRequest, str]:
    """(request, operation) from the request's tensors (as numpy) and its parameters."""
    operation = optional_text(arrays, "operation") or "generate"
    if operation not in GATEWAY_OPERATIONS:
        raise invalid("operation", f"must be one of {', '.join(GATEWAY_OPERATIONS)}, got {operation!r}")
    req = GatewayRequest(
        api_key=api_key_from(parameters),
        max_tokens=scalar(arrays, "max_tokens", None, int),
        text=scalar(arrays, "text_input"),
        messages=scalar(arrays, "messages"),
        stream=bool(scalar(arrays, "stream", False)),
        sampling=Sampling(**{k: scalar(arrays, k) for k in SAMPLING}),
        stop_words=word_list(arrays, "stop_words"),
        bad_words=word_list(arrays, "bad_words"),
        model=optional_text(arrays, "model"),
        adapter=optional_text(arrays, "adapter"),
        ignore_eos=bool(scalar(arrays, "ignore_eos", False)),
        on_behalf_of=_parameter(parameters, "on_behalf_of"),
        tier=_parameter(parameters, "tier"),
        batch_id=_parameter(parameters, "batch_id"),
        front_key=_parameter(parameters, "front_key"),
        lease=_lease(parameters),
        tools=scalar(arrays, "tools"),
        guide=_guide(arrays),
        session_id=_parameter(parameters, "session_id"),
    )
    if req.tier not in (None, "batch"):
        raise invalid("tier", f"the only tier a request may ask for is 'batch', got {req.tier!r}")
    return req, operation


def _guide(arrays: dict) -> Guide | None:
    """`guided_decoding_guide_type` (one of GUIDE_TYPES) and `guided_decoding_guide`; the engine compiles it."""
    kind = optional_text(arrays, "guided_decoding_guide_type")
    guide = scalar(arrays, "guided_decoding_guide")
    if kind is None:
        if guide is not None:
            raise invalid("guided_decoding_guide", "needs guided_decoding_guide_type (which grammar it is)")
        return None
    if kind not in GUIDE_TYPES:
        raise invalid("guided_decoding_guide_type", f"must be one of {', '.join(GUIDE_TYPES)}, got {kind!r}")
    return Guide(kind, decode_text("guided_decoding_guide", guide) if guide is not None else "")


def _parameter(parameters: dict, name: str) -> str | None:
    """A string request parameter (the batch worker sets on_behalf_of, tier and batch_id)."""
    value = parameters.get(name)
    if value is None or value == "":
        return None
    if not isinstance(value, str) or len(value) > 256:
        raise invalid(name, "must be a string of at most 256 characters")
    return value


def _lease(parameters: dict) -> dict | None:
    """The `lease` parameter of the lease operations: a JSON object (bls/gateway/core.py Leases)."""
    raw = parameters.get("lease")
    if raw is None or raw == "":
        return None
    if not isinstance(raw, str) or len(raw) > 1 << 20:
        raise invalid("lease", "must be a JSON object in a string parameter")
    try:
        value = json.loads(raw)
    except ValueError:
        raise invalid("lease", "is not valid JSON") from None
    if not isinstance(value, dict):
        raise invalid("lease", "must be a JSON object")
    return value
