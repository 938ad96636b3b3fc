"""Render the load balancer's nginx config from its one template (deploy/nginx/llm-lb.conf.template).

The shipped configs (compose's deploy/nginx/llm-lb.compose.conf, the Kubernetes ConfigMap in
deploy/k8s/scale-out.yaml) and the tests' nginx (tests/support/nginx.py) all come from here;
tests/deploy/test_deploy.py checks that the shipped files equal a fresh render.

    python build/nginx_lb.py --write     # re-render the shipped configs after editing the template
"""
from __future__ import annotations

import argparse
import string
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "deploy" / "nginx" / "llm-lb.conf.template"
# the API key, wherever the client put it: the front's Authorization / x-api-key headers, or the
# api_key query argument of Triton's own /generate (the tests' replicas)
HASH_KEY = "$http_authorization$http_x_api_key$arg_api_key"
NOTE = "generated from deploy/nginx/llm-lb.conf.template by build/nginx_lb.py: edit the template, not this file"


def render_lb_config(servers: list[str], listen: str, balance: str = "hash", *, resolver: str | None = None,
                     temp_dir: str = "/var/cache/nginx", pid: str = "/var/run/nginx.pid",
                     error_log: str = "/dev/stderr warn", worker_processes: str = "auto") -> str:
    """`servers`: host:port of each replica; with `resolver`, names are re-resolved (`resolve`, nginx
    1.27.3+), so replicas that move or scale are followed. `balance`: "hash" (consistent, on the API key)
    or "round_robin"."""
    if balance not in ("hash", "round_robin"):
        raise ValueError(f"balance must be hash or round_robin, got {balance!r}")
    resolve = " resolve" if resolver else ""
    values = {
        "generated_note": NOTE,
        "worker_processes": worker_processes,
        "pid": pid,
        "error_log": error_log,
        "temp_dir": temp_dir,
        "resolver": f"  resolver {resolver};" if resolver else "",
        "zone": "    zone llm 64k;" if resolver else "",
        "balance": f"    hash {HASH_KEY} consistent;" if balance == "hash" else "",
        "servers": "\n".join(f"    server {s}{resolve};" for s in servers),
        "listen": listen,
    }
    text = string.Template(TEMPLATE.read_text()).substitute(values)
    return "\n".join(line for line in text.splitlines() if line.strip()) + "\n"


# The shipped configs: what each deploy target balances over
COMPOSE_CONF = ROOT / "deploy" / "nginx" / "llm-lb.compose.conf"
K8S_CONF = ROOT / "deploy" / "nginx" / "llm-lb.k8s.conf"


def shipped() -> dict[Path, str]:
    return {
        # compose: Docker's embedded DNS; the two replicas of the `scale` profile
        COMPOSE_CONF: render_lb_config(["llm-a:9000", "llm-b:9000"], "9000", resolver="127.0.0.11 valid=10s"),
        # Kubernetes: the headless Service's name resolves to every ready pod
        K8S_CONF: render_lb_config(["triton-llm-pods.default.svc.cluster.local:9000"], "9000",
                                   resolver="kube-dns.kube-system.svc.cluster.local valid=10s"),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", action="store_true", help="write the shipped configs")
    args = p.parse_args(argv)
    for path, text in shipped().items():
        if args.write:
            path.write_text(text)
        print(f"{'wrote' if args.write else 'would write'} {path.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
