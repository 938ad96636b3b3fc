"""The gateway: auth -> tokenize -> quotas -> route -> rate limit -> admission -> engine stream ->
detokenize -> settle. Framework-free: Triton specifics come in through a `backend` object
(`gateway/triton_backend.py` inside the server, a fake in tests).

Every request settles through one `finally`: the rate-limit reservation is refunded down to the
tokens really used, the engine slot is released, usage is recorded, and if the client went away the
engine gets an explicit `stop` (Triton 2.51 does not cancel BLS children). Every generate request that
reaches `handle` also leaves one usage record (contracts/usage_record.py) on the ledger spool when one is set: success,
each error kind, or cancelled, with the token counts of its final chunk.

Batch lines come from the batch worker with the launcher's worker key and an `on_behalf_of` tenant: they
run with that tenant's limits at the batch tier's priority (never higher than the tenant's own).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from collections.abc import AsyncIterator

import orjson

from gateway.admission import Admission, Stopped
from gateway.batch_gate import BatchGate
from gateway.breaker import BreakerBoard
from gateway.classify import prompt_text
from gateway.edges import Guide, Preprocessed, Sampling
from gateway.request_ids import new_request_id
from contracts.generation import FINISH_REASONS, GeneratedCounts, Outputs
from contracts.logprobs import generated_logprobs, prompt_logprobs
from contracts.tensors import GATEWAY_OPERATIONS, STORED_OPERATIONS
from text.detokenize import Detokenizer, IncrementalDetokenizer
from text.preprocess import check_max_tokens
from gateway.engine_limits import no_limits
from gateway.kv_store import MemoryKV
from gateway.response_cache import CachedAnswer, CachePolicy, ResponseCache, cache_key
from gateway.sessions import (SessionPolicy, Sessions, Turn, check_session_id, fit_window, kv_retention, merge,
                              store_unavailable, stored_objects)
from contracts.errors import RETRYABLE_KINDS, ServingError, invalid, item_error
from contracts.usage_record import UsageRecord
from gateway.metrics import GatewayMetrics
from gateway.routing import choose
from gateway.tenants import hash_key


@dataclass
class GatewayRequest:
    api_key: str | None
    max_tokens: int | None
    text: bytes | str | None = None
    messages: bytes | str | None = None
    stream: bool = False
    sampling: Sampling = field(default_factory=Sampling)
    stop_words: list | None = None
    bad_words: list | None = None
    model: str | None = None
    adapter: str | None = None
    ignore_eos: bool = False
    request_id: str = field(default_factory=new_request_id)
    on_behalf_of: str | None = None  # batch worker only: the tenant a batch line belongs to
    tier: str | None = None  # "batch": serve at the batch tier's priority (only ever lowers it)
    batch_id: str | None = None  # recorded in the ledger
    front_key: str | None = None  # the launcher's key of the front: only it may take and settle leases
    lease: dict | None = None  # settle / renew / engine_check: which lease, and how it ended (Leases)
    tools: bytes | str | None = None  # JSON [OpenAI tools], rendered into the prompt by preprocessing
    guide: Guide | None = None  # guided decoding: the engine masks every token to this grammar
    session_id: str | None = None  # a chat session the gateway keeps (gateway/sessions.py)
    # the oldest turns of `messages` that do not fit the window are dropped, the system messages and at
    # least the last slide_keep messages kept (the Responses API's truncation "auto"); None: a 400 instead
    slide_keep: int | None = None
    # OpenAI's prompt_cache_key: the prompt's KV kept in the engine as a session's is (kv_retention)
    prompt_cache_key: str | None = None
    stored_id: str | None = None  # response_* / conversation_*: the stored object's id (StoredObjects)
    stored_object: dict | None = None  # <kind>_put, conversation_append: what to store (the front's)
    stored_revision: str | None = None  # <kind>_put: only over this version (contracts/tensors.py stored_revision)
    kv_retention: tuple[int, int] | None = None  # (priority, duration ms) of its KV in the engine: session turns
    # set at admission from the tenant (Tenant.lookahead): the engine's lookahead inputs, None: its default
    lookahead: dict | None = None
    outputs: Outputs = field(default_factory=Outputs)  # n, log probs, echo, logit_bias
    prompt_ids: list | None = None  # the prompt as token ids (no text, no messages)
    user: str | None = None  # the end user the caller names: recorded in the ledger
    stream_id: str | None = None  # generate: the caller's name for the stream, which its `stop` names
    # a lease's admit: the prompt as the front's own preprocessor tokenized it (Leases.admit), in place of
    # a call to `preprocessing`
    prepared: Preprocessed | None = None

    @property
    def n(self) -> int:
        return self.outputs.num_return_sequences


@dataclass
class Trace:
    """What the ledger records of one request, filled in as `handle` goes."""
    ts: float = field(default_factory=time.time)
    arrival: float = field(default_factory=time.monotonic)
    tenant: str = "unknown"
    tier: str = ""
    model: str = ""
    n_in: int = 0
    n_out: int = 0
    cost: float = 0.0
    ttft_s: float | None = None
    latency_s: float | None = None  # a lease's, as the front measured it (from its arrival, as its ttft_s); else ours
    outcome: str = "error"
    error_kind: str = "internal"
    finish_reason: str = ""
    provider: str = ""  # "local" or the upstream's name (gateway/catalog.py)
    served_from: str = ""  # "response_cache" when the answer came from it (no engine work)


@dataclass
class Keep:
    """What the gateway keeps of a request's answer when it succeeds: the response-cache entry
    (gateway/response_cache.py) and the session's turn (gateway/sessions.py)."""
    tenant: str
    cache_key: str | None = None
    cache_policy: CachePolicy | None = None
    turn: Turn | None = None

    @property
    def wanted(self) -> bool:
        return self.cache_key is not None or self.turn is not None


@dataclass
class Chunk:
    text: str
    final: bool
    model_used: str = ""
    finish_reason: str = ""
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    sequence_index: int = 0
    token_logprobs: str = ""  # JSON of TokenLogprob lists, token-level requests only (Gateway._handle_tokens)


def json_answer(value) -> dict[str, list]:
    """An operation's JSON answer as the gateway's `text_output` (orjson: the lease operations' answers are
    a per-request cost of the gateway's one event loop)."""
    return {"text_output": [[orjson.dumps(value)]]}


