"""Engine benchmark through Triton, layer by layer: the llama.cpp peer's workload through `ensemble`
(gRPC streaming), through the `gateway` model (gRPC streaming, with an API key) and through the
OpenAI-compatible front (HTTP SSE, `POST /v1/completions`).

    python benchmarks/triton_bench.py [--layers ensemble,gateway,front] [--out benchmarks/results/latest-layers.json]
    python benchmarks/triton_bench.py --layers ensemble --out benchmarks/results/latest.json   # the engine alone

Without --url it renders the CPU repository and starts its own stack (tritonserver, and the front when
the front layer is asked for), with a benchmark gateway config whose tenant no limit throttles. Workload,
as the peer's (docs/peer.md, loadtest/matrix.py): 64-token prompts, 128 output tokens forced
(ensemble: min_tokens = max_tokens; gateway and front: ignore_eos plus min_tokens = max_tokens), greedy,
streaming; concurrency 1, 4, 16 with 8, 12, 48 requests, each level run --repeat times (default 3) per
layer and reported by its median run, as the peer's table is. The layers run interleaved within a level
(one round = one run of each layer; the order rotates every round), so their ratios come from the same
window. Every prompt starts differently, across layers too, so no request reuses another's KV blocks
(the peer ran with its prompt cache off). Reports aggregate output tok/s, TTFT and latency percentiles,
per layer and level: the ratios gateway / ensemble and front / gateway (the median of the rounds' own
ratios) and the TTFT p50 each layer adds;
the CPU seconds each server process (and the front) and the client used per run, and the resident memory
of the server (tritonserver plus its Python stub processes) and of the front.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cpu_engine.checkpoint import WEIGHT_DTYPES  # noqa: E402
from cpu_engine.config import resolve_backends  # noqa: E402
from cpu_engine.kernels import BACKENDS  # noqa: E402
from loadtest.matrix import (MATRIX, OUTPUT_TOKENS, PROMPT_TOKENS, level_row, make_prompts,  # noqa: E402,F401
                             one_request, run_level, run_level_front)
from contracts.measures import percentile  # noqa: E402
from benchmarks.report import machine  # noqa: E402

LAYERS = ("peer", "ensemble", "gateway", "front")  # bottom up: each layer's ratio is against the one below
LAYER_ENDPOINTS = {
    "peer": "llama.cpp's `llama-server -np 16` on the same GGUF (HTTP SSE `POST /v1/completions`, "
            "ignore_eos, prompt cache off), built by `make bench-peer`",
    "ensemble": "gRPC streaming to `ensemble`, min_tokens = max_tokens",
    "gateway": "gRPC streaming to `gateway` with the key in `authorization: Bearer`, ignore_eos and "
               "min_tokens = max_tokens",
    "front": "HTTP SSE `POST /v1/completions` on the front (aiohttp, a new connection per request), "
             "ignore_eos and min_tokens = max_tokens",
}
BENCH_KEY = "sk-demo-acme-enterprise"  # the demo enterprise key; the benchmark's own config lifts its limits
BENCH_LIMITS = {"requests_per_minute": 1_000_000, "tokens_per_minute": 1_000_000_000, "max_concurrent": 1024,
                "kv_share_percent": 100}  # the one tenant may hold the whole KV cache (no other tenant waits)
PEER_SERVER = ROOT / ".cache" / "peer" / "llama.cpp-0.3.36" / "build" / "bin" / "llama-server"
PEER_BODY = {"cache_prompt": False}  # the peer's prompt cache off: no request reuses another's prefix


def bench_gateway_config(path: Path, api_key: str = BENCH_KEY, adapters: bool = False, **limits) -> Path:
    """A gateway config with one enterprise tenant (`api_key`) whose limits never throttle the benchmark:
    the gateway layer measures the gateway's work, not its rate limiter saying no. `adapters`: it may use
    every LoRA adapter."""
    import yaml

    from gateway.tenants import hash_key

    path.write_text(yaml.safe_dump({
        "tiers": {"enterprise": {**BENCH_LIMITS, **limits}},
        "routing": {"default_model": "tensorrt_llm", "models": {"tensorrt_llm": {"max_context_tokens": 8192}}},
        "tenants": {"bench": {"tier": "enterprise", "api_key_sha256": [hash_key(api_key)],
                              **({"allowed_adapters": ["*"]} if adapters else {})}},
    }))
    return path


class PeerServer:
    """llama.cpp's `llama-server` on the project's GGUF, as the reference peer runs it: 16 slots, a context
    of 8192, as many threads as cores, on a free loopback port."""

    def __init__(self, binary: Path, slots: int = 16, extra_args: tuple[str, ...] = (), threads: int | None = None,
                 model: Path | None = None):
        """`model`: another GGUF than the project's (a copy at another precision)."""
        self.binary, self.slots, self.extra_args, self.model = binary, slots, tuple(extra_args), model
        self.threads = threads or os.cpu_count()
        self.proc, self.url = None, None

    def start(self, timeout_s: float = 120.0) -> None:
        import socket
        import subprocess
        import urllib.request

        from build.prepare_model import find_gguf

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        cmd = [str(self.binary), "-m", str(self.model or find_gguf()), "-c", "8192", "-np", str(self.slots),
               "-t", str(self.threads), "--host", "127.0.0.1", "--port", str(port), *self.extra_args]
        print(f"[bench] starting the peer: {' '.join(cmd)}", file=sys.stderr, flush=True)
        # not our OpenMP settings: cpu_engine sets OMP_WAIT_POLICY=PASSIVE for its own kernels, and
        # llama.cpp's OpenMP threads run ~3x slower with it (measured: 56 vs 150 tok/s at 1 stream)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "KMP_", "GOMP_"))}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode} while starting")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"llama-server not healthy within {timeout_s:.0f} s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except Exception:  # noqa: BLE001
                self.proc.kill()


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


