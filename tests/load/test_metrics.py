"""genai-perf metric math on hand-made timelines."""
import pytest

from loadtest.metrics import Record, by_tenant, percentiles, summarize


def rec(tenant, start, first, end, tokens, ok=True):
    return Record(tenant, "grpc-gateway", start, first, end, tokens, ok)


def test_ttft_itl_latency_of_one_request():
    r = rec("a", 10.0, 10.5, 12.5, 5)
    assert r.ttft == 0.5 and r.latency == 2.5
    assert r.itl == pytest.approx((2.5 - 0.5) / 4)
    assert rec("a", 0, 0.1, 0.2, 1).itl is None  # one token: no inter-token gap
    assert rec("a", 0, None, 1.0, 0).ttft is None


def test_throughput_spans_first_send_to_last_receive_and_skips_errors():
    rs = [rec("a", 0.0, 0.2, 2.0, 10), rec("a", 1.0, 1.1, 4.0, 30), rec("a", 0.5, None, 0.6, 0, ok=False)]
    s = summarize(rs)
    assert s["requests"] == 3 and s["errors"] == 1
    assert s["duration_s"] == pytest.approx(4.0)
    assert s["output_token_throughput"] == pytest.approx(40 / 4.0)
    assert s["ttft_s"]["p50"] == pytest.approx(0.15)


def test_percentiles_interpolate_like_numpy():
    p = percentiles([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert p["p50"] == pytest.approx(5.5) and p["p90"] == pytest.approx(9.1) and p["p99"] == pytest.approx(9.91)
    assert percentiles([None, None]) == {}


def test_goodput_counts_requests_meeting_every_slo_per_tenant():
    rs = [rec("a", 0, 0.1, 1.0, 10), rec("a", 0, 2.0, 3.0, 10), rec("b", 0, 0.1, 4.0, 2)]
    out = by_tenant(rs, {"a": {"ttft_s": 1.0}, "b": {"latency_s": 1.0}})
    assert out["a"]["goodput_rps"] == pytest.approx(1 / 3.0)
    assert out["b"]["goodput_rps"] == 0