class Gateway:
    def __init__(self, config, limiter, admission: Admission, metrics: GatewayMetrics, backend,
                 detokenizer: Detokenizer, engine_limits=no_limits, ledger=None, worker_key_sha256=None,
                 batch_gate: BatchGate | None = None, front_key_sha256=None, lease_ttl_s: float = 60.0,
                 response_cache: ResponseCache | None = None, sessions: Sessions | None = None):
        # in-process unless the gateway has a Redis (model.py): gateway/kv_store.py
        self.response_cache = response_cache or ResponseCache(MemoryKV(), metrics)
        self.sessions = sessions or Sessions(MemoryKV())
        self.stored = stored_objects(self.sessions.store)  # responses, conversations: the same store, own keys
        self.front_key_sha256 = front_key_sha256  # the launcher's key of the front (LLM_FRONT_KEY): is_front
        self.leases = Leases(self, lease_ttl_s)  # the front's direct streams (below)
        self.batch_gate = batch_gate or BatchGate()  # batch-tier requests yield to interactive ones
        self.ledger = ledger  # ledger/spool.py SpoolWriter (append one JSON line) or None
        self.worker_key_sha256 = worker_key_sha256  # the batch worker's key digest (launcher), or None
        self.config = config  # () -> GatewayConfig (reloads when the file changes)
        self.limiter = limiter
        self.admission = admission
        self.metrics = metrics
        self.backend = backend
        self.detok = detokenizer
        self.engine_limits = engine_limits  # model -> EngineLimits (gateway/engine_limits.py)
        self.breakers = BreakerBoard(metrics)  # one circuit breaker per upstream provider (gateway/breaker.py)
        self.tokenizing = TenantSemaphores()  # each tenant's prompts in the (shared) tokenizer at once
        self.streams = Streams()  # generate streams their callers can stop by stream_id

    def _reject(self, tenant: str, err: ServingError) -> ServingError:
        self.metrics.rejected(tenant, err.kind)
        return err

    def _authenticate(self, cfg, api_key, on_behalf_of=None):
        if on_behalf_of is not None:
            return self._batch_tenant(cfg, api_key, on_behalf_of)
        tenant = cfg.authenticate(api_key)
        if tenant is None:
            raise self._reject("unknown", ServingError(
                "unauthenticated", "missing or unknown API key (authorization: Bearer, x-api-key or api_key)"))
        return tenant

    def _batch_tenant(self, cfg, api_key, name):
        """The batch worker acts for a tenant by name; only with the worker key the launcher made."""
        if not (api_key and self.worker_key_sha256 and hash_key(api_key) == self.worker_key_sha256):
            raise self._reject("unknown", ServingError(
                "permission_denied", "on_behalf_of is reserved to the batch worker"))
        for tenant in cfg.tenants.values():
            if tenant.name == name:
                return tenant
        raise self._reject("unknown", ServingError("unauthenticated", f"unknown tenant {name!r}"))

    async def _meter(self, tenant, tokens: int = 0) -> None:
        """One request (and `tokens`) of an operation that reserves nothing, charged before it runs."""
        try:
            await self.limiter.charge(tenant.name, tenant.limits, tokens)
        except ServingError as e:
            raise self._reject(tenant.name, e) from None

    async def whoami(self, api_key: str | None) -> dict:
        """The caller's tenant and tier (how the front scopes /v1/usage and /v1/batches without keys) and
        the prompt bound the front applies to a body before reading it; one request of the tenant's."""
        tenant = self._authenticate(self.config(), api_key)
        await self._meter(tenant)
        return {"tenant": tenant.name, "tier": tenant.tier, "max_prompt_bytes": tenant.limits["max_prompt_bytes"],
                "stores_conversations": tenant.sessions is not None}

    async def models(self, api_key: str | None) -> list[dict]:
        """The engine models the caller's tenant may use, with the context the tenant may use on each (the
        model's window, at most the tenant's quota), plus `auto`."""
        cfg = self.config()
        tenant = self._authenticate(cfg, api_key)
        await self._meter(tenant)
        routing, catalog = cfg.routing, cfg.catalog
        quota = tenant.limits["max_context_tokens"]

        def context(spec: dict) -> int:
            window = spec.get("max_context_tokens")
            return quota if window is None else min(window, quota)

        optional = set(routing.degrade_to.values())  # a degrade target the render left out is not offered
        usable = {m for m in routing.models if tenant.may_use(catalog[m])
                  and not (m in optional and not self.engine_limits(m).served)}
        listed = [{"id": m, "max_context_tokens": context(spec), "owned_by": catalog[m].provider}
                  for m, spec in sorted(routing.models.items()) if m in usable]
        if tenant.may_use(catalog[routing.default_model]):
            listed.append({"id": "auto", "max_context_tokens": context(routing.models.get(routing.default_model, {}))})
        # the LoRA adapters the tenant may use, each under the engine model that serves it (vLLM lists
        # them so, and takes an adapter's name as the model name)
        seen = {m["id"] for m in listed}
        for m, spec in sorted(routing.models.items()):
            if m not in usable or catalog[m].upstream is not None:
                continue
            for adapter in self.engine_limits(m).adapters() or []:
                if tenant.allows_adapter(adapter) and adapter not in seen:
                    seen.add(adapter)
                    listed.append({"id": adapter, "parent": m, "max_context_tokens": context(spec)})
        return listed

    def _adapter_model(self, cfg, tenant, adapter: str) -> str | None:
        """The engine model that serves `adapter` (the default model first), or None; None too for an
        adapter the tenant may not use, so its name as a model is a 404 like a name that does not exist
        (no oracle of other tenants' adapters; /v1/models hides them alike)."""
        if not tenant.allows_adapter(adapter):
            return None
        routing = cfg.routing
        models = [routing.default_model] + sorted(m for m in routing.models if m != routing.default_model)
        for m in models:
            if tenant.may_use(cfg.catalog[m]) and adapter in (self.engine_limits(m).adapters() or []):
                return m
        return None

    async def tokenize(self, req: GatewayRequest) -> list[int]:
        """Token ids of a prompt (text or chat messages) as the engine would see them; no inference. One
        request of the tenant's before tokenizing, its tokens after."""
        tenant = self._authenticate(self.config(), req.api_key)
        await self._meter(tenant)
        try:
            check_prompt_bytes(tenant, req)
            prep = await self._tokenize(tenant, GatewayRequest(
                req.api_key, 1, text=req.text, messages=req.messages, tools=req.tools, request_id=req.request_id))
        except ServingError as e:
            raise self._reject(tenant.name, e)
        await self.limiter.charge(tenant.name, tenant.limits, len(prep.token_ids), refuse=False, requests=0)
        return prep.token_ids

    async def _tokenize(self, tenant, req: GatewayRequest):
        """The prompt through `preprocessing` (its own process), at most `max_tokenizing` of the tenant's at
        once: the tokenizer is shared by every tenant, so one tenant's many prompts wait for each other. A
        prompt the front tokenized in its own process takes no part of it."""
        if req.prepared is not None:
            return self.backend.prepared(req)
        async with self.tokenizing.get(tenant.name, tenant.limits["max_tokenizing"]):
            return await self.backend.tokenize(req)

    async def detokenize(self, api_key: str | None, ids) -> str:
        """Text of token ids; one request and its ids as tokens, at most the tenant's context of ids (the
        gateway decodes them on its own event loop)."""
        tenant = self._authenticate(self.config(), api_key)
        quota = tenant.limits["max_context_tokens"]
        if len(ids) > quota:
            raise self._reject(tenant.name, invalid("token_ids", f"at most {quota} ids (the tenant's context "
                                                    f"quota), got {len(ids)}"))
        await self._meter(tenant, len(ids))
        vocab = self.detok.vocab_size
        bad = [i for i in ids if not 0 <= int(i) < vocab]
        if bad:
            raise self._reject(tenant.name, invalid("token_ids", f"ids must be in [0, {vocab}), got {bad[:5]}"))
        return self.detok.decode([int(i) for i in ids])

    async def answers(self, operation: str, req: GatewayRequest, token_ids=None,
                      group_items=None) -> AsyncIterator[tuple[dict[str, list], bool]]:
        """A non-generating operation's responses as (output tensors, whether it is the last): one, or a
        grouped admit's several (Leases.admit_group; `group_items` reads its items: gateway/request.py
        grouped_admits)."""
        if operation == "admit" and isinstance(req.lease, dict) and "admits" in req.lease:
            group = self.leases.admit_group(req, group_items)
            try:
                async for answer, last in group:
                    yield json_answer(answer), last
            finally:
                await group.aclose()  # what still waits leaves the admission queue
            return
        yield await self.operation(operation, req, token_ids), True

    async def operation(self, operation: str, req: GatewayRequest, token_ids=None) -> dict[str, list]:
        """The non-generating operations as output tensors (one final response), each typed in the gateway
        contract (contracts/tensors.py GATEWAY); sessions and leases answer JSON in `text_output`."""
        if operation == "tokenize":
            ids = await self.tokenize(req)
            return {"token_ids": [ids], "num_input_tokens": [[len(ids)]]}
        if operation == "detokenize":
            ids = [] if token_ids is None else list(token_ids.reshape(-1).tolist())
            return {"text_output": [[(await self.detokenize(req.api_key, ids)).encode()]]}
        if operation == "models":
            listed = await self.models(req.api_key)
            return {"model_ids": [[m["id"].encode() for m in listed]],
                    "model_context_tokens": [[m["max_context_tokens"] for m in listed]],
                    "model_owners": [[(m.get("owned_by") or "").encode() for m in listed]],
                    "model_parents": [[(m.get("parent") or "").encode() for m in listed]]}
        if operation == "whoami":
            who = await self.whoami(req.api_key)
            return {"tenant": [[who["tenant"].encode()]], "tier": [[who["tier"].encode()]],
                    "max_prompt_bytes": [[who["max_prompt_bytes"]]],
                    "stores_conversations": [[who["stores_conversations"]]]}
        if operation in SESSION_OPERATIONS:
            return json_answer(await self.session_operation(operation, req))
        if operation in STORED_OPERATIONS:
            return json_answer(await self.stored_operation(operation, req))
        if operation in LEASE_OPERATIONS:
            return json_answer(await self.leases.operation(operation, req))
        if operation == "stop":
            self._authenticate(self.config(), req.api_key, req.on_behalf_of)  # as the stream was: 401 for no key
            return json_answer({"stopped": self.streams.stop(req)})
        raise invalid("operation", f"must be one of {', '.join(GATEWAY_OPERATIONS)}, got {operation!r}")

    async def handle(self, req: GatewayRequest, is_cancelled=lambda: False):
        """The response chunks of one generate request; one usage record when it ends, however it ends.
        A request with a stream_id also ends as cancelled when its caller sends `stop` for it."""
        resumed = self.leases.resumed(req)  # a lease the front hands back: its own trace and request
        trace = Trace() if resumed is None else resumed.admitted.trace
        stream = self.streams.open(req)
        try:
            cancelled = is_cancelled if stream is None else (lambda: stream.is_set() or is_cancelled())
            source = self._handle(req, cancelled, trace, stream) if resumed is None else \
                self._generate(resumed.admitted, cancelled, resumed.keep or Keep(resumed.admitted.tenant.name))
            async for chunk in source:
                yield chunk
        except ServingError as e:
            trace.outcome, trace.error_kind = "error", e.kind
            raise
        except (GeneratorExit, asyncio.CancelledError):
            trace.outcome, trace.error_kind = "cancelled", ""
            raise
        finally:
            self.streams.close(req)
            self._record(req if resumed is None else resumed.admitted.req, trace)

    def _record(self, req: GatewayRequest, t: Trace) -> None:
        if self.ledger is None:
            return
        if req.on_behalf_of is not None and t.outcome == "error" and t.error_kind in RETRYABLE_KINDS:
            return  # a batch line refused so is retried by the worker: no row per attempt
        now = time.monotonic()
        rec = UsageRecord(
            request_id=req.request_id, ts=t.ts, tenant=t.tenant, tier=t.tier, model=t.model,
            adapter=req.adapter or "", prompt_tokens=t.n_in, completion_tokens=t.n_out, cost=t.cost,
            ttft_ms=None if t.ttft_s is None else round(t.ttft_s * 1000, 3),
            latency_ms=round((now - t.arrival if t.latency_s is None else t.latency_s) * 1000, 3), outcome=t.outcome,
            error_kind=t.error_kind if t.outcome == "error" else "", finish_reason=t.finish_reason,
            batch_id=req.batch_id or "", provider=t.provider, end_user=req.user or "", served_from=t.served_from)
        try:
            self.ledger.append(rec.to_json())
        except Exception:  # the ledger must never fail a request
            self.metrics.rejected(t.tenant, "ledger_error")

    async def _handle(self, req: GatewayRequest, is_cancelled, trace: Trace, stopped: asyncio.Event | None):
        """`stopped`: set by the caller's `stop` (Streams); it also ends the request while it waits for
        admission, with no chunk."""
        hit, keep = await self._before_engine(req, trace)
        if hit is not None:
            yield hit
            return
        try:
            a = await self._admit(req, trace, stopped=stopped)
        except Stopped:
            trace.outcome = "cancelled"
            return
        async for chunk in self._generate(a, is_cancelled, keep):
            yield chunk

    async def _generate(self, a: "Admitted", is_cancelled, keep: Keep):
        """An admitted request's engine stream as chunks, settled however it ends."""
        req, trace = a.req, a.trace
        if req.outputs.token_level:
            async for chunk in self._handle_tokens(a, is_cancelled, trace):
                yield chunk
            return
        model, n_in, name, arrival = a.model, a.n_in, a.tenant.name, trace.arrival
        counts, outcome, final = GeneratedCounts(req.max_tokens), "error", None
        kept: list[str] = []  # the whole answer, when it is kept (cache, session)
        try:
            detok, pieces, first_at, last_at = IncrementalDetokenizer(self.detok), [], None, None
            async for step in self.backend.engine_stream(model, req, a.prep, name):
                ids = step.ids
                if is_cancelled():
                    outcome = trace.outcome = "cancelled"
                    await self.backend.engine_stop(model, req)
                    break
                counts.add(step)
                text = detok.push(ids)
                last_at = time.monotonic()
                if text and first_at is None:
                    first_at = last_at
                    trace.ttft_s = first_at - arrival
                    self.metrics.ttft(name, model, first_at - arrival)
                if keep.wanted and text:
                    kept.append(text)
                if req.stream and text:
                    # the first piece names the model that serves, so a front can tell its client up front
                    yield Chunk(text, final=False, model_used=model if first_at == last_at else "")
                elif text:
                    pieces.append(text)
            else:
                outcome = trace.outcome = "success"
                n_out = counts.total
                if first_at is not None and n_out > 1:
                    self.metrics.itl(name, model, (last_at - first_at) / (n_out - 1))
                tail = detok.finish()
                final = Chunk("".join(pieces) + tail, final=True, model_used=model,
                              finish_reason=counts.finish_reason(), num_input_tokens=n_in, num_output_tokens=n_out)
                kept.append(tail)
        finally:
            await self._settle(a, counts.total, outcome, final.finish_reason if final is not None else None)
        if final is not None:  # after settling: a client that sees the end also sees its usage counted
            await self._keep(keep, "".join(kept), model, final.finish_reason, n_in, counts.total)
            yield final

    # -- sessions and the response cache: before the engine, and what is kept after it ----------------
    async def _before_engine(self, req: GatewayRequest, trace: Trace) -> tuple[Chunk | None, Keep]:
        """A session's stored conversation put in place of its new messages (within the window), or the
        answer from the response cache (served here: no engine work), and what to keep of the new answer."""
        cfg = self.config()
        tenant = self._authenticate(cfg, req.api_key, req.on_behalf_of)
        trace.tenant = tenant.name
        keep = Keep(tenant.name)
        if req.prompt_cache_key is not None:  # a session's retention; a session turn sets its own below
            req.kv_retention = kv_retention(tenant.sessions or SessionPolicy())
        if req.slide_keep is not None:
            if req.session_id is not None:
                raise self._reject(tenant.name, invalid("slide_keep", "a session slides its own conversation"))
            try:
                await self._slide(cfg, tenant, req)
            except ServingError as e:
                raise self._reject(tenant.name, e) from None
        if req.outputs.token_level:  # per-token answers (n, log probs, echo): never cached, not a session's
            if req.session_id is not None:  # which of n choices would the session keep? refused, not guessed
                raise self._reject(tenant.name, invalid("session_id", "cannot be combined with n > 1, logprobs or echo"))
            return None, keep
        try:
            check_max_tokens(req.max_tokens)
            if req.session_id is not None:
                # a session's answer depends on what it stored: never served from the response cache
                keep.turn = await self._open_turn(cfg, tenant, req)
            elif tenant.response_cache is not None and (key := cache_key(tenant.name, req)) is not None:
                hit = await self._serve_cached(cfg, tenant, req, key, trace)
                if hit is not None:
                    return hit, keep
                keep.cache_key, keep.cache_policy = key, tenant.response_cache
        except ServingError as e:
            raise self._reject(tenant.name, e) from None
        return None, keep

    def _window(self, cfg, tenant, model: str | None) -> int:
        """The context tokens a request of `model` may use: the tenant's quota, the routed model's and the engine's."""
        model = model if model in cfg.routing.models else cfg.routing.default_model
        bounds = [tenant.limits["max_context_tokens"], (cfg.routing.models.get(model) or {}).get("max_context_tokens")]
        engine = self.engine_limits(model).limit()
        return min(b for b in bounds + [engine[0] if engine else None] if b)

    async def _open_turn(self, cfg, tenant, req: GatewayRequest) -> Turn:
        if tenant.sessions is None:
            raise invalid("session_id", f"sessions are not enabled for tenant '{tenant.name}'")
        check_session_id(req.session_id)
        new = _message_list(req.messages, "session_id")
        conversation = merge(await self.sessions.load(tenant.name, req.session_id) or [], new)

        sent = await self._fit(cfg, tenant, req, conversation, len(new))
        req.messages = json.dumps(sent)
        req.kv_retention = kv_retention(tenant.sessions)
        self.metrics.session_turn(tenant.name, len(sent) < len(conversation))
        return Turn(tenant.name, req.session_id, tenant.sessions, new)

    async def _slide(self, cfg, tenant, req: GatewayRequest) -> None:
        """A request's messages with their oldest turns dropped until they fit the window (slide_keep)."""
        check_max_tokens(req.max_tokens)
        messages = _message_list(req.messages, "slide_keep")
        sent = await self._fit(cfg, tenant, req, messages, req.slide_keep)
        if len(sent) < len(messages):
            req.messages = json.dumps(sent)
        self.metrics.truncation(tenant.name, len(sent) < len(messages))

    async def _fit(self, cfg, tenant, req: GatewayRequest, messages: list[dict], n_new: int) -> list[dict]:
        """The sliding window (gateway/sessions.py fit_window) over the request's window less its max_tokens,
        counted by `preprocessing` with the request's tools."""
        async def count(messages) -> int:
            prep = await self.backend.tokenize(GatewayRequest(
                req.api_key, req.max_tokens, messages=json.dumps(messages), tools=req.tools, request_id=req.request_id))
            return prep.n_input

        return await fit_window(messages, n_new, self._window(cfg, tenant, req.model) - req.max_tokens, count)

    async def _serve_cached(self, cfg, tenant, req: GatewayRequest, key: str, trace: Trace) -> Chunk | None:
        """A cached answer, through the tenant's limits and into its usage; None: a miss."""
        hit = await self.response_cache.get(tenant.name, key)
        limits = tenant.limits
        if hit is None or hit.model not in cfg.catalog or not tenant.may_use(cfg.catalog[hit.model]) \
                or (req.adapter and not tenant.allows_adapter(req.adapter)) or tenant.output_refusal(req.max_tokens) \
                or tenant.context_refusal(hit.num_input_tokens, req.max_tokens):
            return None  # (the tenant's policy changed since the answer was kept: asked anew, or refused)
        name, n_in, n_out = tenant.name, hit.num_input_tokens, hit.num_output_tokens
        batch = req.on_behalf_of is not None or req.tier == "batch"
        trace.tier, trace.model, trace.n_in = "batch" if batch else tenant.tier, hit.model, n_in
        reservation = await self.limiter.acquire(name, limits, n_in + n_out)  # the limits count a hit's tokens
        await self.limiter.settle(reservation, limits, n_in + n_out)
        cost = tenant.cost(n_in, n_out) if tenant.response_cache.billing == "full" else 0.0
        trace.n_out, trace.cost, trace.finish_reason, trace.outcome = n_out, cost, hit.finish_reason, "success"
        trace.served_from = "response_cache"
        trace.ttft_s = time.monotonic() - trace.arrival
        self.metrics.finished(name, hit.model, "success", n_in, n_out, cost)
        return Chunk(hit.text, final=True, model_used=hit.model, finish_reason=hit.finish_reason,
                     num_input_tokens=n_in, num_output_tokens=n_out)

    async def _keep(self, keep: Keep, text: str, model: str, reason: str, n_in: int, n_out: int) -> None:
        """A successful answer into the response cache and its session (before the client sees its end, so
        the session's next turn finds it)."""
        if keep.cache_key is not None:
            await self.response_cache.put(keep.cache_key, CachedAnswer(keep.tenant, text, model, reason, n_in, n_out),
                                          keep.cache_policy)
        if keep.turn is not None:
            try:
                await self.sessions.save(keep.turn, text)
            except Exception:  # noqa: BLE001 - the answer stands; the turn is lost, and counted
                self.metrics.rejected(keep.tenant, "session_store_error")

    async def session_operation(self, operation: str, req: GatewayRequest) -> dict:
        """`session_get` (the stored conversation) and `session_delete`, of the caller's tenant only: another
        tenant's id is not found, like an id never used."""
        tenant = self._authenticate(self.config(), req.api_key)
        if req.session_id is None:
            raise self._reject(tenant.name, invalid("session_id", "is required"))
        check_session_id(req.session_id)
        if operation == "session_get":
            messages = await self.sessions.load(tenant.name, req.session_id)
            found = messages is not None
        else:
            found = await self.sessions.delete(tenant.name, req.session_id)
        if not found:
            raise ServingError("not_found", f"no session {req.session_id!r}", field="session_id")
        return {"id": req.session_id, "messages": messages} if operation == "session_get" \
            else {"id": req.session_id, "deleted": True}

    async def stored_operation(self, operation: str, req: GatewayRequest) -> dict:
        """The objects of the Responses and Conversations APIs the front keeps here (StoredObjects), of the
        caller's tenant only (another tenant's id is not found, like an id never used): `<kind>_get` (the
        whole stored object), `<kind>_delete`, and `<kind>_put` (with a revision: only over that version,
        "stored": false otherwise) / `conversation_append`, which only the front may do (it makes them)."""
        tenant = self._authenticate(self.config(), req.api_key)
        kind, verb = operation.rsplit("_", 1)
        stored = self.stored[kind]
        object_id = stored.check_id(req.stored_id)
        if verb in ("put", "append"):
            if not self.is_front(req):
                raise ServingError("permission_denied", f"operation {operation!r} is reserved to the front")
            if tenant.sessions is None:
                raise self._reject(tenant.name, invalid(kind, f"tenant '{tenant.name}' keeps no conversations "
                                                        "(sessions: false)"))
            try:
                if verb == "put":
                    written = await stored.save(tenant.name, object_id, req.stored_object, tenant.sessions,
                                                req.stored_revision)
                else:
                    await stored.append(tenant.name, object_id, req.stored_object, tenant.sessions)
                    written = True
            except ServingError as e:
                raise self._reject(tenant.name, e) from None
            except Exception:  # noqa: BLE001 - the store did not answer
                self.metrics.rejected(tenant.name, f"{kind}_store_error")
                raise store_unavailable() from None
            return {"id": object_id, "stored": written}
        if verb == "get":
            doc = await stored.get(tenant.name, object_id)
            found = doc is not None
        else:
            found = await stored.delete(tenant.name, object_id)
        if not found:
            raise ServingError("not_found", f"no {kind} {object_id!r}", field=stored.kind.id_field)
        if verb == "get":
            return {part: doc[part] for part in stored.kind.parts}
        return {"id": object_id, "deleted": True}

    def is_front(self, req: GatewayRequest) -> bool:
        """Whether the request carries the launcher's key of the front (LLM_FRONT_KEY)."""
        return bool(req.front_key and self.front_key_sha256 and hash_key(req.front_key) == self.front_key_sha256)

    async def _handle_tokens(self, a: "Admitted", is_cancelled, trace: Trace):
        """A request answered per token or per sequence (n > 1, log probs, echo): every engine step is a
        chunk naming its sequence, with its text (detokenized per sequence) and its tokens' log probs."""
        req = a.req
        model, n_in, name, arrival = a.model, a.n_in, a.tenant.name, trace.arrival
        k, temperature = req.outputs.logprobs or 0, req.sampling.temperature
        counts = GeneratedCounts(req.max_tokens)
        detoks: dict[int, IncrementalDetokenizer] = {}
        outcome, final, first_at = "error", None, None
        try:
            async for step in self.backend.engine_stream(model, req, a.prep, name):
                if is_cancelled():
                    outcome = trace.outcome = "cancelled"
                    await self.backend.engine_stop(model, req)
                    break
                i = step.sequence_index
                counts.add(step)
                text = detoks.setdefault(i, IncrementalDetokenizer(self.detok)).push(step.ids)
                logprobs = {"ids": step.ids}
                token_bytes = self.detok.token_bytes
                if req.outputs.logprobs is not None and step.ids:
                    logprobs["tokens"] = [t.to_list() for t in generated_logprobs(
                        step.ids, step.log_probs, step.generation_logits, temperature, k, token_bytes)]
                if step.context_logits is not None and req.outputs.echo_logprobs:
                    logprobs["prompt"] = [t.to_list() for t in prompt_logprobs(
                        a.prep.token_ids, step.context_logits, temperature, k, token_bytes)]
                if first_at is None and step.ids:
                    first_at = time.monotonic()
                    trace.ttft_s = first_at - arrival
                    self.metrics.ttft(name, model, first_at - arrival)
                if text or len(logprobs) > 1 or step.ids:
                    yield Chunk(text, final=False, model_used=model, sequence_index=i,
                                token_logprobs=json.dumps(logprobs))
            else:
                outcome = trace.outcome = "success"
                for i in range(req.n):  # each sequence's end: what its detokenizer held, and why it ended
                    rest = detoks[i].finish() if i in detoks else ""
                    yield Chunk(rest, final=False, model_used=model, sequence_index=i,
                                finish_reason=counts.finish_reason(i), token_logprobs=json.dumps({"ids": []}))
                final = Chunk("", final=True, model_used=model, finish_reason=counts.finish_reason(),
                              num_input_tokens=n_in, num_output_tokens=counts.total)
        finally:
            await self._settle(a, counts.total, outcome, final.finish_reason if final is not None else None)
        if final is not None:
            yield final

    async def _admit(self, req: GatewayRequest, trace: Trace, lease: bool = False,
                     stopped: asyncio.Event | None = None) -> "Admitted":
        """Everything a request needs before the engine, stage by stage: who asks and what it may ask for,
        its prompt tokenized and charged, its route and rate-limit reservation, an engine slot. On a refusal
        nothing stays held. `lease`: the front asks, and can stream from an upstream provider (which holds
        no engine slot: its reservation is the limit). `stopped` set while it waits (the batch gate, an engine
        slot): Stopped, with what it held settled as cancelled."""
        cfg = self.config()
        tenant, batch = self._permitted(cfg, req, trace)
        prep = await self._tokenized(tenant, req, trace)
        model, reservation = await self._reserved(cfg, req, tenant, prep.n_input, batch, lease, trace, stopped)
        self.metrics.reserved(tenant.name, self.limiter.reserved.get(tenant.name, 0))
        upstream = cfg.catalog[model].upstream is not None
        a = Admitted(req, tenant, model, prep, prep.n_input, batch, reservation,
                     None if upstream else self.admission.slots(model), trace, spec=cfg.catalog[model])
        if not upstream:  # an upstream holds no engine slot: the front streams from it
            await self._slotted(a, cfg, stopped)
        return a

    def _permitted(self, cfg, req: GatewayRequest, trace: Trace):
        """Who asks, and whether it may ask for this model, adapter and output: (tenant, a batch line?).
        Nothing is tokenized or charged yet, so these refusals cost nothing."""
        tenant = self._authenticate(cfg, req.api_key, req.on_behalf_of)
        name = tenant.name
        req.lookahead = tenant.lookahead_inputs()
        batch = req.on_behalf_of is not None or req.tier == "batch"
        trace.tenant, trace.tier = name, "batch" if batch else tenant.tier
        if req.model and req.model != "auto" and req.model not in cfg.routing.models and not req.adapter \
                and self._adapter_model(cfg, tenant, req.model):
            # an adapter's name as the model name (vLLM's convention): that adapter on the model serving it
            req.adapter, req.model = req.model, self._adapter_model(cfg, tenant, req.model)
        if req.adapter and not tenant.allows_adapter(req.adapter):
            raise self._reject(name, ServingError("permission_denied", f"tenant '{name}' may not use adapter "
                                                  f"{req.adapter!r}", field="adapter"))
        refused = tenant.model_refusal(cfg.catalog[req.model]) if req.model in cfg.routing.models else None
        if refused is not None:  # before tokenizing, like every refusal here (routing asks the same of its pick)
            raise self._reject(name, refused)
        if req.model and req.model != "auto" and req.model not in cfg.routing.models:
            # before tokenizing: an unknown name costs nothing and records no prompt tokens
            raise self._reject(name, ServingError(
                "not_found", f"model {req.model!r} does not exist or this key may not use it", field="model"))
        try:
            check_max_tokens(req.max_tokens)
        except ServingError as e:
            raise self._reject(name, e) from None
        bias = req.outputs.logit_bias or {}
        if bias and max(bias) >= self.detok.vocab_size:
            raise self._reject(name, invalid("logit_bias", f"token ids must be in [0, {self.detok.vocab_size}), "
                                                           f"got {max(bias)}"))
        refused = tenant.output_refusal(req.max_tokens)
        if refused is not None:
            raise self._reject(name, refused)
        return tenant, batch

    async def _tokenized(self, tenant, req: GatewayRequest, trace: Trace):
        """The prompt tokenized, its work charged: a prompt over the tenant's byte bound is refused unread and
        counted as a request, a tenant with no request left gets its 429 before any tokenizing, and a prompt
        over the context quota is counted with its tokens."""
        name, limits = tenant.name, tenant.limits
        try:
            await self.limiter.check(name, limits)
            try:
                check_prompt_bytes(tenant, req)
            except ServingError:
                await self.limiter.charge(name, limits, refuse=False)
                raise
        except ServingError as e:
            raise self._reject(name, e) from None
        try:
            prep = await self._tokenize(tenant, req)
        except ServingError as e:
            await self.limiter.charge(name, limits, refuse=False)
            raise self._reject(name, e)
        n_in = trace.n_in = prep.n_input
        refused = tenant.context_refusal(n_in, req.max_tokens)
        if refused is not None:
            await self.limiter.charge(name, limits, n_in, refuse=False)
            raise self._reject(name, refused)
        return prep

    async def _reserved(self, cfg, req: GatewayRequest, tenant, n_in: int, batch: bool, lease: bool, trace: Trace,
                        stopped: asyncio.Event | None = None):
        """The model that serves it (an engine model, or an upstream provider for a lease) and its rate-limit
        reservation: (model, reservation). A batch line waits here while interactive traffic runs."""
        name, limits = tenant.name, tenant.limits
        gated, model = False, None
        try:
            # an adapter belongs to its base model: no degrading to another one
            saturated = (lambda m: False) if req.adapter else (lambda m: self.admission.slots(m).saturated)
            # every pick fits (routing.context_refusal): what no engine slot could ever serve is refused now,
            # not after reserving tokens and queueing
            model = self._route(cfg, req, tenant, n_in, saturated, upstream_ok=lease and not req.adapter)
            upstream = cfg.catalog[model].upstream
            if upstream is not None:
                trace.model, trace.provider = model, upstream.name
                return model, await self.limiter.acquire(name, limits, n_in + req.max_tokens)
            if req.adapter:
                # never the base model's answer for an adapter request: what is not applied is refused
                served = self.engine_limits(model).adapters()
                if served is None or req.adapter not in served:
                    raise ServingError("not_found", f"adapter {req.adapter!r} is not served by model '{model}' "
                                       f"(available: {', '.join(served or []) or 'none'})", field="adapter")
            trace.model, trace.provider = model, "local"
            if batch:  # waits while interactive traffic runs, before holding any of the tenant's limits
                await self.batch_gate.enter_batch(model, stopped)
                gated = True
            # n sequences: each may produce max_tokens, all of them billed
            return model, await self.limiter.acquire(name, limits, n_in + req.n * req.max_tokens)
        except ServingError as e:
            if gated:
                self.batch_gate.leave_batch(model)
            if e.kind == "context_too_long":  # over what the engine or the bucket could ever hold: counted
                await self.limiter.charge(name, limits, n_in, refuse=False)
            raise self._reject(name, e)
        except BaseException:
            if gated:
                self.batch_gate.leave_batch(model)
            raise

    async def _slotted(self, a: "Admitted", cfg, stopped: asyncio.Event | None = None) -> None:
        """An engine slot for an admitted request, in tier order and the tenant's KV share; a refusal here
        settles what the request holds, and so does a stop while it waits (as cancelled)."""
        name, limits, req = a.tenant.name, a.tenant.limits, a.req
        priority = max(a.tenant.priority, cfg.tiers["batch"]["priority"]) if a.batch else a.tenant.priority
        if not a.batch:
            self.batch_gate.enter_interactive(a.model)
        try:
            self.metrics.queue_depth(a.model, a.slots.queued + 1)
            try:
                waited = await a.slots.acquire(name, priority, a.n_in + req.max_tokens, limits["kv_share_percent"],
                                               stopped)
            finally:
                self.metrics.queue_depth(a.model, a.slots.queued)
        except BaseException as e:
            await self._settle(a, 0, "cancelled" if isinstance(e, (Stopped, asyncio.CancelledError)) else "error", None)
            if isinstance(e, ServingError):
                raise self._reject(name, e) from None
            raise
        a.has_slot = True
        self.metrics.inflight(a.model, a.slots.inflight, a.slots.kv_held)
        self.metrics.queue_wait(name, waited)

    def _route(self, cfg, req: GatewayRequest, tenant, n_in: int, saturated, upstream_ok: bool) -> str:
        """The model (gateway/routing.py choose), local or upstream, skipping upstreams whose circuit is
        open and those the front already tried for this request (its lease `avoid`)."""
        unsupported = upstream_unsupported(req)

        def available(spec) -> bool:
            return spec.upstream is None or self.breakers.get(spec.upstream.name, spec.upstream.breaker).allows()

        avoid = req.lease.get("avoid") if isinstance(req.lease, dict) else None
        avoid = tuple(m for m in avoid if isinstance(m, str)) if isinstance(avoid, list) else ()
        try:
            model = choose(cfg, req.model, tenant, n_in, req.max_tokens, lambda: prompt_text(req.text, req.messages),
                           saturated, lambda spec: spec.upstream is None or unsupported is None, available, avoid,
                           upstream_ok, self.engine_limits)
        except ServingError as e:
            asked = cfg.catalog.get(req.model or "")
            if e.kind == "upstream_unavailable" and asked is not None and asked.upstream is not None:
                # when its circuit lets a probe through again (at least a second)
                wait = self.breakers.get(asked.upstream.name, asked.upstream.breaker).retry_after()
                e.retry_after = max(1.0, wait) if wait else e.retry_after
            raise
        spec = cfg.catalog[model]
        if spec.upstream is not None and unsupported is not None:
            raise ServingError("invalid_argument", f"{unsupported} is not supported with model {model!r}, "
                               "which an upstream provider serves", field=unsupported)
        requested = cfg.catalog.get(req.model) if req.model else None
        if avoid or (requested is not None and requested.upstream is not None and model != req.model):
            self.metrics.fallback(req.model or "auto", model)  # past a failed or open upstream
        return model

    async def _settle(self, a: "Admitted", n_out: int, outcome: str, final_reason: str | None,
                      n_in: int | None = None) -> None:
        """Whatever ended the request: leave the batch gate, free the slot, refund the reservation down
        to the tokens used, count it. Once per admitted request. `n_in`: the prompt tokens an upstream
        counted (its usage), which replace the local tokenizer's estimate the reservation was made with."""
        if a.settled:
            return
        a.settled = True
        name, model, tenant = a.tenant.name, a.model, a.tenant
        if n_in is not None:
            a.n_in = a.trace.n_in = n_in
        if a.slots is None:
            pass  # an upstream's request: no batch gate, no engine slot
        elif a.batch:
            self.batch_gate.leave_batch(model)
        else:
            self.batch_gate.leave_interactive(model)
        if a.has_slot:
            a.slots.release(name, a.n_in + a.req.max_tokens)
            self.metrics.inflight(model, a.slots.inflight, a.slots.kv_held)
        await self.limiter.settle(a.reservation, tenant.limits, a.n_in + n_out)
        self.metrics.reserved(name, self.limiter.reserved.get(name, 0))
        cost = a.spec.cost(tenant, a.n_in, n_out) if a.spec is not None else tenant.cost(a.n_in, n_out)
        a.trace.n_out, a.trace.cost = n_out, cost
        if final_reason is not None:
            a.trace.finish_reason = final_reason
        # an upstream's failed tries before its first token are no client-visible outcome (a fallback answers,
        # or the client's 503 is counted as a rejection): gateway_upstream_errors_total counts them
        if (outcome != "error" or a.has_slot or a.slots is None) and not a.tried_only:
            self.metrics.finished(name, model, outcome, a.n_in, n_out, cost)
            if a.req.adapter:
                self.metrics.adapter_finished(name, model, a.req.adapter, outcome, n_out)


