"""The headless runner end to end against the shared real server: a short locust run with the traffic
profile (bounded in time and requests) and a small matrix against the server and a fake peer."""
import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.load.fake_peer import TOKEN_DELAY_S, FakePeer

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
    rows = list(csv.DictReader(open(tmp_path / "requests.csv")))
    assert len(rows) == data["total"]["requests"] == sum(s["requests"] for s in tenants.values())
    for name, s in tenants.items():
        mine = [r for r in rows if r["tenant"] == name]
        # the tokens counted are the tokens each request received; throughput is them over the run's span,
        # which holds every request's whole latency
        assert s["output_tokens"] == sum(int(r["output_tokens"]) for r in mine)
        assert s["output_token_throughput"] == pytest.approx(s["output_tokens"] / s["duration_s"])
        assert s["duration_s"] >= max(float(r["latency_s"]) for r in mine) * (1 - 1e-9)
        assert s["latency_s"]["p99"] >= s["latency_s"]["p50"] > 0
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
    rows = list(csv.DictReader(open(tmp_path / "requests.csv")))
    for m in data["matrix"]:
        c = m["concurrency"]
        assert m["requests"] == 4 and m["ratio"] == pytest.approx(m["output_tok_s"] / m["peer_tok_s"])
        assert 7 <= m["retokenized_output_tokens_mean"] <= 9  # 8 forced tokens, re-tokenized
        # 4 x 8 tokens over the level's span: the span holds its longest request, and at concurrency 1 all
        # four one after another; the peer's, each of its streams at most a token every TOKEN_DELAY_S
        for rate, tenant in ((m["output_tok_s"], f"c={c}"), (m["peer_tok_s"], f"peer c={c}")):
            latencies = [float(r["latency_s"]) for r in rows if r["tenant"] == tenant]
            assert len(latencies) == 4
            assert rate <= 4 * 8 / (sum(latencies) if c == 1 else max(latencies)) * (1 + 1e-9)
        assert m["peer_tok_s"] <= c / TOKEN_DELAY_S
    assert {"c=1", "c=4", "peer c=1", "peer c=4"} <= set(data["tenants"])
    assert "ratio" in out.stdout and (tmp_path / "throughput_vs_concurrency.png").exists()
