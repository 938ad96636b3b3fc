"""The front's only way in: the `gateway` model over tritonclient's asyncio gRPC client.

One client (one gRPC channel) for the process, one bidirectional stream per request. The caller's key
travels as the `authorization` header, which tritonserver forwards to the gateway as a request
parameter; the gateway alone decides who the caller is. Abandoning a stream (client gone, stop string
seen) cancels the gRPC call, which the gateway turns into an engine `stop`.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from contracts.tensors import GATEWAY
from contracts.grpc_inputs import grpc_input
from contracts.errors import ServingError, from_transport, parse
from contracts.logprobs import TokenLogprob
from front.engine_http import StreamCancelled
from front.openai_schema import GatewayCall

# gateway input names -> OpenAI parameter names, for the `param` of an error
OPENAI_PARAM = {"text_input": "prompt", "stop_words": "stop", "top_k": "top_k", "max_tokens": "max_tokens",
                "token_ids": "tokens", "prompt_ids": "prompt", "num_return_sequences": "n", "embedding_bias": "logit_bias",
                "echo_logprobs": "echo"}


@dataclass
class Piece:
    text: str
    final: bool
    model_used: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    token_ids: list | None = None  # tokenize's answer; a token-level request's generated ids
    index: int = 0  # the choice (sequence) a token-level piece belongs to
    logprobs: list[TokenLogprob] | None = None  # its generated tokens' log probs, when asked
    prompt_logprobs: list[TokenLogprob] | None = None  # the prompt's (echo), once


@dataclass(frozen=True)
class Identity:
    """The caller as the gateway's `whoami` answers: its tenant, tier, the prompt bound of its tier, and
    whether its tenant keeps conversations (sessions, stored responses)."""
    tenant: str
    tier: str
    max_prompt_bytes: int
    stores_conversations: bool = False


@dataclass(frozen=True)
class ListedModel:
    """One model the caller may use, as the gateway's `models` answers."""
    id: str
    max_context_tokens: int  # the context the tenant may use on it
    owned_by: str | None  # "local" (an engine model) or the upstream provider's name; None: an adapter, `auto`
    parent: str | None  # an adapter's base model


def to_serving_error(error: Exception) -> ServingError:
    """A gateway or transport error as the error contract (contracts/errors.py) with OpenAI's param names."""
    if isinstance(error, ServingError):
        err = error
    else:
        if isinstance(error, InferenceServerException):
            text, status = error.message() or str(error), str(error.status())
        elif isinstance(error, grpc.RpcError) and hasattr(error, "code"):
            # tritonclient's aio stream hands the channel's own error on (tritonserver gone or replaced);
            # a server killed mid-stream can break it as INTERNAL ("Internal error from Core"), which is the
            # same unavailability (a model's own errors come inside the stream, never as its status)
            text, status = error.details() or str(error), str(error.code())
            if error.code() == grpc.StatusCode.INTERNAL and parse(text) is None:
                status = str(grpc.StatusCode.UNAVAILABLE)
        else:
            text, status = str(error), None
        err = from_transport(text, status)
        if err.kind == "unavailable" and parse(text) is None:  # the transport's words say nothing to a client
            err.message = "the serving backend is unavailable"
    if err.field in OPENAI_PARAM:
        err.field = OPENAI_PARAM[err.field]
    return err


# The same small values go with nearly every request (stream, model, operation, max_tokens, a lease operation's
# inputs): each InferInput is made once and shared, read-only (tritonclient copies it into each request);
# a request's own text, messages, tools and user are not kept. Bounded: emptied when full.
_SHARED_INPUTS: dict = {}
_SHARED_MAX = 4096
_OWN = frozenset({"text_input", "messages", "tools", "logit_bias", "guided_decoding_guide", "user", "token_ids"})


def _input(name: str, value) -> grpcclient.InferInput:
    if name in _OWN or isinstance(value, list):
        return grpc_input(GATEWAY, name, [value if isinstance(value, list) else [value]])
    key = (name, type(value), value)
    shared = _SHARED_INPUTS.get(key)
    if shared is None:
        if len(_SHARED_INPUTS) >= _SHARED_MAX:
            _SHARED_INPUTS.clear()
        shared = _SHARED_INPUTS[key] = grpc_input(GATEWAY, name, [[value]])
    return shared


def gateway_inputs(call: GatewayCall, operation: str = "generate", token_ids=None) -> list:
    """The gateway's inputs for a call (gRPC)."""
    return [_input(k, v) for k, v in gateway_values(call, operation, token_ids).items()]


def stop_parameters(stream_id: str, parameters: dict) -> dict:
    """The gateway's `stop` for a named stream or admission: the batch worker acts for a tenant, its stop too."""
    return {"stream_id": stream_id, **({"on_behalf_of": parameters["on_behalf_of"]}
                                       if "on_behalf_of" in parameters else {})}


