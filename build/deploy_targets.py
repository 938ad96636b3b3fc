"""Where things live inside the container, per GPU deploy target: one mount map per target.

A rendered repository is read by `tritonserver` inside a container, so every path in it (the engine,
the tokenizer, the gateway's config) must be a path of that container, not of the machine that
rendered it. `python build/render.py --target trtllm --deploy compose` renders with these paths;
`tests/deploy/test_deploy.py` checks every path in each rendered repository against the target's mount map,
and each map against the volumes its compose file or Kubernetes manifest really mounts.

- docker:  `python build/trtllm.py serve` (`make serve TARGET=trtllm`): `docker run -v` of each mount
- compose: `deploy/docker-compose.yml` (the same container paths, bind mounts of this checkout)
- k8s:     `deploy/k8s/triton.yaml` (one PVC at /llm, the gateway config from a ConfigMap)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import PurePosixPath

# paths that come with the image itself (upstream's executor_worker_path lives here)
IMAGE_PATHS = ("/opt/tritonserver",)
# the usage ledger's folder in every container (LLM_DATA_DIR of the gateway and the front: the gateway's
# spool, the front's SQLite ledger and batch files; docs/usage.md), writable
DATA_DIR = "/data"
# where `build/trtllm.py serve --lora-dir` (and `lora-convert`) mount a folder of adapters; rendered as lora_dir
LORA_DIR = "/loras"
# Kubernetes: the folder of the gateway's lease socket (LLM_GATEWAY_SOCKET, docs/gateway.md), a volume of the
# pod's own that both containers mount (compose runs both processes in one container: run-pair.sh makes it)
LEASE_SOCKET_DIR = "/run/llm-lease"


@dataclass(frozen=True)
class DeployTarget:
    name: str
    mounts: dict[str, str]  # container path -> what is mounted there
    model_repository: str  # --model-repository inside the container
    pythonpath: str  # the project (contracts/, text/, gateway/, front/, ...) inside the container
    paths: dict[str, str] = field(default_factory=dict)  # render knob -> container path
    # render knob -> the address of the state every replica shares; a target with any runs several replicas
    # and refuses to render without them (a per-replica rate limit multiplies each tenant's budget)
    shared_state: dict[str, str] = field(default_factory=dict)

    def covers(self, path: str) -> bool:
        """True if `path` lies under one of this target's mounts or the image's own paths."""
        p = PurePosixPath(path)
        return any(p == PurePosixPath(root) or PurePosixPath(root) in p.parents
                   for root in (*self.mounts, *IMAGE_PATHS))


_CONTAINER_PATHS = {
    "gpt_model_path": "/engines/engine",
    "tokenizer_dir": "/models/checkpoint",
    "gateway_config": "/project/deploy/gateway.example.yaml",
    # no adapters unless a deployment mounts a folder of them and sets `lora_dir` to it (docs/lora.md):
    # the host's default `<checkpoint>-loras` is not inside any container
    "lora_dir": "",
}
_CONTAINER_MOUNTS = {
    "/repo": "the repository rendered for this target",
    "/engines/engine": "the engine folder (trtllm-build output and manifest.json)",
    "/models/checkpoint": "the Hugging Face checkpoint folder (tokenizer, chat template)",
    "/project": "this project (its packages, deploy/gateway.example.yaml)",
    DATA_DIR: "the usage ledger's folder (written by the gateway and the front)",
}

TARGETS = {
    "docker": DeployTarget("docker", _CONTAINER_MOUNTS, "/repo", "/project", _CONTAINER_PATHS),
    "compose": DeployTarget("compose", _CONTAINER_MOUNTS, "/repo", "/project", _CONTAINER_PATHS),
    "k8s": DeployTarget(
        "k8s",
        {"/llm": "PVC llm-engines: model_repository/, engine/, checkpoint/, project/",
         "/etc/llm/gateway": "ConfigMap llm-gateway (gateway.yaml: tenants, tiers, routing)",
         DATA_DIR: "emptyDir llm-data, shared by the triton and front containers: the usage spool (loaded into "
                   "the PostgreSQL ledger of LLM_LEDGER_URL, shared by all pods) and the drain markers",
         LEASE_SOCKET_DIR: "emptyDir lease, shared by the triton and front containers: the gateway's lease socket"},
        "/llm/model_repository", "/llm/project",
        {"gpt_model_path": "/llm/engine", "tokenizer_dir": "/llm/checkpoint",
         "gateway_config": "/etc/llm/gateway/gateway.yaml", "lora_dir": ""},
        # deploy/k8s/triton.yaml's llm-redis Service: the HPA runs up to 8 replicas
        {"gateway_redis_url": "redis://llm-redis:6379/0"},
    ),
}


def get(name: str) -> DeployTarget:
    if name not in TARGETS:
        raise KeyError(f"unknown deploy target {name!r}: choose one of {', '.join(TARGETS)}")
    return TARGETS[name]
