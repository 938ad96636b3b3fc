"""loadtest/ without a server: profile sampling, the peer client on a fake peer, and report folders
written from hand-made timelines (JSON, CSV, markdown, PNGs that parse)."""
import csv
import json
import random
import sys
from pathlib import Path

import pytest
import yaml

from tests.load.fake_peer import FakePeer

from loadtest.metrics import Record, by_tenant, summarize
from loadtest.run import matrix_markdown, peer_stream, write_report
from loadtest.workload import DEFAULT_PROFILE, Profile, sample_length


def test_lengths_uniform_and_normal_stay_in_bounds():
    rng = random.Random(0)
    uni = [sample_length({"min": 3, "max": 5}, rng) for _ in range(200)]
    assert set(uni) == {3, 4, 5}
    norm = [sample_length({"mean": 64, "stddev": 8, "min": 50, "max": 70}, rng) for _ in range(500)]
    assert min(norm) >= 50 and max(norm) <= 70 and 60 < sum(norm) / len(norm) < 66
    assert sample_length({"mean": 5, "stddev": 0}, rng) == 5


def test_profile_has_tenants_tiers_slos_and_stream_mix():
    p = Profile.load(DEFAULT_PROFILE)
    assert {t["name"] for t in p.tenants} == {"acme", "globex"} and all(t["tier"] for t in p.tenants)
    raw = yaml.safe_load(DEFAULT_PROFILE.read_text())
    assert p.slos() == {t["name"]: t["slo"] for t in raw["tenants"]}  # each tenant's SLOs, as written
    assert 0 <= p.stream_fraction <= 1
    rng = random.Random(1)
    picks = [p.pick_tenant(rng)["name"] for _ in range(400)]
    assert 0.65 < picks.count("acme") / 400 < 0.85  # weights 3:1


def test_non_streamed_records_have_no_ttft_or_itl_but_count_in_throughput():
    rs = [Record("a", "grpc-gateway", 0.0, 0.5, 2.0, 11), Record("a", "grpc-gateway", 0.0, 1.9, 2.0, 9,
                                                                   streaming=False)]
    assert rs[1].ttft is None and rs[1].itl is None
    s = summarize(rs, {"ttft_s": 1.0, "latency_s": 3.0})
    assert s["ttft_s"]["p50"] == 0.5 and s["output_token_throughput"] == pytest.approx(10.0)
    assert s["goodput_rps"] == pytest.approx(1.0)  # both meet their SLOs: 2 requests / 2 s


@pytest.mark.parametrize("v1", [False, True])
def test_peer_stream_llama_cpp_and_openai(v1):
    with FakePeer() as peer:
        t = peer_stream(peer.url + ("/v1" if v1 else ""), "hi", 5)
        path, body = peer.httpd.requests[0]
    assert t["text"] == " word" * 5 and t["start"] < t["first"] <= t["end"]
    assert path == ("/v1/completions" if v1 else "/completion") and body["temperature"] == 0
    assert body.get("ignore_eos") is True


def test_report_folder_from_hand_made_timelines(tmp_path):
    records = [Record("acme", "grpc-gateway", i, i + 0.2, i + 1.0, 9) for i in range(5)]
    records += [Record("globex", "grpc-gateway", 0, 0.4, 2.0, 17), Record("globex", "grpc-gateway", 1, None, 1.1, 0,
                                                                          ok=False, error="[kind=rate_limited] x")]
    summary = {"tenants": by_tenant(records, {"acme": {"ttft_s": 0.5}}), "total": summarize(records)}
    summary["tenants"]["acme"]["tier"] = "enterprise"
    matrix = [{"concurrency": c, "requests": 4, "output_tok_s": 40.0 * c ** 0.5, "ttft_p50": 0.1, "ttft_p95": 0.2,
               "latency_mean": 2.0, "time_per_output_token_ms": 15.0, "peer_tok_s": 50.0, "ratio": 0.8 * c ** 0.5,
               "peer_ttft_p95": 0.3} for c in (1, 4, 16)]
    write_report(tmp_path, summary, records, matrix)
    data = json.loads((tmp_path / "summary.json").read_text())
    assert data["tenants"]["acme"]["goodput_rps"] == pytest.approx(5 / 5.0)
    assert data["tenants"]["globex"]["errors"] == 1
    rows = list(csv.DictReader(open(tmp_path / "requests.csv")))
    assert len(rows) == 7 and rows[-1]["ok"] == "False"
    md = (tmp_path / "summary.md").read_text()
    assert "| acme | enterprise | 5 | 0 |" in md and "0.80x" in md and "1.60x" in md
    for png in ("latency_percentiles.png", "ttft_distribution.png", "throughput_vs_concurrency.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_matrix_table_without_peer_has_no_ratio_column():
    md = matrix_markdown([{"concurrency": 1, "requests": 8, "output_tok_s": 45.0, "ttft_p50": 0.1, "ttft_p95": 0.2,
                           "latency_mean": 2.8, "time_per_output_token_ms": 21.0}])
    assert "ratio" not in md and "| 1 | 8 | 45.0 |" in md
    assert md.splitlines()[1].count("---") == md.splitlines()[0].count("|") - 1
