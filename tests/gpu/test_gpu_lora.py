"""LoRA on the GPU path (issue 20), against a running TensorRT-LLM stack. Never run in this project (no GPU
machine with Docker and the NGC image so far; docs/lora.md). Needs:

    python build/trtllm.py build ...                      # LoRA plugin on by default
    python build/make_demo_adapters.py --checkpoint <ckpt> --out <lora_dir>
    python build/trtllm.py lora-convert --adapters <lora_dir> --trtllm-dir <TensorRT-LLM checkout>
    python build/trtllm.py serve ...  (rendered with --set lora_dir=<lora_dir>)
    GPU_LORA_FRONT_URL=http://127.0.0.1:9000 GPU_LORA_KEY=<key allowed demo-support> \
        GPU_LORA_OTHER_KEY=<key not allowed> .venv/bin/python -m pytest tests/gpu/test_gpu_lora.py -m gpu

The first request for an adapter carries lora_weights / lora_config (the converted .npy files), later ones
the task id alone; both paths are exercised by asking twice.
"""
import os

import pytest

pytestmark = pytest.mark.gpu

URL = os.environ.get("GPU_LORA_FRONT_URL")
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client():
    if not URL:
        pytest.skip("GPU_LORA_FRONT_URL not set: no TensorRT-LLM stack with LoRA to talk to")
    import openai

    return lambda key: openai.OpenAI(base_url=f"{URL}/v1", api_key=key, max_retries=0, timeout=300)


def ask(c, model):
    return c.chat.completions.create(model=model, messages=CHAT, max_tokens=12, temperature=0).choices[0].message.content


def test_adapter_changes_the_answer_first_with_weights_then_by_task_id(client):
    c = client(os.environ["GPU_LORA_KEY"])
    base, first, again = ask(c, "auto"), ask(c, "demo-support"), ask(c, "demo-support")
    assert first != base and again == first


def test_unknown_adapter_404_and_forbidden_adapter_403(client):
    import openai

    with pytest.raises(openai.NotFoundError):
        ask(client(os.environ["GPU_LORA_KEY"]), "demo-nope")
    with pytest.raises(openai.PermissionDeniedError):
        ask(client(os.environ["GPU_LORA_OTHER_KEY"]), "demo-support")
