"""Per-tenant usage and cost from the gateway's Prometheus metrics (`/metrics` on the metrics port).

The gateway exports its families under one prefix (`gateway/metrics.py` FAMILIES); this module reads
every family with that prefix generically and names the few that make the usage table.
"""
from __future__ import annotations

import urllib.request
from collections import defaultdict

from clients.prometheus import parse_samples

USAGE_PREFIX = "gateway_"
# family -> column of the usage table; aligned with gateway/metrics.py FAMILIES (a test checks it)
USAGE_FAMILIES = {"gateway_input_tokens_total": "input_tokens", "gateway_output_tokens_total": "output_tokens",
                  "gateway_cost_total": "cost"}
REQUESTS_FAMILY = "gateway_requests_total"


def families_by_tenant(text: str, prefix: str = USAGE_PREFIX) -> dict[str, dict[str, float]]:
    """{tenant: {sample name: sum over the other labels}} for every sample named `prefix*` that has a
    `tenant` label (histogram buckets left out: their `_sum` and `_count` stay)."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for name, labels, value in parse_samples(text):
        if not name.startswith(prefix) or "tenant" not in labels or name.endswith("_bucket"):
            continue
        out[labels["tenant"]][name] += value
    return {t: dict(v) for t, v in out.items()}


def usage_from_metrics(text: str) -> dict[str, dict[str, float]]:
    """{tenant: {requests, input_tokens, output_tokens, cost}} summed over models and outcomes."""
    usage = {}
    for tenant, fams in families_by_tenant(text).items():
        row = {"requests": fams.get(REQUESTS_FAMILY, 0.0)}
        row.update({col: fams.get(name, 0.0) for name, col in USAGE_FAMILIES.items()})
        usage[tenant] = row
    return usage


def fetch_metrics(url: str, timeout_s: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return r.read().decode()


def fetch_usage(url: str) -> dict[str, dict[str, float]]:
    return usage_from_metrics(fetch_metrics(url))


def format_usage(usage: dict) -> str:
    rows = [f"{'tenant':16} {'requests':>9} {'input tok':>10} {'output tok':>11} {'cost':>10}"]
    for tenant in sorted(usage):
        u = usage[tenant]
        rows.append(f"{tenant:16} {u['requests']:9.0f} {u['input_tokens']:10.0f} {u['output_tokens']:11.0f} "
                    f"{u['cost']:10.4f}")
    if len(rows) == 1:
        rows.append("(no per-tenant usage yet: no gateway traffic since the server started)")
    return "\n".join(rows)
