"""Run NVIDIA's aiperf against the OpenAI-compatible front, the way an NVIDIA user benchmarks a server.

    python benchmarks/aiperf.py [--url http://127.0.0.1:9000] [--endpoint chat|completions|responses]
        [--concurrency 4] [--requests 16] [--input-tokens 64] [--output-tokens 32] [--no-streaming]
        [--api-key sk-demo-acme-enterprise] [--out benchmarks/results/aiperf.json] [-- more aiperf flags]

aiperf lives in its own virtualenv, `.venv-aiperf` (build/setup_aiperf.sh, which `make test` runs): its pins
differ from the stack's. Without --url the script starts the CPU default itself (launcher.local.LocalStack
with the front, the demo tenants) and stops it afterwards. The tokenizer aiperf counts tokens with is the
rendered model's folder (a local path, read from disk: nothing is downloaded). Every request asks for
exactly --output-tokens (`ignore_eos`, vLLM's extra, which the front honours on all three endpoints), on
synthetic prompts of --input-tokens. The summary is aiperf's own figures, read from its
profile_export_aiperf.json: requests and errors, output tok/s, TTFT and ITL, and the server's usage counts.

aiperf counts a chat request's input tokens on the user's text; the server's `usage.prompt_tokens` counts
the chat template too (SmolLM2's system prompt and role markers), so aiperf's "Token Count Discrepancy"
warning names prompt tokens on chat and responses: expected, not an error (completions agree).
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
ENDPOINTS = ("chat", "completions", "responses")
# what the summary keeps of profile_export_aiperf.json: metric -> the statistics kept
KEPT = {"request_count": ("avg",), "request_error_rate": ("avg",), "output_token_throughput": ("avg",),
        "request_throughput": ("avg",), "time_to_first_token": ("avg", "p50", "p99"),
        "inter_token_latency": ("avg", "p50", "p99"), "request_latency": ("avg", "p50", "p99"),
        "output_sequence_length": ("avg", "min", "max"), "usage_completion_tokens": ("avg", "min", "max"),
        "usage_prompt_tokens": ("avg",), "input_sequence_length": ("avg",)}


def command(url: str, tokenizer: str, endpoint: str = "chat", concurrency: int = 4, requests: int = 16,
            input_tokens: int = 64, output_tokens: int = 32, streaming: bool = True, api_key: str | None = DEMO_KEY,
            artifact_dir: Path | str = "aiperf-artifacts", extra: list[str] | None = None) -> list[str]:
    """aiperf's command line for one profile run."""
    if endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
    args = [str(BINARY), "profile", "--model", "auto", "--url", url, "--endpoint-type", endpoint,
            "--tokenizer", tokenizer, "--concurrency", str(concurrency), "--request-count", str(requests),
            "--synthetic-input-tokens-mean", str(input_tokens), "--synthetic-input-tokens-stddev", "0",
            "--output-tokens-mean", str(output_tokens), "--output-tokens-stddev", "0",
            "--extra-inputs", "ignore_eos:true", "--artifact-dir", str(artifact_dir)]
    if streaming:
        args.append("--streaming")
    if api_key:
        args += ["--api-key", api_key]
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
    """aiperf's per-request records (profile_export.jsonl): metadata, metrics and any error."""
    path = Path(artifact_dir) / "profile_export.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


TABLE_HEAD = ("| endpoint | concurrency | requests | errors (%) | output tok/s | TTFT p50 / p99 (ms) | "
              "ITL p50 / p99 (ms) | completion tokens (server's usage) |\n|---|---|---|---|---|---|---|---|")


def table_row(report: dict) -> str:
    """One run's row under TABLE_HEAD, from its results file (`--out`): what docs/benchmarks.md prints (`-`:
    aiperf read no usage, as on /v1/responses answers cut by max_output_tokens, module docstring)."""
    a, s = report["args"], report["summary"]
    usage = s.get("usage_completion_tokens")
    usage = f"{usage['min']:g}-{usage['max']:g}" if usage else "-"
    return (f"| {a['endpoint']} | {a['concurrency']} | {s['request_count']['avg']:g} | "
            f"{s['request_error_rate']['avg']:g} | {s['output_token_throughput']['avg']:.1f} | "
            f"{s['time_to_first_token']['p50']:.1f} / {s['time_to_first_token']['p99']:.1f} | "
            f"{s['inter_token_latency']['p50']:.1f} / {s['inter_token_latency']['p99']:.1f} | "
            f"{usage} |")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="the front's base URL; unset: start the CPU default stack here")
    p.add_argument("--endpoint", choices=ENDPOINTS, default="chat")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--input-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--no-streaming", action="store_true")
    p.add_argument("--api-key", default=DEMO_KEY)
    p.add_argument("--tokenizer", help="a tokenizer folder; unset: the rendered model's")
    p.add_argument("--out", help="the summary (.json), with the machine and the command")
    args = p.parse_args(argv)

    from launcher.local import LocalStack

    stack = None
    try:
        if args.url is None:
            print("[aiperf] starting the stack (CPU default, with the front) ...", file=sys.stderr)
            stack = LocalStack(front=True).start()
        url = args.url or stack.front_url
        tokenizer = args.tokenizer or (stack.stack.tokenizer_dir() if stack else None)
        if tokenizer is None:
            p.error("--tokenizer is needed with --url (the served model's tokenizer folder)")
        with tempfile.TemporaryDirectory(prefix="aiperf-") as tmp:
            cmd = command(url, tokenizer, args.endpoint, args.concurrency, args.requests, args.input_tokens,
                          args.output_tokens, not args.no_streaming, args.api_key, tmp, extra)
            shown = [c if c != args.api_key else "<key>" for c in cmd]
            print("[aiperf] " + " ".join(shown), file=sys.stderr)
            proc, export = run(cmd, Path(tmp))
            if proc.returncode != 0 or export is None:
                print(proc.stdout[-4000:] + proc.stderr[-4000:], file=sys.stderr)
                return proc.returncode or 1
            figures = summary(export)
    finally:
        if stack is not None:
            stack.stop()
    print(json.dumps(figures, indent=2))
    if args.out:
        from benchmarks.report import write_json

        kept = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "api_key"})
        path = write_json(args.out, {"aiperf_version": export.get("aiperf_version"), "command": shown,
                                     "summary": figures}, kept)
        print(TABLE_HEAD + "\n" + table_row(json.loads(path.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
