"""Capacity of the serving path around the engine: how many streamed tokens per second Triton, the
gateway and the front carry when the engine is as fast as an H100, and what each process spends per token.

    python benchmarks/capacity_bench.py [--levels 16,64,256,1024] [--layers ensemble,gateway,front]
        [--duration 20] [--clients 8] [--engine-instances 2] [--front-workers 1] [--itl-ms 10] [--ttft-ms 30]
        [--prompt-tokens 64] [--output-tokens 128] [--end drain|cancel] [--adapter NAME]
        [--out benchmarks/results/capacity.json]

The engine is the SIMULATED GPU engine (cpu_engine/simulated_gpu.py, a test double: no model, one token
per stream every --itl-ms, the first after --ttft-ms), so what is measured is everything else. Each level
runs each layer for --duration seconds: `streams` concurrent streams spread over --clients client
processes (asyncio), each stream sending one request after another (64-token prompts or --prompt-tokens,
128 tokens or --output-tokens, greedy, streaming): gRPC to `ensemble`, gRPC to `gateway` (API key), or SSE
`POST /v1/completions` on the front; the engine model itself over gRPC or HTTP (`engine_grpc`, `engine_http`),
or over HTTP through a TCP relay (`engine_relay`: benchmarks/peer/tcp_relay.py, the floor of any process
between the engine and a client: one wake-up, one read and one write per token, counted as `relay`).
Counted over the window after a warm-up of --warmup seconds: streamed tokens per second (content chunks:
one token each from this engine at stream_interval 1), TTFT and inter-token latency (ITL: the gaps between
a stream's chunks) p50/p95/p99, and CPU microseconds per streamed token of every process: tritonserver,
each Python stub by model instance, the front and the clients. The ideal is streams x 1000 / itl_ms tok/s.
At the window's end the requests in flight finish (--end drain) or all disconnect at once (--end cancel,
a disconnect storm); for the front the report says how its abandoned engine streams ended
(`front_engine_stops`: the engine's stop, or a cancelled call), the window's text events by lane
(`front_text_events`: from the engine's read, or through the body's generator) and the window's passes of
its cyclic collector (`front_gc`: by generation, the objects they found in reference cycles and the ms they
stalled its loop). With --adapter the front's and the gateway's requests name a LoRA adapter as their model
(one adapter folder the simulated engine is given, which it takes as a task id and ignores): what an
adapter's request costs each process.
`summary()` tabulates several reports (docs/benchmarks.md, On 16 cores); benchmarks/device/capacity.sh runs
plans of this on a borrowed host.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import machine, write_json  # noqa: E402
from benchmarks.triton_bench import BENCH_KEY, bench_gateway_config, cpu_seconds  # noqa: E402
from loadtest.matrix import PROMPT_TOKENS, make_prompts  # noqa: E402
from contracts.measures import percentile, throughput  # noqa: E402
from front.token_lane import CHOICES as TOKEN_LANES  # noqa: E402

LAYERS = ("ensemble", "gateway", "front")
# the engine model read directly (token ids out, no text), over each of Triton's protocols: what reading a
# token costs a client and tritonserver over gRPC (what the front does) against HTTP generate_stream (SSE);
# engine_relay: generate_stream through a TCP relay (benchmarks/peer/tcp_relay.py), the floor peer of the
# front's CPU per token (a wake-up, a read and a write, nothing parsed)
ENGINE_LAYERS = ("engine_grpc", "engine_http", "engine_relay")
HTTP_LAYERS = ("front", "engine_http", "engine_relay")  # whose clients speak HTTP (aiohttp), not gRPC
OUTPUT_TOKENS = 128  # per request, unless --output-tokens
DRAIN_S = 30.0  # --end drain: how long the requests in flight at the window's end may take to finish


# -- client processes ------------------------------------------------------------------------------------
async def _grpc_stream(client, model: str, prompt: str, headers, n_out: int, on_chunk, asked: str = "auto") -> None:
    from contracts.tensors import ENSEMBLE, GATEWAY
    from contracts.grpc_inputs import grpc_input

    contract = GATEWAY if model == "gateway" else ENSEMBLE
    values = {"text_input": prompt, "max_tokens": n_out, "stream": True, "temperature": 0.0}
    if model == "gateway":
        values["ignore_eos"] = True
        if asked != "auto":
            values["model"] = asked
    inputs = [grpc_input(contract, name, [[value]]) for name, value in values.items()]
    await _count_chunks(client, model, inputs, headers, "text_output", on_chunk)


async def _count_chunks(client, model: str, inputs: list, headers, output: str, on_chunk) -> None:
    """One streaming request over gRPC: on_chunk() per response whose `output` is not empty."""
    done = asyncio.Event()

    async def requests():
        yield {"model_name": model, "inputs": inputs,
               "parameters": {"triton_enable_empty_final_response": True}}
        await done.wait()

    try:
        async for result, error in client.stream_infer(requests(), headers=headers):
            if error is not None:
                raise RuntimeError(f"{model}: {error}")
            out = result.as_numpy(output)
            if out is not None and out.size and (out.dtype != object or out.reshape(-1)[0]):  # text: not ""
                on_chunk()
            if result.get_response().parameters["triton_final_response"].bool_param:
                return
    finally:
        done.set()


async def _front_stream(session, url: str, prompt: str, n_out: int, on_chunk, asked: str = "auto") -> None:
    body = {"model": asked, "prompt": prompt, "max_tokens": n_out, "ignore_eos": True,
            "temperature": 0, "stream": True}
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"front: HTTP {resp.status}: {(await resp.text())[:300]}")
        async for line in resp.content:
            if line.startswith(b"data: {") and b'"text":""' not in line:  # the front's JSON is compact
                on_chunk()


def _engine_values(prompt_ids: list[int], n_out: int) -> dict:
    return {"input_ids": [prompt_ids], "input_lengths": [[len(prompt_ids)]], "request_output_len": [[n_out]],
            "streaming": [[True]]}


async def _engine_grpc_stream(client, prompt_ids: list[int], n_out: int, on_chunk) -> None:
    from contracts.tensors import ENGINE
    from contracts.grpc_inputs import grpc_input

    inputs = [grpc_input(ENGINE, name, value) for name, value in _engine_values(prompt_ids, n_out).items()]
    await _count_chunks(client, "tensorrt_llm", inputs, None, "output_ids", on_chunk)


async def _engine_http_stream(session, url: str, prompt_ids: list[int], n_out: int, on_chunk) -> None:
    """Triton's generate_stream: a JSON body of the engine's inputs (a batch of one is implicit), one SSE
    `data:` event per response; each is parsed, as a front would have to."""
    body = {name: value[0] if len(value[0]) > 1 else value[0][0]
            for name, value in _engine_values(prompt_ids, n_out).items()}
    async with session.post(f"{url}/v2/models/tensorrt_llm/generate_stream", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"engine_http: HTTP {resp.status}: {(await resp.text())[:300]}")
        async for line in resp.content:
            if line.startswith(b"data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"engine_http: {event['error'][:200]}")
                if event.get("output_ids"):
                    on_chunk()


def client_process(layer: str, target: str, api_key: str, streams: int, prompts: list[str], start_at: float,
                   stop_at: float, end: str, out: mp.Queue, n_out: int = OUTPUT_TOKENS, asked: str = "auto") -> None:
    """`streams` streams, each sending requests of `n_out` tokens back to back from start_at until stop_at;
    reports each request's (start, chunk times, end: None where it failed or was cancelled) and the errors.
    `asked`: the model the front's and the gateway's requests name (an adapter's name, --adapter)."""
    async def main():
        requests, errors = [], []
        headers = {"authorization": f"Bearer {api_key}"}
        if layer in HTTP_LAYERS:
            import aiohttp

            session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=headers,
                                            timeout=aiohttp.ClientTimeout(total=None, sock_read=120))
        else:
            import tritonclient.grpc.aio as grpcaio

            client = grpcaio.InferenceServerClient(target)
        await asyncio.sleep(max(0.0, start_at - time.time()))

        async def stream(i):
            n = 0
            while time.time() < stop_at:
                chunks: list[float] = []
                begin = time.time()
                prompt = prompts[(i * 7919 + n) % len(prompts)]
                n += 1
                try:
                    if layer == "front":
                        await _front_stream(session, target, prompt, n_out, lambda: chunks.append(time.time()), asked)
                    elif layer in ("engine_http", "engine_relay"):
                        await _engine_http_stream(session, target, prompt, n_out, lambda: chunks.append(time.time()))
                    elif layer == "engine_grpc":
                        await _engine_grpc_stream(client, prompt, n_out, lambda: chunks.append(time.time()))
                    else:
                        await _grpc_stream(client, layer, prompt, headers if layer == "gateway" else None, n_out,
                                           lambda: chunks.append(time.time()), asked)
                except asyncio.CancelledError:
                    requests.append((begin, chunks, None))
                    raise
                except Exception as e:  # noqa: BLE001 - counted and reported
                    errors.append(str(e)[:200])
                    await asyncio.sleep(0.5)
                    requests.append((begin, chunks, None))
                    continue
                requests.append((begin, chunks, time.time()))

        tasks = [asyncio.ensure_future(stream(i)) for i in range(streams)]
        await asyncio.sleep(max(0.0, stop_at - time.time()))
        if end == "drain":  # the window is over: no new request starts; those in flight finish
            await asyncio.wait(tasks, timeout=DRAIN_S)
        for t in tasks:  # whatever is still in flight stops here (a client disconnect)
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if layer in HTTP_LAYERS:
            await session.close()
        else:
            await client.close()
        return requests, errors

    requests, errors = asyncio.run(main())
    out.put((requests, errors))


