"""One streaming request to a running stack's engine model itself (NVIDIA's `tensorrt_llm` contract) over
Triton gRPC, for the integration tests that check the engine's own inputs and outputs; and one gateway
operation, Triton-native."""
from __future__ import annotations

import queue
import uuid

import tritonclient.grpc as grpcclient

from contracts.grpc_inputs import grpc_input
from contracts.tensors import ENGINE, GATEWAY, Contract


def contract_inputs(contract: Contract, values: dict) -> list:
    """Each value as a batch of one (a scalar becomes [[v]], a list [list]), typed by the contract."""
    return [grpc_input(contract, name, [value if isinstance(value, list) else [value]])
            for name, value in values.items()]


def engine_call(grpc_url: str, final_outputs: tuple[str, ...] = (), **values):
    """The streamed token ids, and (when `final_outputs` names any) the final response's outputs by name:
    (ids, {name: array})."""
    events = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    requested = [grpcclient.InferRequestedOutput(n) for n in ("output_ids", "sequence_length", *final_outputs)]
    try:
        client.async_stream_infer("tensorrt_llm", contract_inputs(ENGINE, values), outputs=requested,
                                  request_id=uuid.uuid4().hex, enable_empty_final_response=True)
        ids = []
        while True:
            result, error = events.get(timeout=120)
            if error is not None:
                raise error
            out = result.as_numpy("output_ids")
            if out is not None:
                ids.extend(out.reshape(-1).tolist())
            if result.get_response().parameters["triton_final_response"].bool_param:
                return (ids, {n: result.as_numpy(n) for n in final_outputs}) if final_outputs else ids
    finally:
        client.stop_stream()
        client.close()


def gateway_operation(grpc_url: str, operation: str, key: str | None, parameters: dict | None = None, **values):
    """One call of a gateway operation over gRPC streaming (the gateway is decoupled), with `key` as the
    forwarded header: its one response; raises its error."""
    client = grpcclient.InferenceServerClient(grpc_url)
    answers = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)),
                        headers={"authorization": f"Bearer {key}"} if key else None)
    try:
        client.async_stream_infer("gateway", contract_inputs(GATEWAY, {**values, "operation": operation}),
                                  parameters=parameters)
        result, error = answers.get(timeout=30)
        if error is not None:
            raise error
        return result
    finally:
        client.stop_stream()
        client.close()
