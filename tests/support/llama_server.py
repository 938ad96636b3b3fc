"""llama.cpp's `llama-server` (an OpenAI-compatible server no one here wrote) on the project's GGUF, on a
fixed loopback port so it can be killed and started again where the gateway config points. Built from the
pinned llama-cpp-python sdist by `make bench-peer` (benchmarks/peer/build_llama_server.sh)."""
from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from launcher.triton import ROOT, die_with_parent
from tests.support.server import HOST, free_port

BINARY = ROOT / ".cache" / "peer" / "llama.cpp-0.3.36" / "build" / "bin" / "llama-server"


class LlamaServer:
    def __init__(self, api_key: str, binary: Path = BINARY, port: int | None = None):
        self.binary, self.api_key, self.port = binary, api_key, port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self, timeout_s: float = 120.0) -> "LlamaServer":
        from build.prepare_model import find_gguf

        cmd = [str(self.binary), "-m", str(find_gguf()), "-c", "4096", "-np", "4", "-t", "2", "--host", HOST,
               "--port", str(self.port), "--api-key", self.api_key, "--metrics", "--no-webui"]
        # llama.cpp's OpenMP threads crawl under the engine's OMP_WAIT_POLICY=PASSIVE (benchmarks/triton_bench.py)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "KMP_", "GOMP_"))}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                                     preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode} while starting")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"llama-server not healthy within {timeout_s:.0f} s")

    def kill(self) -> None:
        """SIGKILL, as a crash: the port refuses connections until `start()` again."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def pause(self, paused: bool) -> None:
        """SIGSTOP / SIGCONT: a server that accepts connections and answers nothing (a real stall)."""
        self.proc.send_signal(signal.SIGSTOP if paused else signal.SIGCONT)

    def metric(self, name: str) -> float:
        req = urllib.request.Request(self.url + "/metrics", headers={"authorization": f"Bearer {self.api_key}"})
        with urllib.request.urlopen(req, timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " ") or line.startswith(name + "{"):
                    return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
