"""benchmarks/wakeup_bench.py, what a wake-up costs a process on this host: its accounting holds together, and
its work steps are the front's path."""
import json
import os

from benchmarks import wakeup_bench as bench
from front import token_lane

LANE = "compiled" if token_lane.Lane is not None else "python"


def test_the_bench_reports_each_placement_and_work_with_its_cpu_and_wall(checkpoint, tmp_path):
    out = tmp_path / "wakeup.json"
    assert bench.main(["--round-trips", "4000", "--repeat", "1", "--lane", LANE, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    placements = {"one_core"} | ({"two_cores"} if len(os.sched_getaffinity(0)) > 1 else set())
    works = {"none", "token", f"lane {LANE}"}
    runs = report["runs"]
    assert {(r["placement"], r["others"], r["work"]) for r in runs} == \
        {(p, o, w) for p in placements for o in ("idle", "busy") for w in works}
    assert set(report["work_hot_us"]) == works - {"none"} and min(report["work_hot_us"].values()) > 0
    for r in runs:
        sides = sum(r["parent_cpu_us"].values()) + sum(r["child_cpu_us"].values())
        assert r["cpu_us_per_side"] > 0 and abs(r["cpu_us_per_side"] - sides / 2) < 0.02, r
        if r["placement"] == "one_core":  # the two take turns on one CPU: their CPU fits in the wall time
            assert sides <= 1.25 * r["wall_us"] + 3, r
    assert set(bench.medians(report)) == {f"{r['placement']}/{r['others']}/{r['work']}" for r in runs}


def test_the_lane_work_writes_each_token_to_the_client():
    """The lane step is the front's path: each call takes one engine read to one SSE event for the client."""
    from benchmarks.fast_lane_bench import sse_texts, text_ids

    detok, ids = text_ids()
    written = []
    work = bench.lane_work(LANE)
    for i in range(200):
        work(i)
        written.extend(work.written)
        work.written.clear()
    work.close()
    assert "".join(sse_texts(b"".join(written))) == detok.decode([ids[i % len(ids)] for i in range(200)])
