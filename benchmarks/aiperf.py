"""Run NVIDIA's aiperf against the OpenAI-compatible front, the way an NVIDIA user benchmarks a server.

    python benchmarks/aiperf.py [--url http://127.0.0.1:9000] [--endpoint chat|completions|responses|ensemble,...]
        [--concurrency 4] [--requests 16] [--input-tokens 64] [--output-tokens 32] [--no-streaming]
        [--rounds 1] [--api-key sk-demo-acme-enterprise] [--triton-url 127.0.0.1:8000]
        [--out benchmarks/results/aiperf.json] [-- more aiperf flags]

aiperf lives in its own virtualenv, `.venv-aiperf` (build/setup_aiperf.sh, which `make test` runs): its pins
differ from the stack's. Without --url the script starts the CPU default itself (launcher.local.LocalStack
with the front; --set render knobs) and stops it afterwards, the key's tenant given limits that never
throttle it (benchmarks/triton_bench.py bench_gateway_config). The tokenizer aiperf counts tokens with is the
rendered model's folder (a local path, read from disk: nothing is downloaded). Every request asks for
exactly --output-tokens (`ignore_eos`, vLLM's extra, which the front honours on all three endpoints), on
synthetic prompts of --input-tokens. The summary is aiperf's own figures, read from its
profile_export_aiperf.json: requests and errors, output tok/s, TTFT and ITL, and the server's usage counts.

aiperf counts a chat request's input tokens on the user's text; the server's `usage.prompt_tokens` counts
the chat template too (SmolLM2's system prompt and role markers), so aiperf's "Token Count Discrepancy"
warning names prompt tokens on chat and responses: expected, not an error (completions agree).

`ensemble` is the peer of the front's completions: the same client against Triton's own HTTP
`generate_stream` of the `ensemble` model (NVIDIA's text-in/text-out contract, no tenant, no admission),
through aiperf's template endpoint (`text_input`, `max_tokens` = `min_tokens` = --output-tokens). Several
endpoints with --rounds R run interleaved, endpoint after endpoint, R times, on the same synthetic prompts
(`--random-seed 0`): one window, as every comparison in docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BINARY = ROOT / ".venv-aiperf" / "bin" / "aiperf"
DEMO_KEY = "sk-demo-acme-enterprise"  # deploy/gateway.example.yaml: acme, enterprise tier
ENDPOINTS = ("chat", "completions", "responses", "ensemble")
# the ensemble's generate_stream body (aiperf's template endpoint renders it per request)
ENSEMBLE_TEMPLATE = ('{"text_input": {{ text|tojson }}, "max_tokens": {{ max_tokens }}, '
                     '"min_tokens": {{ max_tokens }}, "stream": {{ stream|tojson }}}')
# what the summary keeps of profile_export_aiperf.json: metric -> the statistics kept
KEPT = {"request_count": ("avg",), "request_error_rate": ("avg",), "output_token_throughput": ("avg",),
        "request_throughput": ("avg",), "time_to_first_token": ("avg", "p50", "p99"),
        "inter_token_latency": ("avg", "p50", "p99"), "request_latency": ("avg", "p50", "p99"),
        "output_sequence_length": ("avg", "min", "max"), "usage_completion_tokens": ("avg", "min", "max"),
        "usage_prompt_tokens": ("avg",), "input_sequence_length": ("avg",)}


def command(url: str, tokenizer: str, endpoint: str = "chat", concurrency: int = 4, requests: int = 16,
            input_tokens: int = 64, output_tokens: int = 32, streaming: bool = True, api_key: str | None = DEMO_KEY,
            artifact_dir: Path | str = "aiperf-artifacts", extra: list[str] | None = None) -> list[str]:
    """aiperf's command line for one profile run (`ensemble`: `url` is tritonserver's HTTP address)."""
    if endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
    args = [str(BINARY), "profile", "--model", "auto" if endpoint != "ensemble" else "ensemble", "--url", url,
            "--tokenizer", tokenizer, "--concurrency", str(concurrency), "--request-count", str(requests),
            "--synthetic-input-tokens-mean", str(input_tokens), "--synthetic-input-tokens-stddev", "0",
            "--output-tokens-mean", str(output_tokens), "--output-tokens-stddev", "0", "--random-seed", "0",
            "--warmup-request-count", str(concurrency),  # not in the figures: each run starts warm
            "--artifact-dir", str(artifact_dir)]
    if endpoint == "ensemble":
        template = Path(artifact_dir) / "ensemble.jinja"
        template.parent.mkdir(parents=True, exist_ok=True)
        template.write_text(ENSEMBLE_TEMPLATE)
        args += ["--endpoint-type", "template", "--custom-endpoint", "/v2/models/ensemble/generate_stream",
                 "--extra-inputs", f"payload_template:{template}", "--extra-inputs", "response_field:text_output"]
    else:
        args += ["--endpoint-type", endpoint, "--extra-inputs", "ignore_eos:true"]
        if api_key:
            args += ["--api-key", api_key]
    if streaming:
        args.append("--streaming")
    return args + list(extra or [])


def environment() -> dict:
    """aiperf's environment: no colour codes in its log, no telemetry. Not HF_HUB_OFFLINE: aiperf 0.13.0
    then looks a local tokenizer folder up as a hub repository id in the cache and fails; a local folder
    is loaded from disk without it (aiperf.common.tokenizer.resolve_alias)."""
    return {**os.environ, "NO_COLOR": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def run(args: list[str], artifact_dir: Path, timeout_s: float = 300) -> tuple[subprocess.CompletedProcess, dict | None]:
    """Run aiperf; (the process, its profile_export_aiperf.json or None when it wrote none)."""
    if not BINARY.is_file():
        raise FileNotFoundError(f"{BINARY} not found: run `bash build/setup_aiperf.sh` (make test runs it)")
    p = subprocess.run(args, env=environment(), capture_output=True, text=True, timeout=timeout_s)
    export = Path(artifact_dir) / "profile_export_aiperf.json"
    return p, json.loads(export.read_text()) if export.is_file() else None


def summary(export: dict) -> dict:
    """The figures KEPT of an aiperf export, {metric: {stat: value}} with each metric's unit."""
    out = {}
    for name, stats in KEPT.items():
        metric = export.get(name)
        if isinstance(metric, dict):
            out[name] = {"unit": metric.get("unit"), **{s: metric.get(s) for s in stats}}
    return out


