"""The ledger library against real stores (SQLite files, a real PostgreSQL server): the spool, the writer
(exactly once, replay, outage), reports, and batch jobs (bad lines, tenancy, claims, cancel, finalize)."""
import json
import os
import shutil
import time
import uuid

import pytest

from front.batch.jobs import BatchLimits, Jobs, output_line
from contracts.errors import ServingError
from front.metrics import FrontMetrics
from ledger import reports
from contracts.usage_record import UsageRecord
from ledger.spool import SpoolWriter, backlog, read_segment, sealed_segments
from ledger.store import Store
from ledger.writer import LedgerWriter
from tests.support.postgres import PostgresServer


def record(i: int, tenant="acme", **kw) -> UsageRecord:
    base = dict(request_id=uuid.uuid4().hex, ts=time.time(), tenant=tenant, tier="standard", model="tensorrt_llm",
                adapter="", prompt_tokens=10 + i, completion_tokens=i, cost=0.001 * i, ttft_ms=5.0 + i,
                latency_ms=50.0 + i, outcome="success", error_kind="", finish_reason="length")
    base.update(kw)
    return UsageRecord(**base)


@pytest.fixture(scope="module")
def pg():
    with PostgresServer() as server:
        yield server


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    if request.param == "sqlite":
        s = Store.open(tmp_path / "ledger.sqlite3").init()
    else:
        pg = request.getfixturevalue("pg")
        s = Store.open(pg.url).init()
        with s.tx() as cur:
            for t in ("usage", "files", "batches", "batch_lines"):
                cur.execute(f"DELETE FROM {t}")
    yield s
    s.close()


def test_spool_writes_seals_and_the_writer_loads_each_record_exactly_once(store, tmp_path):
    spool = SpoolWriter(tmp_path / "spool", flush_interval_s=0.05, segment_seconds=0.1)
    recs = [record(i) for i in range(200)]
    for r in recs:
        spool.append(r.to_json())
    spool.close()
    segs = sealed_segments(tmp_path / "spool")
    assert segs and sum(len(read_segment(p)) for p in segs) == 200
    keep = tmp_path / "replay.jsonl"
    shutil.copy(segs[0], keep)
    writer = LedgerWriter(store, tmp_path / "spool")
    assert writer.drain() and writer.written == 200
    assert backlog(tmp_path / "spool") == (0, 0)
    # a replayed segment (crash between commit and delete) adds nothing
    shutil.copy(keep, tmp_path / "spool" / keep.name)
    assert writer.drain() and writer.written == 200
    rows = store.usage_rows("acme", 0, time.time() + 1)
    assert sorted(r["request_id"] for r in rows) == sorted(r.request_id for r in recs)
    got = store.usage_by_id(recs[7].request_id)
    assert (got["prompt_tokens"], got["completion_tokens"], got["outcome"]) == (17, 7, "success")


def test_a_dead_writers_open_segment_is_sealed_and_a_torn_line_skipped(tmp_path):
    d = tmp_path / "spool"
    d.mkdir()
    good = record(1).to_json()
    # pid 2**22+7 is above pid_max's default: no such process
    (d / f"gateway-{2**22 + 7}-{time.time_ns()}-1.open").write_text(good + "\n" + good[:20])
    alive = d / f"gateway-{os.getpid()}-{time.time_ns()}-2.open"
    alive.write_text(good + "\n")
    segs = sealed_segments(d)
    assert len(segs) == 1 and alive.exists()
    assert [r["request_id"] for r in read_segment(segs[0])] == [json.loads(good)["request_id"]]


def test_reports_group_by_day_and_model_with_percentiles():
    day = time.mktime(time.strptime("2026-11-20", "%Y-%m-%d")) - time.timezone + 3600
    rows = [dict(record(i, ts=day).__dict__, day="2026-11-20") for i in range(1, 21)]
    rows.append(dict(record(0, ts=day + 86400, model="small", outcome="error", error_kind="rate_limited",
                            ttft_ms=None).__dict__, day="2026-11-21"))
    by_day = reports.aggregate(rows, "day")
    assert [(r["day"], r["requests"]) for r in by_day] == [("2026-11-20", 20), ("2026-11-21", 1)]
    first = by_day[0]
    assert first["prompt_tokens"] == sum(10 + i for i in range(1, 21))
    assert first["ttft_p50_ms"] == 15.5 and first["ttft_p95_ms"] == 24.1 and first["latency_p95_ms"] == 69.0
    assert by_day[1]["errors"] == 1 and by_day[1]["ttft_p50_ms"] is None
    assert [r["model"] for r in reports.aggregate(rows, "model")] == ["small", "tensorrt_llm"]
    csv = reports.render(by_day, "csv").splitlines()
    assert csv[0].startswith("tenant,day,requests") and len(csv) == 3
    with pytest.raises(reports.ReportError, match="start"):
        reports.window("2026-13-01", None)
    with pytest.raises(reports.ReportError, match="after end"):
        reports.window("2026-11-21", "2026-11-20")


