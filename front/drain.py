"""The drain markers a replica's front reads: `<drain dir>/draining` turns its readiness off (the load
balancer and the Service stop sending it requests); `launcher/drain.py` writes them (Kubernetes' preStop)."""
from __future__ import annotations

from pathlib import Path

DRAINING = "draining"  # present: /health/ready answers 503 {"status": "draining"}
DRAINED = "drained"  # present: nothing was left in flight (or the drain timed out); tritonserver may stop


def is_draining(drain_dir: Path | None) -> bool:
    return drain_dir is not None and (Path(drain_dir) / DRAINING).exists()