def call_parameters(call: GatewayCall) -> dict:
    """The gateway's request parameters of a call: its session, its sliding window, its cache key."""
    return {**({"session_id": call.session_id} if call.session_id else {}),
            **({"slide_keep": str(call.slide_keep)} if call.slide_keep is not None else {}),
            **({"prompt_cache_key": call.prompt_cache_key} if call.prompt_cache_key else {})}


def gateway_values(call: GatewayCall, operation: str = "generate", token_ids=None) -> dict:
    """The gateway's input values of a call, by name (those it does not set left out)."""
    if operation in ("generate", "admit") and call.prompt_ids is not None:
        token_ids = call.prompt_ids
    values = {
        "max_tokens": call.max_tokens,
        "text_input": call.text,
        "messages": json.dumps(call.messages) if call.messages is not None else None,
        "stream": True,  # always: the front sees every step and can stop the engine at a stop string
        "stop_words": call.stop or None,
        "model": call.model,
        "ignore_eos": call.ignore_eos or None,
        "operation": None if operation == "generate" else operation,
        "token_ids": token_ids,
        "tools": json.dumps(call.tool_plan.tools) if call.tool_plan is not None else None,
        "guided_decoding_guide_type": call.guide.guide_type if call.guide is not None else None,
        "guided_decoding_guide": call.guide.guide if call.guide is not None else None,
        "num_return_sequences": call.n if call.n > 1 else None,
        "logprobs": call.logprobs,
        "echo_logprobs": call.echo_logprobs or None,
        "logit_bias": json.dumps(call.logit_bias) if call.logit_bias else None,
        "user": call.user,
        **call.sampling,
    }
    return {k: v for k, v in values.items() if v is not None}


STOP_SEND_S = 5.0  # the answer to a `stop`
DRAIN_MAX_S = 30.0  # an abandoned stream's remaining responses, before its call is cancelled after all


def is_final(result) -> bool:
    params = result.get_response().parameters
    return "triton_final_response" in params and params["triton_final_response"].bool_param


class ReadAheadCall:
    """A gRPC stream_infer call read by a task of its own into a queue.

    Why a task: grpc.aio cancels the call when a read is cancelled, so a caller that went away while it
    waited for a response (a client disconnect) would cancel the call. Triton 2.51's gRPC server can abort
    when many streams are cancelled while their requests complete ("ASSERTION FAILED: prior > 0";
    triton-inference-server/server#7368, fixed in later releases; seen here with 1,024 streams whose
    clients left at once: benchmarks/results/2026-11-26-capacity-16core-*.json). With the reader apart, a
    request its caller abandons is ended by a `stop` (the engine's, or the gateway's for its own streams)
    and its stream read to the end, as a finished one. The request side stays open until the final
    response, as in tritonclient's stream, then half-closes."""

    def __init__(self, client, request: dict, timeout_s: float, headers: dict | None = None):
        self._done = asyncio.Event()
        self._queue: asyncio.Queue = asyncio.Queue()

        async def requests():
            yield request
            await self._done.wait()

        self._call = client.stream_infer(requests(), stream_timeout=timeout_s, headers=headers)
        self._reader = asyncio.ensure_future(self._read())

    @property
    def ended(self) -> bool:
        """The reader has seen the stream's end: its final response, an error or the call's end (the
        caller may not have taken it from the queue yet)."""
        return self._reader.done()

    async def _read(self) -> None:
        try:
            async for result, error in self._call:
                if error is not None:
                    self._queue.put_nowait(error)
                    return
                self._queue.put_nowait(result)
                if is_final(result):
                    return
            self._queue.put_nowait(None)
        except asyncio.CancelledError:
            self._queue.put_nowait(StreamCancelled())
        except Exception as e:  # noqa: BLE001 - the channel's own error, handed to the reader
            self._queue.put_nowait(e)
        finally:
            self._done.set()

    async def result(self):
        """The next response, or None at the stream's end without a final one; raises the stream's error."""
        item = await self._queue.get()
        if isinstance(item, Exception):
            raise item
        return item

    async def drain(self, timeout_s: float) -> bool:
        """Read what is left until the stream ends (within timeout_s): True if it did."""
        try:
            await asyncio.wait_for(asyncio.shield(self._reader), timeout_s)
        except asyncio.TimeoutError:
            return False
        while not self._queue.empty():
            if isinstance(self._queue.get_nowait(), StreamCancelled):
                return False
        return True

    def close(self) -> None:
        """Nothing: the request side half-closes when the reader ends."""

    def cancel(self) -> None:
        self._call.cancel()


