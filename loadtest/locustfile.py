"""Locust users for the serving stack: gRPC streaming to `gateway` and `ensemble`, HTTP
`/generate_stream` to `ensemble`, and OpenAI SSE streaming (`/v1/chat/completions`) on the front. Each
request is reported to locust's events (web UI, CSVs) and, when $LOADTEST_RECORDS is set, appended as a
JSON line with its timeline for genai-perf-style metrics.

    locust -f loadtest/locustfile.py --headless -u 4 -r 4 -t 20s
Environment: LLM_GRPC_URL (127.0.0.1:8001), LLM_HTTP_URL (127.0.0.1:8000), LLM_FRONT_URL (the front's
http://host:port; without it no front user runs), LOADTEST_PROFILE.
Every loop is bounded: locust's -t / --iterations, and a timeout on every request.
"""
from __future__ import annotations

import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()  # grpcio must cooperate with locust's gevent loop; before any channel exists

import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from locust import User, between, events, task  # noqa: E402
from locust.exception import StopUser  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clients.llm import GenerationResult, HTTPClient, LLMClient, LLMError, error_from_text  # noqa: E402
from loadtest.sse import StreamError, event_text, parse_line  # noqa: E402
from loadtest.workload import Profile  # noqa: E402

PROFILE = Profile.load(os.environ.get("LOADTEST_PROFILE", Path(__file__).with_name("profile.yaml")))
GRPC_URL = os.environ.get("LLM_GRPC_URL", "127.0.0.1:8001")
HTTP_URL = os.environ.get("LLM_HTTP_URL", "127.0.0.1:8000")
FRONT_URL = (os.environ.get("LLM_FRONT_URL") or "").rstrip("/") or None  # the OpenAI-compatible front
RECORDS = os.environ.get("LOADTEST_RECORDS")
MAX_REQUESTS = int(os.environ.get("LOADTEST_MAX_REQUESTS", "0"))  # 0: only locust's -t bounds the run
_sent = 0
_tokenizer = None


def count_tokens(text: str) -> int:
    """Output tokens as genai-perf counts them: re-tokenize the text with the model's tokenizer."""
    global _tokenizer
    if _tokenizer is None:
        from tokenizers import Tokenizer

        from build.render import DEFAULT_CHECKPOINT

        _tokenizer = Tokenizer.from_file(str(DEFAULT_CHECKPOINT / "tokenizer.json"))
    return len(_tokenizer.encode(text, add_special_tokens=False).ids)


def report(kind: str, tenant: str, start: float, first: float | None, end: float, text: str, error=None,
           streaming: bool = True):
    """One request to locust's events (the web UI and CSVs group by kind and tenant; `context` carries the
    tenant and the genai-perf timeline for listeners) and, with $LOADTEST_RECORDS, to a JSON line."""
    tokens = count_tokens(text) if text else 0
    record = {"tenant": tenant, "kind": kind, "start": start, "first_chunk": first, "end": end,
              "output_tokens": tokens, "ok": error is None, "error": None if error is None else str(error),
              "streaming": streaming}
    events.request.fire(request_type=kind if streaming else f"{kind}-unary", name=tenant,
                        response_time=(end - start) * 1000, response_length=tokens, exception=error,
                        context=record)
    if RECORDS:
        with open(RECORDS, "a") as f:
            f.write(json.dumps(record) + "\n")


class _LLMUser(User):
    abstract = True
    wait_time = between(0.0, 0.2)

    def on_start(self):
        self.rng = random.Random()

    def budget(self) -> None:
        """Stop the whole run once $LOADTEST_MAX_REQUESTS requests have been started."""
        global _sent
        _sent += 1
        if MAX_REQUESTS and _sent > MAX_REQUESTS:
            import gevent

            gevent.spawn(self.environment.runner.quit)
            raise StopUser()


