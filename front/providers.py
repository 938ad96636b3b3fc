"""Streams from upstream OpenAI-compatible providers, through the same door as the local engine.

The gateway decides (gateway/catalog.py, routing.py choose): its `admit` answers with a provider route
(base URL, the upstream's model name, timeouts, retries, where the key is) instead of an engine call.
The front then POSTs OpenAI's body to the upstream with `stream: true` and `stream_options.include_usage`,
turns its SSE chunks into the same Pieces the engine path gives (front/engine_direct.py), and `settle`s
the lease with the upstream's own usage (the reservation was made with the local tokenizer's count) and
how its tries went, which feeds the upstream's circuit breaker in the gateway (gateway/breaker.py).

Reliability, each where it is safe:
- timeouts: connect, request -> first token (`first_byte_timeout_s`), and between chunks (`idle_timeout_s`);
- retries of the same upstream only before the first token, when nothing has reached the client: on a
  refused or reset connection, a timeout, 408/429/5xx; backoff with full jitter, a `Retry-After` honoured
  when it is at most `max_retry_after_s` (longer: this upstream is given up for now);
- fallback: when every try failed, the lease is settled (nothing charged) and the gateway is asked again
  with the failed model in `avoid`: it answers with the next model of the fallback chain (or `auto`'s
  next candidate), local or upstream, or 503 when none is left;
- after the first token an upstream failure ends the stream with an error (never a retry: the client
  has text already), charged with what was received;
- a client that goes away closes the upstream connection at once (the upstream sees the disconnect).

The key is read here, from the environment variable or file the route names, when calling; it goes only
into the upstream's `authorization` header, never into a log line, an error or a metric label.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from contracts.errors import ServingError
from front.gateway_client import Piece
from front.openai_schema import GatewayCall

RETRY_STATUSES = (408, 409, 425, 429, 500, 502, 503, 504)
ERROR_BODY_BYTES = 4096  # of an upstream's error answer, read for its message


class UpstreamFailed(Exception):
    """Every try of an upstream failed before its first token: the request may go elsewhere."""

    def __init__(self, upstream: str, kinds: list[str], message: str, retry_after: float | None):
        super().__init__(message)
        self.upstream, self.kinds, self.message, self.retry_after = upstream, kinds, message, retry_after


class _TryFailed(Exception):
    def __init__(self, kind: str, message: str, retry_after: float | None = None, retriable: bool = True):
        super().__init__(message)
        self.kind, self.message, self.retry_after, self.retriable = kind, message, retry_after, retriable


def read_key(route: dict) -> str:
    """The upstream's key from the environment or a file (read at each call: a rotated file is picked up)."""
    name, env, path = route["name"], route.get("api_key_env"), route.get("api_key_file")
    if env:
        key = os.environ.get(env, "")
        if not key:
            raise _TryFailed("credentials", f"upstream {name!r} has no API key: environment variable {env} is "
                             "not set in the front", retriable=False)
        return key
    if path:
        try:
            return Path(path).read_text().strip()
        except OSError as e:
            raise _TryFailed("credentials", f"upstream {name!r} has no API key: cannot read its key file "
                             f"({e.strerror})", retriable=False) from None
    return ""  # an upstream that needs no key (a local server)


def redact(text: str, key: str) -> str:
    return text.replace(key, "[redacted]") if key else text


def upstream_body(model: str, call: GatewayCall) -> dict:
    """OpenAI's request body for the upstream: the standard fields only (the gateway refused the others)."""
    body: dict = {"model": model, "max_tokens": call.max_tokens, "stream": True,
                  "stream_options": {"include_usage": True}}
    if call.messages is not None:
        body["messages"] = call.messages
    else:
        body["prompt"] = call.text or ""
    for k in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty"):
        if call.sampling.get(k) is not None:
            body[k] = call.sampling[k]
    if call.stop:
        body["stop"] = call.stop
    if call.user:
        body["user"] = call.user  # the client's end-user id, for the provider's abuse monitoring
    return body


def _retry_after(resp: httpx.Response) -> float | None:
    value = resp.headers.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: treated as absent (backoff applies)