def process_rss_mb(pid: int | None) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss / 2**20 if pid else None
    except psutil.Error:
        return None


def cpu_seconds(pid: int | None, front_pid: int | None = None) -> dict[str, float]:
    """CPU seconds used so far by tritonserver, by each Python stub (named by its model instance, the
    stub's second-to-last argument), by the front (when given) and by this client: a level's difference
    says where a streamed token's cost goes (docs/benchmarks.md)."""
    import psutil

    named = [("client", psutil.Process())]
    try:
        server = server_processes(pid) if pid else []
    except psutil.Error:  # gone (the launcher replaces a tritonserver that died)
        server = []
    for p in server:
        try:
            named.append(("tritonserver" if p.name() == "tritonserver" else p.cmdline()[-2], p))
        except (psutil.Error, IndexError):
            continue
    if front_pid:
        try:
            front = psutil.Process(front_pid)
            named += [("front", p) for p in (front, *front.children(recursive=True))]  # --workers: its children
        except psutil.Error:
            pass
    out = {}
    for name, p in named:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        out[name] = out.get(name, 0.0) + t.user + t.system
    return out


def markdown(report: dict) -> str:
    rows = ["| streams | requests | output tok/s (median run) | runs (tok/s) | vs llama.cpp | TTFT p50 / p95 (s) | "
            "peer TTFT p95 (s) | latency mean (s) | ms / output token |",
            "|---|---|---|---|---|---|---|---|---|"]
    peers = report.get("peer") or {}
    for lvl in report["levels"]:
        # the peer only as measured in the same run (never constants from another machine)
        peer = peers.get(lvl["concurrency"]) or peers.get(str(lvl["concurrency"]))
        ratio, peer_ttft = ("n/a", "n/a") if peer is None else \
            (f"{lvl['output_tok_s'] / peer['tok_s']:.2f}x", f"{peer['ttft_p95']:.2f}")
        rows.append(
            f"| {lvl['concurrency']} | {lvl['requests']} | {lvl['output_tok_s']:.1f} | "
            f"{', '.join(str(x) for x in lvl.get('runs_output_tok_s', []))} | "
            f"{ratio} | {lvl['ttft_p50']:.2f} / {lvl['ttft_p95']:.2f} | "
            f"{peer_ttft} | {lvl['latency_mean']:.2f} | {lvl['time_per_output_token_ms']:.1f} |")
    m = report["machine"]
    resolved = report.get("resolved") or {}

    def knob(name, old_default):  # as given, and what `auto` resolved to on this machine
        given = report.get(name, old_default)
        return f"{given} ({resolved[name]})" if given == "auto" and name in resolved else given

    rss = report.get("server_rss_mb")
    front_rss = report.get("front_rss_mb")
    flags = f" (flags: {' '.join(m['cpu_flags'])})" if m.get("cpu_flags") else ""
    rows.append("")
    if report.get("layers"):
        rows.append(f"The table above is the {report['workload']['layer']} layer "
                    f"({report['workload']['endpoint']}); every layer is under Layers.")
        rows.append("")
    rows.append(f"Server resident memory after the runs: {'n/a' if rss is None else f'{rss:.0f} MB'} "
                f"(tritonserver + Python stubs)"
                + ("" if front_rss is None else f"; the front {front_rss:.0f} MB")
                + f". Machine: {m['cpu']}, {m['cores']} cores{flags}, "
                f"AVX2 {m['avx2']}, AVX-512 {m['avx512f']}, {m['memory_gb']} GB; {report['date']}. Knobs: "
                f"weight_dtype {knob('weight_dtype', 'float32')}, matmul_backend {knob('matmul_backend', 'numpy')}, "
                f"attention_backend {knob('attention_backend', 'numpy')}, "
                f"stream_interval {report.get('stream_interval', 1)}, output_threads {report.get('output_threads', 1)}.")
    if report.get("layers"):
        rows += ["", layers_markdown(report["layers"])]
    return "\n".join(rows) + "\n"


