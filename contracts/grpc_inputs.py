"""A contract's tensor as a tritonclient gRPC input: the one place a client of Triton (the front, `clients/`,
the benchmarks) turns a value into a wire input. The Python models never import it (they have no
tritonclient in the GPU image: tests/deploy/test_deploy.py)."""
from __future__ import annotations

import numpy as np
import tritonclient.grpc as grpcclient

from contracts.tensors import Contract


def grpc_input(contract: Contract, name: str, value) -> grpcclient.InferInput:
    """`value` already in the tensor's shape (batch dimension first), typed as the contract says."""
    spec = contract.input(name)
    arr = np.asarray(value, dtype=spec.numpy_dtype)
    t = grpcclient.InferInput(name, list(arr.shape), spec.wire_dtype)
    t.set_data_from_numpy(arr)
    return t
