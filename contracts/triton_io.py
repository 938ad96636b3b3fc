"""Tiny helpers shared by the `model.py` adapters: tensors <-> numpy, parameters, errors.

`pb_utils` is passed in because Triton 2.51's Python backend binds some of its classes (`TritonError`,
`MetricFamily`) only once the model's stub has started and called `initialize()`, and so that these
helpers import without Triton.
"""
from __future__ import annotations

import json
import time

import numpy as np
import orjson

from contracts.errors import invalid


def model_parameters(args: dict) -> dict[str, str]:
    """`parameters { key: "..." value: { string_value: "..." } }` of the model config, as a dict."""
    config = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


def inputs(request, contract) -> dict[str, np.ndarray]:
    """The request's tensors of the contract's inputs, as numpy, batch dimension checked to be 1. The
    request's inputs are read once: pb_utils.get_input_tensor_by_name walks all of them for each name asked
    (4-6% of the gateway's event loop for its ~35 inputs: benchmarks/results/2026-11-27-loop-profiles.json)."""
    out = {}
    names = contract.input_name_set
    for t in request.inputs():
        name = t.name()
        if name not in names:
            continue
        arr = t.as_numpy()
        if arr.ndim and arr.shape[0] != 1:
            raise invalid(name, f"batch size must be 1 per request, got {arr.shape[0]}")
        out[name] = arr
    return out


def scalar(arrays: dict, name: str, default=None, kind=None):
    """First element of a [1] / [1,1] tensor as a Python value (bytes stay bytes)."""
    arr = arrays.get(name)
    if arr is None:
        return default
    if arr.size == 0:
        raise invalid(name, "must hold one value, got an empty tensor")
    value = arr.reshape(-1)[0]
    value = value.item() if hasattr(value, "item") else value
    return kind(value) if kind is not None else value


def tensors(pb_utils, arrays: dict[str, np.ndarray]) -> list:
    return [pb_utils.Tensor(name, np.ascontiguousarray(arr)) for name, arr in arrays.items()]


def request_parameters(request) -> dict:
    """The request's parameters (Triton hands them over as JSON text; the gateway's lease operations carry
    a JSON object in one, so orjson)."""
    raw = request.parameters()
    return orjson.loads(raw) if raw else {}


class CancelPoll:
    """A response sender's `is_cancelled`, asked at most once per `interval_s`; a yes sticks.

    In Triton 2.51's Python backend each `is_cancelled()` is a blocking IPC round trip to the server
    (about a millisecond while the engine keeps the cores busy). Asked for every streamed token it cost a
    round trip per token, and in the gateway it held the event loop that serves every stream (py-spy at
    16 streams: its loop thread was blocked ~40% of the time in these asks even at one per 50 ms and
    stream). A client that goes away is still seen within `interval_s`. Called on the thread that sends
    the request's responses, never beside it: an ask racing the final send would reach a request the
    server may already have released."""

    def __init__(self, is_cancelled, interval_s: float, clock=time.monotonic):
        self._ask, self.interval_s, self._clock = is_cancelled, interval_s, clock
        self._next_at = float("-inf")  # the first call asks
        self.cancelled = False

    def __call__(self) -> bool:
        if not self.cancelled:
            now = self._clock()
            if now >= self._next_at:
                self._next_at = now + self.interval_s
                self.cancelled = bool(self._ask())
        return self.cancelled