def _error_message(raw: bytes) -> str:
    try:
        err = json.loads(raw).get("error")
        msg = err.get("message") if isinstance(err, dict) else err
        return str(msg)[:300] if msg else ""
    except (ValueError, AttributeError):
        return ""


@dataclass
class Opened:
    """An upstream stream that has produced its first event with text (or ended without any)."""
    response: httpx.Response
    events: object  # async iterator of parsed SSE events
    first: list = field(default_factory=list)  # the events read before the first text, that one included
    kinds: list = field(default_factory=list)  # the failed tries before this one
    ttft_s: float | None = None


class Upstreams:
    """One HTTP client (connection pool) per front process, made in its event loop."""

    def __init__(self, metrics=None, rng=random.random, sleep=asyncio.sleep):
        self.metrics, self.rng, self.sleep = metrics, rng, sleep
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100))
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _count(self, upstream: str, result: str) -> None:
        if self.metrics is not None:
            self.metrics.upstream_tries.labels(upstream, result).inc()

    async def open(self, route: dict, call: GatewayCall, start: float) -> Opened:
        """Tries the upstream until it produces its first text; raises UpstreamFailed when every try
        failed, or ServingError when the upstream refused the request itself (a 4xx: the client's fault)."""
        name, kinds, last = route["name"], [], None
        try:
            key = read_key(route)
        except _TryFailed as f:
            self._count(name, f.kind)
            raise UpstreamFailed(name, [f.kind], f.message, None) from None
        body = upstream_body(route["model"], call)
        path = "/chat/completions" if call.messages is not None else "/completions"
        for attempt in range(int(route["max_retries"]) + 1):
            if last is not None:
                delay = last.retry_after if last.retry_after is not None else \
                    self.rng() * min(route["backoff_max_s"], route["backoff_base_s"] * 2 ** (attempt - 1))
                await self.sleep(delay)
            try:
                opened = await self._try(route, key, path, body)
                opened.kinds, opened.ttft_s = kinds, time.monotonic() - start
                self._count(name, "ok")
                return opened
            except _TryFailed as f:
                self._count(name, f.kind)
                kinds.append(f.kind)
                last = f
                if not f.retriable or (f.retry_after is not None and f.retry_after > route["max_retry_after_s"]):
                    break
        raise UpstreamFailed(name, kinds, redact(last.message, key), last.retry_after)

    async def _try(self, route: dict, key: str, path: str, body: dict) -> Opened:
        name = route["name"]
        timeout = httpx.Timeout(connect=route["connect_timeout_s"], read=route["idle_timeout_s"],
                                write=route["connect_timeout_s"], pool=route["connect_timeout_s"])
        headers = {"authorization": f"Bearer {key}"} if key else {}
        request = self.client.build_request("POST", route["base_url"] + path, json=body, headers=headers,
                                            timeout=timeout)
        deadline = time.monotonic() + route["first_byte_timeout_s"]
        response = None
        try:
            response = await asyncio.wait_for(self.client.send(request, stream=True), route["first_byte_timeout_s"])
            if response.status_code != 200:
                raw = b""
                async for chunk in response.aiter_bytes():
                    raw += chunk
                    if len(raw) >= ERROR_BODY_BYTES:
                        break
                await response.aclose()
                self._refused(name, response, redact(_error_message(raw), key))
            events = _sse_events(response)
            first = []
            while True:
                event = await asyncio.wait_for(events.__anext__(), max(0.001, deadline - time.monotonic()))
                first.append(event)
                if _error(event) is not None:
                    raise _TryFailed("error_event", f"upstream {name!r} answered with an error: "
                                     f"{redact(_error(event), key)[:200]}")
                if _text(event) or event is _END:
                    return Opened(response, events, first)
        except _TryFailed:
            if response is not None:
                await response.aclose()
            raise
        except (asyncio.TimeoutError, httpx.TimeoutException):
            if response is not None:
                await response.aclose()
            raise _TryFailed("timeout", f"upstream {name!r} gave no first token within "
                             f"{route['first_byte_timeout_s']:g} s") from None
        except StopAsyncIteration:
            await response.aclose()
            raise _TryFailed("closed", f"upstream {name!r} closed the stream before its first token") from None
        except httpx.ConnectError:
            raise _TryFailed("connect", f"upstream {name!r} refused the connection") from None
        except (httpx.TransportError, httpx.DecodingError, ValueError):
            if response is not None:
                await response.aclose()
            raise _TryFailed("transport", f"upstream {name!r} broke the connection") from None
        except BaseException:  # cancelled: the client went away while we waited
            if response is not None:
                await response.aclose()
            raise

    @staticmethod
    def _refused(name: str, response: httpx.Response, message: str) -> None:
        status = response.status_code
        if status in RETRY_STATUSES or status >= 500:
            raise _TryFailed(f"status_{status}", f"upstream {name!r} answered {status}"
                             + (f": {message}" if message else ""), retry_after=_retry_after(response))
        if status < 400:  # a redirect or an odd success: the base URL is wrong, nothing the client did
            raise _TryFailed(f"status_{status}", f"upstream {name!r} answered {status} (check its base_url)",
                             retriable=False)
        if status in (401, 403):  # our credentials: nothing the client can change; never their text
            raise _TryFailed("credentials", f"upstream {name!r} refused the gateway's credentials ({status})",
                             retriable=False)
        if status == 404:  # the configured base URL or upstream model name is wrong: our fault, not the client's
            raise _TryFailed("status_404", f"upstream {name!r} answered 404" + (f": {message}" if message else ""),
                             retriable=False)
        kind = "context_too_long" if "context" in message.lower() else "invalid_argument"
        raise ServingError(kind, f"upstream {name!r} refused the request ({status})"
                           + (f": {message}" if message else ""))