def layers_markdown(layers: dict) -> str:
    """The per-layer table: tok/s (median run), ratios, TTFT p50 / p95 and the TTFT p50 each layer adds."""
    names = layers["order"]
    rows = ["## Layers", "",
            f"Interleaved in one server session, {layers['rounds']} round(s) per level (one run of each layer "
            "a round, the order rotating); tok/s: the median run; ratios: the median of the rounds' own ratios; "
            "TTFT: every request of the level's runs. "
            + "; ".join(f"{n}: {LAYER_ENDPOINTS[n]}" for n in names) + ".", ""]
    ratio_cols = [(n, _below(n, names)) for n in names if _below(n, names)]
    added = [n for n, below in ratio_cols if below != "peer"]
    head = (["streams"] + [f"{n} tok/s" for n in names] + [f"{a} / {b}" for a, b in ratio_cols]
            + [f"TTFT p50 (ms) {' / '.join(names)}", f"TTFT p95 (ms) {' / '.join(names)}"]
            + [f"TTFT p50 added by {n} (ms)" for n in added])
    rows += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for lvl in layers["levels"]:
        by = lvl["by_layer"]
        cells = [str(lvl["concurrency"])]
        cells += [f"{by[n]['output_tok_s']:.1f}" for n in names]
        cells += [f"{lvl['ratios'][f'{a}/{b}']:.3f}x" for a, b in ratio_cols]
        cells += [" / ".join(f"{1000 * by[n]['ttft_p50']:.1f}" for n in names),
                  " / ".join(f"{1000 * by[n]['ttft_p95']:.1f}" for n in names)]
        cells += [f"{lvl['ttft_p50_added_ms'][n]:+.1f}" for n in added]
        rows.append("| " + " | ".join(cells) + " |")
    rows += ["", "Runs (tok/s, in round order) and each round's ratios:", "",
             "| streams | " + " | ".join(names) + (" | " if ratio_cols else "")
             + " | ".join(f"{a} / {b} per round" for a, b in ratio_cols) + " |",
             "|---|" + "---|" * (len(names) + len(ratio_cols))]
    for lvl in layers["levels"]:
        by = lvl["by_layer"]
        cells = [str(lvl["concurrency"])]
        cells += [", ".join(f"{x:.1f}" for x in by[n]["rounds_output_tok_s"]) for n in names]
        cells += [", ".join(f"{x:.3f}" for x in lvl["round_ratios"][f"{a}/{b}"]) for a, b in ratio_cols]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _below(layer: str, measured) -> str | None:
    """The measured layer a layer sits on (the front on the gateway, the gateway on the ensemble; the
    next one down when that one was left out): what its ratio and added TTFT are measured against."""
    lower = [x for x in LAYERS[:LAYERS.index(layer)] if x in measured]
    return lower[-1] if lower else None


