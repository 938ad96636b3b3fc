"""Engine benchmark through Triton: gRPC streaming to `ensemble`, the llama.cpp peer's workload.

    python benchmarks/triton_bench.py [--url 127.0.0.1:8001] [--out benchmarks/results/latest.json]

Without --url it renders the CPU repository and starts its own tritonserver. Workload, as the peer's
(shared/reference/baseline-llama-cpp.md): 64-token prompts, 128 output tokens forced
(min_tokens = max_tokens), greedy, streaming; concurrency 1, 4, 16 with 8, 12, 48 requests, each level
run --repeat times (default 3) and reported by its median run, as the peer's table is. Every prompt
starts differently, so no request reuses another's KV blocks (the peer ran with its prompt cache off).
Reports aggregate output tok/s, TTFT and latency percentiles, the CPU seconds each server process and
the client used per level, and the server's resident memory (tritonserver plus its Python stub processes).
"""
from __future__ import annotations

import argparse
import json
import platform
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clients.llm import GenerationResult, LLMClient  # noqa: E402
from cpu_engine.checkpoint import WEIGHT_DTYPES  # noqa: E402
from cpu_engine.config import resolve_backends  # noqa: E402
from cpu_engine.kernels import BACKENDS  # noqa: E402

MATRIX = ((1, 8), (4, 12), (16, 48))
PROMPT_TOKENS, OUTPUT_TOKENS = 64, 128
PEER = {  # llama.cpp llama-server -np 16, same GGUF, same machine class (reference table)
    1: {"tok_s": 70.8, "ttft_p95": 0.37}, 4: {"tok_s": 83.4, "ttft_p95": 1.43}, 16: {"tok_s": 98.1, "ttft_p95": 5.62},
}


def make_prompts(tokenizer, n: int) -> list[str]:
    base = ("The history of the city is long and full of surprises: merchants, artists and engineers "
            "came from every corner of the continent, built bridges, markets and libraries, and wrote ")
    words = base.split() * 4
    prompts = []
    for i in range(n):
        text = f"Report {i}: " + " ".join(words)
        ids = tokenizer.encode(text).ids[:PROMPT_TOKENS]
        prompts.append(tokenizer.decode(ids))
    return prompts


def one_request(url: str, prompt: str, max_tokens: int = OUTPUT_TOKENS) -> dict:
    """One greedy gRPC stream to `ensemble` with the work fixed (min_tokens = max_tokens), through the
    project's client library; times from the request's send."""
    result = GenerationResult("")
    client = LLMClient(url, model="ensemble", timeout_s=600)
    for _ in client.stream(prompt, max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, result=result):
        pass
    end = time.perf_counter()
    return {"start": end - result.latency_s, "end": end, "ttft": result.ttft_s, "latency": result.latency_s,
            "chunks": len(result.pieces), "text": result.text}


def run_level(url: str, prompts: list[str], concurrency: int, per_request: list | None = None,
              tokenizer=None, output_tokens: int = OUTPUT_TOKENS) -> dict:
    """`concurrency` workers drain `prompts`; aggregate figures (genai-perf definitions). Per-request
    timelines go to `per_request` when given; with `tokenizer`, output tokens are also re-tokenized."""
    work = queue.Queue()
    for p in prompts:
        work.put(p)
    results, lock = [], threading.Lock()

    def worker():
        while True:
            try:
                p = work.get_nowait()
            except queue.Empty:
                return
            r = one_request(url, p, output_tokens)
            with lock:
                results.append(r)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if per_request is not None:
        per_request.extend({**r, "concurrency": concurrency} for r in results)
    first, last = min(r["start"] for r in results), max(r["end"] for r in results)
    ttft = sorted(r["ttft"] for r in results)
    lat = sorted(r["latency"] for r in results)
    pct = lambda xs, q: float(np.percentile(xs, q))  # noqa: E731
    row = {
        "concurrency": concurrency, "requests": len(results),
        "output_tok_s": len(results) * output_tokens / (last - first),
        "ttft_mean": statistics.mean(ttft), "ttft_p50": pct(ttft, 50), "ttft_p95": pct(ttft, 95),
        "latency_mean": statistics.mean(lat), "latency_p95": pct(lat, 95),
        "time_per_output_token_ms": 1000 * statistics.mean(
            (r["latency"] - r["ttft"]) / max(output_tokens - 1, 1) for r in results),
    }
    if tokenizer is not None:  # genai-perf counts the returned text re-tokenized, not engine steps
        counts = [len(tokenizer.encode(r["text"], add_special_tokens=False).ids) for r in results]
        row["retokenized_output_tokens_mean"] = statistics.mean(counts)
        row["retokenized_output_tok_s"] = sum(counts) / (last - first)
    return row