def _prompt_parts(req: GatewayRequest) -> dict[str, int]:
    """Bytes of each input the prompt is made of (the tools are rendered into it too)."""
    return {name: len(v) if isinstance(v, bytes) else len(v.encode("utf-8", "surrogatepass"))
            for name, v in (("text_input", req.text), ("messages", req.messages), ("tools", req.tools))
            if v is not None}


def prompt_bytes(req: GatewayRequest) -> int:
    return sum(_prompt_parts(req).values())


def check_prompt_bytes(tenant, req: GatewayRequest) -> None:
    """The tier's cheap bound on a prompt, before any tokenizer time is spent on it; the error names the
    largest of the inputs the prompt is made of."""
    parts, bound = _prompt_parts(req), tenant.limits["max_prompt_bytes"]
    size = sum(parts.values())
    if size > bound:
        raise ServingError("context_too_long", f"the prompt is {size} bytes, over tenant '{tenant.name}''s "
                           f"bound of {bound} bytes", field=max(parts, key=parts.get))


class Streams:
    """Generate streams and the front's admissions their callers named (request parameter stream_id), by
    the digest of the caller's key: `stop` with the same key and id ends one as a client that went away
    would (out of the admission queue, or the engine's stop; a cancelled outcome), without the call being
    cancelled (Triton 2.51's gRPC server can abort when many streams are cancelled at once;
    front/gateway_client.py ReadAheadCall). Only the key that started a stream can stop it."""

    def __init__(self):
        self.live: dict[tuple[str, str], asyncio.Event] = {}

    @staticmethod
    def _key(req: GatewayRequest) -> tuple[str, str] | None:
        return (hash_key(req.api_key or ""), req.stream_id) if req.stream_id else None

    def open(self, req: GatewayRequest) -> asyncio.Event | None:
        key = self._key(req)
        if key is None:
            return None
        if key in self.live:
            raise invalid("stream_id", "a stream of this key with this stream_id is in flight")
        self.live[key] = stopped = asyncio.Event()
        return stopped

    def close(self, req: GatewayRequest) -> None:
        key = self._key(req)
        if key is not None:
            self.live.pop(key, None)

    def stop(self, req: GatewayRequest) -> bool:
        """Whether the caller's key had such a stream in flight (now told to stop)."""
        if not req.stream_id:
            raise invalid("stream_id", "stop names the stream_id of one of the caller's generate streams")
        stopped = self.live.get(self._key(req))
        if stopped is not None:
            stopped.set()
        return stopped is not None


