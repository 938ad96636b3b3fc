"""GPU smoke test: build a small FP8 engine from SmolLM2's HF folder in the pinned container, serve it,
and run the CPU path's contract checks. Needs an NVIDIA GPU and a Docker engine; skipped elsewhere.
It has not run yet in this project (no GPU machine so far): see docs/gpu.md."""
import json
import shutil
import subprocess
import time
import urllib.request

import pytest

from build import trtllm

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory, checkpoint):
    if not shutil.which("docker"):
        pytest.skip("no docker CLI")
    engine = tmp_path_factory.mktemp("engine")
    subprocess.run(["python", "build/trtllm.py", "build", "--checkpoint", str(checkpoint), "--engine", str(engine),
                    "--max-batch-size", "16", "--max-num-tokens", "2048", "--max-input-len", "2048",
                    "--max-seq-len", "4096", "--calib-size", "32"], check=True, timeout=3600)
    trtllm.check_engine(engine)
    proc = subprocess.Popen(["python", "build/trtllm.py", "serve", "--checkpoint", str(checkpoint),
                             "--engine", str(engine), "--http-port", "18000", "--grpc-port", "18001",
                             "--metrics-port", "18002"])
    deadline = time.time() + 900
    while time.time() < deadline:
        try:
            if urllib.request.urlopen("http://127.0.0.1:18000/v2/health/ready", timeout=2).status == 200:
                break
        except OSError:
            time.sleep(5)
    yield "127.0.0.1:18000"
    subprocess.run(["docker", "stop", "triton-trtllm"], check=False)
    proc.wait(timeout=120)


def generate(url, body, stream=False):
    ep = "generate_stream" if stream else "generate"
    req = urllib.request.Request(f"http://{url}/v2/models/ensemble/{ep}", data=json.dumps(body).encode(), method="POST")
    raw = urllib.request.urlopen(req, timeout=120).read().decode()
    if not stream:
        return json.loads(raw)["text_output"]
    return "".join(json.loads(line[6:])["text_output"] for line in raw.splitlines() if line.startswith("data: "))


def test_fp8_engine_answers_like_the_cpu_path(gpu_server):
    text = generate(gpu_server, {"text_input": "The capital of France is", "max_tokens": 8, "temperature": 0})
    assert text.startswith(" Paris")
    body = {"text_input": "Common French words: café, naïve,", "max_tokens": 24, "temperature": 0}
    assert generate(gpu_server, {**body, "stream": True}, stream=True) == generate(gpu_server, body)
    metrics = urllib.request.urlopen("http://127.0.0.1:18002/metrics").read().decode()
    assert "nv_trt_llm_kv_cache_block_metrics" in metrics and "nv_gpu_utilization" in metrics