# -- measurement ---------------------------------------------------------------------------------------------
def server_cpu(server_pid: int, front_pid: int | None, relay_pid: int | None = None) -> dict[str, float]:
    """CPU seconds so far of tritonserver, each Python stub (by model instance), the front and the relay."""
    import psutil

    out = cpu_seconds(server_pid, front_pid)
    out.pop("client", None)  # this process only waits; the client processes are counted apart
    if relay_pid:
        out["relay"] = _cpu(psutil.Process(relay_pid))
    return out


def context_switches(pids: list[int]) -> dict[str, int]:
    """The context switches so far of every thread of these processes (and their children: the front's
    workers): `voluntary`, each a sleep that a wake-up ends (a token's read waited for), and `involuntary`,
    preemptions. A wake-up that crosses cores costs each side several times its cost on one core on some
    hosts (benchmarks/wakeup_bench.py), so the wake-ups a token say how much of a process's CPU a token is
    that and not its own work."""
    import psutil

    counts = {"voluntary": 0, "involuntary": 0}
    procs = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            procs += [proc, *proc.children(recursive=True)]
        except psutil.Error:
            continue
    for proc in procs:
        for task in Path(f"/proc/{proc.pid}/task").glob("*"):
            try:
                for line in (task / "status").read_text().splitlines():
                    if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                        counts["voluntary" if line[0] == "v" else "involuntary"] += int(line.split()[1])
            except OSError:  # a thread that ended meanwhile
                continue
    return counts


