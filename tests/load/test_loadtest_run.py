"""A short headless locust run against the real server writes a report that parses."""
import csv
import json

import pytest

from loadtest.run import run_locust, write_report
from loadtest.metrics import by_tenant, summarize
from loadtest.workload import DEFAULT_PROFILE, Profile

pytestmark = pytest.mark.integration


def test_headless_locust_reports_per_tenant_metrics(server, tmp_path):
    records = run_locust(server.grpc_url, server.http_url, DEFAULT_PROFILE, users=3, duration=8, out=tmp_path)
    assert records and all(r.ok for r in records), [r.error for r in records if not r.ok]
    summary = {"tenants": by_tenant(records, Profile.load(DEFAULT_PROFILE).slos()), "total": summarize(records)}
    write_report(tmp_path, summary, records)
    data = json.loads((tmp_path / "summary.json").read_text())
    tenants = set(data["tenants"])
    assert tenants & {"acme", "globex"}  # gateway traffic is reported per tenant
    for s in data["tenants"].values():
        assert s["ttft_s"]["p95"] > 0 and s["output_token_throughput"] > 0
    rows = list(csv.DictReader(open(tmp_path / "requests.csv")))
    assert len(rows) == len(records)
    assert (tmp_path / "summary.md").read_text().startswith("| tenant |")
    for png in ("latency_percentiles.png", "ttft_distribution.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "locust_stats.csv").exists()
