"""Run NVIDIA's `perf_analyzer` (shipped in the tritonclient 2.51 wheel) against the stack.

    python benchmarks/perf_analyzer.py --url 127.0.0.1:8001 [--model ensemble] [--concurrency 8]
        [--warmup 8] [--requests 32] [--max-tokens 16] [--api-key sk-demo-acme-enterprise] [-- extra args]

The binary is `.venv/bin/perf_analyzer`. It links `libb64.so.0d` (Debian's libb64-0d, installed by
build/system_deps.sh) and `libcudart.so.12` even on the CPU (the pinned PyPI wheel
nvidia-cuda-runtime-cu12 in requirements.txt, under site-packages/nvidia/cuda_runtime/lib):
`perf_analyzer_env()` gives the environment that finds them.

perf_analyzer 2.51 hangs in its warm-up when `--warmup-request-count` is below the concurrency: its
ConcurrencyManager::PerformWarmup splits the warm-up count over one thread per concurrent request, the
threads that get 0 treat it as "no limit" and never stop, and the warm-up waits for every thread. Fixed in
perf_analyzer 2.52 (triton-inference-server/perf_analyzer PR #112). With 2.51, give at least as many
warm-up requests as the concurrency: `perf_analyzer_args` defaults to that, and this script refuses less
with 2.51 (docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv"
BINARY = VENV / "bin" / "perf_analyzer"
# a prompt the model continues (a finished sentence as raw text often ends at once: 0 tokens, 1 response)
PROMPT = "The history of the lighthouse begins"
FIXED_VERSION = (2, 52)  # first perf_analyzer with the warm-up fix (PR #112, in r24.11)


def cuda_runtime_lib() -> Path:
    """site-packages/nvidia/cuda_runtime/lib of the running Python (the .venv in this project)."""
    purelib = Path(sysconfig.get_paths()["purelib"])
    candidates = [purelib] + sorted((VENV / "lib").glob("python3*/site-packages"))
    for sp in candidates:
        lib = sp / "nvidia" / "cuda_runtime" / "lib"
        if (lib / "libcudart.so.12").is_file():
            return lib
    raise FileNotFoundError("libcudart.so.12 not found: run `make setup` (nvidia-cuda-runtime-cu12 in requirements.txt)")


def perf_analyzer_env(base: dict | None = None) -> dict:
    """The environment to run .venv/bin/perf_analyzer: LD_LIBRARY_PATH with the CUDA runtime wheel's lib."""
    env = dict(os.environ if base is None else base)
    paths = [str(cuda_runtime_lib())] + [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p]
    env["LD_LIBRARY_PATH"] = ":".join(paths)
    return env


def version() -> tuple[int, int]:
    """perf_analyzer's (major, minor), from `perf_analyzer --version` ("Perf Analyzer Version 2.51.0 ...")."""
    p = subprocess.run([str(BINARY), "--version"], env=perf_analyzer_env(), capture_output=True, text=True,
                       timeout=30)
    out = p.stdout + p.stderr
    major, minor = out.split("Version", 1)[1].split()[0].split(".")[:2]
    return int(major), int(minor)


def write_input_data(path: Path, max_tokens: int = 16, prompt: str = PROMPT) -> Path:
    """perf_analyzer --input-data JSON for `ensemble` or `gateway` (the same names): one request, each input
    shaped [1] as upstream (perf_analyzer adds the batch dimension), exactly max_tokens streamed tokens."""
    data = {"text_input": {"content": [prompt], "shape": [1]},
            "max_tokens": {"content": [max_tokens], "shape": [1]},
            "min_tokens": {"content": [max_tokens], "shape": [1]},
            "stream": {"content": [True], "shape": [1]}}
    path.write_text(json.dumps({"data": [data]}))
    return path


def perf_analyzer_args(url: str, input_data: Path, model: str = "ensemble", concurrency: int = 8,
                       warmup: int | None = None, requests: int | None = None, api_key: str | None = None,
                       extra: list[str] | tuple = ()) -> list[str]:
    """A bounded, streaming gRPC run at one concurrency; warm-up defaults to the concurrency (see above)."""
    warmup = concurrency if warmup is None else warmup
    requests = 4 * concurrency if requests is None else requests
    args = [str(BINARY), "-m", model, "-i", "grpc", "-u", url, "--streaming", "--input-data", str(input_data),
            "--concurrency-range", str(concurrency), "--request-count", str(requests),
            "--warmup-request-count", str(warmup)]
    if api_key:
        args += ["-H", f"authorization:Bearer {api_key}"]
    return args + list(extra)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="127.0.0.1:8001", help="Triton's gRPC address (internal)")
    p.add_argument("--model", default="ensemble", choices=("ensemble", "gateway"))
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--warmup", type=int, default=None, help="warm-up requests (default: the concurrency)")
    p.add_argument("--requests", type=int, default=None, help="measured requests (default: 4 x concurrency)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--api-key", default=None, help="for the gateway, e.g. sk-demo-acme-enterprise")
    p.add_argument("--input-data", type=Path, default=None, help="where to write it (default: a temporary file)")
    p.add_argument("extra", nargs="*", help="more perf_analyzer arguments (after --)")
    a = p.parse_args(argv)
    warmup = a.concurrency if a.warmup is None else a.warmup
    if 0 < warmup < a.concurrency and version() < FIXED_VERSION:
        p.error(f"perf_analyzer {'.'.join(map(str, version()))} never finishes a warm-up of {warmup} "
                f"below concurrency {a.concurrency}: use --warmup {a.concurrency} or more (see this file's doc)")
    temporary = a.input_data is None
    if temporary:
        fd, name = tempfile.mkstemp(prefix="perf_analyzer_input_", suffix=".json")
        os.close(fd)
        a.input_data = Path(name)
    try:
        write_input_data(a.input_data, a.max_tokens)
        cmd = perf_analyzer_args(a.url, a.input_data, a.model, a.concurrency, warmup, a.requests, a.api_key, a.extra)
        print(shlex.join(cmd), file=sys.stderr)
        return subprocess.call(cmd, env=perf_analyzer_env())
    finally:
        if temporary:
            a.input_data.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
