"""The GPU path's pinned versions, in one place (scripts, manifests, docs and tests read these).

TensorRT-LLM 1.2.1 is the last line with the TensorRT-engine path (trtllm-build -> C++ `tensorrtllm`
backend); NGC's tritonserver 25.12 `-trtllm-python-py3` image ships it (tensorrtllm_backend HEAD
Dockerfile: base 25.12, TRT-LLM 1.2.1, TensorRT 10.14.1.48, CUDA 13.0).
"""
TENSORRT_LLM_VERSION = "1.2.1"
TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3"
TENSORRT_VERSION = "10.14.1.48"
CUDA_VERSION = "13.0"
DCGM_EXPORTER_IMAGE = "nvcr.io/nvidia/k8s/dcgm-exporter:4.2.3-4.1.3-ubuntu22.04"
PROMETHEUS_IMAGE = "prom/prometheus:v3.5.0"
GRAFANA_IMAGE = "grafana/grafana:12.1.1"
