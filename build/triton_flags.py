"""Flags of `tritonserver` that every target passes (the launcher's CPU server, compose, Kubernetes, the GPU
container): the API key reaches the gateway only as a forwarded header, and the admin APIs are restricted
to callers with the admin key. Facts of the deployment, rendered by build/ and used by launcher/."""
from __future__ import annotations

HEADER_FORWARD = "x-.*|authorization"
ADMIN_HEADER = "triton-admin-key"  # not matched by HEADER_FORWARD: never reaches a model
RESTRICTED_APIS = "model-repository,logging,trace,shared-memory"


def header_forward_flags() -> list[str]:
    """The API key reaches the gateway only as a forwarded header (request parameters): on every target."""
    return [f"--http-header-forward-pattern={HEADER_FORWARD}", f"--grpc-header-forward-pattern={HEADER_FORWARD}"]


def restricted_api_flags(admin_key: str) -> list[str]:
    """The admin APIs need the header ADMIN_HEADER on HTTP and `triton-grpc-protocol-` + ADMIN_HEADER on
    gRPC (build/upstream facts, triton_cli); on every target."""
    return [f"--http-restricted-api={RESTRICTED_APIS}:{ADMIN_HEADER}={admin_key}",
            f"--grpc-restricted-protocol={RESTRICTED_APIS}:{ADMIN_HEADER}={admin_key}"]
