"""Which model serves a request: explicit, `auto`, degraded when the target is saturated (`route`, engine
models), and with upstream providers, open circuits and fallbacks (`choose`); whether a request fits a
model (`context_refusal`)."""
from __future__ import annotations

from gateway.catalog import ModelSpec
from gateway.classify import complexity, rank
from gateway.engine_limits import EngineLimits, no_limits
from contracts.errors import ServingError
from gateway.tenants import GatewayConfig, Tenant


def context_refusal(spec: ModelSpec, engine: EngineLimits, prompt_tokens: int, max_tokens: int) -> ServingError | None:
    """Why prompt + max_tokens do not fit a model, or None: the one place the gateway decides it, against
    the tightest of the model's configured context (the catalog's `max_context_tokens`) and, for an engine
    model, what its engine can ever hold (gateway/engine_limits.py), so what no engine slot could serve is
    refused before tokens are reserved or a slot is waited for. The tenant's own quota is its policy
    (Tenant.context_refusal); the engine still checks its own invariants."""
    bounds = [(spec.max_context_tokens, f"model '{spec.name}' is configured with")] if spec.max_context_tokens else []
    engine_bound = engine.limit() if spec.upstream is None else None
    if engine_bound is not None:
        bounds.append((engine_bound[0], f"engine model '{spec.name}' can ever hold (its {engine_bound[1]})"))
    if not bounds:
        return None
    tokens, what = min(bounds)
    if prompt_tokens + max_tokens <= tokens:
        return None
    room = max(0, tokens - prompt_tokens)
    return ServingError(
        "context_too_long", f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
        f"{prompt_tokens + max_tokens} tokens, more than the {tokens} tokens of context {what}; "
        + (f"use max_tokens <= {room}" if room else "shorten the prompt"), field="max_tokens")


def route(cfg: GatewayConfig, requested: str | None, tenant: Tenant, prompt_tokens: int, max_tokens: int, saturated,
          engine_limits=no_limits) -> str:
    """`saturated(model) -> bool` reads the admission state; `engine_limits(model)`: what the engine can
    hold, and whether the repository has that engine model at all (a config may name a degrade target that
    a render left out: it is then not used). The result is `model_used`; a model the tenant may not use
    (Tenant.model_refusal) or that the request does not fit (context_refusal) is refused, and a degrade
    target is taken only where the tenant may use it and the request fits it."""
    routing, catalog = cfg.routing, cfg.catalog
    served = lambda m: engine_limits(m).served  # noqa: E731
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
    refused = tenant.model_refusal(catalog[model]) or context_refusal(catalog[model], engine_limits(model),
                                                                      prompt_tokens, max_tokens)
    if refused is not None:
        raise refused
    smaller = routing.degrade_to.get(model)
    if smaller and served(smaller) and tenant.degrade and saturated(model) and tenant.may_use(catalog[smaller]) \
            and context_refusal(catalog[smaller], engine_limits(smaller), prompt_tokens, max_tokens) is None:
        return smaller
    return model


def choose(cfg: GatewayConfig, requested: str | None, tenant: Tenant, prompt_tokens: int,
           max_tokens: int, text, saturated, honours, available, avoid=(), upstream_ok: bool = True,
           engine_limits=no_limits) -> str:
    """The model that answers, local or upstream (gateway/catalog.py), where `route` knows only local ones.

    `honours(spec) -> bool`: the model can honour what the request asks for (an upstream: no engine-only
    field); `available(spec) -> bool`: its upstream's circuit lets this request through (it takes a
    half-open probe; always true for a local model);
    `avoid`: models already tried for this request (the front's fallback after an upstream failed);
    `text() -> str`: the prompt's words (read only by the classifier); `upstream_ok`: False where the
    caller cannot stream from an upstream (Triton-native clients, batch lines, adapters). An unusable pick
    falls back along its `fallback` list; `auto` under the classifier policy ranks every candidate
    (gateway/classify.py)."""

    routing, catalog = cfg.routing, cfg.catalog

    def usable(spec) -> bool:
        return ((spec.upstream is not None or engine_limits(spec.name).served) and spec.name not in avoid
                and (upstream_ok or spec.upstream is None) and tenant.may_use(spec) and honours(spec)
                and context_refusal(spec, engine_limits(spec.name), prompt_tokens, max_tokens) is None)

    if (not requested or requested == "auto") and routing.auto_policy == "classifier":
        level, _why = complexity(text(), prompt_tokens, routing.auto_long_prompt_tokens)
        ceiling = tenant.auto_max_price_per_1k
        candidates = [s for s in catalog.values() if s.auto and usable(s)
                      and (ceiling is None or s.price_per_1k(tenant) <= ceiling)]
        for spec in rank(candidates, level, tenant):
            if available(spec):
                return spec.name
        raise _none_left("auto", avoid)
    model = route(cfg, requested, tenant, prompt_tokens, max_tokens, saturated, engine_limits)
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