def test_postgres_outage_keeps_records_spooled_and_replays_them_all(pg, tmp_path):
    store = Store.open(pg.url).init()
    metrics = FrontMetrics()
    spool_dir = tmp_path / "spool"
    spool = SpoolWriter(spool_dir, flush_interval_s=0.05, segment_seconds=0.05)
    writer = LedgerWriter(store, spool_dir, metrics=metrics)
    writer.ensure_ready = store.init
    before = [record(i, tenant="outage") for i in range(5)]
    for r in before:
        spool.append(r.to_json())
    spool.flush(seal=True)
    assert writer.drain()
    pg.pause()
    try:
        during = [record(i, tenant="outage") for i in range(30)]
        for r in during:
            spool.append(r.to_json())
        spool.flush(seal=True)
        assert not writer.drain() and not writer.drain()
        assert metrics.ledger_failures._value.get() == 2 and metrics.ledger_up._value.get() == 0
        assert metrics.spool_segments._value.get() >= 1
        assert sum(len(read_segment(p)) for p in sealed_segments(spool_dir)) == 30
    finally:
        pg.resume()
    assert writer.drain()
    spool.close()
    rows = store.usage_rows("outage", 0, time.time() + 1)
    assert sorted(r["request_id"] for r in rows) == sorted(r.request_id for r in before + during)
    assert metrics.ledger_up._value.get() == 1 and backlog(spool_dir) == (0, 0)
    store.close()


LINES = [
    {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "auto", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}},
    "not json {",
    {"custom_id": "b", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 4}},
    {"custom_id": "a", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "x"}]}},
    {"custom_id": "c", "url": "/v1/chat/completions", "body": {"messages": "oops"}},
    {"custom_id": "d", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "y"}],
                                                               "max_tokens": 2}},
]


def jsonl(lines) -> bytes:
    return ("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n").encode()


def test_batch_jobs_bad_lines_tenancy_claims_and_finalize(store):
    jobs = Jobs(store, BatchLimits(max_file_bytes=4096, max_lines=10))
    with pytest.raises(ServingError, match="purpose"):
        jobs.upload("acme", "fine-tune", "x.jsonl", jsonl(LINES))
    with pytest.raises(ServingError, match="over the limit of 10"):
        jobs.upload("acme", "batch", "x.jsonl", jsonl(LINES * 2))
    with pytest.raises(ServingError, match="over the limit of 4096 bytes"):
        jobs.upload("acme", "batch", "x.jsonl", b"x" * 5000)
    f = jobs.upload("acme", "batch", "in.jsonl", jsonl(LINES))
    with pytest.raises(ServingError) as e:
        jobs.create("globex", {"input_file_id": f["id"], "endpoint": "/v1/chat/completions"})
    assert e.value.status == 404
    with pytest.raises(ServingError, match="endpoint"):
        jobs.create("acme", {"input_file_id": f["id"], "endpoint": "/v1/embeddings"})
    b = jobs.create("acme", {"input_file_id": f["id"], "endpoint": "/v1/chat/completions",
                             "completion_window": "24h"})
    assert b["status"] == "in_progress" and b["request_counts"] == {"total": 6, "completed": 0, "failed": 4}
    with pytest.raises(ServingError) as e:
        jobs.get("globex", b["id"])
    assert e.value.status == 404
    assert jobs.list("globex")["data"] == [] and jobs.list("acme")["data"][0]["id"] == b["id"]
    claimed = store.claim_lines("w1", 10, 60)
    assert sorted(c["custom_id"] for c in claimed) == ["a", "d"]
    assert store.claim_lines("w2", 10, 60) == []  # nothing left to claim
    assert store.release_worker("w1") == 2  # a restart of w1 hands them back
    claimed = store.claim_lines("w1", 10, 60)
    for c in claimed:
        assert store.finish_line(c["batch_id"], c["line_no"], "w1", True,
                                 output_line(c["batch_id"], c["line_no"], c["custom_id"], {"ok": 1}))
        # a second result for the same line is refused
        assert not store.finish_line(c["batch_id"], c["line_no"], "w1", True, "dup")
    assert jobs.finalize(b["id"])
    done = jobs.get("acme", b["id"])
    assert done["status"] == "completed" and done["request_counts"] == {"total": 6, "completed": 2, "failed": 4}
    out = [json.loads(x) for x in jobs.file("acme", done["output_file_id"], True)["content"].splitlines()]
    err = [json.loads(x) for x in jobs.file("acme", done["error_file_id"], True)["content"].splitlines()]
    assert [o["custom_id"] for o in out] == ["a", "d"]
    assert [(e["custom_id"], e["error"]["code"]) for e in err] == [
        ("", "invalid_json"), ("b", "invalid_url"), ("a", "duplicate_custom_id"), ("c", "invalid_argument")]
    assert "messages" in err[3]["error"]["message"] and err[3]["response"]["status_code"] == 400
    with pytest.raises(ServingError):
        jobs.file("globex", done["output_file_id"], True)


