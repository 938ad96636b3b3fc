"""The OpenAI-compatible HTTP front (Starlette): translate, never decide.

Auth, limits, priority, routing and usage live in the gateway; this layer parses OpenAI bodies
(`front/openai_schema.py`), asks the gateway (`front/gateway_client.py`) and answers with real HTTP
statuses. It waits for the gateway's first answer before it sends any header, so an error that comes
before the first token (401, 403, 404, 429, 503, 400) is a real status, and the first piece names the
model that serves (`x-model-used`). An error after streaming began is an SSE error event. A client
that goes away cancels its gRPC stream, which stops the engine.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from contracts.errors import ServingError, invalid
from front.drain import is_draining
from front.choices import Choices, ChoiceState
from front.connections import DIRECT_BODY, DirectBody
from front.gateway_client import GatewayClient, Identity, Piece
from front.keys import api_key, key_digest
from front.ledger_api import LedgerRoutes, LedgerService, LedgerSettings
from front.metrics import FrontMetrics
from front.openai_schema import (
    Completion, GatewayCall, ResponseBuilder, error_body, parse_json, parse_request, parse_token_ids,
    parse_tokenize, retry_after_header, with_session_header,
)
from front.conversations_api import (added_items, item as conversation_item, items_list, new_conversation,
                                     with_metadata, without_item)
from front.responses_api import (ResponsesBuilder, ResponsesEvents, input_items_page, parse_responses,
                                 responses_error, stored_reference)
from front.stored_objects import NOT_WRITABLE, StoredObjects
from front.tool_calls import ToolCallStream

log = logging.getLogger("front")


@dataclass
class FrontSettings:
    max_body_bytes: int = 4 * 1024 * 1024
    default_max_tokens: int = 256  # when a request names none (OpenAI: "up to the context window")
    drain_dir: Path | None = None  # where launcher/drain.py marks a drain (front/drain.py): readiness goes off
    # a body larger than this (or of unknown length: chunked) is read only after the key is checked, and
    # only up to the bound of the key's tier (tier_body_bytes)
    preauth_body_bytes: int = 64 * 1024
    auth_cache_s: float = 30.0  # how long a key's tier bound is kept (the gateway still checks every request)
    bodies_in_flight_per_key: int = 4  # a key's large bodies read at once: at most this many tier bounds in all
    # a large body of a key the gateway refused (rate_limited) that comes back before its Retry-After is held,
    # unread, until then, at most this long, and only then answered: a client ignoring Retry-After slows to it
    early_retry_hold_s: float = 2.0


def tier_body_bytes(max_prompt_bytes: int) -> int:
    """The body a prompt of the tier's bound can take as JSON: JSON's escapes write a UTF-8 byte as at most
    3 bytes (\\uXXXX for a 2-byte character), plus room for the other fields."""
    return 3 * max_prompt_bytes + 64 * 1024


BODY_BUDGET = "llm.body_budget"  # scope key: the BodyBudget of a request


@dataclass
class BodyBudget:
    limit: int  # bytes of body the request may still send in all; lowered by the route once it knows more
    read: int = 0
    complete: bool = False
    counted: bool = False  # the gateway has counted this request already (the door asked it)


def _remember(cache: dict, digest: str, entry: tuple, now: float) -> None:
    """entry = (until, ...) under a key digest; keys come and go, so expired entries are dropped past 10,000."""
    if len(cache) > 10_000:
        for k in [k for k, v in cache.items() if v[0] <= now]:
            del cache[k]
    cache[digest] = entry


class BodyLimit:
    """ASGI middleware: counts a request's body as it arrives (chunked too) and refuses it the moment it is
    over its budget, so nothing larger is ever buffered or spooled; a response sent before the body ended
    closes the connection (the rest is never read)."""

    def __init__(self, app, limit_for):
        self.app, self.limit_for = app, limit_for

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        chunked = b"chunked" in headers.get(b"transfer-encoding", b"").lower()
        budget = BodyBudget(self.limit_for(scope["path"]),
                            complete=not chunked and headers.get(b"content-length", b"0").strip() in (b"0", b""))
        scope[BODY_BUDGET] = budget

        async def counted_receive():
            message = await receive()
            if message["type"] == "http.request":
                budget.read += len(message.get("body", b""))
                budget.complete = not message.get("more_body", False)
                if budget.read > budget.limit:
                    raise ServingError("invalid_argument", f"request body is over the limit of {budget.limit} "
                                       "bytes", field="file" if scope["path"] == "/v1/files" else None)
            elif message["type"] == "http.disconnect":
                budget.complete = True
            return message

        async def closing_send(message):
            if message["type"] == "http.response.start" and not budget.complete:
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, counted_receive, closing_send)


def content_length(request: Request) -> int | None:
    """The declared body length; None when there is none (chunked)."""
    raw = request.headers.get("content-length")
    if raw is None:
        return None
    if not raw.strip().isdigit():
        raise ServingError("invalid_argument", "content-length: not a number")
    return int(raw)


def error_response(err: ServingError) -> JSONResponse:
    return JSONResponse(error_body(err), status_code=err.status, headers=retry_after_header(err))


def sse_event(event: dict) -> bytes:
    """A Responses API event: its type as the SSE event name, then the data."""
    return b"event: " + event["type"].encode() + b"\n" + sse(event)


def sse(data) -> bytes:
    return b"data: " + (data if isinstance(data, bytes) else json.dumps(data, separators=(",", ":")).encode()) \
        + b"\n\n"


class _SseText:
    """The SSE body's fast lane (front/engine_direct.py TextSink): the one choice's next text, once its first
    chunk is out, goes from the engine's read through its stop matcher into the event `_sse` would send
    for it (ResponseBuilder.text_event, byte for byte) and onto the client's connection (front/connections.py
    DirectBody), without a wake-up of the body's generators or an ASGI `send` per token. For the requests
    whose every later chunk is that plain event: one choice, no log probs, no tool calls."""

    __slots__ = ("body", "choices", "state", "head", "tail", "events", "flush")

    def __init__(self, body: DirectBody):
        self.body = body
        self.flush = body.flush  # TextSink.flush: one write of what this read of the engine gave
        self.state: ChoiceState | None = None  # the choice, once its first chunk is out (bind)
        self.events = 0  # written here (the front's metric, at the stream's end)

    @classmethod
    def of(cls, request: Request, call: GatewayCall, chat: bool) -> "_SseText | None":
        body = request.scope.get("extensions", {}).get(DIRECT_BODY)
        if body is None or not call.stream or call.n != 1 or call.logprobs is not None \
                or (chat and call.tool_plan is not None):
            return None
        return cls(body)

    def bind(self, choices: Choices, state: ChoiceState, event_parts: tuple[bytes, bytes]) -> None:
        """From now on: the text of choice `state` through `choices`, as the event whose bytes around its
        JSON string are `event_parts` (ResponseBuilder.text_event_parts)."""
        self.choices, (self.head, self.tail), self.state = choices, event_parts, state

    def ready(self) -> bool:
        return self.state is not None and self.body.writable()

    def write(self, text: str) -> None:
        state = self.state
        text = self.choices.text(state, text)
        state.sent += len(text)
        if text:  # ResponseBuilder.text_event
            self.body.add(self.head + encode_basestring_ascii(text).encode() + self.tail)
            self.events += 1


class DisconnectAwareStream(StreamingResponse):
    """Stops the body the moment the client disconnects, even while no token is flowing (queued,
    prefilling): Starlette's ASGI 2.4 path would notice only at the next send. Then the body generator
    is closed and `cleanup` runs (it cancels the gateway stream), whether or not the body ever started."""

    def __init__(self, content, cleanup, **kwargs):
        super().__init__(content, **kwargs)
        self.cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await until_disconnect(receive, lambda: self.stream_response(send))
        finally:
            await self.body_iterator.aclose()
            await self.cleanup()


async def until_disconnect(receive, work):
    """`await work()` in this task, or None (the work cancelled) if the client disconnects first (or its
    `receive` fails): a watcher task reads `receive` and cancels this one at the disconnect. One task a
    request phase, in place of a task for the work beside it and asyncio.wait, or anyio's task group (the
    front's cost per request: docs/benchmarks.md)."""
    this = asyncio.current_task()
    left = False

    async def watch():
        nonlocal left
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception:  # noqa: BLE001 - a connection that cannot be read is gone
            pass
        left = True
        this.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await work()
    except asyncio.CancelledError:
        if not left:  # cancelled from outside (the server stopping): not ours to end
            raise
        return None
    finally:
        watcher.cancel()
        if left:
            this.uncancel()  # the disconnect's cancel is spent here


