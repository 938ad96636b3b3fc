"""Draining a replica (issue 31, HA): `python -m launcher.drain front` turns a real front's readiness off and
waits for its in-flight requests (read from its /metrics); `... triton` waits for the front's drain. These
are the preStop hooks of deploy/k8s/triton.yaml (tests/deploy/test_deploy.py holds the manifest to them)."""
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from front.drain import DRAINED, DRAINING
from launcher import drain

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture
def front(tmp_path):
    """A real front process (no Triton behind it: it is not ready, for that reason, until drained)."""
    port, metrics = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "front", "--port", str(port), "--metrics-port", str(metrics),
                             "--triton-grpc", f"127.0.0.1:{free_port()}", "--drain-dir", str(tmp_path / "drain")],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while True:
        try:
            get(f"http://127.0.0.1:{port}/health")
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-2000:]
            time.sleep(0.2)
    yield port, metrics, tmp_path / "drain"
    proc.terminate()
    proc.wait(timeout=30)


def test_the_front_drain_turns_readiness_off_and_marks_drained(front):
    port, metrics, drain_dir = front
    status, body = get(f"http://127.0.0.1:{port}/health/ready")
    assert status == 503 and body["status"] == "unavailable"  # no Triton: not ready, but not draining
    done = subprocess.run([sys.executable, "-m", "launcher.drain", "front", "--drain-dir", str(drain_dir),
                           "--metrics-url", f"http://127.0.0.1:{metrics}/metrics", "--endpoint-grace-s", "0",
                           "--timeout-s", "10"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (drain_dir / DRAINING).exists() and (drain_dir / DRAINED).read_text().strip() == "0"
    status, body = get(f"http://127.0.0.1:{port}/health/ready")
    assert status == 503 and body == {"status": "draining"}
    assert get(f"http://127.0.0.1:{port}/health")[0] == 200  # alive: the kubelet must not restart it


class _Metrics(ThreadingHTTPServer):
    daemon_threads = True


def _metrics_server(values):
    """/metrics whose in-flight gauge takes the next of `values` at each scrape (the last one stays)."""
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            v = values[min(len(seen), len(values) - 1)]
            seen.append(v)
            body = (f'# TYPE {drain.IN_FLIGHT} gauge\n{drain.IN_FLIGHT}{{route="/v1/chat/completions"}} {v}\n'
                    f'{drain.IN_FLIGHT}{{route="/v1/completions"}} 0.0\n').encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = _Metrics(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, seen


def test_the_drain_waits_for_in_flight_requests_and_is_bounded(tmp_path):
    server, seen = _metrics_server([3.0, 2.0, 1.0, 0.0])
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        assert drain.drain_front(tmp_path / "a", url, endpoint_grace_s=0, timeout_s=30, poll_s=0.01) == 0
        assert seen[-1] == 0.0 and len(seen) == 4  # it polled until nothing was in flight
    finally:
        server.shutdown()
    stuck, _ = _metrics_server([5.0])
    try:
        url = f"http://127.0.0.1:{stuck.server_address[1]}/metrics"
        assert drain.drain_front(tmp_path / "b", url, endpoint_grace_s=0, timeout_s=0.3, poll_s=0.05) == 5
        assert (tmp_path / "b" / DRAINED).read_text().strip() == "5"  # marked anyway: Triton must not wait forever
    finally:
        stuck.shutdown()
    # a front that does not answer has nothing in flight to wait for
    assert drain.drain_front(tmp_path / "c", f"http://127.0.0.1:{free_port()}/metrics", 0, 5) == 0


def test_the_triton_side_waits_for_the_front(tmp_path):
    assert drain.wait_drained(tmp_path, timeout_s=0.2, poll_s=0.05) is False
    threading.Timer(0.3, lambda: (tmp_path / DRAINED).write_text("0\n")).start()
    assert drain.wait_drained(tmp_path, timeout_s=10, poll_s=0.05) is True
    done = subprocess.run([sys.executable, "-m", "launcher.drain", "triton", "--drain-dir", str(tmp_path),
                           "--timeout-s", "5"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "tritonserver may stop" in done.stderr


def test_the_drain_waits_for_the_usage_spool_to_be_loaded(tmp_path):
    """The pod's spool folder goes with the pod: the drain ends once the front's ledger writer has loaded
    what the gateway spooled (a segment deleted after its commit), or at the timeout, saying so."""
    spool = tmp_path / "spool"
    spool.mkdir()
    segment = spool / "gateway-1-1-1.jsonl"
    segment.write_text('{"request_id": "r1"}\n')
    threading.Timer(0.3, segment.unlink).start()  # the writer committing it
    url = f"http://127.0.0.1:{free_port()}/metrics"
    assert drain.drain_front(tmp_path / "d", url, 0, 10, poll_s=0.05, spool_dir=spool) == 0
    assert not segment.exists() and "spool" not in (tmp_path / "d" / DRAINED).read_text()
    (spool / "gateway-1-1-2.open").write_text('{"request_id": "r2"}\n')  # the store unreachable: bounded
    drain.drain_front(tmp_path / "e", url, 0, 0.3, poll_s=0.05, spool_dir=spool)
    assert "spool segments left: 1" in (tmp_path / "e" / DRAINED).read_text()
