"""How many requests one gateway admits and settles per second: the front's two lease operations per
request (admit, then settle), with no engine stream between them, against a real stack.

Every request of the front crosses the gateway's one stub twice, and its event loop does that work one
request at a time; what it spends per request bounds the request rate of the whole server (at 128 tokens
a request, 25,000 tok/s is 195 requests/s) and, once requests queue for it, the time to first token. This
process plays the front (its DirectEngine, uvloop where installed) and reports, per concurrency level:
requests (admit + settle pairs) per second, the admit's latency p50/p95, and the CPU of the gateway's stub
and of tritonserver per request.

    python benchmarks/admission_bench.py [--concurrency 16,64] [--requests 600] [--rounds 3] [--set K=V]
        [--protocol grpc|http|socket|grpc,http] [--tokenize-max-bytes 0,4096] [--prompt-chars N] [--clients K]
        --out FILE
    python benchmarks/admission_bench.py --preprocessor-cost TOKENIZER_DIR --out FILE
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import write_json  # noqa: E402
from benchmarks.triton_bench import BENCH_KEY, bench_gateway_config, cpu_seconds  # noqa: E402
from build.render import parse_sets  # noqa: E402
from contracts.measures import percentile, throughput  # noqa: E402
from front.engine_direct import DirectEngine  # noqa: E402
from front.engine_http import EngineHttpClient  # noqa: E402
from front.gateway_client import GatewayClient  # noqa: E402
from front.lease_socket import LeaseSocketClient  # noqa: E402
from front.openai_schema import GatewayCall  # noqa: E402
from front.prompt_prep import DEFAULT_MAX_BYTES, PromptPreparer  # noqa: E402
from launcher.local import LocalStack  # noqa: E402
from text.preprocess import Preprocessor  # noqa: E402
from text.tokenization import TokenizerBundle  # noqa: E402


PROMPT = "Say hello in one short sentence, please."


async def admit_and_settle(url: str, front_key: str, n: int, concurrency: int, server_pid: int,
                           http_url: str | None = None, prepare: PromptPreparer | None = None,
                           prompt: str = PROMPT, socket_path: str | None = None, together=None) -> dict:
    """`http_url`: the lease operations over Triton's HTTP generate_stream (the front's default with its
    engine read over HTTP), else over gRPC; `socket_path` too: on the gateway's lease socket once it is open
    (the front's default where the launcher gives it one). `prepare`: the prompt tokenized here, as the front
    does (front/prompt_prep.py), else by the gateway's call to preprocessing. `together`: a barrier this
    process waits at before and after the measured pairs, with the other clients (`several_clients`)."""
    ops = EngineHttpClient(http_url) if http_url else None
    lease_socket = LeaseSocketClient(socket_path) if socket_path else None
    direct = DirectEngine(GatewayClient(url), front_key, detokenizer=None, operations_http=ops, prepare=prepare,
                          lease_socket=lease_socket)
    call = GatewayCall(text=prompt, max_tokens=128)
    admits: list[float] = []

    async def one():
        t0 = time.perf_counter()
        grant = await direct.admit(call, BENCH_KEY)
        admits.append(time.perf_counter() - t0)
        await direct.settles.settle({"id": grant["lease"], "num_output_tokens": 128, "outcome": "success",
                                     "finish_reason": "length", "ttft_s": 0.05, "itl_s": 0.01})

    async def worker(k: int):
        for _ in range(k):
            await one()

    await asyncio.gather(*(one() for _ in range(concurrency)))  # warm: the channel, the tenant's state
    if lease_socket is not None:  # its connection opened in the background meanwhile
        for _ in range(50):
            if lease_socket.ready():
                break
            await asyncio.sleep(0.1)
        else:
            raise RuntimeError(f"the gateway's lease socket {socket_path} did not open")
        await asyncio.gather(*(one() for _ in range(concurrency)))
    admits.clear()
    per = [n // concurrency + (1 if i < n % concurrency else 0) for i in range(concurrency)]
    if together is not None:
        together.wait()  # the others are warm too
    before = cpu_seconds(server_pid)
    wall0 = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in per))
    wall1 = time.perf_counter()
    after = cpu_seconds(server_pid)
    if together is not None:
        together.wait()  # the parent reads the server's CPU once every client is done
    await direct.gateway.close()
    if ops is not None:
        await ops.close()
    if lease_socket is not None:
        await lease_socket.close()
    return {"concurrency": concurrency, "protocol": "socket" if socket_path else "http" if http_url else "grpc",
            "prompt_chars": len(prompt), "tokenized_by": "front" if prepare is not None else "gateway",
            **_measured(n, wall0, wall1, admits, before, after),
            "window": [wall0, wall1], "admit_s": admits}  # for several_clients; main drops them


def _measured(n: int, wall0: float, wall1: float, admits: list[float], before: dict, after: dict) -> dict:
    """What a level reports of its `n` pairs: their rate, the admit's latency, and CPU µs per pair by process
    (`cpu_seconds` read before and after)."""
    cpu = {name: round((after[name] - before[name]) / n * 1e6, 1) for name in after
           if name in before and (name in ("client", "tritonserver") or name.startswith(("gateway", "preprocessing")))}
    return {"requests": n, "requests_per_s": round(throughput(n, wall0, wall1), 1),
            "admit_ms": {p: round(percentile(admits, p) * 1e3, 2) for p in (50, 95)},
            "cpu_us_per_request": cpu, "loadavg_1_5_15": list(os.getloadavg())}


def _client(kwargs: dict, together, results) -> None:
    tokenizer_dir, max_bytes = kwargs.pop("tokenizer_dir"), kwargs.pop("max_bytes")
    prepare = (PromptPreparer(Preprocessor(TokenizerBundle.load(tokenizer_dir), None), max_bytes)
               if tokenizer_dir else None)
    results.put(run_loop(admit_and_settle(**kwargs, prepare=prepare, together=together)))


def several_clients(clients: int, n: int, concurrency: int, server_pid: int, **kwargs) -> dict:
    """The pairs from `clients` processes at once, each with its share of the requests and of the
    concurrency: as the front's workers send them, each its own admits and settles grouped apart. One
    process alone alternates with the gateway (each waits for the other's answers in turn: both half idle
    on 2 cores); several overlap. The server's CPU is read here around all of them."""
    ctx = multiprocessing.get_context("spawn")
    together, results = ctx.Barrier(clients + 1), ctx.Queue()
    shares = [(n // clients + (1 if i < n % clients else 0), concurrency // clients + (1 if i < concurrency % clients else 0))
              for i in range(clients)]
    procs = [ctx.Process(target=_client, args=(dict(kwargs, n=k, concurrency=c, server_pid=server_pid), together, results))
             for k, c in shares]
    for proc in procs:
        proc.start()
    together.wait()
    before = cpu_seconds(server_pid)
    together.wait()
    after = cpu_seconds(server_pid)
    got = [results.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
    out = {**got[0], "concurrency": concurrency, "clients": clients,
           **_measured(n, min(g["window"][0] for g in got), max(g["window"][1] for g in got),
                       [a for g in got for a in g["admit_s"]], before, after)}
    # "client" above is this process, which only waits: the clients' own CPU instead
    out["cpu_us_per_request"]["client"] = round(sum(g["cpu_us_per_request"]["client"] * g["requests"]
                                                    for g in got) / n, 1)
    return out


def preprocessor_cost(tokenizer_dir: str, source: Path = ROOT / "README.md") -> list[dict]:
    """How long the front's tokenizing of a prompt holds its event loop, by prompt size: the first
    characters of `source`, as a text prompt and as a chat message."""
    preprocess = Preprocessor(TokenizerBundle.load(tokenizer_dir), None)
    base, rows = source.read_text(), []
    for n in (41, 256, 1024, 4096, 16384):
        for kind, inputs in (("text", {"query": base[:n]}),
                             ("chat", {"query": None, "messages": json.dumps([{"role": "user", "content": base[:n]}])})):
            tokens = int(preprocess(request_output_len=16, **inputs)["REQUEST_INPUT_LEN"][0][0])
            t0 = time.perf_counter()
            for _ in range(100):
                preprocess(request_output_len=16, **inputs)
            us = (time.perf_counter() - t0) / 100 * 1e6
            rows.append({"characters": n, "kind": kind, "tokens": tokens, "us": round(us, 1),
                         "us_per_token": round(us / tokens, 2)})
    return rows


def run_loop(coro):
    try:
        import uvloop
        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="16,64", help="requests in flight, per level")
    ap.add_argument("--requests", type=int, default=600, help="admit + settle pairs per level and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                    help="a render knob for the stack (docs/knobs.md), e.g. gateway_response_threads=4")
    ap.add_argument("--protocol", default="grpc", help="the lease operations over grpc, http (Triton's "
                    "generate_stream) or socket (the gateway's lease socket), or several (grpc,http,socket: "
                    "alternated within each round)")
    ap.add_argument("--tokenize-max-bytes", default=str(DEFAULT_MAX_BYTES),
                    help="prompts up to this size tokenized by this process as the front does (its "
                         "--tokenize-max-bytes), else by the gateway; 0: the gateway; a list such as 0,4096: "
                         "alternated within each round")
    ap.add_argument("--prompt-chars", type=int, default=len(PROMPT),
                    help="the prompt's length: its short sentence repeated to this many characters")
    ap.add_argument("--clients", type=int, default=1,
                    help="processes playing the front, each with its share of the requests and of the "
                         "concurrency (as the front's --workers): 1 alternates with the gateway, several overlap")
    ap.add_argument("--out", required=True)
    ap.add_argument("--preprocessor-cost", metavar="TOKENIZER_DIR",
                    help="only measure the front's tokenizing by prompt size (no stack) with this tokenizer")
    args = ap.parse_args()
    if args.preprocessor_cost:
        write_json(args.out, {"preprocessor_cost": preprocessor_cost(args.preprocessor_cost)}, args)
        return
    levels = [int(c) for c in args.concurrency.split(",")]
    runs = []
    # the simulated engine (no weights to load: a GPU host has none), which no admit + settle pair reaches,
    # with room in its KV cache for every lease in flight (the gateway admits by it: gateway/admission.py)
    stack = LocalStack(overrides={"simulated_engine": "true",
                                  "max_tokens_in_paged_kv_cache": str(4 * max(levels) * 1024)})
    stack.overrides["gateway_config"] = str(bench_gateway_config(stack.workdir / "bench-gateway.yaml", BENCH_KEY))
    stack.overrides["gateway_max_inflight"] = str(4 * max(levels))  # admission slots are not what is measured
    stack.overrides.update(parse_sets(args.set))
    prompt = ((PROMPT + " ") * (args.prompt_chars // len(PROMPT) + 1))[:args.prompt_chars]
    with stack:
        tokenizer = TokenizerBundle.load(stack.stack.tokenizer_dir())
        for r in range(args.rounds):
            for c in levels:
                for protocol, max_bytes in itertools.product(args.protocol.split(","), args.tokenize_max_bytes.split(",")):
                    prepare = PromptPreparer(Preprocessor(tokenizer, None), int(max_bytes)) if int(max_bytes) else None
                    kwargs = dict(url=stack.grpc_url, front_key=stack.stack.front_key,
                                  http_url=stack.http_url if protocol != "grpc" else None, prompt=prompt,
                                  socket_path=stack.stack.env["LLM_GATEWAY_SOCKET"] if protocol == "socket" else None)
                    if args.clients > 1:  # each process tokenizes as the front does, with its own tokenizer
                        got = several_clients(args.clients, args.requests, c, stack.proc.pid,
                                              tokenizer_dir=str(stack.stack.tokenizer_dir()) if prepare else None,
                                              max_bytes=int(max_bytes), **kwargs)
                    else:
                        got = run_loop(admit_and_settle(n=args.requests, concurrency=c, server_pid=stack.proc.pid,
                                                        prepare=prepare, **kwargs))
                    got["round"] = r + 1
                    for raw in ("window", "admit_s"):
                        got.pop(raw)
                    runs.append(got)
                    print(got, flush=True)
    write_json(args.out, {"runs": runs}, args)


if __name__ == "__main__":
    main()
