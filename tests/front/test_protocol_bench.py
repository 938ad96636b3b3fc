"""benchmarks/protocol_bench.py, the Python a request costs the front's HTTP/1.1 protocol alone: its check
holds each protocol to whole answers in order, and a check that could not fail would hold nothing."""
import json

import pytest

from benchmarks import protocol_bench as bench


def test_the_bench_reports_each_protocols_cost_and_calls(tmp_path):
    out = tmp_path / "protocol.json"
    assert bench.main(["--requests", "300", "--repeat", "1", "--out", str(out)]) == 0
    protocols = json.loads(out.read_text())["protocols"]
    assert set(protocols) == {"front (BoundedHttpToolsProtocol)", "uvicorn h11", "uvicorn httptools"}
    for result in protocols.values():
        assert result["us_per_request"] > 0 and 20 < result["python_calls_per_request"] < 2000
    # h11 parses in Python, llhttp in C: the count, not the time, is what a test may hold
    assert protocols["uvicorn h11"]["python_calls_per_request"] > protocols["uvicorn httptools"][
        "python_calls_per_request"]


def test_the_check_fails_when_an_answer_is_incomplete(monkeypatch):
    async def half(scope, receive, send):  # the head and an event, never the end
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": bench.EVENT, "more_body": True})
    monkeypatch.setattr(bench, "app", half)
    with pytest.raises(AssertionError):
        bench.measure(bench.BoundedHttpToolsProtocol, 10, 1)


def test_another_protocol_loads_from_its_file(tmp_path):
    path = tmp_path / "other.py"
    path.write_text("from dataclasses import dataclass\n"
                    "from uvicorn.protocols.http.h11_impl import H11Protocol\n\n"
                    "@dataclass\nclass Limits:\n    n: int = 1\n\n"
                    "class Other(H11Protocol):\n    pass\n")
    other = bench.load(f"{path}:Other")
    assert other.__name__ == "Other" and "calls" in str(bench.measure(other, 50, 1))