def records(artifact_dir: Path) -> list[dict]:
    """aiperf's per-request records of the measured phase (profile_export.jsonl, the warm-up's left out):
    metadata, metrics and any error."""
    path = Path(artifact_dir) / "profile_export.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    every = [json.loads(line) for line in lines if line.strip()]
    return [r for r in every if r.get("metadata", {}).get("benchmark_phase") != "warmup"]


TABLE_HEAD = ("| endpoint | concurrency | requests | errors (%) | output tok/s | TTFT p50 / p99 (ms) | "
              "ITL p50 / p99 (ms) | completion tokens (server's usage) |\n|---|---|---|---|---|---|---|---|")


def table_row(run: dict) -> str:
    """One run's row under TABLE_HEAD: what docs/benchmarks.md prints (`-`: aiperf read no usage, as on
    /v1/responses answers cut by max_output_tokens, or the ensemble's, which has none)."""
    s = run["summary"]
    usage = s.get("usage_completion_tokens")
    usage = f"{usage['min']:g}-{usage['max']:g}" if usage else "-"
    return (f"| {run['endpoint']} | {run['concurrency']} | {s['request_count']['avg']:g} | "
            f"{s['request_error_rate']['avg']:g} | {s['output_token_throughput']['avg']:.1f} | "
            f"{s['time_to_first_token']['p50']:.1f} / {s['time_to_first_token']['p99']:.1f} | "
            f"{s['inter_token_latency']['p50']:.1f} / {s['inter_token_latency']['p99']:.1f} | "
            f"{usage} |")


