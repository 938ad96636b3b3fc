"""The token stream without the gateway in it: the front streams token ids from the engine model itself
and detokenizes them, as vLLM's and TensorRT-LLM's own servers do; the gateway stays the policy engine.

Per request: `admit` (the gateway's lease operation: auth, quotas, tokenize, route, rate-limit reservation,
engine slot; gateway/core.py Leases; several in one request when they queue, front/grouped_admits.py) -> one stream to the engine model the lease names, with the inputs
and cache salt the lease carries (Triton's HTTP generate_stream, front/engine_http.py, or a gRPC stream:
`--engine-protocol`) -> incremental detokenizing here -> `settle` with the tokens
received and how the stream ended (success, cancelled, error), which refunds, frees the slot and records
usage exactly as a stream through the gateway does. Policy costs one round trip at each end of a request;
each token crosses one Python process fewer (measured: benchmarks/results/capacity*.json).

The gateway must never wait on a stream it does not see, so the front keeps its leases alive (`renew`,
every ttl/3, all at once) and a lease whose front died expires there. A stream whose engine process died
never ends by itself (Triton 2.51 leaves a gRPC or HTTP stream to a dead Python stub open, even after the
model is reloaded): a watchdog asks the gateway (`engine_check`) about every stream silent for `check_after_s`
and fails it `unavailable` if the engine it started on is gone. An empty final response ends a stream as
a success only if the engine is alive, as in the gateway.

A request with a LoRA adapter streams here with its `lora_task_id` while the engine holds the adapter. Only
the gateway's own stream sends an adapter's weights (TensorRT-LLM takes them with a request: its first use,
or after its LoRA cache evicted them), so the front hands such a lease back and relays the gateway's stream
(`lease: {"resume": id}`, gateway/core.py Leases.resumed): at once when the grant says `hand_back`, or when
the engine answers "not found in cache" before a token. The batch worker's lines take leases as a client's
requests do, with its key and their own gateway parameters (on_behalf_of, tier, batch_id).
"""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

import orjson
import tritonclient.grpc as grpcclient

from contracts.tensors import ENGINE
from contracts.grpc_inputs import grpc_input
from contracts.errors import LORA_NOT_CACHED, ServingError
from contracts.generation import STOP_REQUEST, EngineStep, GeneratedCounts
from contracts.logprobs import generated_logprobs, prompt_logprobs
from text.detokenize import Detokenizer, IncrementalDetokenizer
from front.engine_http import EngineHttpClient, HttpEngineStream, StreamCancelled, body_fields, engine_body
from front.gateway_client import (STOP_SEND_S, GatewayClient, Piece, ReadAheadCall, call_parameters, end_abandoned,
                                  gateway_values, is_final, stop_parameters, to_serving_error)
from front.grouped_admits import GroupedAdmits
from front.grouped_settles import GroupedSettles
from front.lease_socket import LeaseSocketClient
from front.openai_schema import GatewayCall
from front.prompt_prep import PromptPreparer
from front.providers import UpstreamPath

LEASE_CALL = GatewayCall()  # the lease operations carry their data in the `lease` parameter


def _engine_error(err: ServingError, model: str) -> ServingError:
    """An error of the engine stream. The gateway routed the request to this model, so Triton not knowing
    it ("Request for unknown model: ... has no available versions") means the launcher is loading it
    again (its stub died): unavailable for now, not a model the client named wrongly (404)."""
    if err.kind == "not_found":
        return ServingError("unavailable", f"engine model '{model}' is not available: it is being loaded",
                            retry_after=5.0)
    return err


@dataclass(frozen=True)
class _Admit:
    """One request's admit: its call, its client's key, its stream_id, its lease object and its own gateway
    parameters (a batch line's on_behalf_of, tier and batch_id)."""
    call: GatewayCall
    api_key: str | None
    name: str
    lease: dict
    parameters: dict


def _parameters(call: GatewayCall, api_key: str | None, parameters: dict) -> dict:
    """A gateway operation's request parameters over HTTP: the call's, the operation's, and the client's key
    as `authorization` (HTTP headers do not reach a model there)."""
    out = {**call_parameters(call), **parameters}
    if api_key:
        out["authorization"] = f"Bearer {api_key}"
    return out