class TenantSemaphores:
    """One asyncio.Semaphore per tenant, remade when the tenant's bound changes (a config reload)."""

    def __init__(self):
        self._by_tenant: dict[str, tuple[int, asyncio.Semaphore]] = {}

    def get(self, tenant: str, bound: int) -> asyncio.Semaphore:
        held = self._by_tenant.get(tenant)
        if held is None or held[0] != bound:
            held = self._by_tenant[tenant] = (bound, asyncio.Semaphore(bound))
        return held[1]


def upstream_unsupported(req: GatewayRequest) -> str | None:
    """The first field of the request an upstream call cannot honour (the front sends OpenAI's standard
    fields only, and constrained decoding and tools are the local engine's), or None."""
    if req.tools:
        return "tools"
    if req.guide is not None:
        return "guided_decoding_guide"
    for name in ("top_k", "min_tokens"):
        if getattr(req.sampling, name) is not None:
            return name
    if req.ignore_eos:
        return "ignore_eos"
    if req.bad_words:
        return "bad_words"
    if req.prompt_ids is not None:
        return "prompt_ids"
    out = req.outputs  # the engine's own distribution, ids and sequences: not an upstream's
    for name, asked in (("num_return_sequences", out.num_return_sequences > 1), ("logprobs", out.logprobs is not None),
                        ("echo_logprobs", out.echo_logprobs), ("logit_bias", bool(out.logit_bias))):
        if asked:
            return name
    return None