def test_cancel_ends_pending_lines_and_keeps_running_results(store):
    jobs = Jobs(store)
    lines = [{"custom_id": f"r{i}", "url": "/v1/completions", "body": {"prompt": "p", "max_tokens": 2}}
             for i in range(5)]
    f = jobs.upload("acme", "batch", "in.jsonl", jsonl(lines))
    b = jobs.create("acme", {"input_file_id": f["id"], "endpoint": "/v1/completions"})
    running = store.claim_lines("w", 1, 60)
    c = jobs.cancel("acme", b["id"])
    assert c["status"] == "cancelling"
    r = running[0]
    assert store.finish_line(r["batch_id"], r["line_no"], "w", True, output_line(b["id"], r["line_no"], "r0", {}))
    assert jobs.finalize(b["id"])
    done = jobs.get("acme", b["id"])
    assert done["status"] == "cancelled" and done["request_counts"] == {"total": 5, "completed": 1, "failed": 4}
    err = jobs.file("acme", done["error_file_id"], True)["content"].decode().splitlines()
    assert len(err) == 4 and all(json.loads(x)["error"]["code"] == "batch_cancelled" for x in err)
    with pytest.raises(ServingError) as e:
        jobs.cancel("globex", b["id"])
    assert e.value.status == 404


def test_cli_usage_report_from_the_ledger(tmp_path):
    import subprocess
    import sys

    db = tmp_path / "ledger.sqlite3"
    store = Store.open(db).init()
    day = 1795392000.0  # 2026-11-23 00:00 UTC
    store.insert_usage([record(i, ts=day + 60 * i) for i in range(1, 5)]
                       + [record(2, tenant="globex", ts=day - 3600, model="small")])
    store.close()

    def run(*a):
        return subprocess.run([sys.executable, "-m", "clients", "usage", "--ledger", str(db), *a],
                              capture_output=True, text=True, timeout=60)

    out = run("--since", "2026-11-22", "--until", "2026-11-23", "--by", "day", "--format", "json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert [(r["tenant"], r["day"], r["requests"]) for r in got] == [("acme", "2026-11-23", 4),
                                                                    ("globex", "2026-11-22", 1)]
    assert got[0]["completion_tokens"] == 10 and got[0]["latency_p50_ms"] == 52.5
    csv = run("--since", "2026-11-22", "--until", "2026-11-23", "--by", "model", "--format", "csv").stdout
    assert csv.splitlines()[0].startswith("tenant,model,requests") and "globex,small,1" in csv
    table = run("--since", "2026-11-23", "--until", "2026-11-23").stdout
    assert "acme" in table and "globex" not in table and "ttft_p95_ms" in table
    bad = run("--since", "2026-11-31")
    assert bad.returncode == 2 and "--since" in bad.stderr


def test_a_bug_in_a_ledger_call_is_a_500_and_only_the_stores_own_failure_a_503(tmp_path):
    """LedgerService.call: the database failing is `unavailable` (503, retry) and drops the connection; any
    other exception is a bug (500, logged) that leaves the store's connection alone."""
    import asyncio
    import sqlite3

    from front.ledger_api import LedgerService, LedgerSettings

    service = LedgerService(LedgerSettings(data_dir=tmp_path), lines=None, metrics=None, collect=None)
    service.ensure_ready()
    resets = []
    service.store.reset = lambda: resets.append(1)

    def fails(error):
        def fn():
            raise error
        return fn

    with pytest.raises(ServingError) as e:
        asyncio.run(service.call(fails(TypeError("a bug"))))
    assert (e.value.kind, e.value.status) == ("internal", 500) and not resets  # its connection kept
    with pytest.raises(ServingError) as e:
        asyncio.run(service.call(fails(sqlite3.OperationalError("database is locked"))))
    assert (e.value.kind, e.value.status, e.value.retry_after) == ("unavailable", 503, 5) and resets == [1]
    service.store.close()