class EngineStream(ReadAheadCall):
    """One request's gRPC stream to the engine model, read ahead by a task of its own
    (front/gateway_client.py ReadAheadCall: an abandoned request is ended by the engine's `stop`, never by
    cancelling its call, DirectEngine._stop). `next()` gives (EngineStep or None, final) per response, as
    the HTTP reader does (front/engine_http.py HttpEngineStream)."""

    ends_without_event = False  # the final flag comes with a response (an empty one, or the last outputs)

    def __init__(self, client, request: dict, timeout_s: float):
        super().__init__(client, request, timeout_s)
        self.request_id = request["request_id"]

    async def next(self):
        """The next response as (EngineStep or None, final), or None at the stream's end without a final
        response; raises the stream's error."""
        item = await self.result()
        if item is None:
            return None
        return EngineStep.from_outputs(item.as_numpy), is_final(item)


class TextSink(Protocol):
    """Where a streamed answer's text may go as the engine's read delivers it (front/app.py's SSE body):
    `ready()` while it can take text now (its first chunk out, its client writable), `write(text)` the
    next text, `flush()` at the end of each read of the engine's connection (one client write for what
    that read held)."""

    def ready(self) -> bool: ...

    def write(self, text: str) -> None: ...

    def flush(self) -> None: ...


class _Answer:
    """A lease's answer as the engine's steps arrive: counted (the finish reason's rule), detokenized,
    timed (first text, last token), its text kept when the gateway asked for it (report_text)."""

    __slots__ = ("counts", "detok", "kept", "first_at", "last_at")

    def __init__(self, detokenizer: Detokenizer, max_tokens: int, keep: bool):
        self.counts = GeneratedCounts(max_tokens)
        self.detok = IncrementalDetokenizer(detokenizer)
        self.kept: list[str] | None = [] if keep else None
        self.first_at: float | None = None
        self.last_at: float | None = None

    def add(self, step: EngineStep) -> str:
        """A step in: its new text."""
        ids = step.ids
        self.counts.add(step)
        if not ids:
            return ""
        text = self.detok.push(ids)
        now = self.last_at = time.monotonic()
        if text and self.first_at is None:
            self.first_at = now
        if self.kept is not None:
            self.kept.append(text)
        return text

    def whole(self, tail: str) -> str | None:
        """The whole answer (`tail`: what the detokenizer held at the end), if kept."""
        return "".join(self.kept) + tail if self.kept is not None else None


class _EmptyEnd:
    """The empty-end rule's memory of one engine stream: an end is checked with the gateway (engine_check)
    unless the stream produced tokens and its last response carried outputs. Over gRPC the final flag
    comes with a response, empty or not; over HTTP the stream's end is the body's end, no event
    (`synthetic_end`), so the rule reads the last event (a flags-only final response sends none: a stream
    of no tokens ends that way, and is checked)."""

    __slots__ = ("synthetic_end", "produced", "last_had_output")

    def __init__(self, synthetic_end: bool):
        self.synthetic_end = synthetic_end
        self.produced = self.last_had_output = False

    def saw(self, step: EngineStep | None, final: bool) -> None:
        if step is not None:
            self.last_had_output = True
            self.produced = self.produced or bool(step.ids)
        elif not (final and self.synthetic_end):
            self.last_had_output = False

    def needs_check(self) -> bool:
        return not (self.produced and self.last_had_output)


class _TakeText:
    """An HTTP engine stream's StepSink for from_engine: a step with tokens, once the answer's first text
    is out and while the text sink is ready, goes into the answer and its text into the sink in the
    connection's read, not through a wake-up of the request's task and its generators (the front's cost
    per token: docs/benchmarks.md)."""

    __slots__ = ("answer", "text", "end", "live", "flush", "_lane_type", "_lane")

    def __init__(self, answer: _Answer, text: TextSink, end: _EmptyEnd, live: "_Live", lane_type=None):
        """`lane_type`: front/token_lane.py's compiled Lane, which takes a read's plain steps in one call;
        None: each step through `take`."""
        self.answer, self.text, self.end, self.live = answer, text, end, live
        self.flush = text.flush  # StepSink.flush: the text sink's own
        self._lane_type, self._lane = lane_type, None

    def lane(self):
        """StepSink.lane: the compiled lane while `take` would take this read's steps (the answer's first
        text out, the text sink ready), else None. Built at its first use: the sink's choice is bound by then."""
        if self._lane_type is None or self.answer.first_at is None or not self.text.ready():
            return None
        lane = self._lane
        if lane is None:
            lane = self._lane = self._lane_type(self.answer, self.text, self.end, self.live)
        return lane

    def take(self, step: EngineStep) -> bool:
        if not step.ids or self.answer.first_at is None or not self.text.ready():
            return False
        self.end.saw(step, False)
        text = self.answer.add(step)
        self.live.last = self.answer.last_at
        if text:
            self.text.write(text)
        return True


