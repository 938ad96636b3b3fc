"""LoRA adapters across the layers, in one folder (docs/lora.md): the CPU engine's adapters
(test_engine_lora.py, cpu_engine/lora.py), the gateway's adapter routing and engine tensors
(test_gateway_lora.py), and the whole stack (test_lora_server.py). The GPU path's LoRA tests need the
GPU conftest and stay with the GPU tests (tests/gpu/test_gpu_lora.py; its build flags:
tests/build/test_gpu_path.py)."""
from tests.engine.conftest import tiny_dir  # noqa: F401  (the engine tests' tiny checkpoint, a fixture)