def run_layer(layer: str, target: str, api_key: str, streams: int, clients: int, prompts: list[str],
              duration: float, warmup: float, server_pid: int, front_pid: int | None, end: str = "drain",
              front_metrics: str | None = None, relay_pid: int | None = None, n_out: int = OUTPUT_TOKENS,
              server_metrics: str | None = None, asked: str = "auto") -> dict:
    """`server_metrics`: Triton's /metrics, for the gateway's collector pauses in the window. `asked`: see
    client_process."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    per = [streams // clients + (1 if i < streams % clients else 0) for i in range(clients)]
    start_at = time.time() + 3.0  # the client processes start (imports) before the window opens
    stop_at = start_at + warmup + duration
    procs = [ctx.Process(target=client_process,
                         args=(layer, target, api_key, n, prompts, start_at, stop_at, end, queue, n_out, asked))
             for n in per if n > 0]
    for p in procs:
        p.start()
    import psutil

    time.sleep(max(0.0, start_at + warmup - time.time()))
    window_start = time.time()
    cpu0 = server_cpu(server_pid, front_pid, relay_pid)
    client_cpu0 = sum(_cpu(psutil.Process(p.pid)) for p in procs)
    watched = {"front": [front_pid] if front_pid else [], "relay": [relay_pid] if relay_pid else [],
               "clients": [p.pid for p in procs]}
    switches0 = {name: context_switches(pids) for name, pids in watched.items() if pids}
    lanes0 = _text_events(front_metrics) if front_metrics else {}
    gc0 = _gc_passes(front_metrics) if front_metrics else {}
    leases0 = _lease_waits(front_metrics) if front_metrics else {}
    gateway_gc0 = _gateway_gc_ms(server_metrics) if server_metrics else {}
    time.sleep(max(0.0, stop_at - time.time()))
    window_end = time.time()
    lanes1 = _text_events(front_metrics) if front_metrics else {}
    gc1 = _gc_passes(front_metrics) if front_metrics else {}
    leases1 = _lease_waits(front_metrics) if front_metrics else {}
    gateway_gc1 = _gateway_gc_ms(server_metrics) if server_metrics else {}
    cpu1 = server_cpu(server_pid, front_pid, relay_pid)
    client_cpu1 = sum(_cpu(psutil.Process(p.pid)) for p in procs)
    switches1 = {name: context_switches(watched[name]) for name in switches0}
    results = [queue.get(timeout=120 + DRAIN_S) for _ in procs]
    for p in procs:
        p.join(30)
    chunks_in_window, ttft, itl, tail, errors, completed = 0, [], [], [], [], 0
    for requests, errs in results:
        errors += errs
        for begin, chunks, ended in requests:
            if chunks and ended and window_start <= chunks[-1] < window_end:
                tail.append(ended - chunks[-1])
            chunks_in_window += sum(1 for t in chunks if window_start <= t < window_end)
            if chunks and window_start <= begin < window_end:
                ttft.append(chunks[0] - begin)
            itl += [b - a for a, b in zip(chunks, chunks[1:]) if window_start <= a and b < window_end]
            completed += len(chunks) >= n_out and window_start <= chunks[-1] < window_end
    span = window_end - window_start
    tokens = max(chunks_in_window, 1)
    stops = _engine_stops(front_metrics) if front_metrics else {}
    cpu = {k: cpu1[k] - cpu0[k] for k in cpu1 if k in cpu0}
    cpu["clients"] = client_cpu1 - client_cpu0
    ms = lambda xs, q: round(1000 * percentile(sorted(xs), q), 2) if xs else None  # noqa: E731
    return {"layer": layer, "streams": streams, "window_s": round(span, 2),
            "tok_s": round(throughput(chunks_in_window, window_start, window_end), 1),
            "completed_requests": completed, "errors": len(errors), "error_examples": sorted(set(errors))[:3],
            "ttft_ms": {"p50": ms(ttft, 50), "p95": ms(ttft, 95), "p99": ms(ttft, 99)},
            "itl_ms": {"p50": ms(itl, 50), "p95": ms(itl, 95), "p99": ms(itl, 99)},
            # from a request's last token to its end (the front's finish event and [DONE], the stream's close):
            # with the TTFT, what a stream waits per request beyond its tokens' pace
            "tail_ms": {"p50": ms(tail, 50), "p95": ms(tail, 95), "p99": ms(tail, 99)},
            "cpu_cores": {k: round(throughput(v, window_start, window_end), 3) for k, v in sorted(cpu.items())},
            "cpu_us_per_token": {k: round(1e6 * v / tokens, 1) for k, v in sorted(cpu.items())},
            # the front's, the relay's and the clients' context switches a streamed token: voluntary ones are
            # wake-ups (`context_switches`)
            "switches_per_token": {name: {kind: round((switches1[name][kind] - switches0[name][kind]) / tokens, 3)
                                          for kind in switches0[name]} for name in switches0},
            # how the front's abandoned engine streams have ended so far (front/engine_direct.py EngineStream)
            **({"front_engine_stops": stops} if stops else {}),
            # the window's text events by lane: written from the engine's read (direct) or through the body's
            # generator and ASGI `send` (front/app.py _SseText), counted as each stream ends
            **({"front_text_events": {lane: lanes1[lane] - lanes0[lane] for lane in lanes1}} if lanes1 else {}),
            # the window's passes of the front's cyclic collector by generation (2: the whole heap, every
            # stream stalled meanwhile), and the objects they found in reference cycles
            **({"front_gc": {k: {g: gc1[k][g] - gc0[k][g] for g in gc1[k]} for k in gc1}} if gc1 else {}),
            # how long a request of the window waited for the gateway's answer to its admit and its settle, on
            # average (the front's llm_front_lease_operation_seconds): part of its TTFT and of its tail
            **({"front_lease_wait_ms": _mean_waits(leases0, leases1)} if leases1 else {}),
            # the ms the gateway's process stood still in its cyclic collector in the window, by generation
            **({"gateway_gc_pause_ms": {g: gateway_gc1[g] - gateway_gc0[g] for g in gateway_gc1}}
               if gateway_gc1 else {})}


def _metric_counts(metrics_url: str, name: str, label: str, values: tuple[str, ...], scale: int = 1) -> dict:
    """A counter (the front's, or Triton's) by one label's values (summed over the others), times `scale`,
    whole."""
    import urllib.request

    from clients.prometheus import metric_value

    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return {v: round(scale * (metric_value(text, name, **{label: v}) or 0)) for v in values}


def _text_events(metrics_url: str) -> dict:
    """llm_front_sse_text_events_total by lane, all routes."""
    return _metric_counts(metrics_url, "llm_front_sse_text_events_total", "lane", ("direct", "send"))


def _gc_passes(metrics_url: str) -> dict:
    """The front's cyclic collector so far: passes and objects collected, by generation."""
    passes = {key: _metric_counts(metrics_url, f"python_gc_{name}_total", "generation", ("0", "1", "2"))
              for key, name in (("passes", "collections"), ("collected", "objects_collected"))}
    return {**passes, "pause_ms": _metric_counts(metrics_url, "llm_front_gc_pause_seconds_sum", "generation",
                                                ("0", "1", "2"), scale=1000)}


