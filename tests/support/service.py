"""Shared lifecycle of the helper services the tests start (Redis, nginx): a process and a temp dir."""
from __future__ import annotations

import shutil
import subprocess

from launcher.triton import die_with_parent


class Service:
    """Subclasses define `start()` (spawn, then wait until the service answers)."""

    proc: subprocess.Popen | None = None
    dir = None

    def spawn(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     preexec_fn=die_with_parent)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