def summarize_layers(order: list[str], levels: dict[int, dict[str, list[dict]]],
                     requests: dict[int, dict[str, list[dict]]], rounds: int) -> dict:
    """The report's `layers` section from each level's runs (`levels[c][layer]`, in round order) and
    per-request timelines (`requests[c][layer]`)."""
    out = []
    for conc in sorted(levels):
        by = {}
        for name in order:
            runs = levels[conc][name]
            ranked = sorted(runs, key=lambda r: r["output_tok_s"])
            median = ranked[len(ranked) // 2]
            ttft = [r["ttft"] for r in requests[conc][name]]
            lat = [r["latency"] for r in requests[conc][name]]
            by[name] = {"output_tok_s": median["output_tok_s"],
                        "rounds_output_tok_s": [round(r["output_tok_s"], 2) for r in runs],
                        "requests": len(ttft), "ttft_p50": percentile(ttft, 50), "ttft_p95": percentile(ttft, 95),
                        "ttft_mean": statistics.mean(ttft), "latency_mean": statistics.mean(lat),
                        "time_per_output_token_ms": statistics.mean(r["time_per_output_token_ms"] for r in runs),
                        "runs": runs}
        ratios, round_ratios, added = {}, {}, {}
        for a in order:
            b = _below(a, order)
            if b is None:
                continue
            # each round runs the layers back to back, so a round's own ratio cancels the machine's drift
            # between rounds (this VM's differ by up to 1.5x), which a ratio of two median runs does not
            round_ratios[f"{a}/{b}"] = [x["output_tok_s"] / y["output_tok_s"]
                                        for x, y in zip(levels[conc][a], levels[conc][b])]
            ratios[f"{a}/{b}"] = statistics.median(round_ratios[f"{a}/{b}"])
            if b != "peer":  # the ensemble does not sit on the peer: only the ratio compares them
                added[a] = 1000 * (by[a]["ttft_p50"] - by[b]["ttft_p50"])
        out.append({"concurrency": conc, "requests_per_run": levels[conc][order[0]][0]["requests"],
                    "by_layer": by, "ratios": ratios, "round_ratios": round_ratios, "ttft_p50_added_ms": added})
    return {"order": list(order), "rounds": rounds, "endpoints": {n: LAYER_ENDPOINTS[n] for n in order},
            "levels": out}


def parse_layers(text: str) -> list[str]:
    layers = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in layers if x not in LAYERS]
    if unknown or not layers or len(set(layers)) != len(layers) or layers == ["peer"]:
        raise ValueError(f"--layers: a comma-separated subset of {','.join(LAYERS)}, each once, not the peer "
                         f"alone; got {text!r}")
    return [x for x in LAYERS if x in layers]  # always bottom up: peer, ensemble, gateway, front


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="gRPC host:port of a running server (default: start one)")
    ap.add_argument("--front-url", help="with --url: the running front's base URL (http://host:port), for the "
                                        "front layer")
    ap.add_argument("--api-key", default=BENCH_KEY,
                    help="the key the gateway and front layers send (default: the demo enterprise key, which "
                         "the benchmark's own gateway config un-throttles; with --url, a key of that server)")
    ap.add_argument("--layers", default="ensemble,gateway,front",
                    help="layers to measure, interleaved per level: peer (llama.cpp's llama-server, built by "
                         "`make bench-peer`), ensemble (gRPC), gateway (gRPC, API key), front (HTTP SSE "
                         "/v1/completions); default ensemble,gateway,front")
    ap.add_argument("--peer-server", type=Path, default=PEER_SERVER,
                    help="the peer's llama-server binary (default: what `make bench-peer` builds)")
    ap.add_argument("--out", type=Path, help="the report (.json, and .md beside it); default "
                    "benchmarks/results/latest-layers.json, or latest.json with --layers ensemble")
    ap.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                    help="a render knob for the stack it starts (repeatable), e.g. gateway_max_inflight=64")
    ap.add_argument("--levels", default="1,4,16", help="concurrency levels to run (1, 4, 16: the peer's 8, 12, 48 requests; others: 3 a stream)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs per level (per layer: rounds); the level reports its median run by output tok/s "
                         "(the peer: median of 3)")
    ap.add_argument("--requests", type=int,
                    help="requests per run instead of 8/12/48 (smoke runs only: not the benchmark's workload)")
    ap.add_argument("--output-tokens", type=int, default=OUTPUT_TOKENS,
                    help="forced output tokens per request (default 128; other values: smoke runs only)")
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
    if args.requests is not None and args.requests < 1 or args.output_tokens < 1:
        ap.error("--requests and --output-tokens must be >= 1")
    try:
        layers = parse_layers(args.layers)
    except ValueError as e:
        ap.error(str(e))
    if args.url and "front" in layers and not args.front_url:
        ap.error("the front layer with --url needs --front-url (the running front's http://host:port)")
    if "peer" in layers and not args.peer_server.is_file():
        ap.error(f"the peer layer needs llama-server at {args.peer_server}: run `make bench-peer` (builds it) "
                 "or pass --peer-server")
    out = args.out or ROOT / "benchmarks" / "results" / ("latest.json" if layers == ["ensemble"] else
                                                         "latest-layers.json")
    from tokenizers import Tokenizer

    from build.render import DEFAULT_CHECKPOINT, TARGET_DEFAULTS, parse_sets

    given = {"stream_interval": args.stream_interval, "output_threads": args.output_threads}
    engine_model_knobs = {k: TARGET_DEFAULTS["cpu"][k] if v is None else str(v) for k, v in given.items()}

    tokenizer = Tokenizer.from_file(str(DEFAULT_CHECKPOINT / "tokenizer.json"))
    server = None
    if args.url is None:
        from launcher.local import LocalStack

        server = LocalStack(overrides={"weight_dtype": args.weight_dtype, "matmul_backend": args.matmul_backend,
                                         "attention_backend": args.attention_backend,
                                         **engine_model_knobs, **parse_sets(args.set)},
                            front="front" in layers)
        # the gateway layer's tenant: no limit of its tier may throttle the benchmark
        config = bench_gateway_config(server.workdir / "bench-gateway.yaml", args.api_key)
        server.overrides["gateway_config"] = str(config)
        server.start()
        url, front_url = server.grpc_url, server.front_url if "front" in layers else None
    else:
        url, front_url = args.url, args.front_url
    pid = server.proc.pid if server else server_pid_for_port(int(url.rsplit(":", 1)[1]))
    front_pid = None
    if front_url:
        front_pid = (server.stack.front.pid if server and server.stack and server.stack.front else
                     server_pid_for_port(int(front_url.rstrip("/").rsplit(":", 1)[1])))
    # same machine and environment as a server this script started: what its `auto` knobs resolve to
    resolved = resolve_backends(args.weight_dtype, args.matmul_backend, args.attention_backend) if server else None
    n_out = args.output_tokens

    peer = PeerServer(args.peer_server) if "peer" in layers else None
    if peer:
        peer.start()

    def measure(layer: str, prompts: list[str], conc: int, per_request: list) -> dict:
        if layer == "peer":
            return run_level_front(peer.url, None, prompts, conc, per_request, tokenizer, n_out, PEER_BODY, "peer")
        if layer == "front":
            return run_level_front(front_url, args.api_key, prompts, conc, per_request, tokenizer, n_out)
        model, key = ("gateway", args.api_key) if layer == "gateway" else ("ensemble", None)
        return run_level(url, prompts, conc, per_request, tokenizer, n_out,
                         request=lambda p, n: one_request(url, p, n, model, key))

    try:
        for layer in layers:  # load pages, first-call costs, the front's channel to tritonserver
            measure(layer, ["warm up"], 1, [])
        wanted = sorted({int(x) for x in args.levels.split(",")})
        # the peer's matrix where it has the level; beyond it, 3 requests a stream as at 16 (48)
        plan = [(conc, args.requests or dict(MATRIX).get(conc, 3 * conc)) for conc in wanted]
        all_prompts = make_prompts(tokenizer, sum(n for _, n in plan) * args.repeat * len(layers))
        offset = 0
        runs: dict[int, dict[str, list[dict]]] = {}
        timelines: dict[int, dict[str, list[dict]]] = {}
        for conc, n in plan:
            runs[conc] = {layer: [] for layer in layers}
            timelines[conc] = {layer: [] for layer in layers}
            for rep in range(args.repeat):
                shift = rep % len(layers)  # rotate the order: no layer always runs first after a pause
                for layer in layers[shift:] + layers[:shift]:
                    prompts = all_prompts[offset:offset + n]
                    offset += n
                    if args.same_prompt:
                        prompts = [prompts[0]] * n
                    print(f"[bench] concurrency {conc}, {layer}: {n} requests (run {rep + 1}/{args.repeat}) ...",
                          file=sys.stderr, flush=True)
                    before = cpu_seconds(pid, front_pid)
                    row = measure(layer, prompts, conc, timelines[conc][layer])
                    after = cpu_seconds(pid, front_pid)
                    row["cpu_s"] = {k: round(after[k] - before[k], 2) for k in after if k in before}
                    runs[conc][layer].append(row)
                    print(f"[bench]   {row['output_tok_s']:.1f} tok/s, TTFT p50 {row['ttft_p50']:.3f} s, "
                          f"p95 {row['ttft_p95']:.2f} s", file=sys.stderr, flush=True)
        # the table of earlier reports: the lowest layer of this project measured (the ensemble unless left out)
        base = next(layer for layer in layers if layer != "peer")
        levels = []
        for conc, _ in plan:
            ranked = sorted(runs[conc][base], key=lambda r: r["output_tok_s"])
            levels.append({**ranked[len(ranked) // 2],
                           "runs_output_tok_s": [round(r["output_tok_s"], 1) for r in ranked]})
        report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
                  "weight_dtype": args.weight_dtype, "matmul_backend": args.matmul_backend,
                  "attention_backend": args.attention_backend, "resolved": resolved,
                  **{k: int(v) for k, v in engine_model_knobs.items()},
                  "same_prompt": args.same_prompt, "repeat": args.repeat,
                  "workload": {"prompt_tokens": PROMPT_TOKENS, "output_tokens": n_out,
                               "requests": {conc: n for conc, n in plan},
                               "sampling": "greedy", "layer": base, "endpoint": LAYER_ENDPOINTS[base]},
                  "levels": levels,
                  "peer": {conc: {"tok_s": sorted(r["output_tok_s"] for r in runs[conc]["peer"])[args.repeat // 2],
                                  "ttft_p95": percentile([r["ttft"] for r in timelines[conc]["peer"]], 95),
                                  "server": str(args.peer_server)}
                           for conc, _ in plan} if peer else None,
                  "server_rss_mb": server_rss_mb(pid) if pid else None,
                  "front_rss_mb": process_rss_mb(front_pid)}
        if layers != ["ensemble"]:
            report["layers"] = summarize_layers(layers, runs, timelines, args.repeat)
    finally:
        if server:
            server.stop()
        if peer:
            peer.stop()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    print(f"report: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