_END = object()  # the upstream's `data: [DONE]` (or the end of its body)


async def _sse_events(response: httpx.Response):
    """The upstream's SSE `data:` payloads as JSON objects, then _END."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        yield json.loads(data)
    yield _END


def _error(event) -> str | None:
    if isinstance(event, dict) and "error" in event:
        err = event["error"]
        return str(err.get("message") if isinstance(err, dict) else err)
    return None


def _text(event) -> str:
    if not isinstance(event, dict):
        return ""
    for choice in event.get("choices") or []:
        if isinstance(choice, dict):
            delta = choice.get("delta")
            if isinstance(delta, dict) and isinstance(delta.get("content"), str):
                return delta["content"]
            if isinstance(choice.get("text"), str):
                return choice["text"]
    return ""


def _finish(event) -> str | None:
    if isinstance(event, dict):
        for choice in event.get("choices") or []:
            if isinstance(choice, dict) and choice.get("finish_reason"):
                return choice["finish_reason"]
    return None


@dataclass
class Received:
    """What an upstream stream gave so far: what the settle reports."""
    n_out: int = 0  # content events (the count when the upstream sends no usage)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None

    @property
    def reason(self) -> str:
        """Why the upstream's answer ended, as it said; one that names no reason ended on its own."""
        return self.finish_reason or "stop"


async def pieces(route: dict, opened: Opened, model: str, got: Received):
    """(Piece, is final) from an opened upstream stream; raises ServingError on a failure after the first token."""
    name = route["name"]

    async def events():
        for e in opened.first:
            yield e
        async for e in opened.events:
            yield e

    try:
        sent_first = False
        async for event in events():
            if event is _END:
                break
            err = _error(event)
            if err is not None:
                raise ServingError("upstream_unavailable", f"upstream {name!r} failed mid-stream: {err[:200]}")
            usage = event.get("usage") if isinstance(event, dict) else None
            if isinstance(usage, dict):
                got.prompt_tokens = usage.get("prompt_tokens") if isinstance(usage.get("prompt_tokens"), int) else None
                got.completion_tokens = usage.get("completion_tokens") \
                    if isinstance(usage.get("completion_tokens"), int) else None
            got.finish_reason = _finish(event) or got.finish_reason
            text = _text(event)
            if text:
                got.n_out += 1
                yield Piece(text=text, final=False, model_used=None if sent_first else model)
                sent_first = True
    except httpx.TimeoutException:
        raise ServingError("upstream_unavailable", f"upstream {name!r} stalled mid-stream (no chunk within "
                           f"{route['idle_timeout_s']:g} s)") from None
    except (httpx.TransportError, httpx.DecodingError, ValueError):
        raise ServingError("upstream_unavailable", f"upstream {name!r} broke the connection mid-stream") from None


