"""benchmarks/fast_lane_bench.py, the front's Python per streamed token alone: its check holds the fast lane
to the text the client must get, and a check that could not fail would hold nothing."""
import json

import pytest

from benchmarks import fast_lane_bench as bench


@pytest.fixture(scope="module")
def text_ids(checkpoint):
    return bench.text_ids()


def test_every_token_read_reaches_the_client_as_its_sse_text_in_order(text_ids):
    detok, ids = text_ids
    bench.check(detok, ids, 300)  # raises if a token's text is missing, extra or out of order


def test_the_check_fails_when_the_fast_lane_loses_a_token(text_ids, monkeypatch):
    detok, ids = text_ids
    real = bench.engine_read
    monkeypatch.setattr(bench, "engine_read", lambda token: real(token) if token != ids[5] else b"")
    with pytest.raises(AssertionError):
        bench.check(detok, ids, 300)


def test_the_bench_reports_its_cost_and_calls_per_token(checkpoint, tmp_path):
    out = tmp_path / "lane.json"
    assert bench.main(["--tokens", "2000", "--repeat", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["us_per_token"] > 0 and 5 < report["python_calls_per_token"] < 200
    assert report["machine"]["cores"] >= 1
