"""The real `tritonserver` (2.51, from the `nvidia-pytriton` wheel): runtime, environment, command line.

The wheel's `tritonserver/` folder is copied once into `.cache/tritonserver`, the Python backend stub
that matches the running interpreter is put under `backends/python/`, and the server runs with
`LD_LIBRARY_PATH` at the wheel's `nvidia_pytriton.libs` and `PYTHONPATH` at the project and the venv,
so the models import the project's packages (`contracts/`, `text/`, `gateway/`, `cpu_engine/`) and the venv's packages; the server runs with the project
root as its working directory too, because the 2.51 stub does not pass `PYTHONPATH` on to the models.
Triton's own HTTP, gRPC and metrics listen on an internal address only (loopback by default): the
public door is the front (`front/`). The repository, logging and trace APIs are restricted to callers
that present the launcher's admin key (`ADMIN_HEADER`).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

from build.triton_flags import header_forward_flags, restricted_api_flags

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ROOT / ".cache" / "tritonserver"


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
    # the Python backend stub links libpython3.X.so: a Python built outside the system's library folders
    # (pyenv, a tarball) has it only in its own LIBDIR
    libpython = sysconfig.get_config_var("LIBDIR") if sysconfig.get_config_var("Py_ENABLE_SHARED") else None
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(libs), libpython, env.get("LD_LIBRARY_PATH")]))
    site = sysconfig.get_paths()["purelib"]
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), site])
    env["VIRTUAL_ENV"] = sys.prefix
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    return env


def server_command(repo: Path, host="127.0.0.1", http_port=8000, grpc_port=8001, metrics_port=8002,
                   log_verbose=0, exit_timeout=30, extra=(), admin_key: str | None = None) -> list[str]:
    """`admin_key`: restrict RESTRICTED_APIS to callers with that ADMIN_HEADER, and load models explicitly
    (all at start) so the launcher can reload a model whose stub died."""
    rt = install_runtime()
    admin = [] if admin_key is None else [
        *restricted_api_flags(admin_key),
        "--model-control-mode=explicit", "--load-model=*",
    ]
    return [
        str(rt / "bin" / "tritonserver"),
        f"--model-repository={repo}",
        f"--backend-directory={rt / 'backends'}",
        f"--cache-directory={rt / 'caches'}",
        f"--http-address={host}", f"--grpc-address={host}", f"--metrics-address={host}",
        f"--http-port={http_port}", f"--grpc-port={grpc_port}", f"--metrics-port={metrics_port}",
        *header_forward_flags(),
        "--allow-metrics=true", "--allow-cpu-metrics=true", "--allow-gpu-metrics=false",
        f"--exit-timeout-secs={exit_timeout}",
        f"--log-verbose={log_verbose}",
        # every config is complete: no model.py defines auto_complete_config, and a Python model's load
        # then starts one stub, not a throwaway auto-complete stub first (1.2 s per load; a stub killed
        # while it auto-completes hangs that load for good: StubSupervisor)
        "--disable-auto-complete-config",
        *admin,
        *extra,
    ]


def die_with_parent() -> None:
    """preexec_fn: the server gets SIGTERM if its launcher dies, so no server outlives a killed test run."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 180, what: str = "tritonserver") -> None:
    """Poll `url` until it answers 200; fail early if `proc` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{what} not ready after {timeout:.0f} s ({url})")
