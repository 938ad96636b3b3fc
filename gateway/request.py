"""The gateway's input tensors -> a `GatewayRequest` (the model.py adapter only fetches the tensors).

Every string input a client controls is checked here and a bad one is a 400 `invalid_argument` naming
the field, never a 500 from deep inside: `model`, `adapter` and `operation` must be UTF-8 (they are
compared with configured names, so a lossy decode would turn garbage into a 403 or 404 about a name
the client never sent), and so must every entry of `stop_words` / `bad_words`. The prompt itself
(`text_input`, `messages`) goes to `preprocessing` as bytes, which checks it the same way.

Ranges have one owner each: OpenAI's (temperature 0..2, top_p, penalties -2..2, n, logit_bias -100..100,
top_logprobs) are the front's, where the OpenAI fields enter (front/openai_schema.py); the engine's own
contract ranges are the engine's (cpu_engine/sequence.py SamplingParams.problems, temperature up to 1e4,
at most 128 sequences). The gateway passes sampling on unchecked and checks only what its own work needs:
n within the engine's bound (its reservation counts every sequence: an n past it would otherwise be refused
by the tenant's token bucket, naming max_tokens), logprobs within what it computes (contracts.logprobs), a
logit_bias it can turn into the engine's embedding_bias.
"""
from __future__ import annotations

import json
import math
import re

import numpy as np
import orjson

from contracts.tensors import (GATEWAY, GATEWAY_OPERATIONS, GUIDE_TYPES, MAX_ADMITS_PER_GROUP,
                               MAX_JSON_PARAMETER_CHARS, SAMPLING_TO_ENGINE, STORED_KINDS, STORED_OPERATIONS)
from contracts.errors import ServingError, invalid
from contracts.api_keys import api_key_from
from gateway.core import GatewayRequest
from gateway.edges import Guide, Sampling
from contracts.generation import MAX_RETURN_SEQUENCES, Outputs
from contracts.logprobs import MAX_TOP_LOGPROBS
from text.preprocess import decode_text
from contracts.triton_io import scalar

REVISION = re.compile(r"[0-9a-f]{64}")

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
        sampling=Sampling(**{k: scalar(arrays, k) for k in SAMPLING if k in arrays}),
        stop_words=word_list(arrays, "stop_words"),
        bad_words=word_list(arrays, "bad_words"),
        model=optional_text(arrays, "model"),
        adapter=optional_text(arrays, "adapter"),
        ignore_eos=bool(scalar(arrays, "ignore_eos", False)),
        on_behalf_of=_parameter(parameters, "on_behalf_of"),
        tier=_parameter(parameters, "tier"),
        batch_id=_parameter(parameters, "batch_id"),
        front_key=_parameter(parameters, "front_key"),
        lease=_json_object(parameters, "lease"),
        tools=scalar(arrays, "tools"),
        guide=_guide(arrays),
        session_id=_parameter(parameters, "session_id"),
        slide_keep=_count_parameter(parameters, "slide_keep"),
        prompt_cache_key=_parameter(parameters, "prompt_cache_key"),
        stored_id=_stored_id(parameters, operation),
        stored_object=_json_object(parameters, "stored_object"),
        stored_revision=_revision(parameters),
        outputs=_outputs(arrays),
        prompt_ids=_prompt_ids(arrays, operation),
        user=optional_text(arrays, "user"),
        stream_id=_parameter(parameters, "stream_id"),
    )
    if req.user is not None and len(req.user) > 256:
        raise invalid("user", "must be at most 256 characters")
    if req.tier not in (None, "batch"):
        raise invalid("tier", f"the only tier a request may ask for is 'batch', got {req.tier!r}")
    return req, operation


def grouped_admits(group: GatewayRequest) -> list[tuple[str, GatewayRequest | ServingError]]:
    """The admits of one grouped request (`lease: {"admits": [...]}`: the front's admits that arrived while
    its previous group was on its way), each as (its stream_id, its request or the 400 its inputs earn).

    Each item is what a single admit sends: `inputs`, the gateway's input values by name as in Triton's
    JSON (a scalar, or a list for a [-1] input); `parameters`, its request parameters (its stream_id and
    its client's `authorization` among them); and `lease`, its own lease object (the front's prepared
    prompt). Each is read by parse_gateway_request, as a single admit's tensors are; the group's front key
    stands for every item (an item's own is ignored), so only the front's group admits anything."""
    items = (group.lease or {}).get("admits")
    if not isinstance(items, list) or not 1 <= len(items) <= MAX_ADMITS_PER_GROUP \
            or not all(isinstance(i, dict) and isinstance(i.get("parameters"), dict) for i in items):
        raise invalid("lease", f"a grouped admit needs {{\"admits\": [1 to {MAX_ADMITS_PER_GROUP} "
                               "{\"inputs\": {...}, \"parameters\": {...}}]}")
    ids = [i["parameters"].get("stream_id") for i in items]
    if not all(isinstance(i, str) and i for i in ids) or len(set(ids)) != len(ids):
        raise invalid("lease", "each admit of a group needs its own stream_id")
    out = []
    for stream_id, item in zip(ids, items):
        try:
            parameters = {k: v for k, v in item["parameters"].items() if k not in ("front_key", "lease")}
            req, operation = parse_gateway_request(json_arrays(item.get("inputs")),
                                                   {**parameters, "front_key": group.front_key})
            if operation != "admit":
                raise invalid("operation", f"each item of a grouped admit is an admit, got {operation!r}")
            lease = item.get("lease")
            if lease is not None and not isinstance(lease, dict):
                raise invalid("lease", "an admit's lease must be a JSON object")
            req.lease = lease
            out.append((stream_id, req))
        except ServingError as e:
            out.append((stream_id, e))
    return out


