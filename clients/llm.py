"""A small typed client over `tritonclient` for `gateway` and `ensemble`.

gRPC streaming is the main path (`stream()` yields text pieces as they arrive); `generate()` returns
the whole text. The API key goes in the `authorization: Bearer` header, which tritonserver forwards
to the gateway. Errors are parsed from the gateway's error contract (`contracts/errors.py`) into typed
exceptions; `with_retries` honours `retry_after`.
"""
from __future__ import annotations

import json
import queue
import time
import uuid
from dataclasses import dataclass, field

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from contracts.tensors import ENSEMBLE, GATEWAY
from contracts.grpc_inputs import grpc_input
from contracts.errors import KINDS, from_transport


class LLMError(Exception):
    status = 500

    def __init__(self, message: str, kind: str = "internal", field: str | None = None,
                 retry_after: float | None = None):
        super().__init__(message)
        self.kind, self.field, self.retry_after = kind, field, retry_after


class BadRequestError(LLMError):
    status = KINDS["invalid_argument"].status


class AuthenticationError(LLMError):
    status = KINDS["unauthenticated"].status


class PermissionDeniedError(LLMError):
    status = KINDS["permission_denied"].status


class NotFoundError(LLMError):
    status = KINDS["not_found"].status


class ContextTooLongError(LLMError):
    status = KINDS["context_too_long"].status


class RateLimitError(LLMError):
    status = KINDS["rate_limited"].status


class OverloadedError(LLMError):
    status = KINDS["overloaded"].status


_BY_KIND = {"invalid_argument": BadRequestError, "unauthenticated": AuthenticationError,
            "permission_denied": PermissionDeniedError, "not_found": NotFoundError,
            "context_too_long": ContextTooLongError, "rate_limited": RateLimitError,
            "queue_full": OverloadedError, "overloaded": OverloadedError, "unavailable": OverloadedError,
            "upstream_unavailable": OverloadedError}


def error_from_text(text: str, status: int | str | None = None) -> LLMError:
    """The typed exception for an error message: from the contract prefix (contracts/errors.py) when present,
    otherwise from Triton's message or the HTTP status (`404`, `"503"`) or gRPC status (`"StatusCode.UNAVAILABLE"`)."""
    err = from_transport(text, status)
    return _BY_KIND.get(err.kind, LLMError)(err.message, err.kind, err.field, err.retry_after)


def _from_exception(error) -> LLMError:
    if isinstance(error, InferenceServerException):
        return error_from_text(error.message() or str(error), error.status())
    return error_from_text(str(error))


@dataclass
class GenerationResult:
    text: str
    model_used: str | None = None
    finish_reason: str | None = None
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    pieces: list[str] = field(default_factory=list)


class LLMClient:
    def __init__(self, url: str = "127.0.0.1:8001", api_key: str | None = None, model: str = "gateway",
                 timeout_s: float = 300.0):
        self.url, self.api_key, self.model, self.timeout_s = url, api_key, model, timeout_s
        self.contract = GATEWAY if model == "gateway" else ENSEMBLE

    def _inputs(self, text, messages, max_tokens, stream, **options):
        values = {"text_input": text, "max_tokens": max_tokens, "stream": stream, **options}
        if messages is not None:
            if self.model != "gateway":
                raise ValueError("chat messages need the gateway model")
            values["messages"] = json.dumps(messages)
        out = []
        for name, value in values.items():
            if value is None:
                continue
            out.append(grpc_input(self.contract, name, [value if isinstance(value, list) else [value]]))
        return out

    def stream(self, text: str | None = None, messages: list | None = None, max_tokens: int = 128,
               result: GenerationResult | None = None, cancel_after: int | None = None, streaming: bool = True,
               **options):
        """Yield text pieces as they arrive. `options`: temperature, top_k, top_p, seed, min_tokens,
        stop_words, bad_words, and on the gateway model / adapter. `result` is filled at the end.
        `streaming=False` asks for one response with the whole text (the model's `stream` input off).
        `timeout_s` bounds the wait for each response and, twice over, the whole request."""
        result = result if result is not None else GenerationResult("")
        events: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(self.url)
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else None
        client.start_stream(callback=lambda result, error: events.put((time.perf_counter(), result, error)),
                            headers=headers, stream_timeout=2 * self.timeout_s)
        start = time.perf_counter()
        finished = False  # anything else (an error, cancel_after, the consumer stopping early) cancels
        try:
            client.async_stream_infer(self.model, self._inputs(text, messages, max_tokens, streaming, **options),
                                      request_id=uuid.uuid4().hex, enable_empty_final_response=True)
            while True:
                try:
                    t, res, error = events.get(timeout=self.timeout_s)
                except queue.Empty:
                    raise LLMError(f"no response within {self.timeout_s} s", "timeout") from None
                if error is not None:
                    raise _from_exception(error)
                out = res.as_numpy("text_output")
                piece = b"".join(out.reshape(-1)).decode() if out is not None else ""
                if piece:
                    result.ttft_s = result.ttft_s if result.ttft_s is not None else t - start
                    result.pieces.append(piece)
                    yield piece
                    if cancel_after is not None and len(result.pieces) >= cancel_after:
                        return
                for name in ("model_used", "finish_reason"):
                    arr = res.as_numpy(name) if self.model == "gateway" else None
                    if arr is not None:
                        setattr(result, name, arr.reshape(-1)[0].decode())
                for name in ("num_input_tokens", "num_output_tokens"):
                    arr = res.as_numpy(name) if self.model == "gateway" else None
                    if arr is not None:
                        setattr(result, name, int(arr.reshape(-1)[0]))
                if res.get_response().parameters["triton_final_response"].bool_param:
                    result.latency_s = t - start
                    result.text = "".join(result.pieces)
                    finished = True
                    return
        finally:
            client.stop_stream(cancel_requests=not finished)
            client.close()

    def generate(self, text: str | None = None, messages: list | None = None, max_tokens: int = 128,
                 streaming: bool = True, **options) -> GenerationResult:
        """The whole text; streamed underneath unless `streaming=False` (then one response)."""
        result = GenerationResult("")
        for _ in self.stream(text, messages, max_tokens, result=result, streaming=streaming, **options):
            pass
        return result


