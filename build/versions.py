"""The GPU path's pinned versions, in one place (scripts, manifests, docs and tests read these).

The pinned image is NGC's `tritonserver:25.12-trtllm-python-py3`. NVIDIA's compatibility matrix
(build/upstream/tensorrt_llm_backend.json, "containers") lists what it ships: TensorRT-LLM 1.1.0,
TensorRT 10.13.3.9, CUDA 13.0.2, and it needs driver 580.95.05 or newer. TensorRT-LLM 1.2.1 exists
only as an image built from tensorrtllm_backend's Dockerfile; no NGC tag ships it. An engine is built
in this image and served in this image: `build/trtllm.py` records what the container really reports
(`tensorrt_llm.__version__`, TensorRT version, image digest, GPU) and refuses to serve an engine
built by anything else.
"""
TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3"
TENSORRT_LLM_VERSION = "1.1.0"
TENSORRT_VERSION = "10.13.3.9"
CUDA_VERSION = "13.0.2"
MIN_DRIVER_VERSION = "580.95.05"
DCGM_EXPORTER_IMAGE = "nvcr.io/nvidia/k8s/dcgm-exporter:4.2.3-4.1.3-ubuntu22.04"
PROMETHEUS_IMAGE = "prom/prometheus:v3.5.0"
GRAFANA_IMAGE = "grafana/grafana:12.1.1"
NGINX_IMAGE = "nginx:1.28.0"  # 1.27.3+ re-resolves upstream names (`server ... resolve`) in open source
REDIS_IMAGE = "redis:7.4.2"
# The project's image: the pinned Triton image plus the front's virtualenv (deploy/Dockerfile.trtllm)
PROJECT_IMAGE = "llm-serving-trtllm:25.12-1.1.0"


def release(version: str) -> tuple[int, ...]:
    """The release a version string names: its first three numeric components. NGC's containers have reported
    `tensorrt_llm.__version__` with a build suffix (25.11: `1.0.3.2510`), so `1.1.0.2512` is release 1.1.0;
    `1.1.0rc5` is not (a pre-release is another build)."""
    parts = version.strip().split(".")
    if len(parts) < 3 or not all(p.isdigit() for p in parts[:3]) or not all(p.isdigit() for p in parts[3:]):
        return ()
    return tuple(int(p) for p in parts[:3])


def is_pinned_release(version: str) -> bool:
    """True when a container's TensorRT-LLM version is the pinned release, with or without NGC's build suffix."""
    return release(version) == release(TENSORRT_LLM_VERSION)
