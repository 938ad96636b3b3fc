"""The GPU stack the GPU tests share: one FP8 engine built in the pinned container (with the LoRA plugin,
`build/trtllm.py build`'s default), served by `build/trtllm.py serve` (tritonserver in the container, the
front beside it), and a report of every step. Needs an NVIDIA GPU and a Docker engine; nothing here has
run yet in this project (docs/gpu.md)."""
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from build import trtllm

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable  # the venv that runs the tests also runs build/trtllm.py
BUILD_TIMEOUT_S = 3600  # quantize + trtllm-build of a 135M model take minutes; the first pull is not counted
READY_TIMEOUT_S = 900
REPORT = Path(os.environ.get("GPU_SMOKE_REPORT", ROOT / "runtime" / "gpu-smoke" / "report.json"))


class Report:
    """Everything a reader needs to judge the run, written even when a step fails."""

    def __init__(self, path: Path):
        self.path = path
        self.data = {"started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "steps": [], "checks": []}

    def step(self, name: str, **fields):
        self.data["steps"].append({"step": name, "at_s": round(time.time(), 1), **fields})
        self.write()

    def check(self, name: str, ok: bool, detail=None):
        self.data["checks"].append({"check": name, "ok": bool(ok), "detail": detail})
        self.write()
        return ok

    def write(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=2, default=str) + "\n")


def tail(path: Path, n=4000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


@pytest.fixture(scope="session")
def report():
    r = Report(REPORT)
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap,driver_version,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True)
    r.step("host", nvidia_smi=smi.stdout.strip(), docker=shutil.which("docker"))
    yield r
    r.data["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    r.data["passed"] = all(c["ok"] for c in r.data["checks"]) and bool(r.data["checks"])
    r.write()


@pytest.fixture(scope="session")
def gpu_work(tmp_path_factory, report):
    # GPU tests skip only where no GPU exists (tests/conftest.py); on a GPU machine a missing piece fails
    if not shutil.which("docker"):
        report.step("fail", reason="no docker CLI")
        pytest.fail("a GPU but no docker CLI: the GPU tests build and serve in the pinned container")
    return tmp_path_factory.mktemp("gpu")


def build_engine(gpu_work: Path, checkpoint: Path, report, name: str, extra=()) -> Path:
    engine, log_path = gpu_work / name, gpu_work / f"build-{name}.log"
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        built = subprocess.run([PYTHON, "build/trtllm.py", "build", "--checkpoint", str(checkpoint),
                                "--engine", str(engine), "--max-batch-size", "16", "--max-num-tokens", "2048",
                                "--max-input-len", "2048", "--max-seq-len", "4096", "--calib-size", "32", *extra],
                               cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_S)
    manifest = json.loads((engine / trtllm.MANIFEST).read_text()) if (engine / trtllm.MANIFEST).exists() else None
    report.step(f"build {name}", rc=built.returncode, seconds=round(time.monotonic() - t0, 1), manifest=manifest,
                log_tail=tail(log_path))
    assert built.returncode == 0, tail(log_path)
    return engine


@pytest.fixture(scope="session")
def gpu_engine(gpu_work, checkpoint, report) -> Path:
    """The default engine (no LoRA plugin, bfloat16), built once for every GPU test."""
    return build_engine(gpu_work, checkpoint, report, "engine")


@pytest.fixture(scope="session")
def gpu_lora_engine(gpu_work, checkpoint, report) -> Path:
    """An engine with the LoRA plugin for all seven modules (float16: build/trtllm.py LORA_DTYPE)."""
    return build_engine(gpu_work, checkpoint, report, "engine-lora", ("--lora-target-modules", "all"))


def _ready(url: str) -> bool:
    try:
        return urllib.request.urlopen(url, timeout=2).status == 200
    except OSError:
        return False


@contextmanager
def serve_stack(name: str, engine: Path, checkpoint: Path, work: Path, report: Report, ports: dict, extra=()):
    """`build/trtllm.py serve` with `ports` (http, grpc, metrics, front) and `extra` arguments, until the
    front answers ready; stops the container and the front on the way out."""
    log_path = work / f"serve-{name}.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([PYTHON, "build/trtllm.py", "serve", "--checkpoint", str(checkpoint), "--engine", str(engine),
                             "--repo", str(work / f"repo-{name}"), "--data-dir", str(work / f"data-{name}"),
                             "--http-port", str(ports["http"]), "--grpc-port", str(ports["grpc"]),
                             "--metrics-port", str(ports["metrics"]), "--front-port", str(ports["front"]), *extra],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    t0, ready = time.monotonic(), False
    while time.monotonic() - t0 < READY_TIMEOUT_S and proc.poll() is None:
        ready = _ready(f"http://127.0.0.1:{ports['http']}/v2/health/ready") and \
            _ready(f"http://127.0.0.1:{ports['front']}/health/ready")
        if ready:
            break
        time.sleep(5)
    report.step(f"serve {name}", ready=ready, seconds_to_ready=round(time.monotonic() - t0, 1),
                exit_code=proc.poll(), log_tail=tail(log_path))
    try:
        assert ready, f"not ready after {READY_TIMEOUT_S} s (exit code {proc.poll()}): {tail(log_path)}"
        yield
    finally:
        subprocess.run(["docker", "stop", "-t", "30", "triton-trtllm"], check=False, capture_output=True)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        report.step(f"stopped {name}", log_tail=tail(log_path))