class UpstreamPath:
    """A lease on an upstream provider, from the first try to the settle, falling back where it may."""

    def __init__(self, upstreams: Upstreams | None = None):
        self.upstreams = upstreams or Upstreams()

    async def stream(self, direct, grant: dict, call: GatewayCall, api_key: str | None, start: float,
                     parameters: dict | None = None):
        """The request's Pieces; `direct` is the front's DirectEngine (lease operations, the engine path);
        `parameters`: the request's own gateway parameters (DirectEngine.stream), for a fallback's admit."""
        tried: list[str] = []
        while "provider" in grant:
            route, model = grant["provider"], grant["model"]
            live = direct.register(grant["lease"], model, upstream=True)
            try:
                opened = await self.upstreams.open(route, call, start)
            except UpstreamFailed as f:
                # nothing was served: settle this lease uncharged (0 tokens), ask the gateway for the next model
                await direct._settle(live, 0, "error", None, start, "upstream_unavailable", extra={
                    "num_input_tokens": 0, "upstream_failures": len(f.kinds), "upstream_errors": f.kinds,
                    "before_first_token": True})
                tried.append(model)
                try:
                    grant = await direct.admit(call, api_key, avoid=tried, parameters=parameters)
                except ServingError as e:
                    if e.kind != "upstream_unavailable":
                        raise
                    raise ServingError("upstream_unavailable", f"{f.message}; {e.message}",
                                       retry_after=max(f.retry_after or 0.0, e.retry_after or 0.0) or None) from None
                continue
            except ServingError as e:  # the upstream refused the request itself: the client's error
                await direct._settle(live, 0, "error", None, start, e.kind, extra={"num_input_tokens": 0})
                raise
            except BaseException:  # the client went away before the first token: nothing was served
                direct.settle_later(live, 0, "cancelled", None, start, extra={"num_input_tokens": 0})
                raise
            relay = self._relay(direct, live, route, opened, grant, start)
            async with contextlib.aclosing(relay):
                async for piece in relay:
                    yield piece
            return
        local = direct.from_engine(grant, call, start)  # a fallback to a local engine model
        async with contextlib.aclosing(local):
            async for piece in local:
                yield piece

    async def close(self) -> None:
        await self.upstreams.close()

    async def _relay(self, direct, live, route: dict, opened: Opened, grant: dict, start: float):
        model, got = grant["model"], Received()
        kept = [] if grant.get("report_text") else None  # the whole answer, for the gateway's cache / session
        first_at = start + (opened.ttft_s or 0.0)
        outcome, error_kind, last_at = "error", "internal", first_at

        def report(failed_now: bool) -> dict:
            kinds = opened.kinds + (["mid_stream"] if failed_now else [])
            return {"num_input_tokens": got.prompt_tokens if got.prompt_tokens is not None else grant["num_input_tokens"],
                    "finish_reason": got.reason, "upstream_failures": len(kinds), "upstream_errors": kinds}

        try:
            async for piece in pieces(route, opened, model, got):
                last_at = time.monotonic()
                if kept is not None:
                    kept.append(piece.text)
                yield piece
            outcome = "success"
            n_out = got.completion_tokens if got.completion_tokens is not None else got.n_out
            itl = (last_at - first_at) / (n_out - 1) if n_out > 1 else None
            await direct._settle(live, n_out, "success", first_at, start, itl_s=itl, extra=report(False),
                                 text="".join(kept) if kept is not None else None)
            n_in = report(False)["num_input_tokens"]
            yield Piece(text="", final=True, model_used=model, finish_reason=got.reason,
                        prompt_tokens=n_in, completion_tokens=n_out)
        except ServingError as e:
            error_kind = e.kind
            raise
        except (GeneratorExit, asyncio.CancelledError):
            outcome = "cancelled"
            raise
        finally:
            await opened.response.aclose()  # a client gone: the upstream sees its connection close now
            if outcome != "success":
                n_out = got.completion_tokens if got.completion_tokens is not None else got.n_out
                direct.settle_later(live, n_out, outcome, first_at, start, error_kind,
                                    extra=report(outcome == "error"))
