"""Which engine model serves a request: explicit, `auto`, or degraded when the target is saturated."""
from __future__ import annotations

from bls.serving.errors import ServingError
from bls.gateway.tenants import Routing, Tenant


def route(routing: Routing, requested: str | None, tenant: Tenant, prompt_tokens: int, saturated) -> str:
    """`saturated(model) -> bool` reads the admission state; the result is `model_used`."""
    if not requested or requested == "auto":
        small = routing.degrade_to.get(routing.default_model)
        # short prompts from tiers that accept degradation go to the small model; long ones stay big
        if small and tenant.degrade and prompt_tokens < routing.auto_long_prompt_tokens:
            model = small
        else:
            model = routing.default_model
    else:
        if requested not in routing.models:
            raise ServingError("not_found", f"model {requested!r} is not served "
                               f"(available: {', '.join(sorted(routing.models))}, auto)", field="model")
        model = requested
    if not tenant.allows_model(model):
        raise ServingError("permission_denied", f"tenant '{tenant.name}' may not use model {model!r}", field="model")
    limit = routing.models[model].get("max_context_tokens")
    smaller = routing.degrade_to.get(model)
    if smaller and tenant.degrade and saturated(model) and tenant.allows_model(smaller):
        small_limit = routing.models[smaller].get("max_context_tokens")
        if small_limit is None or prompt_tokens < small_limit:
            return smaller
    if limit is not None and prompt_tokens > limit:
        raise ServingError("context_too_long", f"prompt of {prompt_tokens} tokens exceeds {model}'s "
                           f"context of {limit}", field="text_input")
    return model
