"""`python -m launcher` (what `make serve` runs): ready banner, the front answers, Triton stays internal,
a clean stop on SIGINT that leaves no process behind, and it works from any working directory."""
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import psutil
import pytest

from build.render import render
from launcher.triton import ROOT
from tests.support.server import free_port

pytestmark = pytest.mark.integration
KEY = "sk-demo-acme-enterprise"


def _start(repo, cwd):
    ports = {name: free_port() for name in ("port", "http", "grpc", "metrics", "front_metrics")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher", "--repo", str(repo), "--port", str(ports["port"]),
         "--http-port", str(ports["http"]), "--grpc-port", str(ports["grpc"]),
         "--metrics-port", str(ports["metrics"]), "--front-metrics-port", str(ports["front_metrics"])],
        cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines, deadline = [], time.monotonic() + 240
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        lines.append(line)
        if "Ctrl-C" in line or proc.poll() is not None:
            break
    return proc, ports, "".join(lines)


def _chat(port, content="What is the capital of France?"):
    body = json.dumps({"model": "auto", "messages": [{"role": "user", "content": content}],
                       "max_tokens": 12, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body, method="POST",
                                 headers={"authorization": f"Bearer {KEY}"})
    return json.loads(urllib.request.urlopen(req, timeout=60).read())


def test_serve_from_another_directory_answers_through_the_front_and_stops_clean(tmp_path, checkpoint):
    repo = render("cpu", tmp_path / "repo", checkpoint=checkpoint)
    proc, ports, banner = _start(repo, cwd=tmp_path)  # not the project root: the models must still import
    try:
        assert "is ready" in banner, banner[-3000:]
        assert f"127.0.0.1:{ports['port']}/v1" in banner
        assert "Paris" in _chat(ports["port"])["choices"][0]["message"]["content"]
        tree = psutil.Process(proc.pid).children(recursive=True)
        assert len(tree) >= 6  # tritonserver, the front, one stub per Python model
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0
        time.sleep(0.5)
        alive = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, [p.cmdline()[:2] for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_without_a_rendered_repository_says_what_to_do(tmp_path):
    out = subprocess.run([sys.executable, "-m", "launcher", "--repo", str(tmp_path)], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 2 and "make render" in out.stderr
