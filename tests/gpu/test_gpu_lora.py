"""LoRA on the GPU path (issue 20), on a stack this test serves itself: an FP8 engine built with the LoRA
plugin in float16 (tests/gpu/conftest.py gpu_lora_engine; LoRA is opt-in, issue 31), the demo adapters written by build/make_demo_adapters.py and
converted with upstream's hf_lora_convert.py (`build/trtllm.py lora-convert`), served with
`build/trtllm.py serve --lora-dir`, and asked through the OpenAI-compatible front with the demo tenants of
deploy/gateway.example.yaml. Never run in this project (no GPU machine with Docker and the NGC image so
far; docs/lora.md). One command on a GPU machine with Docker, the pinned image and a TensorRT-LLM checkout
of the pinned tag (its examples/hf_lora_convert.py; the image does not ship it; without it these tests fail):

    GPU_TRTLLM_DIR=/path/to/TensorRT-LLM .venv/bin/python -m pytest tests/gpu/test_gpu_lora.py -m gpu

The first request for an adapter carries lora_weights / lora_config (the converted .npy files), later ones
the task id alone; both paths are exercised by asking twice.
"""
import os
import subprocess
import sys

import pytest

from tests.gpu.conftest import BUILD_TIMEOUT_S, READY_TIMEOUT_S, ROOT, serve_stack, tail

PORTS = {"http": 18100, "grpc": 18101, "metrics": 18102, "front": 18190}
ALLOWED, OTHER = "sk-demo-acme-enterprise", "sk-demo-globex-standard"  # docs/gateway.md's demo keys
# (tests/build/test_gpu_path.py checks that they are the example config's tenants with and without the adapter)
CHAT = [{"role": "user", "content": "What is the capital of France?"}]

CHECKS_BUDGET_S = 1200  # make and convert the adapters, then the checks
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(BUILD_TIMEOUT_S + READY_TIMEOUT_S + CHECKS_BUDGET_S + 300)]


@pytest.fixture(scope="module")
def front_url(gpu_lora_engine, gpu_work, checkpoint, report):
    trtllm_dir = os.environ.get("GPU_TRTLLM_DIR")
    if not trtllm_dir:  # on a GPU machine a missing piece fails, it does not skip (tests/gpu/conftest.py)
        report.step("fail lora", reason="GPU_TRTLLM_DIR not set")
        pytest.fail("GPU_TRTLLM_DIR (a TensorRT-LLM checkout of the pinned tag) is not set: the image does not "
                    "ship examples/hf_lora_convert.py, which converts the adapters")
    loras, log_path = gpu_work / "loras", gpu_work / "lora-convert.log"
    with open(log_path, "w") as log:
        for cmd in ([sys.executable, "build/make_demo_adapters.py", "--checkpoint", str(checkpoint), "--out", str(loras)],
                    [sys.executable, "build/trtllm.py", "lora-convert", "--adapters", str(loras),
                     "--trtllm-dir", trtllm_dir]):
            done = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=1800)
            report.step("lora " + cmd[1], rc=done.returncode, log_tail=tail(log_path))
            assert done.returncode == 0, tail(log_path)
    assert (loras / "demo-support" / "model.lora_weights.npy").is_file(), "lora-convert wrote no weights"
    with serve_stack("lora", gpu_lora_engine, checkpoint, gpu_work, report, PORTS, extra=("--lora-dir", str(loras))):
        yield f"http://127.0.0.1:{PORTS['front']}"


def client(url, key):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=300)


def ask(c, model):
    return c.chat.completions.create(model=model, messages=CHAT, max_tokens=12, temperature=0).choices[0].message.content


def test_adapter_changes_the_answer_first_with_weights_then_by_task_id(front_url, report):
    c = client(front_url, ALLOWED)
    base, first, again = ask(c, "auto"), ask(c, "demo-support"), ask(c, "demo-support")
    ok = first != base and again == first
    report.check("LoRA: the adapter changes the answer, the same by task id", ok,
                 {"base": base, "first": first, "again": again})
    assert ok


def test_the_adapter_is_listed_unknown_is_404_and_forbidden_is_403(front_url, report):
    import openai

    listed = [m.id for m in client(front_url, ALLOWED).models.list()]
    report.check("LoRA: /v1/models lists the adapter", "demo-support" in listed, listed)
    assert "demo-support" in listed
    with pytest.raises(openai.NotFoundError):
        ask(client(front_url, ALLOWED), "demo-nope")
    with pytest.raises(openai.PermissionDeniedError):
        ask(client(front_url, OTHER), "demo-support")