class HTTPClient:
    """HTTP `/generate` and `/generate_stream` (server-sent events). tritonclient has no generate-extension
    API, so this reads the event lines itself; decoupled models (gateway, ensemble) do not serve `/infer`.
    The key travels as the `api_key` parameter: Triton 2.51 forwards no headers to `/generate*`."""

    def __init__(self, url: str = "127.0.0.1:8000", api_key: str | None = None, model: str = "gateway",
                 timeout_s: float = 300.0):
        self.url, self.api_key, self.model, self.timeout_s = url, api_key, model, timeout_s

    def stream(self, text: str | None = None, messages: list | None = None, max_tokens: int = 128,
               result: GenerationResult | None = None, streaming: bool = True, **options):
        """Yield text pieces as events arrive on `/generate_stream`; with `streaming=False`, one piece
        from `/generate` (the model sends one response). `timeout_s` bounds each socket read."""
        import urllib.error
        import urllib.request

        result = result if result is not None else GenerationResult("")
        body = {"text_input": text, "max_tokens": max_tokens, "stream": streaming, **options}
        if messages is not None:
            body["messages"] = json.dumps(messages)
        if self.api_key:
            body["api_key"] = self.api_key
        body = {k: v for k, v in body.items() if v is not None}
        endpoint = "generate_stream" if streaming else "generate"
        req = urllib.request.Request(f"http://{self.url}/v2/models/{self.model}/{endpoint}",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json"})
        start = time.perf_counter()
        try:
            resp = urllib.request.urlopen(req, timeout=self.timeout_s)
        except urllib.error.HTTPError as e:  # the body is `{"error": ...}` (or one event `data: {...}`)
            raw = e.read().decode().strip()
            raw = raw[len("data: "):] if raw.startswith("data: ") else raw
            try:
                message = json.loads(raw).get("error", raw)
            except (json.JSONDecodeError, AttributeError):
                message = raw or str(e)
            raise error_from_text(message, e.code) from None
        with resp:
            # SSE: one `data: <json>` line per response, a blank line between; no [DONE] sentinel.
            lines = resp if streaming else [b"data: " + resp.read()]
            for raw in lines:
                if not raw.startswith(b"data: "):
                    continue
                event = json.loads(raw[6:])
                if "error" in event:  # an error after some data still arrives with status 200
                    raise error_from_text(event["error"])
                piece = event.get("text_output") or ""
                if isinstance(piece, list):
                    piece = "".join(piece)
                for name in ("model_used", "finish_reason", "num_input_tokens", "num_output_tokens"):
                    if name in event:
                        value = event[name][0] if isinstance(event[name], list) else event[name]
                        setattr(result, name, value)
                if piece:
                    result.ttft_s = result.ttft_s if result.ttft_s is not None else time.perf_counter() - start
                    result.pieces.append(piece)
                    yield piece
        result.latency_s = time.perf_counter() - start
        result.text = "".join(result.pieces)

    def generate(self, text: str | None = None, messages: list | None = None, max_tokens: int = 128,
                 streaming: bool = True, **options) -> GenerationResult:
        result = GenerationResult("")
        for _ in self.stream(text, messages, max_tokens, result=result, streaming=streaming, **options):
            pass
        return result


def with_retries(fn, attempts: int = 5, max_wait_s: float = 60.0, sleep=time.sleep):
    """Call `fn()`; on RateLimitError / OverloadedError wait `retry_after` (bounded) and try again."""
    for attempt in range(attempts):
        try:
            return fn()
        except (RateLimitError, OverloadedError) as e:
            if attempt == attempts - 1:
                raise
            sleep(min(max_wait_s, e.retry_after or 1.0))


__all__ = ["LLMClient", "HTTPClient", "GenerationResult", "with_retries", "error_from_text", "InferenceServerException"]
