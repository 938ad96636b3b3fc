"""The fixed benchmark workload, shared by `benchmarks/triton_bench.py` and `loadtest.run --matrix`: the
llama.cpp peer's matrix (64-token prompts, 128 output tokens forced, greedy, streaming; concurrency 1, 4,
16 with 8, 12, 48 requests), one request per layer (gRPC `ensemble`/`gateway`, the front's SSE) and one
run's aggregate figures (genai-perf definitions, `loadtest.metrics`)."""
from __future__ import annotations

import asyncio
import queue
import statistics
import threading
import time

from clients.llm import GenerationResult, LLMClient
from contracts.measures import percentile, throughput
from loadtest.sse import StreamTimeline

MATRIX = ((1, 8), (4, 12), (16, 48))
PROMPT_TOKENS, OUTPUT_TOKENS = 64, 128


def make_prompts(tokenizer, n: int, tokens: int = PROMPT_TOKENS) -> list[str]:
    """n distinct prompts of `tokens` tokens each (ASCII English)."""
    base = ("The history of the city is long and full of surprises: merchants, artists and engineers "
            "came from every corner of the continent, built bridges, markets and libraries, and wrote ")
    words = base.split() * max(4, tokens // 16)
    prompts = []
    for i in range(n):
        text = f"Report {i}: " + " ".join(words)
        ids = tokenizer.encode(text).ids[:tokens]
        prompts.append(tokenizer.decode(ids))
    return prompts


def one_request(url: str, prompt: str, max_tokens: int = OUTPUT_TOKENS, model: str = "ensemble",
                api_key: str | None = None) -> dict:
    """One greedy gRPC stream to `ensemble` (or `gateway`, with `api_key`) with the work fixed
    (min_tokens = max_tokens; the gateway also gets ignore_eos), through the project's client library;
    times from the request's send."""
    result = GenerationResult("")
    client = LLMClient(url, api_key=api_key, model=model, timeout_s=600)
    options = {"ignore_eos": True} if model == "gateway" else {}
    for _ in client.stream(prompt, max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, result=result,
                           **options):
        pass
    end = time.perf_counter()
    if result.num_output_tokens is not None and result.num_output_tokens != max_tokens:
        raise RuntimeError(f"{model}: {result.num_output_tokens} output tokens, not the forced {max_tokens}")
    if result.ttft_s is None:
        raise RuntimeError(f"{model}: the stream ended without any text")
    return {"start": end - result.latency_s, "end": end, "ttft": result.ttft_s, "latency": result.latency_s,
            "chunks": len(result.pieces), "text": result.text}


async def front_request(session, front_url: str, prompt: str, max_tokens: int = OUTPUT_TOKENS,
                        extra: dict | None = None, who: str = "front") -> dict:
    """One greedy SSE stream from the front's `POST /v1/completions` (`session`: an aiohttp session that
    carries the key), the work fixed as for the gateway; TTFT at the first event with non-empty text, as
    the gRPC layers count it. The usage chunk checks the forced length."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    timeline = StreamTimeline()
    async with session.post(front_url.rstrip("/") + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{who}: HTTP {resp.status}: {(await resp.text())[:500]}")
        async for raw in resp.content:  # one SSE line at a time, as it arrives
            timeline.feed(raw)
    end, start, usage = time.perf_counter(), timeline.start, timeline.usage
    if usage is not None and usage.get("completion_tokens") != max_tokens:
        raise RuntimeError(f"{who}: {usage.get('completion_tokens')} output tokens, not the forced {max_tokens}")
    if timeline.first is None:
        raise RuntimeError(f"{who}: the stream ended without any text")
    return {"start": start, "end": end, "ttft": timeline.first - start, "latency": end - start,
            "chunks": len(timeline.pieces), "text": timeline.text}


def front_requests(front_url: str, api_key: str | None, prompts: list[str], concurrency: int,
                   max_tokens: int = OUTPUT_TOKENS, extra: dict | None = None, who: str = "front") -> list[dict]:
    """`concurrency` asyncio workers drain `prompts` on the front, each request on its own connection (as
    each gRPC request of the other layers opens its own channel)."""
    import aiohttp

    async def main():
        todo = iter(prompts)
        results = []
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        timeout = aiohttp.ClientTimeout(total=1200, sock_read=600)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
            async def worker():
                for p in todo:  # one shared iterator: each prompt goes to exactly one worker
                    results.append(await front_request(session, front_url, p, max_tokens, extra, who))

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results

    return asyncio.run(main())


def run_level(url: str, prompts: list[str], concurrency: int, per_request: list | None = None,
              tokenizer=None, output_tokens: int = OUTPUT_TOKENS, request=None) -> dict:
    """`concurrency` workers drain `prompts`; aggregate figures (genai-perf definitions). Per-request
    timelines go to `per_request` when given; with `tokenizer`, output tokens are also re-tokenized.
    `request(prompt, output_tokens)` sends one (default: gRPC streaming to `ensemble` at `url`)."""
    request = request or (lambda p, n: one_request(url, p, n))
    work = queue.Queue()
    for p in prompts:
        work.put(p)
    results, errors, lock = [], [], threading.Lock()

    def worker():
        while not errors:
            try:
                p = work.get_nowait()
            except queue.Empty:
                return
            try:
                r = request(p, output_tokens)
            except BaseException as e:  # noqa: BLE001 - re-raised below, in the caller's thread
                with lock:
                    errors.append(e)
                return
            with lock:
                results.append(r)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return level_row(results, concurrency, per_request, tokenizer, output_tokens)


def run_level_front(front_url: str, api_key: str | None, prompts: list[str], concurrency: int,
                    per_request: list | None = None, tokenizer=None, output_tokens: int = OUTPUT_TOKENS,
                    extra: dict | None = None, who: str = "front") -> dict:
    """run_level's figures for the front, or the peer's OpenAI-compatible server (HTTP SSE, asyncio workers)."""
    results = front_requests(front_url, api_key, prompts, concurrency, output_tokens, extra, who)
    return level_row(results, concurrency, per_request, tokenizer, output_tokens)


def level_row(results: list[dict], concurrency: int, per_request: list | None = None, tokenizer=None,
              output_tokens: int = OUTPUT_TOKENS) -> dict:
    """One run's aggregate figures from its per-request timelines."""
    if per_request is not None:
        per_request.extend({**r, "concurrency": concurrency} for r in results)
    first, last = min(r["start"] for r in results), max(r["end"] for r in results)
    ttft = sorted(r["ttft"] for r in results)
    lat = sorted(r["latency"] for r in results)
    row = {
        "concurrency": concurrency, "requests": len(results),
        "output_tok_s": throughput(len(results) * output_tokens, first, last),
        "ttft_mean": statistics.mean(ttft), "ttft_p50": percentile(ttft, 50), "ttft_p95": percentile(ttft, 95),
        "latency_mean": statistics.mean(lat), "latency_p95": percentile(lat, 95),
        "time_per_output_token_ms": 1000 * statistics.mean(
            (r["latency"] - r["ttft"]) / max(output_tokens - 1, 1) for r in results),
    }
    if tokenizer is not None:  # genai-perf counts the returned text re-tokenized, not engine steps
        counts = [len(tokenizer.encode(r["text"], add_special_tokens=False).ids) for r in results]
        row["retokenized_output_tokens_mean"] = statistics.mean(counts)
        row["retokenized_output_tok_s"] = throughput(sum(counts), first, last)
    return row