@dataclass(eq=False)
class _Live:
    lease: str
    model: str
    last: float  # when the stream last heard from the engine
    call: object = None  # the gRPC call, cancelled by the watchdog when its engine is gone
    failed: ServingError | None = None
    checking: bool = field(default=False)
    upstream: bool = False  # an upstream provider's stream: no engine to check
    first_at: float | None = None


class _AdapterNotCached(Exception):
    """The engine answered a lease's first request for its adapter with "not found in cache"."""


class DirectEngine:
    def __init__(self, gateway: GatewayClient, front_key: str, detokenizer: Detokenizer,
                 check_after_s: float = 1.0, upstreams: "UpstreamPath | None" = None, on_stop=None,
                 engine_http: EngineHttpClient | None = None, operations_http: EngineHttpClient | None = None,
                 prepare: PromptPreparer | None = None, on_admits=None, on_lease=None,
                 lease_socket: LeaseSocketClient | None = None, on_channel=None, token_lane=None,
                 on_hand_back=None):
        """`on_stop(how)`: how an abandoned engine stream ended, "stop" or "cancel" (the front's metric).
        `engine_http`: read the engine over Triton's HTTP generate_stream (front/engine_http.py) instead of
        a gRPC stream (`--engine-protocol`); `operations_http`: the gateway's lease operations the same way
        (`_operation`) instead of through `gateway` over gRPC. `prepare`: prompts tokenized here for the
        admit (front/prompt_prep.py); None: by the gateway. `on_admits(n)`: a request with n admits went to
        the gateway (GroupedAdmits, the front's metrics). `on_lease(operation, seconds)`: how long the gateway
        took to answer an admit or a settle (the front's metrics). `lease_socket`: the gateway's socket for
        the lease operations (front/lease_socket.py), used whenever it is open, Triton's HTTP meanwhile;
        `on_channel(channel)`: a request of lease operations went to the gateway on "socket" or "triton".
        `token_lane`: the compiled Lane for an HTTP stream's plain steps (front/token_lane.py); None: Python.
        `on_hand_back()`: a lease was handed back to stream through the gateway (an adapter's weights)."""
        self.gateway, self.front_key, self.detok = gateway, front_key, detokenizer
        self.token_lane = token_lane
        self.prepare = prepare
        self.settles = GroupedSettles(self._send_settles)
        self.engine_http, self.operations_http, self.lease_socket = engine_http, operations_http, lease_socket
        # admits in groups where the operations go over HTTP, whose stream carries a group's several answers
        self.admits = GroupedAdmits(self._send_admit, self._send_admits, self._admit_item, on_sent=on_admits) \
            if operations_http is not None else None
        self.on_admits = on_admits
        self.on_lease = on_lease or (lambda operation, seconds: None)
        self.on_channel = on_channel or (lambda channel: None)
        self.on_hand_back = on_hand_back or (lambda: None)
        self.upstreams = upstreams or UpstreamPath()  # upstream providers' leases (front/providers.py)
        self.check_after_s = check_after_s
        self.live: dict[str, _Live] = {}
        self.on_stop = on_stop
        self.ttl_s = 60.0
        self._watchdog: asyncio.Task | None = None
        self._settling: set[asyncio.Task] = set()

    async def _lease_op(self, operation: str, lease: dict | None = None, call: GatewayCall = LEASE_CALL,
                        api_key: str | None = None, parameters: dict | None = None) -> dict:
        """A lease operation of the gateway (the front key says who asks; only `admit` needs the
        client's key, which the gateway authenticates as on any generate request)."""
        params = {"front_key": self.front_key, **(parameters or {})}
        if lease is not None:
            params["lease"] = orjson.dumps(lease).decode()
        return await self._operation(operation, call, api_key, params)

    async def _send_settles(self, reports: list[dict]) -> list[dict]:
        return (await self._lease_op("settle", {"leases": reports}))["settled"]

    async def _send_admit(self, admit: _Admit) -> dict:
        """One admit alone, as its tensors."""
        lease = admit.lease or None
        return await self._lease_op("admit", lease, call=admit.call, api_key=admit.api_key,
                                    parameters={"stream_id": admit.name, **admit.parameters})

    async def _send_admits(self, items: list[bytes]) -> AsyncIterator[dict]:
        """A group of admits (each serialized by `_admit_item`) as one request; its answers as they come."""
        lease = b'{"admits":[' + b",".join(items) + b"]}"
        async for answer in self._answers("admit", LEASE_CALL, None,
                                          {"front_key": self.front_key, "lease": lease.decode()}):
            yield answer.get("admits") or {}

    @staticmethod
    def _admit_item(admit: _Admit) -> bytes:
        """One admit of a group: what a single admit sends (gateway/request.py grouped_admits reads it)."""
        item = {"inputs": gateway_values(admit.call, "admit"),
                "parameters": _parameters(admit.call, admit.api_key, {"stream_id": admit.name, **admit.parameters})}
        if admit.lease:
            item["lease"] = admit.lease
        return orjson.dumps(item)

    async def _operation(self, operation: str, call: GatewayCall, api_key: str | None, parameters: dict) -> dict:
        """One operation of the gateway, its JSON answer. Where the front reads the engine over HTTP, over
        Triton's HTTP generate_stream too: one request and one event on a kept-alive connection, parsed by
        the engine reader's protocol, against a gRPC stream per operation (grpc.aio's call set-up, writes
        and reads were ~15% of the front's CPU; benchmarks/results/2026-11-27-lease-ops-http.json). The key
        travels as the request's `authorization` parameter (HTTP headers do not reach a model there), which
        the gateway reads as it reads a forwarded header (contracts/api_keys.py)."""
        if self.operations_http is None:
            self.on_channel("triton")
            piece = await self.gateway.call(call, api_key, operation, parameters=parameters)
            return orjson.loads(piece.text)
        answer = None
        async for answer in self._answers(operation, call, api_key, parameters):
            pass
        if answer is None:
            raise ServingError("unavailable", f"the gateway did not answer {operation}", retry_after=1.0)
        return answer

    async def _answers(self, operation: str, call: GatewayCall, api_key: str | None,
                       parameters: dict) -> AsyncIterator[dict]:
        """Each JSON answer of an operation over HTTP (one, or a grouped admit's several): on the gateway's
        lease socket while it is open, else through Triton's generate_stream."""
        values = gateway_values(call, operation)
        fields = body_fields({k: [v] if isinstance(v, list) else [[v]] for k, v in values.items()},
                             _parameters(call, api_key, parameters))
        if self.lease_socket is not None and self.lease_socket.ready():
            self.on_channel("socket")
            op = self.lease_socket.operation(fields)
            while True:
                try:
                    answer, last = await op.next()
                except ServingError as e:
                    raise to_serving_error(e) from None
                yield orjson.loads(answer)
                if last:
                    return
        self.on_channel("triton")
        stream = self.operations_http.stream(self.gateway.model, orjson.dumps({**fields, "id": operation}), operation,
                                             events=True)
        while True:
            try:
                event, final = await stream.next()
            except ServingError as e:
                raise to_serving_error(e) from None  # OpenAI's param names, as over gRPC
            if final:
                return
            text = event.get("text_output")
            if isinstance(text, list):
                text = text[0] if text else None
            if not isinstance(text, str):
                raise ServingError("unavailable", f"the gateway answered {operation} without text_output",
                                   retry_after=1.0)
            yield orjson.loads(text)

    async def stream(self, call: GatewayCall, api_key: str | None, text_sink: TextSink | None = None,
                     parameters: dict | None = None) -> AsyncIterator[Piece]:
        """The request's pieces, as GatewayClient.stream gives them; raises ServingError. `text_sink`: see
        from_engine (a local engine's stream only). `parameters`: the request's own gateway parameters (the
        batch worker's on_behalf_of, tier and batch_id), as GatewayClient.stream takes them."""
        start = time.monotonic()
        grant = await self.admit(call, api_key, parameters=parameters)
        if grant.get("cached"):  # the gateway answered from its response cache: nothing to stream
            hit = grant["cached"]
            yield Piece(text=hit["text"], final=True, model_used=hit["model"], finish_reason=hit["finish_reason"],
                        prompt_tokens=hit["num_input_tokens"], completion_tokens=hit["num_output_tokens"])
            return
        if not grant.get("hand_back"):
            source = self.upstreams.stream(self, grant, call, api_key, start, parameters) if "provider" in grant \
                else self.from_engine(grant, call, start, text_sink)
            try:
                async with contextlib.aclosing(source):  # a client gone closes it now (the upstream's connection too)
                    async for piece in source:
                        yield piece
                return
            except _AdapterNotCached:
                pass
        self.on_hand_back()  # the lease this grant names, not settled here (_check_adapter)
        resume = {**(parameters or {}), "front_key": self.front_key,
                  "lease": orjson.dumps({"resume": grant["lease"]}).decode()}
        async for piece in self.gateway.stream(call, api_key, parameters=resume):
            yield piece

    async def close(self) -> None:
        await self.upstreams.close()
        if self.lease_socket is not None:
            await self.lease_socket.close()
        if self.engine_http is not None:
            await self.engine_http.close()

    def register(self, lease: str, model: str, upstream: bool = False) -> "_Live":
        """A stream in flight: its lease is renewed until it settles (an upstream's is never engine-checked)."""
        live = _Live(lease, model, time.monotonic(), upstream=upstream)
        self.live[lease] = live
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.ensure_future(self._watch())
        return live

    async def admit(self, call: GatewayCall, api_key: str | None, avoid: list[str] | None = None,
                    parameters: dict | None = None) -> dict:
        """The gateway's lease for this request; `avoid`: models that failed it already (a fallback);
        `parameters`: see `stream`.

        The admission is named (`stream_id`), as a stream through the gateway is: a caller that leaves
        while it waits (the gateway's admission queue) sends the gateway's `stop` for it, which takes it out
        of the queue, and a lease granted before the stop arrived is settled at once, cancelled with nothing
        generated. Cancelling the call instead would leave the gateway to grant a lease no one settles: an
        engine slot held, and every reserved token charged, until the lease expired."""
        name = uuid.uuid4().hex
        prep = self.prepare(call, api_key) if self.prepare is not None else None
        lease = {**({"avoid": avoid} if avoid else {}), **({"prep": prep} if prep is not None else {})}
        admit = _Admit(call, api_key, name, lease, parameters or {})
        if self.admits is not None:
            pending = asyncio.ensure_future(self.admits.admit(name, admit))
        else:  # over gRPC: each alone
            pending = asyncio.ensure_future(self._send_admit(admit))
            if self.on_admits is not None:
                self.on_admits(1)
        asked = time.monotonic()
        try:
            grant = await asyncio.shield(pending)
        except (GeneratorExit, asyncio.CancelledError):
            self._background(self._abandon_admission(pending, api_key, name, admit.parameters))
            raise
        except ServingError as e:
            self.on_lease("admit", time.monotonic() - asked)
            if self.prepare is not None:
                self.prepare.refused(api_key)
            raise to_serving_error(e) from None  # a grouped admit's error names the gateway's fields
        self.on_lease("admit", time.monotonic() - asked)
        if self.prepare is not None and grant.get("lease"):
            self.prepare.granted(api_key)
        if prep is not None and "inputs" in grant:  # the gateway does not send back the ids it was given
            grant["inputs"].setdefault("input_ids", prep["INPUT_ID"])
        return grant

    async def _abandon_admission(self, pending: asyncio.Future, api_key: str | None, name: str,
                                 parameters: dict) -> None:
        if self.admits is not None and self.admits.withdraw(name):
            return  # still in the front's queue: the gateway never heard of it
        with contextlib.suppress(Exception):  # not sent: the grant, if any, is settled below all the same
            await asyncio.wait_for(self._operation("stop", GatewayCall(), api_key, stop_parameters(name, parameters)),
                                   STOP_SEND_S)
        try:
            grant = await pending
        except Exception:  # noqa: BLE001 - stopped, or refused: nothing is held
            return
        if grant.get("lease"):  # granted before the stop reached it
            with contextlib.suppress(ServingError):  # expired meanwhile: the gateway settled it
                await self.settles.settle({"id": grant["lease"], "num_output_tokens": 0, "outcome": "cancelled"})

    async def from_engine(self, grant: dict, call: GatewayCall, start: float,
                          text_sink: TextSink | None = None) -> AsyncIterator[Piece]:
        """The pieces of a lease on a local engine model. `text_sink`: where the answer's text may go
        straight from the engine's read once its first piece is out (the SSE body's fast lane, see
        TextSink); what it does not take comes as pieces."""
        lease, model = grant["lease"], grant["model"]
        self.ttl_s = float(grant.get("ttl_s") or self.ttl_s)
        live = self.register(lease, model)
        # what the gateway asked the engine for; the whole answer kept for the gateway's cache / session
        answer = _Answer(self.detok, grant["max_tokens"], keep=bool(grant.get("report_text")))
        outcome, error_kind = "error", "internal"
        try:
            if call.token_level:
                async for piece in self._token_pieces(call, grant, live, start, answer.counts):
                    yield piece
                outcome = "success"
                return
            async for step, final in self._engine(grant, live, call, answer, text_sink):
                had_text = answer.first_at is not None
                text = answer.add(step) if step is not None else ""
                if final:
                    outcome, n_out, reason = "success", answer.counts.total, answer.counts.finish_reason()
                    first_at, last_at = answer.first_at, answer.last_at
                    itl = (last_at - first_at) / (n_out - 1) if first_at is not None and n_out > 1 else None
                    tail = answer.detok.finish()
                    await self._settle(live, n_out, outcome, first_at, start, itl_s=itl, text=answer.whole(tail),
                                       finish_reason=reason)
                    yield Piece(text=text + tail, final=True, model_used=model, finish_reason=reason,
                                prompt_tokens=grant["num_input_tokens"], completion_tokens=n_out)
                    return
                if text:
                    yield Piece(text=text, final=False, model_used=None if had_text else model)
            raise ServingError("unavailable", "the engine closed the stream before the end of the request")
        except ServingError as e:
            error_kind = e.kind
            self._check_adapter(e, grant, live, answer.counts)
            raise
        except (GeneratorExit, asyncio.CancelledError):
            outcome = "cancelled"
            raise
        finally:
            if outcome != "success":  # not awaited here: a closing generator must not block its caller
                first_at = live.first_at if call.token_level else answer.first_at  # per-token answers: timed by step
                self.settle_later(live, answer.counts.total, outcome, first_at, start, error_kind)

    def _check_adapter(self, e: ServingError, grant: dict, live: _Live, counts: GeneratedCounts) -> None:
        """Raises _AdapterNotCached when the engine does not hold the lease's adapter and nothing was
        generated: the lease is then not settled here but handed back to the gateway (see `stream`)."""
        # (an adapter's lease is never an upstream's, so the grant that named the engine is `stream`'s own)
        if "lora_task_id" in grant["inputs"] and counts.total == 0 and LORA_NOT_CACHED in e.message:
            self.live.pop(live.lease, None)  # its settle is the gateway's stream's now
            raise _AdapterNotCached(e.message) from None

    def settle_later(self, live: _Live, n_out: int, outcome: str, first_at, start, error_kind: str = "",
                     extra: dict | None = None) -> None:
        report = self._report(live, n_out, outcome, first_at, start, error_kind, extra=extra)
        if report is not None:
            self._background(self._settle_report(report))

    async def _token_pieces(self, call: GatewayCall, grant: dict, live: _Live, start: float,
                            counts: GeneratedCounts):
        """A token-level request's pieces (n > 1, log probs, echo): one per engine response, naming its
        choice, with its text (detokenized per choice) and its tokens' log probs; each choice's end names
        why it ended."""
        model, k = grant["model"], call.logprobs or 0
        temperature = call.sampling.get("temperature")
        detoks: dict[int, IncrementalDetokenizer] = {}
        prompt_ids = grant["inputs"]["input_ids"][0][:grant["num_input_tokens"]]
        last_at = None
        async for step, final in self._engine(grant, live, call):
            now = time.monotonic()
            if step is not None:
                i = step.sequence_index
                counts.add(step)
                text = detoks.setdefault(i, IncrementalDetokenizer(self.detok)).push(step.ids)
                if step.ids:
                    live.first_at = live.first_at or now
                    last_at = now
                piece = Piece(text=text, final=False, model_used=model, index=i, token_ids=step.ids)
                if call.logprobs is not None and step.ids:
                    piece.logprobs = generated_logprobs(step.ids, step.log_probs, step.generation_logits,
                                                        temperature, k, self.detok.token_bytes)
                if step.context_logits is not None and call.echo_logprobs:
                    piece.prompt_logprobs = prompt_logprobs(prompt_ids, step.context_logits, temperature, k,
                                                            self.detok.token_bytes)
                yield piece
            if final:
                for i in range(call.n):  # each choice's end: what its detokenizer held, and why it ended
                    yield Piece(text=detoks[i].finish() if i in detoks else "", final=False, index=i, token_ids=[],
                                finish_reason=counts.finish_reason(i))
                n, first_at, reason = counts.total, live.first_at, counts.finish_reason()
                itl = (last_at - first_at) / (n - 1) if first_at is not None and n > 1 else None
                await self._settle(live, n, "success", first_at, start, itl_s=itl, finish_reason=reason)
                yield Piece(text="", final=True, model_used=model, finish_reason=reason,
                            prompt_tokens=grant["num_input_tokens"], completion_tokens=n, token_ids=[])
                return
        raise ServingError("unavailable", "the engine closed the stream before the end of the request")

    async def _settle(self, live: _Live, n_out: int, outcome: str, first_at, start, error_kind: str = "",
                      itl_s: float | None = None, text: str | None = None, extra: dict | None = None,
                      finish_reason: str | None = None) -> dict:
        """`extra`: an upstream lease's report (its usage, failed tries: front/providers.py)."""
        report = self._report(live, n_out, outcome, first_at, start, error_kind, itl_s, text, extra, finish_reason)
        return {} if report is None else await self._settle_report(report)

    def _report(self, live: _Live, n_out: int, outcome: str, first_at, start, error_kind: str = "",
                itl_s: float | None = None, text: str | None = None, extra: dict | None = None,
                finish_reason: str | None = None) -> dict | None:
        """The lease's settle report, None if it was settled already: a lease is settled once, by its first
        settle (a later one is the caller's close after the final piece, which the generators see as a cancel)."""
        if self.live.pop(live.lease, None) is None:
            return None
        report = {"id": live.lease, "num_output_tokens": n_out, "outcome": outcome, "error_kind": error_kind,
                  **(extra or {})}
        if text is not None:  # the gateway asked for the answer (report_text): its response cache or session
            report["text"] = text
        if finish_reason is not None:
            report["finish_reason"] = finish_reason
        if first_at is not None:
            report["ttft_s"] = first_at - start
        # the request's time as its client saw it, from the same start as ttft_s: the ledger records both so
        # (the gateway's own clock starts at the admit, after the front read and tokenized the request)
        report["latency_s"] = time.monotonic() - start
        if itl_s is not None:
            report["itl_s"] = itl_s
        return report

    async def _settle_report(self, report: dict) -> dict:
        asked = time.monotonic()
        try:
            answer = await self.settles.settle(report)
        except ServingError:
            answer = {}  # the lease expired meanwhile: the gateway settled it already
        self.on_lease("settle", time.monotonic() - asked)
        return answer

    def _open(self, grant: dict, live: _Live, call: GatewayCall):
        """The request's stream to the engine: over HTTP generate_stream (HttpEngineStream) or gRPC
        (EngineStream), each read apart from its caller."""
        if self.engine_http is not None:
            inputs = grant["inputs"]
            body = engine_body(inputs, live.lease, {"cache_salt": grant["cache_salt"]})
            prompt_len = inputs["input_lengths"][0][0] if "input_lengths" in inputs else grant["num_input_tokens"]
            return self.engine_http.stream(grant["model"], body, live.lease, prompt_len)
        inputs = [grpc_input(ENGINE, name, value) for name, value in grant["inputs"].items()]
        request = {"model_name": grant["model"], "inputs": inputs, "request_id": live.lease,
                   "outputs": [grpcclient.InferRequestedOutput(name) for name in call.outputs().output_names()],
                   "parameters": {"triton_enable_empty_final_response": True, "cache_salt": grant["cache_salt"]}}
        return EngineStream(self.gateway.client, request, self.gateway.timeout_s)

    async def _engine(self, grant: dict, live: _Live, call: GatewayCall, answer: "_Answer | None" = None,
                      text_sink: TextSink | None = None):
        """(EngineStep or None, is final) per engine response. The stream is read apart from its caller
        (EngineStream's task, HttpEngineStream's connection), so a caller that goes away ends the request
        with the engine's `stop`, not by cancelling the call (see EngineStream).

        With `answer` and `text_sink`, an HTTP stream's steps after the first text go into the answer and
        their text into the sink in the connection's read, while the sink is ready and this generator waits
        (_TakeText); the rest come from here, in order.

        The empty-end rule: the engine's own last response carries outputs, so an end without output (what
        Triton sends a stream whose stub died) is a success only if the engine lives (_EmptyEnd)."""
        stream = self._open(grant, live, call)
        live.call = stream
        end = _EmptyEnd(stream.ends_without_event)
        sunk = text_sink is not None and answer is not None and isinstance(stream, HttpEngineStream)
        if sunk:
            stream.sink = _TakeText(answer, text_sink, end, live, self.token_lane)
        try:
            while True:
                try:
                    item = await stream.next()
                except ServingError as e:  # the HTTP reader's error, as the contract: the same mapping as gRPC's
                    raise _engine_error(to_serving_error(e), grant["model"]) from None
                live.last = time.monotonic()
                if item is None:
                    return  # the stream ended without a final response: the caller says so
                step, final = item
                end.saw(step, final)
                if final and end.needs_check():
                    # an empty end (what Triton sends when a stub dies) is a success only if the engine lives
                    await self._lease_op("engine_check", {"id": live.lease})
                yield step, final
                if final:
                    return
        except StreamCancelled:
            if live.failed is not None:  # the watchdog cancelled the call: its engine is gone
                raise live.failed from None
            raise ServingError("unavailable", "the engine stream was cancelled") from None
        except ServingError:
            raise
        except Exception as e:
            if live.failed is not None:
                raise live.failed from None
            raise _engine_error(to_serving_error(e), grant["model"]) from None
        finally:
            if sunk:
                stream.sink = None  # nothing more goes straight to a caller that has left
            if not stream.ended:  # abandoned mid-stream; not awaited: a closing generator must not block its caller
                self._background(self._stop(grant["model"], stream))

    async def _stop(self, model: str, stream: "EngineStream") -> None:
        """End an abandoned request with the engine's `stop` and read its stream to the end (cancelled only
        if the stop could not be sent or the stream has not ended within DRAIN_MAX_S). A stop ends the
        stream within an engine step; where Triton hands it to an instance that does not run the request
        (the simulated engine's instances share nothing), the stream runs to its own end meanwhile."""
        await end_abandoned(stream, lambda: self._send_stop(model, stream.request_id), self.on_stop)

    async def _send_stop(self, model: str, request_id: str) -> bool:
        if self.engine_http is not None:
            stop = self.engine_http.stream(model, engine_body(STOP_REQUEST, request_id, {}), request_id)
        else:
            inputs = [grpc_input(ENGINE, name, value) for name, value in STOP_REQUEST.items()]
            request = {"model_name": model, "inputs": inputs, "request_id": request_id, "outputs": [],
                       "parameters": {"triton_enable_empty_final_response": True}}
            stop = EngineStream(self.gateway.client, request, self.gateway.timeout_s)
        try:
            while (item := await stop.next()) is not None and not item[1]:
                pass
        finally:
            if not stop.ended:
                stop.cancel()
        return True  # the engine runs the request or ignores the stop: drain either way

    def _background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _watch(self) -> None:
        """While streams are live: renew every lease each ttl/3, and check the engine of each stream that
        has been silent for check_after_s (one check at a time per stream)."""
        renewed = time.monotonic()
        while self.live:
            await asyncio.sleep(min(self.check_after_s / 2, self.ttl_s / 6))
            now = time.monotonic()
            if now - renewed >= self.ttl_s / 3:
                renewed = now
                try:
                    await self._lease_op("renew", {"ids": list(self.live)})
                except Exception:  # noqa: BLE001 - the next round tries again
                    pass
            for live in list(self.live.values()):
                if not live.checking and not live.upstream and live.failed is None \
                        and now - live.last >= self.check_after_s:
                    live.checking = True
                    asyncio.ensure_future(self._check(live))

    async def _check(self, live: _Live) -> None:
        try:
            await self._lease_op("engine_check", {"id": live.lease})
        except ServingError as e:
            if e.kind == "unavailable" and live.call is not None:
                live.failed = e
                live.call.cancel()
        except Exception:  # noqa: BLE001 - checked again after the next silence
            pass
        finally:
            live.checking = False
            live.last = max(live.last, time.monotonic() - self.check_after_s / 2)
