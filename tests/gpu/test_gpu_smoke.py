"""GPU smoke test: build a small FP8 engine from SmolLM2's HF folder in the pinned container, serve it,
and run the CPU path's contract checks. Needs an NVIDIA GPU and a Docker engine; skipped elsewhere.
It has not run yet in this project (no GPU machine with Docker so far): see docs/gpu.md.

One command on a GPU machine with Docker and the pinned image pulled:

    .venv/bin/python -m pytest tests/gpu -m gpu

It writes `runtime/gpu-smoke/report.json` (or $GPU_SMOKE_REPORT): the container's probed versions,
the engine manifest, the build and start-up times, each check with its result, and the log tails.
"""
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from build import trtllm

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable  # the venv that runs the tests also runs build/trtllm.py
BUILD_TIMEOUT_S = 3600  # quantize + trtllm-build of a 135M model take minutes; the first pull is not counted
READY_TIMEOUT_S = 900
CHECKS_BUDGET_S = 600
HTTP, GRPC, METRICS = 18000, 18001, 18002
REPORT = Path(os.environ.get("GPU_SMOKE_REPORT", ROOT / "runtime" / "gpu-smoke" / "report.json"))

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(BUILD_TIMEOUT_S + READY_TIMEOUT_S + CHECKS_BUDGET_S + 300)]


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


@pytest.fixture(scope="module")
def report():
    r = Report(REPORT)
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap,driver_version,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True)
    r.step("host", nvidia_smi=smi.stdout.strip(), docker=shutil.which("docker"))
    yield r
    r.data["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    r.data["passed"] = all(c["ok"] for c in r.data["checks"]) and bool(r.data["checks"])
    r.write()


def _tail(path: Path, n=4000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory, checkpoint, report):
    if not shutil.which("docker"):
        report.step("skip", reason="no docker CLI")
        pytest.skip("no docker CLI")
    work = tmp_path_factory.mktemp("gpu-smoke")
    engine, logs = work / "engine", work / "logs"
    logs.mkdir()
    t0 = time.monotonic()
    with open(logs / "build.log", "w") as log:
        built = subprocess.run([PYTHON, "build/trtllm.py", "build", "--checkpoint", str(checkpoint),
                                "--engine", str(engine), "--max-batch-size", "16", "--max-num-tokens", "2048",
                                "--max-input-len", "2048", "--max-seq-len", "4096", "--calib-size", "32"],
                               cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_S)
    manifest = json.loads((engine / trtllm.MANIFEST).read_text()) if (engine / trtllm.MANIFEST).exists() else None
    report.step("build", rc=built.returncode, seconds=round(time.monotonic() - t0, 1), manifest=manifest,
                log_tail=_tail(logs / "build.log"))
    assert built.returncode == 0, _tail(logs / "build.log")
    serve_log = open(logs / "serve.log", "w")
    proc = subprocess.Popen([PYTHON, "build/trtllm.py", "serve", "--checkpoint", str(checkpoint),
                             "--engine", str(engine), "--repo", str(work / "repo"), "--http-port", str(HTTP),
                             "--grpc-port", str(GRPC), "--metrics-port", str(METRICS)],
                            cwd=ROOT, stdout=serve_log, stderr=subprocess.STDOUT)
    t1, ready = time.monotonic(), False
    while time.monotonic() - t1 < READY_TIMEOUT_S and proc.poll() is None:
        try:
            ready = urllib.request.urlopen(f"http://127.0.0.1:{HTTP}/v2/health/ready", timeout=2).status == 200
        except OSError:
            pass
        if ready:
            break
        time.sleep(5)
    report.step("serve", ready=ready, seconds_to_ready=round(time.monotonic() - t1, 1), exit_code=proc.poll(),
                log_tail=_tail(logs / "serve.log"))
    try:
        assert ready, f"not ready after {READY_TIMEOUT_S} s (exit code {proc.poll()}): {_tail(logs / 'serve.log')}"
        yield f"127.0.0.1:{HTTP}"
    finally:
        subprocess.run(["docker", "stop", "-t", "30", "triton-trtllm"], check=False, capture_output=True)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
        serve_log.close()
        report.step("stopped", log_tail=_tail(logs / "serve.log"))


def generate(url, body, stream=False):
    ep = "generate_stream" if stream else "generate"
    req = urllib.request.Request(f"http://{url}/v2/models/ensemble/{ep}", data=json.dumps(body).encode(), method="POST")
    raw = urllib.request.urlopen(req, timeout=120).read().decode()
    if not stream:
        return json.loads(raw)["text_output"]
    return "".join(json.loads(line[6:])["text_output"] for line in raw.splitlines() if line.startswith("data: "))


def test_fp8_engine_answers_like_the_cpu_path(gpu_server, report):
    failures = []

    def check(name, fn):
        try:
            ok, detail = fn()
        except Exception:  # recorded in the report, then failed below
            ok, detail = False, traceback.format_exc(limit=3)
        if not report.check(name, ok, detail):
            failures.append(name)

    def greedy():
        text = generate(gpu_server, {"text_input": "The capital of France is", "max_tokens": 8, "temperature": 0})
        return text.startswith(" Paris"), text

    def streamed_equals_whole():
        body = {"text_input": "Common French words: café, naïve,", "max_tokens": 24, "temperature": 0}
        a, b = generate(gpu_server, {**body, "stream": True}, stream=True), generate(gpu_server, body)
        return a == b, {"streamed": a, "whole": b}

    def metrics():
        text = urllib.request.urlopen(f"http://127.0.0.1:{METRICS}/metrics", timeout=10).read().decode()
        want = ("nv_trt_llm_kv_cache_block_metrics", "nv_trt_llm_request_metrics", "nv_gpu_utilization")
        return all(w in text for w in want), {w: w in text for w in want}

    def admin_api_closed():
        req = urllib.request.Request(f"http://{gpu_server}/v2/repository/index", data=b"{}", method="POST")
        try:
            status = urllib.request.urlopen(req, timeout=10).status
        except urllib.error.HTTPError as e:
            status = e.code
        return 400 <= status < 500 and status != 404, status

    check("greedy answer starts with ' Paris'", greedy)
    check("streamed text equals the whole answer", streamed_equals_whole)
    check("engine and GPU metrics exported", metrics)
    check("model-repository API needs the admin key", admin_api_closed)
    assert not failures, f"failed: {failures}; see {REPORT}"
