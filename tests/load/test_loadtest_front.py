"""The front in the load-test and benchmark tooling, against the session's shared stack (tritonserver +
gateway + the OpenAI-compatible front): the locust front user (SSE `/v1/chat/completions`) in a short
profile run, `loadtest.run --matrix --peer front`, and the layered benchmark end to end. Every run is
small and bounded: a few requests of a few tokens."""
import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
KEY = "k-loadtest"  # the shared stack's tenant "loadtest": limits that never throttle (tests/support/tenants.py)


@pytest.fixture(scope="module")
def stack(shared_stack):
    return shared_stack


def runner(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "loadtest.run", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_locust_front_user_streams_chat_with_ttft_itl_and_tokens(stack, tmp_path):
    profile = tmp_path / "front.yaml"
    profile.write_text(yaml.safe_dump({
        "tenants": [{"name": "acme", "api_key": KEY, "tier": "enterprise", "slo": {"ttft_s": 30, "itl_s": 5}}],
        "users": {"front_chat": 1, "grpc_gateway": 0, "grpc_ensemble": 0, "http_generate_stream": 0},
        "prompt_tokens": {"min": 8, "max": 16}, "output_tokens": {"min": 6, "max": 8}, "stream_fraction": 1.0}))
    out = runner("--grpc", stack.grpc_url, "--http", stack.http_url, "--front", stack.front_url, "--profile",
                 str(profile), "--users", "2", "--duration", "8", "--max-requests", "40", "--out", str(tmp_path / "r"))
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert set(data["kinds"]) == {"front-chat"} and set(data["tenants"]) == {"acme"}
    s = data["kinds"]["front-chat"]
    rows = list(csv.DictReader(open(tmp_path / "r" / "requests.csv")))
    assert s["errors"] == 0, [r["error"] for r in rows if r["error"]]
    assert 1 <= s["requests"] == len(rows) <= 40 + 2  # the cap, plus requests already in flight
    assert 0 < s["ttft_s"]["p50"] <= s["latency_s"]["p50"] and s["itl_s"]["p50"] > 0
    # the tokens counted are the tokens the requests received; throughput is them over the run's span,
    # which holds every request's whole latency
    assert s["output_tokens"] == sum(int(r["output_tokens"]) for r in rows)
    assert s["output_token_throughput"] == pytest.approx(s["output_tokens"] / s["duration_s"])
    assert s["duration_s"] >= max(float(r["latency_s"]) for r in rows) * (1 - 1e-9)
    # forced lengths of 6-8, counted by re-tokenizing the text: that can merge or split a few tokens at
    # piece boundaries (a clean-clone run saw one outside 6-9), but never turns an early EOS into 6+
    assert all(4 <= int(r["output_tokens"]) <= 12 for r in rows), [r["output_tokens"] for r in rows]
    assert data["tenants"]["acme"]["tier"] == "enterprise" and "goodput_rps" in data["tenants"]["acme"]
    # locust's own view, by kind and tenant (its CSV is written once a second, and not again at the end: the
    # run lasts up to 8 s, so requests have completed before a write even on a loaded host, where 4 s once
    # ended with none written)
    stats = list(csv.DictReader(open(tmp_path / "r" / "locust_stats.csv")))
    assert ("front-chat", "acme") in {(r["Type"], r["Name"]) for r in stats}
    assert "| front-chat |" in (tmp_path / "r" / "summary.md").read_text()


def test_matrix_with_the_front_as_peer(stack, tmp_path):
    out = runner("--grpc", stack.grpc_url, "--front", stack.front_url, "--matrix", "--levels", "1,4", "--requests",
                 "2", "--output-tokens", "8", "--peer", "front", "--api-key", KEY, "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads((tmp_path / "summary.json").read_text())
    assert [m["concurrency"] for m in data["matrix"]] == [1, 4]
    assert {"c=1", "c=4", "front c=1", "front c=4"} <= set(data["tenants"])
    assert data["tenants"]["front c=4"]["errors"] == 0 and data["total"]["errors"] == 0
    every = list(csv.DictReader(open(tmp_path / "requests.csv")))
    rows = [r for r in every if r["tenant"].startswith("front")]
    assert len(rows) == 4 and all(7 <= int(r["output_tokens"]) <= 9 for r in rows)
    for m in data["matrix"]:
        c = m["concurrency"]
        assert m["peer_name"] == "front" and m["ratio"] == pytest.approx(m["output_tok_s"] / m["peer_tok_s"])
        # 2 x 8 tokens over the level's span, which holds its longest request (at concurrency 1: both)
        for rate, tenant in ((m["output_tok_s"], f"c={c}"), (m["peer_tok_s"], f"front c={c}")):
            latencies = [float(r["latency_s"]) for r in every if r["tenant"] == tenant]
            assert len(latencies) == 2
            assert 0 < rate <= 2 * 8 / (sum(latencies) if c == 1 else max(latencies)) * (1 + 1e-9)
        assert 0 < m["peer_ttft_p50"] <= max(float(r["latency_s"]) for r in every if r["tenant"] == f"front c={c}")
    assert "front tok/s" in out.stdout and "ratio (ensemble / front)" in out.stdout


def test_runner_refuses_peer_front_without_a_front_for_a_running_stack(stack, tmp_path):
    out = runner("--grpc", stack.grpc_url, "--matrix", "--peer", "front", "--out", str(tmp_path), timeout=60)
    assert out.returncode != 0 and "--front" in out.stderr


def test_layered_benchmark_end_to_end_on_a_running_stack(stack, tmp_path):
    from benchmarks import triton_bench

    out = tmp_path / "layers.json"
    assert triton_bench.main(["--url", stack.grpc_url, "--front-url", stack.front_url, "--api-key", KEY,
                              "--levels", "1,4", "--repeat", "1", "--requests", "2", "--output-tokens", "8",
                              "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [lvl["concurrency"] for lvl in report["levels"]] == [1, 4]  # the earlier format: the ensemble's rows
    assert report["workload"]["layer"] == "ensemble" and report["workload"]["output_tokens"] == 8
    layers = report["layers"]
    assert layers["order"] == ["ensemble", "gateway", "front"]
    for lvl in layers["levels"]:
        for name in layers["order"]:
            by = lvl["by_layer"][name]
            assert by["requests"] == 2 and 0 < by["ttft_p50"] <= by["ttft_p95"]
            # 2 x 8 tokens over a span that holds the longer request: at most 16 / its latency
            assert 0 < by["output_tok_s"] <= 2 * 8 / by["runs"][0]["latency_p95"] * (1 + 1e-9)
            assert by["runs"][0]["retokenized_output_tokens_mean"] >= 7  # forced length on every layer
        assert set(lvl["ratios"]) == {"gateway/ensemble", "front/gateway"}
        for upper, lower in (("gateway", "ensemble"), ("front", "gateway")):  # one round: its own ratio
            assert lvl["ratios"][f"{upper}/{lower}"] == pytest.approx(
                lvl["by_layer"][upper]["output_tok_s"] / lvl["by_layer"][lower]["output_tok_s"])
        assert set(lvl["ttft_p50_added_ms"]) == {"gateway", "front"}
        assert "front" in lvl["by_layer"]["front"]["runs"][0]["cpu_s"]  # the front's process is found by port
    md = out.with_suffix(".md").read_text()
    assert "## Layers" in md and "gateway / ensemble" in md and "TTFT p50 added by front (ms)" in md