def _message_list(raw, field: str) -> list[dict]:
    """A request's `messages` as a list of message objects (what `field` needs), or a 400."""
    if raw is None:
        raise invalid(field, "needs a chat conversation: send messages, not a prompt")
    try:
        messages = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise invalid("messages", "must be a JSON list of messages") from None
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise invalid("messages", "must be a JSON list of messages")
    return messages


@dataclass(eq=False)
class Admitted:
    """A request that holds a reservation and (once `has_slot`) an engine slot, until `_settle`."""
    req: GatewayRequest
    tenant: object
    model: str
    prep: object
    n_in: int
    batch: bool
    reservation: object
    slots: object
    trace: Trace
    has_slot: bool = False
    settled: bool = False
    spec: object = None  # its ModelSpec (gateway/catalog.py): prices, the upstream if any
    tried_only: bool = False  # an upstream's tries all failed before a first token (the front falls back)


# -- leases: the front streams from the engine itself ----------------------------------------------------
LEASE_OPERATIONS = ("admit", "settle", "renew", "engine_check")
SESSION_OPERATIONS = ("session_get", "session_delete")
LEASE_OUTCOMES = ("success", "cancelled", "error")
MAX_SETTLES_PER_REQUEST = 1024


def _admit_answer(task: asyncio.Task) -> dict:
    """A grouped admit's answer: its grant, or its failure (item_error)."""
    try:
        return task.result()
    except Exception as e:  # noqa: BLE001 - one admit's failure must not fail the others of its group
        return item_error(e)


