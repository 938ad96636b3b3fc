"""benchmarks/fast_lane_bench.py, the front's Python per streamed token alone: its check holds the fast lane
to the text the client must get, and a check that could not fail would hold nothing."""
import json

import pytest

from benchmarks import fast_lane_bench as bench
from front import token_lane


@pytest.fixture(scope="module")
def text_ids(checkpoint):
    return bench.text_ids()


LANES = ["python"] + (["compiled"] if token_lane.Lane is not None else [])


@pytest.mark.parametrize("lane", LANES)
def test_every_token_read_reaches_the_client_as_its_sse_text_in_order(text_ids, lane):
    detok, ids = text_ids
    bench.check(detok, ids, 300, token_lane.resolve(lane))  # raises if a token's text is missing, extra or out of order


def test_the_check_fails_when_the_fast_lane_loses_a_token(text_ids, monkeypatch):
    detok, ids = text_ids
    real = bench.engine_read
    monkeypatch.setattr(bench, "engine_read", lambda token: real(token) if token != ids[5] else b"")
    with pytest.raises(AssertionError):
        bench.check(detok, ids, 300)


def test_the_bench_reports_its_cost_and_calls_per_token(checkpoint, tmp_path):
    out = tmp_path / "lane.json"
    assert bench.main(["--tokens", "2000", "--repeat", "2", "--lane", ",".join(LANES), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["lanes"]) == set(LANES) and report["machine"]["cores"] >= 1
    python = report["lanes"]["python"]
    assert python["us_per_token"] > 0 and 5 < python["python_calls_per_token"] < 200
    if "compiled" in LANES:  # the lane's point: a read's plain steps in one call
        assert 0 < report["lanes"]["compiled"]["python_calls_per_token"] < python["python_calls_per_token"] / 2