def grpc_request(rng: random.Random, model: str, tenant: dict | None) -> None:
    """One gRPC request to `gateway` (as `tenant`) or `ensemble`, streamed for the profile's
    `stream_fraction` of requests (else one response), reported to locust."""
    n = PROFILE.max_tokens(rng)
    streaming = rng.random() < PROFILE.stream_fraction
    client = LLMClient(GRPC_URL, tenant["api_key"] if tenant else None, model, timeout_s=120)
    result, start, error = GenerationResult(""), time.perf_counter(), None
    try:
        for _ in client.stream(PROFILE.prompt(rng), max_tokens=n, min_tokens=n, temperature=0.0, result=result,
                               streaming=streaming):
            pass
    except LLMError as e:
        error = e
    end = time.perf_counter()
    first = start + result.ttft_s if result.ttft_s is not None else None
    report(f"grpc-{model}", tenant["name"] if tenant else model, start, first, end, "".join(result.pieces), error,
           streaming)


class GrpcGatewayUser(_LLMUser):
    weight = PROFILE.users.get("grpc_gateway", 0)

    @task
    def generate(self):
        self.budget()
        grpc_request(self.rng, "gateway", PROFILE.pick_tenant(self.rng))


class GrpcEnsembleUser(_LLMUser):
    weight = PROFILE.users.get("grpc_ensemble", 0)

    @task
    def generate(self):
        self.budget()
        grpc_request(self.rng, "ensemble", None)


class HttpStreamUser(_LLMUser):
    weight = PROFILE.users.get("http_generate_stream", 0)

    @task
    def generate(self):
        self.budget()
        n = PROFILE.max_tokens(self.rng)
        client = HTTPClient(HTTP_URL, None, "ensemble", timeout_s=120)
        result, start, error = GenerationResult(""), time.perf_counter(), None
        try:
            for _ in client.stream(PROFILE.prompt(self.rng), max_tokens=n, min_tokens=n, temperature=0.0,
                                   result=result):
                pass
        except (LLMError, OSError) as e:
            error = e
        end = time.perf_counter()
        first = start + result.ttft_s if result.ttft_s is not None else None
        report("http-ensemble", "ensemble", start, first, end, "".join(result.pieces), error)


def front_chat_request(session, rng: random.Random, tenant: dict) -> None:
    """One streamed `/v1/chat/completions` on the front as `tenant` (its key in `authorization: Bearer`),
    the profile's workload as the gRPC users send it (greedy, min_tokens = max_tokens), reported to locust.
    TTFT: the first chunk with non-empty content, as the other users count it."""
    import requests

    n = PROFILE.max_tokens(rng)
    body = {"model": "auto", "messages": [{"role": "user", "content": PROFILE.prompt(rng)}], "max_tokens": n,
            "min_tokens": n, "temperature": 0, "stream": True}
    start, first, pieces, error = time.perf_counter(), None, [], None
    try:
        with session.post(f"{FRONT_URL}/v1/chat/completions", json=body, stream=True, timeout=120,
                          headers={"authorization": f"Bearer {tenant['api_key']}"}) as resp:
            if resp.status_code != 200:  # OpenAI's error body, with the real status
                try:
                    message = resp.json()["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = resp.text[:500]
                raise error_from_text(message, resp.status_code)
            for raw in resp.iter_lines(chunk_size=None):  # each SSE line as it arrives
                event = parse_line(raw)
                piece = event_text(event) if event is not None else ""
                if piece:
                    first = first if first is not None else time.perf_counter()
                    pieces.append(piece)
    except (LLMError, StreamError, requests.RequestException, ValueError) as e:
        error = e
    end = time.perf_counter()
    report("front-chat", tenant["name"], start, first, end, "".join(pieces), error)


class FrontChatUser(_LLMUser):
    """OpenAI SSE streaming chat on the front, per-tenant keys (only when LLM_FRONT_URL names a front)."""
    weight = PROFILE.users.get("front_chat", 0) if FRONT_URL else 0

    def on_start(self):
        import requests

        super().on_start()
        self.session = requests.Session()  # keep-alive per user, as an SDK client does

    def on_stop(self):
        self.session.close()

    @task
    def generate(self):
        self.budget()
        front_chat_request(self.session, self.rng, PROFILE.pick_tenant(self.rng))
