"""Run the real `tritonserver` (2.51, from the `nvidia-pytriton` wheel) on a rendered repository.

    python build/serve.py [--host 127.0.0.1] [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002]

The wheel's `tritonserver/` folder is copied once into `.cache/tritonserver`, the Python backend stub
that matches the running interpreter is put under `backends/python/`, and the server runs with
`LD_LIBRARY_PATH` at the wheel's `nvidia_pytriton.libs` and `PYTHONPATH` at the project and the venv,
so the models import `bls/`, `cpu_engine/` and the venv's packages. The tests start servers through
the same `server_command()` and `server_env()`.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ROOT / ".cache" / "tritonserver"
HEADER_FORWARD = "x-.*|authorization"


def wheel_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("serve: nvidia-pytriton is not installed in this interpreter: run `make setup`")
    return Path(list(spec.submodule_search_locations)[0])


def install_runtime() -> Path:
    """Copy the wheel's server once; idempotent (a marker names the source and Python version)."""
    pyver = f"{sys.version_info.major}.{sys.version_info.minor}"
    src = wheel_dir() / "tritonserver"
    marker = RUNTIME / ".installed"
    stamp = f"{src}|{pyver}"
    if marker.is_file() and marker.read_text() == stamp:
        return RUNTIME
    stub = src / "python_backend_stubs" / pyver / "triton_python_backend_stub"
    if not stub.is_file():
        raise SystemExit(f"serve: the wheel has no Python backend stub for Python {pyver} ({stub})")
    print(f"serve: installing tritonserver runtime into {RUNTIME} ...", file=sys.stderr)
    tmp = RUNTIME.with_name("tritonserver.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, symlinks=True)
    shutil.copy2(stub, tmp / "backends" / "python" / "triton_python_backend_stub")
    shutil.rmtree(RUNTIME, ignore_errors=True)
    tmp.rename(RUNTIME)
    marker.write_text(stamp)
    return RUNTIME


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    libs = wheel_dir().parent / "nvidia_pytriton.libs"
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(libs), env.get("LD_LIBRARY_PATH")]))
    site = sysconfig.get_paths()["purelib"]
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), site])
    env["VIRTUAL_ENV"] = sys.prefix
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    return env


def server_command(repo: Path, host="127.0.0.1", http_port=8000, grpc_port=8001, metrics_port=8002,
                   log_verbose=0, exit_timeout=30, extra=()) -> list[str]:
    rt = install_runtime()
    return [
        str(rt / "bin" / "tritonserver"),
        f"--model-repository={repo}",
        f"--backend-directory={rt / 'backends'}",
        f"--cache-directory={rt / 'caches'}",
        f"--http-address={host}", f"--grpc-address={host}", f"--metrics-address={host}",
        f"--http-port={http_port}", f"--grpc-port={grpc_port}", f"--metrics-port={metrics_port}",
        f"--http-header-forward-pattern={HEADER_FORWARD}",
        f"--grpc-header-forward-pattern={HEADER_FORWARD}",
        "--allow-metrics=true", "--allow-cpu-metrics=true", "--allow-gpu-metrics=false",
        f"--exit-timeout-secs={exit_timeout}",
        f"--log-verbose={log_verbose}",
        *extra,
    ]


def die_with_parent() -> None:
    """preexec_fn: the server gets SIGTERM if its launcher dies, so no server outlives a killed test run."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def wait_ready(host: str, http_port: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    url = f"http://{host}:{http_port}/v2/health/ready"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tritonserver exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"tritonserver not ready after {timeout:.0f} s ({url})")


def banner(host, http_port, grpc_port, metrics_port) -> str:
    return f"""
  Triton Inference Server is ready (CPU engine, SmolLM2-135M-Instruct)
    HTTP    http://{host}:{http_port}    gRPC {host}:{grpc_port}    metrics http://{host}:{metrics_port}/metrics
  Try:
    curl -s -X POST http://{host}:{http_port}/v2/models/ensemble/generate \\
      -d '{{"text_input": "The capital of France is", "max_tokens": 16, "temperature": 0}}'
  Ctrl-C stops the server (in-flight streams get the exit timeout).
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    env = os.environ.get
    p.add_argument("--repo", type=Path, default=ROOT / "runtime" / "model_repository")
    p.add_argument("--host", default=env("TRITON_HOST", "127.0.0.1"))
    p.add_argument("--http-port", type=int, default=int(env("TRITON_HTTP_PORT", "8000")))
    p.add_argument("--grpc-port", type=int, default=int(env("TRITON_GRPC_PORT", "8001")))
    p.add_argument("--metrics-port", type=int, default=int(env("TRITON_METRICS_PORT", "8002")))
    p.add_argument("--log-verbose", type=int, default=int(env("TRITON_LOG_VERBOSE", "0")))
    args = p.parse_args(argv)
    if not (args.repo / "ensemble" / "config.pbtxt").is_file():
        print(f"serve: no rendered repository at {args.repo}: run `make render`", file=sys.stderr)
        return 2
    cmd = server_command(args.repo, args.host, args.http_port, args.grpc_port, args.metrics_port,
                         args.log_verbose)
    proc = subprocess.Popen(cmd, env=server_env(), preexec_fn=die_with_parent)

    def forward(signum, _frame):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM if signum == signal.SIGINT else signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    try:
        wait_ready(args.host, args.http_port, proc)
        print(banner(args.host, args.http_port, args.grpc_port, args.metrics_port), file=sys.stderr, flush=True)
    except (RuntimeError, TimeoutError) as e:
        print(f"serve: {e}", file=sys.stderr)
        forward(signal.SIGTERM, None)
    return proc.wait()


if __name__ == "__main__":
    sys.exit(main())