def server_pid_for_port(port: int) -> int | None:
    """The process listening on a local TCP port (a server we did not start), if visible."""
    import psutil

    try:
        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                return c.pid
    except (psutil.AccessDenied, OSError):
        pass
    return None


def server_processes(pid: int) -> list:
    """tritonserver (found under a launcher such as build/serve.py) and its children: the Python stubs."""
    import psutil

    proc = psutil.Process(pid)
    if proc.name() != "tritonserver":  # a launcher: take its tritonserver child
        proc = next((c for c in proc.children(recursive=True) if c.name() == "tritonserver"), proc)
    return [proc, *proc.children(recursive=True)]


def server_rss_mb(pid: int) -> float:
    return sum(p.memory_info().rss for p in server_processes(pid)) / 2**20


def cpu_seconds(pid: int | None) -> dict[str, float]:
    """CPU seconds used so far by tritonserver, by each Python stub (named by its model instance, the
    stub's second-to-last argument) and by this client: a level's difference says where a streamed
    token's cost goes (docs/benchmarks.md)."""
    import psutil

    named = [("client", psutil.Process())]
    for p in server_processes(pid) if pid else []:
        try:
            named.append(("tritonserver" if p.name() == "tritonserver" else p.cmdline()[-2], p))
        except (psutil.Error, IndexError):
            continue
    out = {}
    for name, p in named:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        out[name] = out.get(name, 0.0) + t.user + t.system
    return out


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    import os

    return {"cpu": cpu, "cores": os.cpu_count(), "avx2": " avx2" in flags, "avx512f": " avx512f" in flags,
            "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "python": platform.python_version(), "numpy": np.__version__}


def markdown(report: dict) -> str:
    rows = ["| streams | requests | output tok/s (median run) | runs (tok/s) | vs llama.cpp | TTFT p50 / p95 (s) | "
            "peer TTFT p95 (s) | latency mean (s) | ms / output token |",
            "|---|---|---|---|---|---|---|---|---|"]
    for lvl in report["levels"]:
        peer = PEER[lvl["concurrency"]]
        rows.append(
            f"| {lvl['concurrency']} | {lvl['requests']} | {lvl['output_tok_s']:.1f} | "
            f"{', '.join(str(x) for x in lvl.get('runs_output_tok_s', []))} | "
            f"{lvl['output_tok_s'] / peer['tok_s']:.2f}x | {lvl['ttft_p50']:.2f} / {lvl['ttft_p95']:.2f} | "
            f"{peer['ttft_p95']:.2f} | {lvl['latency_mean']:.2f} | {lvl['time_per_output_token_ms']:.1f} |")
    m = report["machine"]
    resolved = report.get("resolved") or {}

    def knob(name, old_default):  # as given, and what `auto` resolved to on this machine
        given = report.get(name, old_default)
        return f"{given} ({resolved[name]})" if given == "auto" and name in resolved else given

    rows.append("")
    rows.append(f"Server resident memory after the runs: {report['server_rss_mb']:.0f} MB "
                f"(tritonserver + Python stubs). Machine: {m['cpu']}, {m['cores']} cores, "
                f"AVX2 {m['avx2']}, AVX-512 {m['avx512f']}, {m['memory_gb']} GB; {report['date']}. Knobs: "
                f"weight_dtype {knob('weight_dtype', 'float32')}, matmul_backend {knob('matmul_backend', 'numpy')}, "
                f"attention_backend {knob('attention_backend', 'numpy')}, "
                f"stream_interval {report.get('stream_interval', 1)}, output_threads {report.get('output_threads', 1)}.")
    return "\n".join(rows) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="gRPC host:port of a running server (default: start one)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "latest.json")
    ap.add_argument("--levels", default="1,4,16", help="concurrency levels to run")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs per level; the level reports its median run by output tok/s (the peer: median of 3)")
    ap.add_argument("--same-prompt", action="store_true",
                    help="every request sends the same prompt (prefix reuse; compare with llama.cpp's prompt cache)")
    ap.add_argument("--weight-dtype", default="auto", choices=WEIGHT_DTYPES,
                    help="the CPU engine's weight_dtype knob (bfloat16 needs torch: make setup BF16=1)")
    ap.add_argument("--matmul-backend", default="auto", choices=BACKENDS["matmul_backend"],
                    help="the CPU engine's matmul_backend knob (numpy: the OpenBLAS baseline)")
    ap.add_argument("--attention-backend", default="auto", choices=BACKENDS["attention_backend"],
                    help="the CPU engine's attention_backend knob")
    ap.add_argument("--stream-interval", type=int,
                    help="the engine model's stream_interval knob (tokens per streamed response after the first; "
                         "default: the rendered default)")
    ap.add_argument("--output-threads", type=int,
                    help="the engine model's output_threads knob (threads that send a step's responses; "
                         "default: the rendered default)")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error(f"--repeat must be >= 1, got {args.repeat}")
    from tokenizers import Tokenizer

    from build.render import DEFAULT_CHECKPOINT, TARGET_DEFAULTS

    given = {"stream_interval": args.stream_interval, "output_threads": args.output_threads}
    engine_model_knobs = {k: TARGET_DEFAULTS["cpu"][k] if v is None else str(v) for k, v in given.items()}

    tokenizer = Tokenizer.from_file(str(DEFAULT_CHECKPOINT / "tokenizer.json"))
    server = None
    if args.url is None:
        from tests.support.server import TritonServer

        server = TritonServer(overrides={"weight_dtype": args.weight_dtype, "matmul_backend": args.matmul_backend,
                                         "attention_backend": args.attention_backend,
                                         **engine_model_knobs}).start()
        url = server.grpc_url
    else:
        url = args.url
    pid = server.proc.pid if server else server_pid_for_port(int(url.rsplit(":", 1)[1]))
    # same machine and environment as a server this script started: what its `auto` knobs resolve to
    resolved = resolve_backends(args.weight_dtype, args.matmul_backend, args.attention_backend) if server else None
    try:
        one_request(url, "warm up")  # load pages, first-call costs
        levels = []
        wanted = {int(x) for x in args.levels.split(",")}
        offset = 0
        for conc, n in MATRIX:
            if conc not in wanted:
                continue
            runs = []
            for rep in range(args.repeat):
                prompts = make_prompts(tokenizer, offset + n)[offset:]
                offset += n
                if args.same_prompt:
                    prompts = [prompts[0]] * n
                print(f"[bench] concurrency {conc}: {n} requests (run {rep + 1}/{args.repeat}) ...",
                      file=sys.stderr, flush=True)
                before = cpu_seconds(pid)
                runs.append(run_level(url, prompts, conc, tokenizer=tokenizer))
                after = cpu_seconds(pid)
                runs[-1]["cpu_s"] = {k: round(after[k] - before[k], 2) for k in after if k in before}
                print(f"[bench]   {runs[-1]['output_tok_s']:.1f} tok/s, TTFT p95 {runs[-1]['ttft_p95']:.2f} s",
                      file=sys.stderr, flush=True)
            runs.sort(key=lambda r: r["output_tok_s"])
            levels.append({**runs[len(runs) // 2], "runs_output_tok_s": [round(r["output_tok_s"], 1) for r in runs]})
        report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
                  "weight_dtype": args.weight_dtype, "matmul_backend": args.matmul_backend,
                  "attention_backend": args.attention_backend, "resolved": resolved,
                  **{k: int(v) for k, v in engine_model_knobs.items()},
                  "same_prompt": args.same_prompt, "repeat": args.repeat,
                  "workload": {"prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS,
                               "sampling": "greedy", "endpoint": "ensemble, gRPC streaming"},
                  "levels": levels, "peer": PEER,
                  "server_rss_mb": server_rss_mb(pid) if pid else None}
    finally:
        if server:
            server.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    if report["server_rss_mb"] is not None:
        args.out.with_suffix(".md").write_text(markdown(report))
        print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