def _gateway_gc_ms(metrics_url: str) -> dict:
    """gateway_gc_pause_seconds_total by generation so far, in ms."""
    return _metric_counts(metrics_url, "gateway_gc_pause_seconds_total", "generation", ("0", "1", "2"), scale=1000)


def _lease_waits(metrics_url: str) -> dict:
    """The front's waits for the gateway's lease answers so far, by operation: how many, and their µs."""
    ops = ("admit", "settle")
    return {"count": _metric_counts(metrics_url, "llm_front_lease_operation_seconds_count", "operation", ops),
            "us": _metric_counts(metrics_url, "llm_front_lease_operation_seconds_sum", "operation", ops, scale=10**6)}


def _mean_waits(before: dict, after: dict) -> dict:
    """Each operation's mean wait in ms between two `_lease_waits` readings (None where there was none)."""
    out = {}
    for op, n in after["count"].items():
        k = n - before["count"][op]
        out[op] = round((after["us"][op] - before["us"][op]) / k / 1000, 3) if k > 0 else None
    return out


def _engine_stops(metrics_url: str) -> dict:
    """llm_front_engine_stops_total by `how` once the streams abandoned at the window's end have ended
    (the count holds still for a second; at most the front's DRAIN_MAX_S and a little)."""
    from front.gateway_client import DRAIN_MAX_S

    deadline, last = time.time() + DRAIN_MAX_S + 5, None
    while (now := _metric_counts(metrics_url, "llm_front_engine_stops_total", "how", ("stop", "cancel"))) != last \
            and time.time() < deadline:
        last = now
        time.sleep(1.0)
    return now


