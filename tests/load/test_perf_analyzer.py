"""NVIDIA's perf_analyzer (tritonclient 2.51 wheel) against the stack: gRPC streaming, concurrency 8, warm-up.

Issue 18, finding 11: `--warmup-request-count 2` at concurrency 8 never finished against the ensemble. The
cause is perf_analyzer 2.51's, not the stack's (benchmarks/perf_analyzer.py): its warm-up gives each of the
8 worker threads 2 // 8 requests plus one for the first 2, and a thread given 0 runs without a limit, so
the warm-up waits forever on 6 threads that keep sending. The server answers every one of them.
"""
import subprocess
import time

import pytest
import tritonclient.http as httpclient

from benchmarks import perf_analyzer as pa

pytestmark = [pytest.mark.integration, pytest.mark.timeout(100)]

CONCURRENCY, REQUESTS, MAX_TOKENS = 8, 32, 16
KEY = "sk-demo-acme-enterprise"  # deploy/gateway.example.yaml: acme, enterprise tier


def successes(server, model: str) -> int:
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        stats = client.get_inference_statistics(model)["model_stats"][0]["inference_stats"]
        return int(stats["success"]["count"])
    finally:
        client.close()


def failures(server, model: str) -> int:
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        return int(client.get_inference_statistics(model)["model_stats"][0]["inference_stats"]["fail"]["count"])
    finally:
        client.close()


def run(server, tmp_path, model="ensemble", warmup=CONCURRENCY, timeout=60, api_key=None):
    data = pa.write_input_data(tmp_path / f"{model}.json", MAX_TOKENS)
    args = pa.perf_analyzer_args(server.grpc_url, data, model, CONCURRENCY, warmup, REQUESTS, api_key)
    before, failed_before, t0 = successes(server, model), failures(server, model), time.monotonic()
    try:
        # SIGINT first: perf_analyzer's handler stops its threads after their requests end; KILL 5 s later
        p = subprocess.run(["timeout", "-s", "INT", "-k", "5", str(timeout)] + args, env=pa.perf_analyzer_env(),
                           capture_output=True, text=True, timeout=timeout + 20)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:  # timeout(1) itself should have ended it first
        rc, out = -9, str(e.stdout or "") + str(e.stderr or "")
    time.sleep(1.0)  # let the streams cut by a kill end on the server before counting
    return rc, out, time.monotonic() - t0, successes(server, model) - before, failures(server, model) - failed_before


def assert_finished(rc, out, served, failed):
    assert rc == 0, out[-3000:]
    assert f"Concurrency: {CONCURRENCY}, throughput:" in out, out[-3000:]
    assert "error" not in out.lower(), out[-3000:]
    assert failed == 0
    # the warm-up and the measurement, nothing more: no worker thread was left sending
    assert served == CONCURRENCY + REQUESTS, out[-3000:]
    client = [line for line in out.splitlines() if "Throughput:" in line]
    infer, responses = (float(line.split(":")[1].split()[0]) for line in client[:2])
    # every token streamed (the gateway adds a last response with finish_reason and usage)
    assert 0.95 * MAX_TOKENS * infer <= responses <= 1.05 * (MAX_TOKENS + 1) * infer, out[-3000:]


def test_perf_analyzer_runs_with_the_projects_setup():
    p = subprocess.run(["ldd", str(pa.BINARY)], env=pa.perf_analyzer_env(), capture_output=True, text=True)
    assert "not found" not in p.stdout, p.stdout
    assert pa.version() >= (2, 51)


def test_ensemble_streaming_with_warmup_at_concurrency_8(server, tmp_path):
    rc, out, _, served, failed = run(server, tmp_path, "ensemble", warmup=CONCURRENCY)
    assert_finished(rc, out, served, failed)


def test_gateway_streaming_with_warmup_at_concurrency_8(server, tmp_path):
    rc, out, _, served, failed = run(server, tmp_path, "gateway", warmup=CONCURRENCY, api_key=KEY)
    assert_finished(rc, out, served, failed)


def test_warmup_2_at_concurrency_8(server, tmp_path):
    """The issue's command. perf_analyzer >= 2.52 finishes it; 2.51 never does, and the server is not why."""
    if pa.version() >= pa.FIXED_VERSION:
        rc, out, _, served, failed = run(server, tmp_path, "ensemble", warmup=2)
        assert rc == 0 and f"Concurrency: {CONCURRENCY}, throughput:" in out, out[-3000:]
        assert failed == 0 and served == 2 + REQUESTS
        return
    # 2.51: the same run with a warm-up of 8 takes about 4 s here; give this one 15 s (then SIGINT)
    rc, out, elapsed, served, failed = run(server, tmp_path, "ensemble", warmup=2, timeout=15)
    assert rc in (124, 137, -9), f"perf_analyzer 2.51 finished a warm-up below the concurrency: {out[-2000:]}"
    assert "Concurrency: 8, throughput:" not in out
    # the stack answered every request it got, more than twice the whole run's 2 + 32 while still in the
    # warm-up: the client kept sending. The client is killed mid-stream here, and Triton counts a stream
    # whose client vanished before its last response as failed: at most the CONCURRENCY in flight then
    # (a clean-clone run saw 6 of 8; the run below, which ends normally, must have none)
    assert failed <= CONCURRENCY, (failed, out[-2000:])
    assert served > 2 * (2 + REQUESTS), (served, out[-2000:])
    # and it still serves perf_analyzer afterwards
    rc, out, _, served, failed = run(server, tmp_path, "ensemble", warmup=CONCURRENCY)
    assert_finished(rc, out, served, failed)
