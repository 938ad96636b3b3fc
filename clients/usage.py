"""Per-tenant usage and cost from the gateway's Prometheus metrics."""
from __future__ import annotations

import urllib.request
from collections import defaultdict

USAGE_FAMILIES = {"gateway_input_tokens_total": "input_tokens", "gateway_output_tokens_total": "output_tokens",
                  "gateway_cost_total": "cost"}


def parse_samples(text: str):
    """(name, labels, value) for every sample line of Prometheus text."""
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, label_text = head.partition("{")
        labels = {}
        for part in label_text.rstrip("}").split(","):
            if "=" in part:
                k, v = part.split("=", 1)
                labels[k.strip()] = v.strip().strip('"')
        yield name, labels, float(value)


def usage_from_metrics(text: str) -> dict[str, dict[str, float]]:
    usage: dict[str, dict[str, float]] = defaultdict(lambda: {"requests": 0.0, **{v: 0.0 for v in USAGE_FAMILIES.values()}})
    for name, labels, value in parse_samples(text):
        tenant = labels.get("tenant")
        if tenant is None:
            continue
        if name in USAGE_FAMILIES:
            usage[tenant][USAGE_FAMILIES[name]] += value
        elif name == "gateway_requests_total":
            usage[tenant]["requests"] += value
    return dict(usage)


def fetch_usage(url: str) -> dict[str, dict[str, float]]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return usage_from_metrics(r.read().decode())


def format_usage(usage: dict) -> str:
    rows = [f"{'tenant':16} {'requests':>9} {'input tok':>10} {'output tok':>11} {'cost':>10}"]
    for tenant in sorted(usage):
        u = usage[tenant]
        rows.append(f"{tenant:16} {u['requests']:9.0f} {u['input_tokens']:10.0f} {u['output_tokens']:11.0f} {u['cost']:10.4f}")
    return "\n".join(rows)
