"""Which model serves a request: explicit, `auto`, degraded when the target is saturated (`route`, engine
models), and with upstream providers, open circuits and fallbacks (`choose`)."""
from __future__ import annotations

from gateway.classify import complexity, rank
from contracts.errors import ServingError
from gateway.tenants import GatewayConfig, Tenant


def route(cfg: GatewayConfig, requested: str | None, tenant: Tenant, prompt_tokens: int, saturated,
          served=lambda model: True) -> str:
    """`saturated(model) -> bool` reads the admission state; `served(model) -> bool`: the repository has
    that engine model (a config may name a degrade target that a render left out: it is then not used).
    The result is `model_used`; a model the tenant may not use (Tenant.model_refusal) is refused."""
    routing = cfg.routing
    if not requested or requested == "auto":
        small = routing.degrade_to.get(routing.default_model)
        # short prompts from tiers that accept degradation go to the small model; long ones stay big
        if small and served(small) and tenant.degrade and prompt_tokens < routing.auto_long_prompt_tokens:
            model = small
        else:
            model = routing.default_model
    else:
        if requested not in routing.models:
            raise ServingError("not_found", f"model {requested!r} is not served "
                               f"(available: {', '.join(sorted(routing.models))}, auto)", field="model")
        model = requested
    refused = tenant.model_refusal(cfg.catalog[model])
    if refused is not None:
        raise refused
    limit = routing.models[model].get("max_context_tokens")
    smaller = routing.degrade_to.get(model)
    if smaller and served(smaller) and tenant.degrade and saturated(model) and tenant.may_use(cfg.catalog[smaller]):
        small_limit = routing.models[smaller].get("max_context_tokens")
        if small_limit is None or prompt_tokens < small_limit:
            return smaller
    if limit is not None and prompt_tokens > limit:
        raise ServingError("context_too_long", f"prompt of {prompt_tokens} tokens exceeds {model}'s "
                           f"context of {limit}", field="text_input")
    return model


def choose(cfg: GatewayConfig, requested: str | None, tenant: Tenant, prompt_tokens: int,
           max_tokens: int, text, saturated, fits, available, avoid=(), upstream_ok: bool = True,
           served=lambda model: True) -> str:
    """The model that answers, local or upstream (gateway/catalog.py), where `route` knows only local ones.

    `fits(spec) -> bool`: prompt + max_tokens fit the model; `available(spec) -> bool`: its upstream's
    circuit lets this request through (it takes a half-open probe; always true for a local model);
    `avoid`: models already tried for this request (the front's fallback after an upstream failed);
    `text() -> str`: the prompt's words (read only by the classifier); `upstream_ok`: False where the
    caller cannot stream from an upstream (Triton-native clients, batch lines, adapters). An unusable pick
    falls back along its `fallback` list; `auto` under the classifier policy ranks every candidate
    (gateway/classify.py)."""

    routing, catalog = cfg.routing, cfg.catalog

    def usable(spec) -> bool:
        return ((spec.upstream is not None or served(spec.name)) and spec.name not in avoid
                and (upstream_ok or spec.upstream is None) and tenant.may_use(spec) and fits(spec))

    if (not requested or requested == "auto") and routing.auto_policy == "classifier":
        level, _why = complexity(text(), prompt_tokens, routing.auto_long_prompt_tokens)
        ceiling = tenant.auto_max_price_per_1k
        candidates = [s for s in catalog.values() if s.auto and usable(s)
                      and (ceiling is None or s.price_per_1k(tenant) <= ceiling)]
        for spec in rank(candidates, level, tenant):
            if available(spec):
                return spec.name
        raise _none_left("auto", avoid)
    model = route(cfg, requested, tenant, prompt_tokens, saturated, served)
    spec = catalog[model]
    if spec.upstream is not None and not upstream_ok:
        raise ServingError("invalid_argument", f"model {model!r} is served by an upstream provider: call it "
                           "through the OpenAI-compatible front (/v1), without an adapter", field="model")
    if model not in avoid and available(spec):
        return model
    seen, queue = {model}, list(spec.fallback)
    while queue:  # the fallbacks in order, then theirs
        name = queue.pop(0)
        if name in seen:
            continue
        seen.add(name)
        fb = catalog[name]
        if usable(fb) and available(fb):
            return name
        queue.extend(fb.fallback)
    raise _none_left(model, avoid)


def _none_left(model: str, avoid) -> ServingError:
    tried = f" (tried: {', '.join(avoid)})" if avoid else ""
    return ServingError("upstream_unavailable", f"no model can answer for {model!r} now: its upstream is failing and no "
                        f"fallback is available{tried}", retry_after=5.0)