class Front:
    def __init__(self, gateway: GatewayClient, settings: FrontSettings | None = None,
                 metrics: FrontMetrics | None = None, ledger: LedgerSettings | None = None, direct=None,
                 front_key: str | None = None):
        self.gateway = gateway
        # stored responses and conversations, kept by the gateway; written with the launcher's key of the
        # front (LLM_FRONT_KEY), without which nothing is stored
        self.stored = StoredObjects(gateway, front_key)
        # front/engine_direct.py: the token stream straight from the engine (the gateway admits and
        # settles); None: every stream through the gateway
        self.direct = direct
        self.settings = settings or FrontSettings()
        self.metrics = metrics or FrontMetrics()
        # the usage ledger, usage reports and the Batch API (front/ledger_api.py); None: no such routes
        # the batch worker's lines take leases too where the front streams from the engine
        self.ledger = LedgerService(ledger, direct or gateway, self.metrics, collect) \
            if ledger is not None and ledger.data_dir is not None else None
        self.ledger_routes = LedgerRoutes(self, self.ledger)
        self._identities: dict[str, tuple[float, Identity]] = {}  # key digest -> (until, its whoami)
        self._refused: dict[str, tuple[float, str]] = {}  # key digest -> (until, the gateway's rate_limited message)
        self._bodies_in_flight: collections.Counter = collections.Counter()  # key digest -> large body bytes read now

    # -- bookkeeping shared by every route ----------------------------------------------------------
    async def _guarded(self, route: str, request: Request, handler) -> Response:
        start = time.monotonic()
        self.metrics.inflight.labels(route).inc()
        try:
            response = await handler(request, start)
        except ServingError as e:
            response = error_response(e)
        except ClientDisconnect:  # the client left while sending its body: no answer to give, no bug
            response = None
        except Exception:  # a bug must still answer as JSON, and never take the process down
            log.exception("%s failed", route)
            response = error_response(ServingError("internal", "internal error in the front (logged)"))
        if response is None:  # client gone before the answer
            self.metrics.disconnects.labels(route).inc()
            response = Response(status_code=499)
        if response.status_code >= 400:
            kind = json.loads(response.body).get("error", {}).get("code") if response.body else None
            self.metrics.errors.labels(route, kind or str(response.status_code)).inc()
        self.metrics.requests.labels(route, str(response.status_code)).inc()
        if not isinstance(response, StreamingResponse):
            self.metrics.inflight.labels(route).dec()
            self.metrics.latency.labels(route).observe(time.monotonic() - start)
        return response

    async def _body(self, request: Request) -> dict:
        held = await self.door(request)
        try:
            chunks, size = [], 0
            try:
                async for chunk in request.stream():  # BodyLimit refuses it as soon as it is over the budget
                    size += len(chunk)
                    if size > self.settings.max_body_bytes:
                        raise ServingError("invalid_argument", f"request body is over the limit of "
                                           f"{self.settings.max_body_bytes} bytes")
                    chunks.append(chunk)
            except ServingError:
                budget = request.scope.get(BODY_BUDGET)
                if held is not None and budget is not None and not budget.counted:
                    # over its bound mid-stream (chunked) with the tier from the cache: one of the tenant's
                    # requests all the same (a 429 instead once they are spent)
                    await self.tier_body_bound(request, fresh=True)
                raise
        finally:
            if held is not None:
                digest, amount = held
                self._bodies_in_flight[digest] -= amount
                if self._bodies_in_flight[digest] <= 0:
                    del self._bodies_in_flight[digest]
        return parse_json(b"".join(chunks), self.settings.max_body_bytes)

    async def door(self, request: Request) -> tuple[str, int] | None:
        """Before reading a large body (or one of unknown length): the key is checked and the body bounded
        by its tier, so an unknown key never makes the front hold megabytes, and a known one only what its
        tier's prompt could need. A refusal here is one of the tenant's requests (the gateway's `whoami`).
        A key's large bodies being read at once hold at most `bodies_in_flight_per_key` times the bound
        (429 beyond): (key digest, bytes held) for the caller to give back once read, or None."""
        budget = request.scope.get(BODY_BUDGET)
        length = content_length(request)
        if length is not None and length <= self.settings.preauth_body_bytes:
            return None
        bound, asked = await self.tier_body_bound(request)
        if length is not None and length > bound:
            if not asked:  # from the cache: ask the gateway, so the refusal is counted as a request
                bound, asked = await self.tier_body_bound(request, fresh=True)
            if length > bound:
                raise ServingError("invalid_argument", f"request body of {length} bytes is over the limit of "
                                   f"{bound} bytes for this key's tier (its prompt bound, as JSON)")
        if budget is not None:
            budget.limit = min(budget.limit, bound)
            budget.counted = asked
        digest, amount = key_digest(api_key(request)), bound if length is None else length
        cap = self.settings.bodies_in_flight_per_key * bound
        if self._bodies_in_flight[digest] + amount > cap:
            raise ServingError("rate_limited", f"this key already sends {self._bodies_in_flight[digest]} bytes of "
                               f"request bodies; at most {cap} at once", retry_after=1.0)
        self._bodies_in_flight[digest] += amount
        return digest, amount

    async def tier_body_bound(self, request: Request, fresh: bool = False) -> tuple[int, bool]:
        """(the body bytes the caller's tier allows (tier_body_bytes), whether the gateway was asked now)."""
        identity, asked = await self.identity(request, fresh)
        return min(self.settings.max_body_bytes, tier_body_bytes(identity.max_prompt_bytes)), asked

    async def identity(self, request: Request, fresh: bool = False) -> tuple[Identity, bool]:
        """(the caller's `whoami`, whether the gateway was asked now): 401 for an unknown key, 429 when the
        tenant's requests are spent; kept `auth_cache_s` per key."""
        key = api_key(request)
        if key is None:
            raise ServingError("unauthenticated", "missing API key (authorization: Bearer or x-api-key)")
        digest = key_digest(key)
        now = time.monotonic()
        held = self._identities.get(digest)
        if held is not None and held[0] > now and not fresh:
            return held[1], False
        refused = self._refused.get(digest)
        if refused is not None and refused[0] > now:
            # The gateway said when to come back (whoami charges no tokens: its 429 holds for any request). A
            # client back early waits, its body unread, until then (at most early_retry_hold_s): a held
            # connection costs a timer, where a client that ignores Retry-After and loops would take the CPU
            # every other tenant's requests need. Still early after the hold: refused here, no gateway call.
            await asyncio.sleep(min(refused[0] - now, self.settings.early_retry_hold_s))
            now = time.monotonic()
            if refused[0] > now:
                raise ServingError("rate_limited", refused[1], retry_after=refused[0] - now)
        try:
            identity = await self.gateway.whoami(key)
        except ServingError as e:
            if e.kind == "rate_limited" and e.retry_after:
                _remember(self._refused, digest, (now + e.retry_after, e.message), now)
            raise
        _remember(self._identities, digest, (now + self.settings.auth_cache_s, identity), now)
        return identity, True

    # -- generation -------------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        return await self._guarded("/v1/chat/completions", request, lambda r, t: self._generate(r, t, True))

    async def completions(self, request: Request) -> Response:
        return await self._guarded("/v1/completions", request, lambda r, t: self._generate(r, t, False))

    async def _generate(self, request: Request, start: float, chat: bool) -> Response | None:
        route = "/v1/chat/completions" if chat else "/v1/completions"
        call = parse_request(await self._body(request), chat, self.settings.default_max_tokens)
        call = with_session_header(call, request.headers.get("x-session-id"))
        text_sink = _SseText.of(request, call, chat)
        opened = await self._open(request, call, text_sink)
        if opened is None:
            return None
        pieces, first = opened
        model = first.model_used or call.model
        if call.stream:
            return self._streaming(route, start, self._sse(route, call, first, pieces, model, start, chat, text_sink),
                                   pieces, model)
        done = await until_disconnect(request.receive, lambda: self._collect(call, first, pieces))
        if done is None:
            await pieces.aclose()
            return None
        return JSONResponse(ResponseBuilder(chat).full(done), headers={"x-model-used": done.model})

    async def _open(self, request: Request, call: GatewayCall, text_sink: "_SseText | None" = None):
        """(pieces, first piece) of a generate request, or None if the client left before the first."""
        if self.direct is not None:
            pieces = self.direct.stream(call, api_key(request), text_sink)
        else:
            pieces = self.gateway.stream(call, api_key(request))
        first = await until_disconnect(request.receive, lambda: _first_piece(call, pieces))
        if first is None:
            await pieces.aclose()
            return None
        return pieces, first

    def _streaming(self, route: str, start: float, body, pieces, model: str) -> Response:
        async def cleanup():
            await pieces.aclose()
            self.metrics.inflight.labels(route).dec()
            self.metrics.latency.labels(route).observe(time.monotonic() - start)

        return DisconnectAwareStream(body, cleanup, media_type="text/event-stream",
                                     headers={"x-model-used": model, "cache-control": "no-cache"})

    # -- /v1/responses (front/responses_api.py) ------------------------------------------------------
    async def responses(self, request: Request) -> Response:
        return await self._guarded("/v1/responses", request, self._respond)

    async def _respond(self, request: Request, start: float) -> Response | None:
        route = "/v1/responses"
        body = await self._body(request)
        ref = stored_reference(body)
        history, store = await self._stored_context(request, ref)
        parsed = parse_responses(body, self.settings.default_max_tokens, history, store, ref)
        call = parsed.call
        try:
            opened = await self._open(request, call)
        except ServingError as e:
            raise responses_error(e) from None
        if opened is None:
            return None
        pieces, first = opened
        model = first.model_used or call.model
        builder = ResponsesBuilder(parsed.echo)
        key = api_key(request)
        if call.stream:
            return self._streaming(route, start, self._response_events(route, parsed, key, first, pieces, model,
                                                                       start, builder), pieces, model)
        done = await until_disconnect(request.receive, lambda: self._collect(call, first, pieces))
        if done is None:
            await pieces.aclose()
            return None
        response = builder.full(done)
        await self._keep_response(key, parsed, response)
        return JSONResponse(response, headers={"x-model-used": done.model})

    async def _stored_context(self, request: Request, ref) -> tuple[list[dict], bool]:
        """(the items the request follows: those of the stored response `previous_response_id` names, or of
        the `conversation`; whether to store this one): `store` true unless asked otherwise, where the key's
        tenant keeps conversations."""
        key = api_key(request)
        history = []
        if ref.previous is not None:
            history = (await self.stored.get(key, "response", ref.previous, "previous_response_id"))["items"]
        elif ref.conversation is not None:
            history = (await self.stored.get(key, "conversation", ref.conversation, "conversation"))["items"]
        if ref.store is False:
            return history, False
        allowed = self.stored.writable and (await self.identity(request))[0].stores_conversations
        if ref.store and not allowed:
            raise invalid("store", "this key's tenant keeps no conversations (sessions: false)" if self.stored.writable
                          else NOT_WRITABLE)
        return history, allowed

    async def _keep_response(self, key: str | None, parsed, response: dict) -> None:
        """A finished response into the gateway's store, and its input and output into its conversation,
        before the client sees its end (so a next request finds them at once). A store that fails (over the
        tenant's max_bytes, a store that does not answer) leaves the answer as it is but for its `store`,
        false when the response cannot be named later, and is counted in
        llm_front_errors_total{route="/v1/responses",kind="store_<error kind>"}."""
        keeps = []
        if parsed.store:
            keeps.append(("response", lambda: self.stored.put(key, "response", response["id"],
                                                              parsed.stored(response))))
        if parsed.conversation is not None:  # added in the gateway: another response's items stay too
            keeps.append(("conversation", lambda: self.stored.append(key, "conversation", parsed.conversation,
                                                                     parsed.input_items + response["output"])))
        for kind, keep in keeps:
            try:
                await keep()
            except ServingError as e:
                if kind == "response":
                    response["store"] = False
                self.metrics.errors.labels("/v1/responses", f"store_{e.kind}").inc()
                log.warning("response %s not kept in its %s: %s", response["id"], kind, e.message)

    async def stored_response(self, request: Request) -> Response:
        """GET: a stored response of the caller's tenant; DELETE: forget it (another tenant's id: 404)."""
        async def handler(request, _start):
            response_id, key = request.path_params["response_id"], api_key(request)
            for name in request.query_params:  # stream / starting_after (a background response's events), include
                raise invalid(name, "is not supported: a stored response is answered whole")
            if request.method == "GET":
                return JSONResponse((await self.stored.get(key, "response", response_id))["response"])
            await self.stored.delete(key, "response", response_id)
            return JSONResponse({"id": response_id, "object": "response", "deleted": True})
        return await self._guarded("/v1/responses/{id}", request, handler)

    async def response_input_items(self, request: Request) -> Response:
        async def handler(request, _start):
            stored = await self.stored.get(api_key(request), "response", request.path_params["response_id"])
            return JSONResponse(input_items_page(stored["input"], request.query_params))
        return await self._guarded("/v1/responses/{id}/input_items", request, handler)

    # -- the Conversations API (front/conversations_api.py), kept by the gateway ------------------------
    async def conversations(self, request: Request) -> Response:
        """POST /v1/conversations: a new conversation (its first items, metadata)."""
        async def handler(request, _start):
            stored = new_conversation(await self._body(request))
            conversation = stored["conversation"]
            await self.stored.put(api_key(request), "conversation", conversation["id"], stored)
            return JSONResponse(conversation)
        return await self._guarded("/v1/conversations", request, handler)

    async def conversation(self, request: Request) -> Response:
        """GET: the conversation object; POST: new metadata; DELETE: forget it and its items."""
        async def handler(request, _start):
            conversation_id, key = request.path_params["conversation_id"], api_key(request)
            if request.method == "DELETE":
                await self.stored.delete(key, "conversation", conversation_id)
                return JSONResponse({"id": conversation_id, "object": "conversation.deleted", "deleted": True})
            if request.method == "POST":
                body = await self._body(request)
                stored = await self.stored.change(key, "conversation", conversation_id,
                                                  lambda read: with_metadata(read, body))
            else:
                stored = await self.stored.get(key, "conversation", conversation_id)
            return JSONResponse(stored["conversation"])
        return await self._guarded("/v1/conversations/{id}", request, handler)

    async def conversation_items(self, request: Request) -> Response:
        """GET: a page of the items; POST: add items (the list of those added)."""
        async def handler(request, _start):
            conversation_id, key = request.path_params["conversation_id"], api_key(request)
            if request.method == "GET":
                stored = await self.stored.get(key, "conversation", conversation_id)
                return JSONResponse(input_items_page(stored["items"], request.query_params))
            added = added_items(await self._body(request))
            await self.stored.append(key, "conversation", conversation_id, added)
            return JSONResponse(items_list(added))
        return await self._guarded("/v1/conversations/{id}/items", request, handler)

    async def conversation_item(self, request: Request) -> Response:
        """GET: one item; DELETE: remove it (the conversation object)."""
        async def handler(request, _start):
            conversation_id, key = request.path_params["conversation_id"], api_key(request)
            item_id = request.path_params["item_id"]
            if request.method == "GET":
                stored = await self.stored.get(key, "conversation", conversation_id)
                return JSONResponse(conversation_item(stored, item_id))
            stored = await self.stored.change(key, "conversation", conversation_id,
                                              lambda read: without_item(read, item_id))
            return JSONResponse(stored["conversation"])
        return await self._guarded("/v1/conversations/{id}/items/{item_id}", request, handler)

    async def _response_events(self, route, parsed, key: str | None, first: Piece, pieces, model: str, start: float,
                               builder: ResponsesBuilder):
        call = parsed.call
        events, deltas = ResponsesEvents(builder, model), _Deltas(call)
        try:
            for e in events.start():
                yield sse_event(e)
            piece, last, sent = first, first, False
            pending = []  # log probs of tokens whose text has not gone out yet (a stop string may hold it)
            while True:
                pending += piece.logprobs or []
                for d in deltas.push(piece):
                    if not sent:
                        self.metrics.ttft.labels(route).observe(time.monotonic() - start)
                        sent = True
                    logprobs, pending = (pending, []) if d.get("content") else (None, pending)
                    for e in events.delta(d, logprobs):
                        yield sse_event(e)
                last = piece
                if piece.final:
                    break
                piece = await pieces.__anext__()
            ending = events.finish(deltas.completion(last))
            await self._keep_response(key, parsed, ending[-1]["response"])
            for e in ending:
                yield sse_event(e)
        except ServingError as e:
            self.metrics.errors.labels(route, e.kind).inc()
            body = error_body(e)["error"]
            yield sse_event(builder.event("error", code=body["code"], message=body["message"], param=body["param"]))

    async def _collect(self, call: GatewayCall, first: Piece, pieces) -> Completion:
        return await _collect(call, first, pieces)

    async def _sse(self, route, call: GatewayCall, first: Piece, pieces, model: str, start: float, chat: bool,
                   text_sink: "_SseText | None" = None):
        out = ResponseBuilder(chat)
        choices, last, timed = Choices(call), first, False
        usage = call.include_usage
        calls: dict[int, ToolCallStream] = {}  # per choice, when tools are offered
        sent = 0  # text events through `send` (the metric beside text_sink.events)

        def deltas(state, text, final):
            """A choice's new text as chat deltas: content, or tool-call deltas when tools are offered."""
            if call.tool_plan is None:
                return [{"content": text}] if text else []
            stream = calls.setdefault(state.index, ToolCallStream(call.tool_plan))
            return stream.push(text) + (stream.finish() if final else [])

        def chunks(state, text, logprobs, final=False):
            nonlocal sent
            offset = state.sent
            if not state.started:  # a choice's first chunk: the role (chat), the echoed prompt (completions)
                echo = choices.echo_text()
                text, offset = echo + text, 0
                if call.echo and call.logprobs is not None:
                    logprobs = choices.echo_logprobs() + (logprobs or [])
            state.sent += len(text)
            if text and state.started and logprobs is None and (not chat or call.tool_plan is None):
                sent += 1
                yield out.text_event(model, text, state.index, usage)  # the per-token case, pre-encoded
                return
            parts = deltas(state, text, final) if chat else ([{"content": text}] if text else [])
            if not parts and (not state.started or logprobs):
                parts = [{}]  # the first chunk names the role even before any text; log probs travel too
            for delta in parts:
                yield sse(out.chunk(model, delta.get("content"), first=not state.started, include_usage=usage,
                                    index=state.index, logprobs=logprobs if call.logprobs is not None else None,
                                    text_offset=offset, delta=delta if "tool_calls" in delta else None))
                state.started, logprobs = True, ([] if call.logprobs is not None else None)

        try:
            piece, last = first, first
            while True:
                state, text = choices.push(piece)
                if text and not timed:
                    timed = True
                    self.metrics.ttft.labels(route).observe(time.monotonic() - start)
                for body in chunks(state, text, piece.logprobs):
                    yield body
                last = piece
                if piece.final:
                    break
                if text_sink is not None and text_sink.state is None and state.started:
                    text_sink.bind(choices, state, out.text_event_parts(model, state.index, usage))
                piece = await pieces.__anext__()
            # the stream's last events in one body: one write and one wake-up of the client, not one each
            tail = [body for state, text in choices.flush() for body in chunks(state, text, None, final=True)]
            done = choices.completion(last, made_calls={i for i, s in calls.items() if s.made_calls})
            tail += [sse(out.chunk(done.model, None, c.finish_reason, include_usage=usage, index=c.index))
                     for c in done.choices]
            if usage:
                tail.append(sse(out.usage_chunk(done)))
            tail.append(sse(b"[DONE]"))
            yield b"".join(tail)
        except ServingError as e:
            self.metrics.errors.labels(route, e.kind).inc()
            yield sse(error_body(e))
            yield sse(b"[DONE]")
        finally:
            if sent:
                self.metrics.sse_text_events.labels(route, "send").inc(sent)
            if text_sink is not None and text_sink.events:
                self.metrics.sse_text_events.labels(route, "direct").inc(text_sink.events)

    # -- tokens and models ------------------------------------------------------------------------
    async def tokenize(self, request: Request) -> Response:
        async def handler(request, _start):
            call = parse_tokenize(await self._body(request))
            piece = await self.gateway.call(call, api_key(request), "tokenize")
            ids = piece.token_ids or []
            return JSONResponse({"tokens": ids, "count": len(ids)})
        return await self._guarded("/v1/tokenize", request, handler)

    async def detokenize(self, request: Request) -> Response:
        async def handler(request, _start):
            ids = parse_token_ids(await self._body(request))
            piece = await self.gateway.call(GatewayCall(), api_key(request), "detokenize", ids)
            return JSONResponse({"prompt": piece.text})
        return await self._guarded("/v1/detokenize", request, handler)

    async def _models(self, request: Request) -> list[dict]:
        created = int(time.time())
        # a LoRA adapter names its base model as `parent`, as vLLM lists them; its id works as a model name;
        # `owned_by`: "local" (an engine model) or the upstream provider's name
        return [{"id": m.id, "object": "model", "created": created, "owned_by": m.owned_by or "tenant-gateway",
                 "max_model_len": m.max_context_tokens, **({"parent": m.parent} if m.parent else {})}
                for m in await self.gateway.models(api_key(request))]

    async def list_models(self, request: Request) -> Response:
        async def handler(request, _start):
            return JSONResponse({"object": "list", "data": await self._models(request)})
        return await self._guarded("/v1/models", request, handler)

    async def get_model(self, request: Request) -> Response:
        async def handler(request, _start):
            wanted = request.path_params["model_id"]
            for m in await self._models(request):
                if m["id"] == wanted:
                    return JSONResponse(m)
            raise ServingError("not_found", f"model {wanted!r} does not exist or this key may not use it",
                               field="model")
        return await self._guarded("/v1/models/{id}", request, handler)

    # -- chat sessions (gateway/sessions.py): the caller's own only ---------------------------------
    async def session(self, request: Request) -> Response:
        """GET: the stored conversation; DELETE: forget it. Another tenant's id is a 404, as an unknown one."""
        async def handler(request, _start):
            operation = "session_get" if request.method == "GET" else "session_delete"
            call = GatewayCall(session_id=request.path_params["session_id"])
            answer = json.loads((await self.gateway.call(call, api_key(request), operation)).text or "{}")
            if operation == "session_get":
                return JSONResponse({"id": answer["id"], "object": "chat.session", "messages": answer["messages"]})
            return JSONResponse({"id": answer["id"], "object": "chat.session.deleted", "deleted": True})
        return await self._guarded("/v1/sessions/{id}", request, handler)

    # -- usage, files and batches (front/ledger_api.py) ------------------------------------------------
    def _ledger(self, route: str, handler):
        async def endpoint(request: Request) -> Response:
            return await self._guarded(route, request, handler)
        return endpoint

    def _ledger_routes(self) -> list:
        """Only when the ledger is configured (--data-dir); otherwise these paths are unknown routes (404)."""
        if self.ledger is None:
            return []
        r = self.ledger_routes
        return [
            Route("/v1/usage", self._ledger("/v1/usage", r.usage), methods=["GET"]),
            Route("/v1/files", self._ledger("/v1/files", r.upload_file), methods=["POST"]),
            Route("/v1/files", self._ledger("/v1/files", r.list_files), methods=["GET"]),
            Route("/v1/files/{file_id}", self._ledger("/v1/files/{id}", r.get_file), methods=["GET"]),
            Route("/v1/files/{file_id}/content", self._ledger("/v1/files/{id}/content", r.file_content),
                  methods=["GET"]),
            Route("/v1/batches", self._ledger("/v1/batches", r.create_batch), methods=["POST"]),
            Route("/v1/batches", self._ledger("/v1/batches", r.list_batches), methods=["GET"]),
            Route("/v1/batches/{batch_id}", self._ledger("/v1/batches/{id}", r.get_batch), methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", self._ledger("/v1/batches/{id}/cancel", r.cancel_batch),
                  methods=["POST"]),
        ]

    # -- health -----------------------------------------------------------------------------------
    async def live(self, _request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(self, _request: Request) -> Response:
        if is_draining(self.settings.drain_dir):  # before anything else: the replica is leaving
            return JSONResponse({"status": "draining"}, status_code=503)
        ok = await self.gateway.ready()
        return JSONResponse({"status": "ready" if ok else "unavailable"}, status_code=200 if ok else 503)

    def app(self) -> "BodyLimit":
        async def not_found(request, _exc):
            return error_response(ServingError("not_found", f"no route {request.method} {request.url.path}"))

        async def method_not_allowed(request, _exc):
            return JSONResponse({"error": {"message": f"{request.method} is not allowed on {request.url.path}",
                                           "type": "invalid_request_error", "param": None, "code": None}},
                                status_code=405)

        return BodyLimit(Starlette(routes=[
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/responses/{response_id}", self.stored_response, methods=["GET", "DELETE"]),
            Route("/v1/responses/{response_id}/input_items", self.response_input_items, methods=["GET"]),
            Route("/v1/conversations", self.conversations, methods=["POST"]),
            Route("/v1/conversations/{conversation_id}", self.conversation, methods=["GET", "POST", "DELETE"]),
            Route("/v1/conversations/{conversation_id}/items", self.conversation_items, methods=["GET", "POST"]),
            Route("/v1/conversations/{conversation_id}/items/{item_id}", self.conversation_item,
                  methods=["GET", "DELETE"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.get_model, methods=["GET"]),
            Route("/v1/tokenize", self.tokenize, methods=["POST"]),
            Route("/v1/detokenize", self.detokenize, methods=["POST"]),
            Route("/v1/sessions/{session_id}", self.session, methods=["GET", "DELETE"]),
            *self._ledger_routes(),
            Route("/health", self.live, methods=["GET"]),
            Route("/health/ready", self.ready, methods=["GET"]),
        ], exception_handlers={404: not_found, 405: method_not_allowed}, lifespan=self._lifespan), self._body_limit)

    def _body_limit(self, path: str) -> int:
        if path == "/v1/files" and self.ledger is not None:
            return self.ledger.settings.batch.max_file_bytes + 64 * 1024  # the multipart around the file
        return self.settings.max_body_bytes

    @contextlib.asynccontextmanager
    async def _lifespan(self, _app):
        if self.ledger is not None:
            await self.ledger.start()
        try:
            yield
        finally:
            if self.ledger is not None:
                await self.ledger.stop()
            if self.direct is not None:
                await self.direct.close()  # its upstream providers' connections (front/providers.py)
            await self.gateway.close()


async def _collect(call: GatewayCall, first: Piece, pieces) -> Completion:
    choices, last = Choices(call), first
    choices.push(first)
    if not first.final:
        async for last in pieces:
            choices.push(last)
    choices.flush()
    return choices.completion(last)


async def collect(call: GatewayCall, pieces) -> Completion:
    """A whole (non-streamed) completion from the gateway's pieces (the batch worker's path)."""
    return await _collect(call, await pieces.__anext__(), pieces)


class _Deltas:
    """One answer's text in (stop strings cut, tool calls found), chat deltas out: `{"content"}` or
    `{"tool_calls"}` (front/tool_calls.py ToolCallStream); `completion` once the last piece is in. The
    Responses API's stream: one choice (front/choices.py)."""

    def __init__(self, call: GatewayCall):
        self.choices = Choices(call)
        self.calls = ToolCallStream(call.tool_plan) if call.tool_plan is not None else None

    def push(self, piece: Piece) -> list[dict]:
        _, text = self.choices.push(piece)
        if piece.final:
            text += "".join(t for _, t in self.choices.flush())
        if self.calls is None:
            return [{"content": text}] if text else []
        return self.calls.push(text) + (self.calls.finish() if piece.final else [])

    def completion(self, last: Piece) -> Completion:
        return self.choices.completion(last, made_calls={0} if self.calls is not None and self.calls.made_calls else ())


async def _first_piece(call: GatewayCall, pieces) -> Piece:
    """The first piece; an error about the engine's guide names the OpenAI field that made it."""
    try:
        return await pieces.__anext__()
    except ServingError as e:
        if call.guide is not None and e.field in ("guided_decoding_guide", "guided_decoding_guide_type"):
            e.field = call.guide.param
            e.message = f"{call.guide.param}: {e.message}"
        raise