def start_relay(target: str, fast_lane: str | None = None, nap_ms: float = 0.0):
    """benchmarks/peer/tcp_relay.py in front of `target` (host:port): (its process, its URL) once it accepts.
    `fast_lane`: its --fast-lane diagnostic, the lane as the front's --token-lane; `nap_ms`: its --nap-ms."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "peer" / "tcp_relay.py"),
                             "--listen", f"127.0.0.1:{port}", "--to", target, *(["--fast-lane", fast_lane] if fast_lane else []),
                             *(["--nap-ms", str(nap_ms)] if nap_ms else [])])
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the TCP relay (benchmarks/peer/tcp_relay.py) did not start")


def _cpu(p) -> float:
    try:
        t = p.cpu_times()
        return t.user + t.system + t.children_user + t.children_system
    except Exception:  # noqa: BLE001 - a client that already exited
        return 0.0


def markdown(report: dict) -> str:
    w = report["workload"]
    rows = [f"Simulated GPU engine: first token after {w['ttft_ms']} ms, {w['itl_ms']} ms between tokens, "
            f"{w['engine_instances']} engine instance(s); {w['duration_s']} s windows after {w['warmup_s']} s of "
            f"warm-up; {w['clients']} client processes; {w.get('prompt_tokens', PROMPT_TOKENS)}-token prompts, "
            f"{w.get('output_tokens', OUTPUT_TOKENS)} tokens per request; {w.get('front_workers', 1)} front worker(s); "
            f"at the window's end the requests in flight "
            f"{'finish' if w.get('end') == 'drain' else 'are cancelled (clients disconnect)'}.", "",
            "| streams | layer | tok/s | ideal | TTFT p50 / p95 / p99 (ms) | ITL p50 / p95 / p99 (ms) | errors | "
            "CPU µs per token (by process) |", "|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        ideal = r["streams"] * 1000 / w["itl_ms"]
        cpu = ", ".join(f"{k} {v:.0f}" for k, v in r["cpu_us_per_token"].items() if v >= 1)
        if r.get("tritonserver_restarted"):
            cpu += " (tritonserver died in this run and was replaced)"
        rows.append(f"| {r['streams']} | {r['layer']} | {r['tok_s']:.0f} | {ideal:.0f} | "
                    f"{' / '.join(str(r['ttft_ms'][q]) for q in ('p50', 'p95', 'p99'))} | "
                    f"{' / '.join(str(r['itl_ms'][q]) for q in ('p50', 'p95', 'p99'))} | {r['errors']} | {cpu} |")
    m = report["machine"]
    rows += ["", f"Machine: {m['cpu']}, {m['cores']} cores (flags: {' '.join(m.get('cpu_flags', []))}); "
                 f"{report['date']}. Command: `{report['command']}`."]
    return "\n".join(rows) + "\n"


def summary(reports: dict[str, dict]) -> str:
    """One row per run of several reports ({name: report}): the figures docs/benchmarks.md compares across
    worker counts and runs (tok/s against the ideal, TTFT p95, ITL p99, the front's and tritonserver's CPU
    per token, errors and how the run ended)."""
    rows = ["| report | engine instances | front workers | streams | layer | tok/s | ideal | TTFT p95 (ms) | "
            "ITL p99 (ms) | front µs/token | tritonserver µs/token | errors | note |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, report in reports.items():
        w = report["workload"]
        for r in report["runs"]:
            cpu = r["cpu_us_per_token"]
            notes = []
            if r.get("tritonserver_restarted"):
                notes.append("tritonserver died and was replaced")
            elif r["tok_s"] == 0:
                notes.append("no token: the server did not answer")
            if r["errors"]:
                notes.append(", ".join(e.split(": ")[1] if ": " in e else e for e in r["error_examples"])[:60])
            if r.get("front_engine_stops"):
                notes.append("abandoned streams ended by " + ", ".join(f"{k} {v}" for k, v in r["front_engine_stops"].items()))
            front = r["layer"] == "front"
            counted = r["tok_s"] > 0 and not r.get("tritonserver_restarted")  # CPU of the process that served it
            front_us = f"{cpu.get('front', 0):.0f}" if front and r["tok_s"] > 0 else "-"
            triton_us = f"{cpu.get('tritonserver', 0):.0f}" if counted else "-"
            rows.append(f"| {name} | {w['engine_instances']} | {w.get('front_workers', 1) if front else '-'} | "
                        f"{r['streams']} | {r['layer']} | {r['tok_s']:.0f} | {r['streams'] * 1000 / w['itl_ms']:.0f} | "
                        f"{r['ttft_ms']['p95']} | {r['itl_ms']['p99']} | {front_us} | {triton_us} | {r['errors']} | "
                        f"{'; '.join(notes)} |")
    return "\n".join(rows) + "\n"


def tails(reports: dict[str, dict]) -> str:
    """One row per run that has tails: what a request waits for beyond its tokens' pace (its first token,
    and its end after its last token), the requests it completed a second and the gateway's cores."""
    rows = ["| report | output tokens | front workers | streams | layer | tok/s | requests/s | TTFT p50 (ms) | "
            "tail p50 / p95 (ms) | gateway cores |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, report in reports.items():
        w = report["workload"]
        for r in report["runs"]:
            if "tail_ms" not in r:
                continue
            front = r["layer"] == "front"
            rows.append(f"| {name} | {w.get('output_tokens', OUTPUT_TOKENS)} | {w.get('front_workers', 1) if front else '-'} | "
                        f"{r['streams']} | {r['layer']} | {r['tok_s']:.0f} | {r['completed_requests'] / r['window_s']:.0f} | "
                        f"{r['ttft_ms']['p50']} | {r['tail_ms']['p50']} / {r['tail_ms']['p95']} | "
                        f"{r['cpu_cores'].get('gateway_0_0', 0) if front else '-'} |")
    return "\n".join(rows) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default="16,64,256,1024", help="concurrent streams per level")
    ap.add_argument("--layers", default=",".join(LAYERS),
                    help=f"a subset of {','.join(LAYERS + ENGINE_LAYERS)}")
    ap.add_argument("--duration", type=float, default=20.0, help="measured seconds per layer and level")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds of load before the window opens")
    ap.add_argument("--clients", type=int, default=min(8, os.cpu_count() or 1), help="client processes")
    ap.add_argument("--engine-instances", type=int, default=2, help="instances of the simulated engine model")
    ap.add_argument("--front-workers", type=int, default=1, help="processes of the front (--workers)")
    ap.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                    help="a render knob for the stack (docs/knobs.md), after the benchmark's own")
    ap.add_argument("--itl-ms", type=float, default=10.0, help="simulated time between a stream's tokens")
    ap.add_argument("--ttft-ms", type=float, default=30.0, help="simulated time to first token")
    ap.add_argument("--relay-fast-lane", nargs="?", const="auto", choices=TOKEN_LANES,
                    help="engine_relay: each streamed token also runs through the front's fast lane in the relay "
                         "(tcp_relay.py --fast-lane, a diagnostic: what that path costs in a serving process); "
                         "the value as the front's --token-lane, alone: auto (the compiled lane where built)")
    ap.add_argument("--relay-nap-ms", type=float, default=0.0,
                    help="engine_relay: the relay sleeps this long after each turn of its loop instead of waiting "
                         "for a read (tcp_relay.py --nap-ms, a diagnostic: what its wake-ups cost)")
    ap.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS,
                    help="tokens per prompt (longer: what tokenizing it costs the front or preprocessing shows)")
    ap.add_argument("--output-tokens", type=int, default=OUTPUT_TOKENS,
                    help="tokens per request (fewer: each request's own cost weighs more per token)")
    ap.add_argument("--end", choices=("drain", "cancel"), default="drain",
                    help="at the window's end, let the requests in flight finish (drain) or disconnect them all "
                         "at once (cancel: a disconnect storm; Triton 2.51's gRPC server can abort when many "
                         "of its streams are cancelled at once, see front/gateway_client.py ReadAheadCall)")
    ap.add_argument("--front-engine-protocol", choices=("grpc", "http"),
                    help="how the front reads the engine (its --engine-protocol; unset: the front's default)")
    ap.add_argument("--front-token-lane", choices=TOKEN_LANES,
                    help="the front's per-token path (its --token-lane: front/token_lane.py; unset: its default)")
    ap.add_argument("--front-through-gateway", action="store_true",
                    help="the front streams every request through the gateway (its --no-engine-direct), as it "
                         "does a LoRA adapter's")
    ap.add_argument("--no-lease-socket", action="store_true",
                    help="the front's lease operations through Triton's HTTP, not on the gateway's lease socket "
                         "(LLM_GATEWAY_SOCKET empty; docs/gateway.md)")
    ap.add_argument("--adapter", metavar="NAME",
                    help="the front's and the gateway's requests name this LoRA adapter as their model (a folder "
                         "of that name is the engine's lora_dir; the simulated engine ignores it)")
    ap.add_argument("--out", type=Path, help="the report (.json, and .md beside it)")
    args = ap.parse_args(argv)
    layers = [x for x in args.layers.split(",") if x]
    if not layers or set(layers) - set(LAYERS + ENGINE_LAYERS):
        ap.error(f"--layers: a subset of {','.join(LAYERS + ENGINE_LAYERS)}")
    levels = [int(x) for x in args.levels.split(",")]
    from tokenizers import Tokenizer

    from build.render import DEFAULT_CHECKPOINT, parse_sets
    from launcher.local import LocalStack

    most = max(levels)
    stack = LocalStack(overrides={
        "simulated_engine": "true", "sim_itl_ms": str(args.itl_ms), "sim_ttft_ms": str(args.ttft_ms),
        "engine_instance_count": str(args.engine_instances), "max_engine_batch_size": str(most),
        "gateway_max_inflight": str(most), "gateway_max_queue": str(2 * most), "max_queue_size": str(2 * most),
        # an H100's KV cache holds every stream (the gateway admits by it: gateway/admission.py)
        "max_tokens_in_paged_kv_cache": str(4 * most * 1024),
        "triton_max_batch_size": "64", **parse_sets(args.set)}, front="front" in layers, front_workers=args.front_workers,
        # every client of the bench comes from one loopback address: the front's per-address bound (256 by
        # default, per worker) would refuse the streams of the 1024 level as too_many_connections
        front_args=("--max-connections-per-client", "0",
                    *(("--engine-protocol", args.front_engine_protocol) if args.front_engine_protocol else ()),
                    *(("--token-lane", args.front_token_lane) if args.front_token_lane else ())),
        engine_direct=not args.front_through_gateway, env={"LLM_GATEWAY_SOCKET": ""} if args.no_lease_socket else {})
    # room for a window's streams while the previous window's cancelled ones settle
    stack.overrides["gateway_config"] = str(bench_gateway_config(stack.workdir / "bench-gateway.yaml", BENCH_KEY,
                                                                 max_concurrent=4 * most, adapters=bool(args.adapter)))
    if args.adapter:
        folder = stack.workdir / "loras" / args.adapter
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text("{}")
        stack.overrides["lora_dir"] = str(folder.parent)
    tokenizer = Tokenizer.from_file(str(DEFAULT_CHECKPOINT / "tokenizer.json"))
    prompts = make_prompts(tokenizer, 512, args.prompt_tokens)
    print(f"[capacity] starting the stack (simulated engine, {args.engine_instances} instance(s)) ...",
          file=sys.stderr, flush=True)
    stack.start()
    runs, relay = [], None
    try:
        front_pid = stack.stack.front.pid if stack.stack.front else None
        targets = {"ensemble": stack.grpc_url, "gateway": stack.grpc_url, "front": stack.front_url,
                   "engine_grpc": stack.grpc_url, "engine_http": f"http://{stack.http_url}"}
        if "engine_relay" in layers:
            relay, targets["engine_relay"] = start_relay(stack.http_url, args.relay_fast_lane, args.relay_nap_ms)
        prompt_ids = [tokenizer.encode(p, add_special_tokens=False).ids for p in prompts]
        for streams in levels:
            for layer in layers:
                print(f"[capacity] {streams} streams, {layer} ({args.warmup:g} s warm-up + {args.duration:g} s) ...",
                      file=sys.stderr, flush=True)
                server_pid = stack.proc.pid
                r = run_layer(layer, targets[layer], BENCH_KEY, streams, min(args.clients, streams),
                              prompt_ids if layer in ENGINE_LAYERS else prompts,
                              args.duration, args.warmup, server_pid, front_pid, args.end,
                              f"http://127.0.0.1:{stack.front_metrics_port}/metrics" if layer == "front" else None,
                              relay.pid if layer == "engine_relay" else None, args.output_tokens,
                              stack.metrics_url if layer in ("front", "gateway") else None, args.adapter or "auto")
                if stack.proc.pid != server_pid:  # tritonserver died during the run and was replaced
                    r["tritonserver_restarted"] = True
                runs.append(r)
                print(f"[capacity]   {r['tok_s']:.0f} tok/s, TTFT p95 {r['ttft_ms']['p95']} ms, ITL p99 "
                      f"{r['itl_ms']['p99']} ms, errors {r['errors']}; CPU µs/token {r['cpu_us_per_token']}; "
                      f"wake-ups a token {({k: v['voluntary'] for k, v in r['switches_per_token'].items()})}",
                      file=sys.stderr, flush=True)
    finally:
        if relay is not None:
            relay.terminate()
            relay.wait(10)
        stack.stop()
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
              "command": "python benchmarks/capacity_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "workload": {"itl_ms": args.itl_ms, "ttft_ms": args.ttft_ms, "engine_instances": args.engine_instances,
                           "front_workers": args.front_workers, "end": args.end,
                           **({"relay_fast_lane": args.relay_fast_lane} if args.relay_fast_lane else {}),
                           **({"relay_nap_ms": args.relay_nap_ms} if args.relay_nap_ms else {}),
                           "front_engine_protocol": args.front_engine_protocol,
                           "front_through_gateway": args.front_through_gateway,
                           "duration_s": args.duration, "warmup_s": args.warmup, "clients": args.clients,
                           "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
                           **({"adapter": args.adapter} if args.adapter else {})},
              "runs": runs}
    print(markdown(report))
    if args.out:
        write_json(args.out, report, None)
        args.out.with_suffix(".md").write_text(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
