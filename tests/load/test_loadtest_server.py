"""The headless runner end to end against the shared real server: a short locust run with the traffic
profile (bounded in time and requests) and a small matrix against the server and a fake peer."""
import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.load.fake_peer import FakePeer

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def runner(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "loadtest.run", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_headless_profile_run_reports_per_tenant(server, tmp_path):
    out = runner("--grpc", server.grpc_url, "--http", server.http_url, "--users", "3", "--duration", "8",
                 "--max-requests", "40", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads((tmp_path / "summary.json").read_text())
    assert data["mode"] == "profile" and data["total"]["requests"] <= 40 + 3  # the cap (plus requests in flight)
    assert data["total"]["errors"] == 0, [r for r in csv.DictReader(open(tmp_path / "requests.csv")) if r["error"]]
    tenants = data["tenants"]
    assert {"acme", "globex"} & set(tenants)  # gateway traffic per tenant, with the profile's tiers
    for name, s in tenants.items():
        assert s["output_token_throughput"] > 0 and s["latency_s"]["p99"] >= s["latency_s"]["p50"] > 0
        if name in ("acme", "globex"):
            assert s["tier"] in ("enterprise", "standard") and "goodput_rps" in s
    assert "| tenant | tier |" in (tmp_path / "summary.md").read_text()
    stats = list(csv.DictReader(open(tmp_path / "locust_stats.csv")))  # locust's own CSV: per kind and tenant
    named = {(r["Type"], r["Name"]) for r in stats if r["Name"] != "Aggregated"}
    assert any(t.startswith("grpc-") for t, _ in named) and sum(int(r["Request Count"]) for r in stats
                                                                if r["Name"] == "Aggregated") > 0
    for png in ("latency_percentiles.png", "ttft_distribution.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"


def test_matrix_against_server_and_peer_prints_ratios(server, tmp_path):
    with FakePeer() as peer:
        out = runner("--grpc", server.grpc_url, "--matrix", "--levels", "1,4", "--requests", "4", "--output-tokens",
                     "8", "--peer", peer.url, "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads((tmp_path / "summary.json").read_text())
    assert [m["concurrency"] for m in data["matrix"]] == [1, 4]
    for m in data["matrix"]:
        assert m["requests"] == 4 and m["output_tok_s"] > 0 and m["ratio"] > 0 and m["peer_tok_s"] > 0
        assert m["retokenized_output_tokens_mean"] > 0
    assert {"c=1", "c=4", "peer c=1", "peer c=4"} <= set(data["tenants"])
    assert "ratio" in out.stdout and (tmp_path / "throughput_vs_concurrency.png").exists()