def ratios(report: dict, endpoint: str, peer: str = "ensemble") -> list[float]:
    """Per round, `endpoint`'s output tok/s over `peer`'s (the runs of one window)."""
    tok = {(r["endpoint"], r["round"]): r["summary"]["output_token_throughput"]["avg"] for r in report["runs"]}
    return [round(tok[(endpoint, n)] / tok[(peer, n)], 3) for e, n in sorted(tok) if e == endpoint and (peer, n) in tok]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="the front's base URL; unset: start the CPU default stack here")
    p.add_argument("--triton-url", help="tritonserver's HTTP address for --endpoint ensemble (with --url)")
    p.add_argument("--endpoint", default="chat", help=f"one or more of {','.join(ENDPOINTS)}, comma-separated")
    p.add_argument("--rounds", type=int, default=1, help="times each endpoint runs, interleaved")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--input-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--no-streaming", action="store_true")
    p.add_argument("--api-key", default=DEMO_KEY)
    p.add_argument("--tokenizer", help="a tokenizer folder; unset: the rendered model's")
    p.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                   help="a render knob for the stack it starts (docs/knobs.md)")
    p.add_argument("--out", help="the runs (.json), with the machine and the commands")
    args = p.parse_args(argv)
    endpoints = args.endpoint.split(",")
    if unknown := [e for e in endpoints if e not in ENDPOINTS]:
        p.error(f"unknown endpoint {', '.join(unknown)}: one of {', '.join(ENDPOINTS)}")

    from benchmarks.triton_bench import bench_gateway_config
    from build.render import parse_sets
    from launcher.local import LocalStack

    stack, done, commands = None, [], []
    try:
        if args.url is None:
            print("[aiperf] starting the stack (CPU default, with the front) ...", file=sys.stderr)
            stack = LocalStack(front=True, overrides=parse_sets(args.set))
            # the key's tenant: no limit of its tier may throttle the benchmark (as triton_bench's)
            stack.overrides["gateway_config"] = str(bench_gateway_config(stack.workdir / "bench-gateway.yaml",
                                                                         args.api_key))
            stack.start()
        front = args.url or stack.front_url
        triton = args.triton_url or (stack.http_url if stack else None)
        tokenizer = args.tokenizer or (stack.stack.tokenizer_dir() if stack else None)
        if tokenizer is None:
            p.error("--tokenizer is needed with --url (the served model's tokenizer folder)")
        if "ensemble" in endpoints and triton is None:
            p.error("--triton-url is needed for the ensemble with --url")
        for n in range(1, args.rounds + 1):
            for endpoint in endpoints:
                url = front if endpoint != "ensemble" else "http://" + triton.split("://")[-1]
                with tempfile.TemporaryDirectory(prefix="aiperf-") as tmp:
                    cmd = command(url, tokenizer, endpoint, args.concurrency, args.requests, args.input_tokens,
                                  args.output_tokens, not args.no_streaming, args.api_key, Path(tmp) / "out", extra)
                    shown = [c if c != args.api_key else "<key>" for c in cmd]
                    print(f"[aiperf] round {n}/{args.rounds}: " + " ".join(shown), file=sys.stderr)
                    proc, export = run(cmd, Path(tmp) / "out")
                    if proc.returncode != 0 or export is None:
                        print(proc.stdout[-4000:] + proc.stderr[-4000:], file=sys.stderr)
                        return proc.returncode or 1
                done.append({"endpoint": endpoint, "concurrency": args.concurrency, "round": n,
                             "aiperf_version": export.get("aiperf_version"), "summary": summary(export)})
                commands.append(shown)
                print(("" if len(done) > 1 else TABLE_HEAD + "\n") + table_row(done[-1]))
    finally:
        if stack is not None:
            stack.stop()
    report = {"runs": done, "commands": commands}
    for endpoint in endpoints:
        if endpoint != "ensemble" and "ensemble" in endpoints:
            report.setdefault("ratios_to_ensemble", {})[endpoint] = ratios(report, endpoint)
    if "ratios_to_ensemble" in report:
        print(json.dumps(report["ratios_to_ensemble"]))
    if args.out:
        from benchmarks.report import write_json

        kept = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "api_key"})
        write_json(args.out, report, kept)
    return 0


if __name__ == "__main__":
    sys.exit(main())
