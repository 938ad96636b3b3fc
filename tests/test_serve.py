"""`build/serve.py` (what `make serve` runs): ready banner, answers, and a clean stop on SIGINT."""
import json
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from build.render import render
from tests.support.server import free_port

pytestmark = pytest.mark.integration


def test_serve_prints_banner_answers_and_stops_on_ctrl_c(tmp_path, checkpoint):
    repo = render("cpu", tmp_path / "repo", checkpoint=checkpoint)
    http, grpc, metrics = free_port(), free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "build/serve.py", "--repo", str(repo), "--http-port", str(http),
                             "--grpc-port", str(grpc), "--metrics-port", str(metrics)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            lines.append(line)
            if "is ready" in line or proc.poll() is not None:
                break
        banner = "".join(lines)
        assert "is ready" in banner, banner[-2000:]
        body = json.dumps({"text_input": "The capital of France is", "max_tokens": 4, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{http}/v2/models/ensemble/generate", data=body, method="POST")
        assert "Paris" in json.loads(urllib.request.urlopen(req, timeout=60).read())["text_output"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_without_a_rendered_repository_says_what_to_do(tmp_path):
    out = subprocess.run([sys.executable, "build/serve.py", "--repo", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 2 and "make render" in out.stderr
