"""GPU smoke test: build a small FP8 engine from SmolLM2's HF folder in the pinned container, serve it,
and run the CPU path's contract checks. Needs an NVIDIA GPU and a Docker engine; skipped where no GPU
exists, failed on a GPU machine without docker.
It has not run yet in this project (no GPU machine with Docker so far): see docs/gpu.md.

One command on a GPU machine with Docker and the pinned image pulled:

    .venv/bin/python -m pytest tests/gpu/test_gpu_smoke.py -m gpu     # tests/gpu: the LoRA test too (GPU_TRTLLM_DIR)

It writes `runtime/gpu-smoke/report.json` (or $GPU_SMOKE_REPORT): the container's probed versions,
the engine manifest, the build and start-up times, each check with its result, and the log tails.
"""
import json
import traceback
import urllib.error
import urllib.request

import pytest

from tests.gpu.conftest import BUILD_TIMEOUT_S, READY_TIMEOUT_S, REPORT, serve_stack

CHECKS_BUDGET_S = 600
PORTS = {"http": 18000, "grpc": 18001, "metrics": 18002, "front": 18090}
HTTP, METRICS = PORTS["http"], PORTS["metrics"]

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(BUILD_TIMEOUT_S + READY_TIMEOUT_S + CHECKS_BUDGET_S + 300)]


@pytest.fixture(scope="module")
def gpu_server(gpu_engine, gpu_work, checkpoint, report):
    with serve_stack("smoke", gpu_engine, checkpoint, gpu_work, report, PORTS):
        yield f"127.0.0.1:{HTTP}"


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