async def end_abandoned(call, send_stop, on_stop) -> None:
    """End a stream its caller abandoned with a `stop` and read it to the end (`send_stop()`: whether the
    server knew the request); cancel the call only if the stop could not be sent or the stream has not
    ended within DRAIN_MAX_S, or within a second when the server did not know it (not started yet, or
    just ended). `on_stop(how)`: "stop" or "cancel" (llm_front_engine_stops_total)."""
    how = "stop"
    try:
        known = await asyncio.wait_for(send_stop(), STOP_SEND_S)
        if not await call.drain(DRAIN_MAX_S if known else 1.0):
            how = "cancel"
    except Exception:  # noqa: BLE001 - the stop could not be sent: cancelling is what is left
        how = "cancel"
    finally:
        if how == "cancel":
            call.cancel()
        if on_stop is not None:
            on_stop(how)


class _OperationCall:
    """An operation's call, read in the caller's task (ReadAheadCall's interface): one response, short."""

    def __init__(self, client, request: dict, timeout_s: float, headers: dict | None = None):
        self._done = asyncio.Event()

        async def requests():
            yield request
            await self._done.wait()  # keep our half of the stream open until the gateway is finished

        self._call = client.stream_infer(requests(), stream_timeout=timeout_s, headers=headers)
        self._responses = self._call.__aiter__()
        self.ended = False

    async def result(self):
        try:
            result, error = await self._responses.__anext__()
        except StopAsyncIteration:
            self.ended = True
            return None
        if error is not None:
            self.ended = True
            raise error
        return result

    def close(self) -> None:
        self._done.set()

    def cancel(self) -> None:
        self._call.cancel()


