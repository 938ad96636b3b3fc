"""benchmarks/wakeup_bench.py, what a wake-up costs a process on this host: its accounting holds together."""
import json
import os

from benchmarks import wakeup_bench as bench


def test_the_bench_reports_each_placement_with_its_cpu_and_wall(tmp_path):
    out = tmp_path / "wakeup.json"
    assert bench.main(["--round-trips", "4000", "--repeat", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    placements = {"one_core"} | ({"two_cores"} if len(os.sched_getaffinity(0)) > 1 else set())
    runs = report["runs"]
    assert {(r["placement"], r["others"], r["work"]) for r in runs} == \
        {(p, o, w) for p in placements for o in ("idle", "busy") for w in (False, True)}
    assert report["work_hot_us"] > 0
    for r in runs:
        sides = sum(r["parent_cpu_us"].values()) + sum(r["child_cpu_us"].values())
        assert r["cpu_us_per_side"] > 0 and abs(r["cpu_us_per_side"] - sides / 2) < 0.02, r
        if r["placement"] == "one_core":  # the two take turns on one CPU: their CPU fits in the wall time
            assert sides <= 1.25 * r["wall_us"] + 3, r
    assert set(bench.medians(report)) == {(r["placement"], r["others"], r["work"]) for r in runs}