@dataclass(eq=False)
class Lease:
    id: str
    admitted: Admitted
    expires: float
    engine: object  # what the engine was at admission (EngineWatch.begin): a stream on another is lost
    keep: Keep | None = None  # what to keep of the answer the front reports at settle (its `text`)
    hand_back: bool = False  # granted to be handed back at once: the engine never had its adapter's weights


class Leases:
    """The token stream without the gateway in it: `admit` does all of a generate request's policy
    (auth, quotas, tokenize, route, reservation, engine slot) and answers with the engine call to make
    and a lease; the front streams from the engine, detokenizes, and `settle`s the lease with the tokens
    it got and how the stream ended, which refunds and frees exactly as `Gateway.handle` does. A lease
    the front never settles (its process died) expires after `ttl_s` without a `renew` and is settled as
    cancelled with all its reserved tokens charged: nothing stays held. `engine_check` tells a front
    whose stream went silent whether the engine it started on is still alive (EngineWatch).

    Only the front, with the launcher's key (LLM_FRONT_KEY), may use these: the lease hands over the
    tenant's cache salt and trusts the token count the front reports."""

    def __init__(self, gateway: Gateway, ttl_s: float):
        self.gateway, self.ttl_s = gateway, ttl_s
        self.live: dict[str, Lease] = {}
        self._sweeper: asyncio.Task | None = None

    async def operation(self, operation: str, req: GatewayRequest) -> dict:
        if not self.gateway.is_front(req):
            raise ServingError("permission_denied", f"operation {operation!r} is reserved to the front")
        if operation == "admit":
            return await self.admit(req)
        lease = req.lease if isinstance(req.lease, dict) else {}
        if operation == "renew":
            ids = lease.get("ids")
            if not isinstance(ids, list):
                raise invalid("lease", "renew needs {\"ids\": [lease ids]}")
            now = time.monotonic()
            for i in ids:
                if isinstance(i, str) and i in self.live:
                    self.live[i].expires = now + self.ttl_s
            return {"renewed": sum(1 for i in ids if isinstance(i, str) and i in self.live)}
        if operation == "settle" and "leases" in lease:
            return {"settled": await self.settle_all(lease["leases"])}
        found = self._found(lease)
        if operation == "engine_check":
            if found.admitted.spec is None or found.admitted.spec.upstream is None:  # an upstream has no engine
                await self.gateway.backend.engine_alive(found.admitted.model, found.engine)
            return {"alive": True}
        return await self.settle(found, lease)

    def _found(self, lease: dict) -> Lease:
        found = self.live.get(lease.get("id")) if isinstance(lease.get("id"), str) else None
        if found is None:
            raise ServingError("not_found", "unknown or expired lease", field="lease")
        return found

    async def settle_all(self, reports) -> list[dict]:
        """Several leases settled by one request (the front sends the settles that queued while its last one
        was answered: a request and its answer's IPC round trip on this one process for all of them); each
        one's answer, or its error, in order."""
        if not isinstance(reports, list) or not reports or len(reports) > MAX_SETTLES_PER_REQUEST \
                or not all(isinstance(r, dict) for r in reports):
            raise invalid("lease", f"settle needs {{\"leases\": [1 to {MAX_SETTLES_PER_REQUEST} settle reports]}}")
        answers = []
        for report in reports:
            try:
                answers.append(await self.settle(self._found(report), report))
            except Exception as e:  # noqa: BLE001 - one report's failure must not leave the others unsettled
                answers.append(item_error(e))
        return answers

    async def admit_group(self, group: GatewayRequest, items) -> AsyncIterator[tuple[dict, bool]]:
        """Several admits in one request (gateway/request.py grouped_admits: its items after the front's key
        is checked): each admit runs as it would alone; the answers decided together go in one answer
        ({"admits": {stream_id: grant, or {"error": the contract's error text}}}), one that waits (the
        admission queue) in a later one, the last with `True`. One answer carries many: each answer is an
        IPC round trip that blocks this process's loop (docs/benchmarks.md, the gateway stub's profile)."""
        if not self.gateway.is_front(group):
            raise ServingError("permission_denied", "operation 'admit' is reserved to the front")
        answers, running = {}, {}
        for stream_id, req in items(group):
            if isinstance(req, ServingError):
                answers[stream_id] = item_error(req)
            else:
                running[asyncio.ensure_future(self.admit(req))] = stream_id
        try:
            while running:
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    answers[running.pop(task)] = _admit_answer(task)
                yield {"admits": answers}, not running
                answers = {}
            if answers:  # every item refused as it was read
                yield {"admits": answers}, True
        finally:
            for task in running:  # the group's caller is gone: what still waits leaves the admission queue
                task.cancel()

    async def admit(self, req: GatewayRequest) -> dict:
        prep = (req.lease or {}).get("prep")
        if prep is not None and req.session_id is None:  # a session's stored turns change the prompt here
            req.prepared = Preprocessed.from_front(prep, self.gateway.detok.vocab_size)
        trace = Trace()
        stopped = self.gateway.streams.open(req)  # the front's `stop` for a client gone while it waits
        try:
            hit, keep = await self.gateway._before_engine(req, trace)
            if hit is not None:  # served from the response cache: no lease, no engine
                self.gateway._record(req, trace)
                return {"cached": {"text": hit.text, "model": hit.model_used, "finish_reason": hit.finish_reason,
                                   "num_input_tokens": hit.num_input_tokens,
                                   "num_output_tokens": hit.num_output_tokens}}
            a = await self.gateway._admit(req, trace, lease=True, stopped=stopped)
        except ServingError as e:
            trace.outcome, trace.error_kind = "error", e.kind
            self.gateway._record(req, trace)
            raise
        except Stopped:
            trace.outcome = "cancelled"
            self.gateway._record(req, trace)
            raise ServingError("cancelled", "stopped by its caller while it waited for admission") from None
        finally:
            self.gateway.streams.close(req)
        keep = keep if keep.wanted else None
        if a.spec.upstream is not None:  # the front streams from the upstream: what to call, never the key
            lease = Lease(req.request_id, a, time.monotonic() + self.ttl_s, None, keep)
            self._hold(lease)
            return {"lease": lease.id, "model": a.model, "num_input_tokens": a.n_in, "max_tokens": req.max_tokens,
                    "ttl_s": self.ttl_s, "report_text": keep is not None, "provider": a.spec.upstream.route()}
        # the lease id is the request's own (the engine request's id too: the front's `stop` finds it by it)
        lease = Lease(req.request_id, a, time.monotonic() + self.ttl_s, self.gateway.backend.engine_identity(a.model),
                      keep)
        self._hold(lease)
        grant = {"lease": lease.id, "model": a.model, "num_input_tokens": a.n_in, "max_tokens": req.max_tokens,
                 "ttl_s": self.ttl_s, "report_text": keep is not None}
        if req.adapter and self.gateway.backend.needs_weights(a.model, req.adapter):
            lease.hand_back = True
            return {**grant, "hand_back": True}  # its weights go with the gateway's stream only (resumed)
        return {**grant, **self.gateway.backend.engine_call(a.model, req, a.prep, a.tenant.name)}

    def resumed(self, req: GatewayRequest) -> Lease | None:
        """The lease a front hands back (`lease: {"resume": id}` on a generate stream) for the gateway to
        stream: its request's adapter is one the engine does not hold (TensorRT-LLM's LoRA cache: never sent,
        evicted, a restarted replica), and only this stream sends an adapter's weights. Its admission
        (reservation, slot, trace) carries on: one request, settled and recorded once. None for a request
        that resumes nothing."""
        lease_id = req.lease.get("resume") if isinstance(req.lease, dict) else None
        if lease_id is None:
            return None
        if not self.gateway.is_front(req):
            raise ServingError("permission_denied", "resuming a lease is reserved to the front", field="lease")
        lease = self._found({"id": lease_id})
        a = lease.admitted
        tenant = self.gateway._authenticate(self.gateway.config(), req.api_key, req.on_behalf_of)
        if tenant.name != a.tenant.name:  # as unknown: no oracle of another tenant's leases
            raise ServingError("not_found", "unknown or expired lease", field="lease")
        if not a.req.adapter:
            raise invalid("lease", "only a lease with an adapter is streamed through the gateway")
        del self.live[lease.id]
        a.req.stream = req.stream
        if not lease.hand_back:  # the front streamed it with the task id alone, and the engine refused
            self.gateway.backend.adapter_lost(a.model, a.req.adapter)
        return lease

    def _hold(self, lease: Lease) -> None:
        self.live[lease.id] = lease
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.ensure_future(self._sweep())

    async def settle(self, lease: Lease, report: dict) -> dict:
        n_out, outcome = report.get("num_output_tokens"), report.get("outcome")
        if not isinstance(n_out, int) or n_out < 0 or outcome not in LEASE_OUTCOMES:
            raise invalid("lease", f"settle needs num_output_tokens >= 0 and outcome in {LEASE_OUTCOMES}")
        self.live.pop(lease.id, None)
        a, trace = lease.admitted, lease.admitted.trace
        trace.outcome = outcome
        trace.error_kind = str(report.get("error_kind") or "internal") if outcome == "error" else ""
        ttft, itl, latency = report.get("ttft_s"), report.get("itl_s"), report.get("latency_s")
        if isinstance(ttft, (int, float)) and ttft >= 0:
            trace.ttft_s = float(ttft)
            self.gateway.metrics.ttft(a.tenant.name, a.model, float(ttft))
        if isinstance(latency, (int, float)) and not isinstance(latency, bool) and latency >= (trace.ttft_s or 0):
            trace.latency_s = float(latency)  # the front's, from its arrival as its ttft_s
        if isinstance(itl, (int, float)) and itl >= 0 and outcome == "success":
            self.gateway.metrics.itl(a.tenant.name, a.model, float(itl))
        # the front read the stream (an engine's, through contracts.generation.GeneratedCounts, or an upstream's)
        given = report.get("finish_reason")
        reason = given if outcome == "success" and given in FINISH_REASONS else None
        n_in = None
        if a.spec is not None and a.spec.upstream is not None:
            n_in, reason = self._upstream_report(a, report, outcome, reason)
        try:
            await self.gateway._settle(a, n_out, outcome, reason, n_in)
            if lease.keep is not None and outcome == "success" and isinstance(report.get("text"), str):
                await self.gateway._keep(lease.keep, report["text"], a.model, reason,
                                         a.n_in if n_in is None else n_in, n_out)
        finally:
            self.gateway._record(a.req, trace)
        return {"settled": lease.id, "finish_reason": reason}

    def _upstream_report(self, a: Admitted, report: dict, outcome: str, reason):
        """An upstream lease's settle: the upstream's own usage and finish reason, and how its tries went,
        which its circuit breaker records (a client's cancel says nothing about the upstream)."""
        up = a.spec.upstream
        n_in = report.get("num_input_tokens")
        n_in = n_in if isinstance(n_in, int) and not isinstance(n_in, bool) and n_in >= 0 else None
        a.tried_only = outcome == "error" and report.get("before_first_token") is True
        failures = report.get("upstream_failures")
        failures = failures if isinstance(failures, int) and not isinstance(failures, bool) and failures > 0 else 0
        ttft = report.get("ttft_s") if isinstance(report.get("ttft_s"), (int, float)) else None
        for kind in report.get("upstream_errors") or []:
            if isinstance(kind, str) and len(kind) <= 40:
                self.gateway.metrics.upstream_error(up.name, kind)
        if failures or outcome == "success":
            self.gateway.breakers.get(up.name, up.breaker).record(failures, outcome == "success", ttft)
        return n_in, reason

    async def expire_due(self) -> int:
        """Settle every lease past its time (cancelled, all reserved tokens charged); how many."""
        now = time.monotonic()
        due = [lease for lease in self.live.values() if lease.expires <= now]
        for lease in due:
            await self.settle(lease, {"num_output_tokens": lease.admitted.req.max_tokens, "outcome": "cancelled"})
        return len(due)

    async def _sweep(self) -> None:
        while self.live:
            await asyncio.sleep(min(1.0, self.ttl_s / 4))
            try:
                await self.expire_due()
            except Exception:  # a sweep must never stop for one bad lease
                pass