# tritonclient's own channel options, and a reconnect at most a second after tritonserver is back (gRPC's
# default backoff grows to 120 s): the front reads the engine and sends its lease operations over HTTP, so
# after a tritonserver restart it serves again at once, and its readiness (asked over this channel) and
# what still goes over gRPC (adapters, the batch worker, models and whoami) must not lag behind
# (tests/launcher/test_lifecycle.py)
_KEEPALIVE = grpcclient.KeepAliveOptions()
CHANNEL_ARGS = [
    ("grpc.max_send_message_length", grpcaio.MAX_GRPC_MESSAGE_SIZE),
    ("grpc.max_receive_message_length", grpcaio.MAX_GRPC_MESSAGE_SIZE),
    ("grpc.keepalive_time_ms", _KEEPALIVE.keepalive_time_ms),
    ("grpc.keepalive_timeout_ms", _KEEPALIVE.keepalive_timeout_ms),
    ("grpc.keepalive_permit_without_calls", _KEEPALIVE.keepalive_permit_without_calls),
    ("grpc.http2.max_pings_without_data", _KEEPALIVE.http2_max_pings_without_data),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class GatewayClient:
    def __init__(self, url: str, model: str = "gateway", timeout_s: float = 600.0, on_stop=None):
        """`on_stop(how)`: how an abandoned generate stream ended, "stop" or "cancel" (the front's metric)."""
        self.url, self.model, self.timeout_s, self.on_stop = url, model, timeout_s, on_stop
        self._client = None
        self._stopping: set[asyncio.Task] = set()

    @property
    def client(self) -> grpcaio.InferenceServerClient:
        """Made on first use, inside the serving event loop (a gRPC aio channel belongs to one loop)."""
        if self._client is None:
            self._client = grpcaio.InferenceServerClient(self.url, channel_args=CHANNEL_ARGS)
        return self._client

    async def ready(self) -> bool:
        """The gateway is loaded and so is every model behind it. Triton's server readiness is strict (every
        model it has loaded is ready): it is false while the launcher reloads an engine whose stub died, or
        after such a load failed; the gateway's own readiness covers the gateway, which a server that
        unloaded it would still call ready."""
        try:
            return await self.client.is_server_ready() and await self.client.is_model_ready(self.model)
        except Exception:
            return False

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def _results(self, inputs: list, api_key: str | None, parameters: dict,
                       generate: bool = False) -> AsyncIterator[tuple]:
        """The gateway's responses, (result, is final) up to the final one; raises ServingError.

        A generate stream carries a `stream_id` and is read ahead (ReadAheadCall): one its caller leaves
        is ended by the gateway's `stop` (scoped to the caller's key) and read to its end, so Triton 2.51
        sees no cancellation storm when many clients leave at once. An operation (an admit named by its own
        `stream_id` too) is read in the caller's task, and leaving it early cancels it."""
        request = {"model_name": self.model, "inputs": inputs,
                   "parameters": {"triton_enable_empty_final_response": True, **parameters}}
        headers = {"authorization": f"Bearer {api_key}"} if api_key else None
        stream_id = parameters.get("stream_id") if generate else None
        call = (ReadAheadCall if stream_id else _OperationCall)(self.client, request, self.timeout_s, headers)
        finished = False
        try:
            while (result := await call.result()) is not None:
                finished = is_final(result)
                yield result, finished
                if finished:
                    return
            finished = True
            raise ServingError("unavailable", "the gateway closed the stream before the end of the request")
        except InferenceServerException as e:
            finished = True
            raise to_serving_error(e) from None
        except Exception as e:
            if type(e).__name__ == "AioRpcError":
                finished = True
                raise to_serving_error(InferenceServerException(e.details(), str(e.code()))) from None
            raise
        finally:
            call.close()
            if not (finished or call.ended):  # left mid-stream
                if stream_id:  # not awaited: a closing generator must not block its caller
                    self._background(self._stop(call, api_key, stop_parameters(stream_id, parameters)))
                else:
                    call.cancel()

    async def _stop(self, call: ReadAheadCall, api_key: str | None, parameters: dict) -> None:
        """The gateway's `stop` for an abandoned generate stream, authenticated as the stream was."""
        async def send_stop() -> bool:
            answer = await self.call(GatewayCall(), api_key, "stop", parameters=parameters)
            return answer is not None and bool(json.loads(answer.text).get("stopped"))

        await end_abandoned(call, send_stop, self.on_stop)

    def _background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    async def stream(self, call: GatewayCall, api_key: str | None, operation: str = "generate",
                     token_ids=None, parameters: dict | None = None) -> AsyncIterator[Piece]:
        """The gateway's responses as Pieces; raises ServingError. A generate stream left early is stopped
        (`_results`); an operation left early is cancelled. `parameters`: extra request parameters (the
        batch worker's on_behalf_of, tier, batch_id)."""
        stream_id = {"stream_id": uuid.uuid4().hex} if operation == "generate" else {}
        results = self._results(gateway_inputs(call, operation, token_ids), api_key,
                                {**call_parameters(call), **stream_id, **(parameters or {})}, operation == "generate")
        async with contextlib.aclosing(results):  # a caller gone ends the call now, not when collected
            async for result, final in results:
                piece = _piece(result, final)
                if piece.text or piece.final or piece.model_used:
                    yield piece

    async def call(self, call: GatewayCall, api_key: str | None, operation: str, token_ids=None,
                   parameters: dict | None = None) -> Piece:
        last = None
        async for piece in self.stream(call, api_key, operation, token_ids, parameters):
            last = piece
        return last

    async def _answer(self, operation: str, api_key: str | None) -> "_Outputs":
        """The one response of an operation that takes nothing but the caller's key."""
        last = None
        async for result, _final in self._results(gateway_inputs(GatewayCall(), operation), api_key, {}):
            last = result
        return _Outputs(last)

    async def whoami(self, api_key: str | None) -> Identity:
        out = await self._answer("whoami", api_key)
        return Identity(out.text("tenant") or "", out.text("tier") or "", out.number("max_prompt_bytes"),
                        bool(out.number("stores_conversations")))

    async def models(self, api_key: str | None) -> list[ListedModel]:
        out = await self._answer("models", api_key)
        ids, contexts = out.texts("model_ids"), out.numbers("model_context_tokens")
        owners, parents = out.texts("model_owners"), out.texts("model_parents")
        return [ListedModel(m, contexts[i], owners[i] or None, parents[i] or None) for i, m in enumerate(ids)]


class _Outputs:
    """A gateway response's output tensors, read by name (absent: empty)."""

    def __init__(self, result):
        self.result = result

    def _array(self, name):
        arr = self.result.as_numpy(name) if self.result is not None else None
        return arr.reshape(-1) if arr is not None else []

    def texts(self, name) -> list[str]:
        return [v.decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v) for v in self._array(name)]

    def text(self, name) -> str | None:
        values = self.texts(name)
        return values[0] if values else None

    def numbers(self, name) -> list[int]:
        return [int(v) for v in self._array(name)]

    def number(self, name) -> int:
        values = self.numbers(name)
        return values[0] if values else 0

def _piece(result, final: bool) -> Piece:
    out = _Outputs(result)
    ids = result.as_numpy("token_ids")
    piece = Piece(text=out.text("text_output") or "", final=final, model_used=out.text("model_used"),
                  finish_reason=out.text("finish_reason"), prompt_tokens=out.number("num_input_tokens"),
                  completion_tokens=out.number("num_output_tokens"),
                  token_ids=ids.reshape(-1).tolist() if ids is not None else None)
    tokens = out.text("token_logprobs")
    if tokens:  # a token-level request (gateway/core.py Gateway._handle_tokens)
        data = json.loads(tokens)
        piece.index = out.number("sequence_index")
        piece.token_ids = data["ids"]
        if "tokens" in data:
            piece.logprobs = [TokenLogprob.from_list(t) for t in data["tokens"]]
        if "prompt" in data:
            piece.prompt_logprobs = [TokenLogprob.from_list(t) for t in data["prompt"]]
    return piece
