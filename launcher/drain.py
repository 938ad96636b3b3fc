"""Drain a replica before its processes are told to stop, where the launcher does not own them: the step
Kubernetes runs as each container's preStop hook (deploy/k8s/triton.yaml). (The launcher's own stop drains
the front it owns by SIGTERM and the front's graceful timeout: launcher/stack.py.)

    python -m launcher.drain front  --drain-dir /data/drain [--metrics-url http://127.0.0.1:9002/metrics]
                                    [--endpoint-grace-s 10] [--timeout-s 30]
    python -m launcher.drain triton --drain-dir /data/drain [--timeout-s 45]

`front`: writes `<drain-dir>/draining`, which turns the front's readiness (`/health/ready`) to 503, so the
Service and the load balancer stop sending it new requests; waits `--endpoint-grace-s` for the endpoint to
be removed (new requests may still arrive until then); then waits until the front has no request in flight
(its `llm_front_requests_in_flight`, summed over routes) and, with `--spool-dir`, until the gateway's usage
spool is empty (the front's ledger writer has loaded the last records: the pod's folder goes with the pod),
or `--timeout-s` passes; then writes `<drain-dir>/drained`. The kubelet's SIGTERM that follows finds
nothing to cut.

`triton`: waits for `drained` (or `--timeout-s`), so tritonserver, which the front's requests go through,
is stopped only after the front has drained (both containers' preStop hooks start at once).
"""
from __future__ import annotations

import argparse
import re
import sys
import time
import urllib.request
from pathlib import Path

from front.drain import DRAINED, DRAINING

IN_FLIGHT = "llm_front_requests_in_flight"  # front/metrics.py
DEFAULT_TIMEOUT_S = 30.0  # the launcher's drain_timeout_s (launcher/stack.py StackConfig) and the front's graceful timeout


def mark_draining(drain_dir: Path) -> Path:
    drain_dir = Path(drain_dir)
    drain_dir.mkdir(parents=True, exist_ok=True)
    (drain_dir / DRAINING).touch()
    return drain_dir / DRAINING


def in_flight(metrics_url: str, timeout_s: float = 2.0) -> float | None:
    """Requests the front is serving, from its /metrics (None when it does not answer: nothing to wait for)."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=timeout_s) as r:
            text = r.read().decode()
    except OSError:
        return None
    values = re.findall(rf"^{IN_FLIGHT}(?:{{[^}}]*}})?\s+(\S+)$", text, re.M)
    return sum(float(v) for v in values)


def drain_front(drain_dir: Path, metrics_url: str, endpoint_grace_s: float, timeout_s: float,
                poll_s: float = 0.2, spool_dir: Path | None = None) -> float:
    """Readiness off, then wait for the in-flight requests and the spool; returns what was still in flight
    at the end (the `drained` marker says it, and the spool segments left)."""
    from ledger.spool import backlog

    mark_draining(drain_dir)
    deadline = time.monotonic() + endpoint_grace_s + timeout_s
    time.sleep(endpoint_grace_s)
    left = in_flight(metrics_url) or 0.0
    while left > 0 and time.monotonic() < deadline:
        time.sleep(poll_s)
        left = in_flight(metrics_url) or 0.0
    spooled = backlog(spool_dir)[0] if spool_dir else 0
    while spooled and time.monotonic() < deadline:
        time.sleep(poll_s)
        spooled = backlog(spool_dir)[0]
    (Path(drain_dir) / DRAINED).write_text(f"{left:g}\n" + (f"spool segments left: {spooled}\n" if spooled else ""))
    return left


def wait_drained(drain_dir: Path, timeout_s: float, poll_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while not (Path(drain_dir) / DRAINED).exists():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m launcher.drain", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("container", choices=("front", "triton"))
    p.add_argument("--drain-dir", type=Path, required=True, help="a folder both containers share")
    p.add_argument("--metrics-url", default="http://127.0.0.1:9002/metrics", help="the front's own metrics")
    p.add_argument("--endpoint-grace-s", type=float, default=10.0,
                   help="front: how long new requests may still arrive once readiness is off")
    p.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S, help="the most to wait for in-flight requests")
    p.add_argument("--spool-dir", type=Path, help="front: wait until this usage spool is empty too (LLM_DATA_DIR/spool)")
    args = p.parse_args(argv)
    if args.container == "front":
        left = drain_front(args.drain_dir, args.metrics_url, args.endpoint_grace_s, args.timeout_s,
                           spool_dir=args.spool_dir)
        print(f"drain: front drained ({left:g} requests still in flight)", file=sys.stderr)
        return 0
    ok = wait_drained(args.drain_dir, args.timeout_s)
    print("drain: the front drained; tritonserver may stop" if ok else
          f"drain: the front did not drain within {args.timeout_s:g} s; stopping anyway", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