def generate_body(body: dict) -> tuple[dict[str, np.ndarray], dict]:
    """A generate_stream body (the lease socket's operations: gateway/lease_socket.py) as Triton hands it to
    the gateway: its inputs as json_arrays makes them, every other field a request parameter (a string, a
    number or a boolean, as Triton's)."""
    names = GATEWAY.input_name_set
    parameters = {k: v for k, v in body.items() if k not in names}
    for name, value in parameters.items():
        if not isinstance(value, (str, int, float, bool)):
            raise invalid(name, "a request parameter must be a string, a number or a boolean")
    return json_arrays({k: v for k, v in body.items() if k in names}), parameters


def json_arrays(values) -> dict[str, np.ndarray]:
    """The gateway's input values by name, as Triton's JSON carries them, as the tensors Triton would make
    of them (a batch of one; strings as UTF-8 bytes)."""
    if not isinstance(values, dict):
        raise invalid("inputs", "must be an object of the gateway's input values by name")
    arrays = {}
    for name, value in values.items():
        if name not in GATEWAY.input_name_set:
            raise invalid(name, "is not an input of the gateway")
        dtype = GATEWAY.input(name).numpy_dtype
        row = value if isinstance(value, list) else [value]
        if dtype is np.object_:
            row = [v.encode() if isinstance(v, str) else v for v in row]
            if not all(isinstance(v, bytes) for v in row):
                raise invalid(name, "must be text")
        try:
            arrays[name] = np.array([row], dtype=dtype)
        except (TypeError, ValueError, OverflowError):
            raise invalid(name, f"is not a valid {GATEWAY.input(name).data_type.removeprefix('TYPE_')} value") from None
    return arrays


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


def _outputs(arrays: dict) -> Outputs:
    n = scalar(arrays, "num_return_sequences", 1, int)
    if not 1 <= n <= MAX_RETURN_SEQUENCES:  # what the reservation counts, within what the engine serves
        raise invalid("num_return_sequences", f"must be in [1, {MAX_RETURN_SEQUENCES}], got {n}")
    logprobs = scalar(arrays, "logprobs", None)
    if logprobs is not None and not 0 <= int(logprobs) <= MAX_TOP_LOGPROBS:
        raise invalid("logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}")
    return Outputs(num_return_sequences=n, logprobs=None if logprobs is None else int(logprobs),
                   echo_logprobs=bool(scalar(arrays, "echo_logprobs", False)),
                   logit_bias=parse_logit_bias(optional_text(arrays, "logit_bias")))


def parse_logit_bias(raw: str | None) -> dict[int, float] | None:
    """`logit_bias` as JSON {"token id": finite bias} -> {id: bias}; the gateway checks the ids against the
    vocabulary (OpenAI's [-100, 100] is the front's to check)."""
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        raise invalid("logit_bias", "is not valid JSON") from None
    if not isinstance(value, dict):
        raise invalid("logit_bias", "must be an object of token id -> bias")
    out = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit() and len(key) < 10):
            raise invalid("logit_bias", f"keys must be token ids (non-negative integers), got {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise invalid("logit_bias", f"the bias of token {key} must be a finite number, got {bias!r}")
        out[int(key)] = float(bias)
    return out or None


def _prompt_ids(arrays: dict, operation: str) -> list[int] | None:
    """generate's prompt as token ids: `token_ids` where neither text_input nor messages is given."""
    if operation not in ("generate", "admit") or "token_ids" not in arrays or "text_input" in arrays \
            or "messages" in arrays:
        return None
    return [int(t) for t in np.asarray(arrays["token_ids"]).reshape(-1)]


def _parameter(parameters: dict, name: str) -> str | None:
    """A string request parameter (the batch worker sets on_behalf_of, tier and batch_id)."""
    value = parameters.get(name)
    if value is None or value == "":
        return None
    if not isinstance(value, str) or len(value) > 256:
        raise invalid(name, "must be a string of at most 256 characters")
    return value


def _stored_id(parameters: dict, operation: str) -> str | None:
    """A stored object's id: request parameter response_id or conversation_id, as the operation's kind."""
    if operation not in STORED_OPERATIONS:
        return None
    return _parameter(parameters, STORED_KINDS[operation.rsplit("_", 1)[0]].id_field)


def _count_parameter(parameters: dict, name: str) -> int | None:
    """A positive count in a request parameter (a string of digits, or an integer)."""
    value = parameters.get(name)
    if value is None or value == "":
        return None
    if isinstance(value, str) and value.isdigit() and len(value) < 10:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise invalid(name, f"must be a positive integer, got {str(value)[:40]!r}")
    return value


def _revision(parameters: dict) -> str | None:
    """`stored_revision` of a conditional put: contracts/tensors.py stored_revision (64 hex digits)."""
    value = parameters.get("stored_revision")
    if value is None or value == "":
        return None
    if not (isinstance(value, str) and REVISION.fullmatch(value)):
        raise invalid("stored_revision", "must be a SHA-256 digest in hex (contracts/tensors.py stored_revision)")
    return value


def _json_object(parameters: dict, name: str) -> dict | None:
    """A JSON object in a string parameter: `lease` of the lease operations (gateway/core.py Leases),
    `stored_object` of response_put and conversation_put (gateway/sessions.py StoredObjects)."""
    raw = parameters.get(name)
    if raw is None or raw == "":
        return None
    if not isinstance(raw, str) or len(raw) > MAX_JSON_PARAMETER_CHARS:
        raise invalid(name, "must be a JSON object in a string parameter")
    try:
        value = orjson.loads(raw)
    except ValueError:
        raise invalid(name, "is not valid JSON") from None
    if not isinstance(value, dict):
        raise invalid(name, "must be a JSON object")
    return value
