"""A private PostgreSQL server (Debian's `postgresql` package) in a temp dir on a free loopback port.

initdb and the server refuse to run as root: as root (CI machines) they run as the `postgres` user the
package creates (`runuser`), on a directory that user owns; otherwise as the current user.
"""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.support.server import HOST, free_port
from tests.support.service import Service


def pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)
    if found:
        return found[0]
    path = shutil.which(name)
    if path:
        return path
    raise RuntimeError(f"{name} not found: run `bash build/system_deps.sh` (installs Debian's postgresql)")


class PostgresServer(Service):
    def __init__(self, dbname: str = "ledger"):
        self.port = free_port()
        self.dbname = dbname
        self.dir = tempfile.mkdtemp(prefix="pg-test-")
        self.data = Path(self.dir) / "data"
        self.as_root = os.geteuid() == 0
        self.user = "postgres" if self.as_root else pwd.getpwuid(os.geteuid()).pw_name

    def _cmd(self, cmd: list[str]) -> list[str]:
        return ["runuser", "-u", "postgres", "--", *cmd] if self.as_root else cmd

    @property
    def url(self) -> str:
        return f"postgresql://{self.user}@{HOST}:{self.port}/{self.dbname}"

    def start(self) -> "PostgresServer":
        if self.as_root:
            os.chmod(self.dir, 0o755)
            self.data.mkdir()
            shutil.chown(self.data, "postgres", "postgres")
        subprocess.run(self._cmd([pg_bin("initdb"), "-D", str(self.data), "-A", "trust", "-U", self.user,
                                  "--no-sync", "-E", "UTF8"]), check=True, capture_output=True)
        self._ctl("start")
        subprocess.run([pg_bin("createdb"), "-h", HOST, "-p", str(self.port), "-U", self.user, self.dbname],
                       check=True, capture_output=True)
        return self

    def _ctl(self, action: str) -> None:
        opts = f"-p {self.port} -h {HOST} -k {self.data} -c fsync=off -c max_connections=50"
        cmd = [pg_bin("pg_ctl"), "-D", str(self.data), "-w", "-t", "30", "-m", "fast", "-l",
               str(self.data / "server.log"), action] + (["-o", opts] if action == "start" else [])
        r = subprocess.run(self._cmd(cmd), capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"pg_ctl {action} failed: {r.stderr or r.stdout}")

    def pause(self) -> None:
        """An outage: stop the server (fast shutdown: clients are cut off), keeping its data."""
        self._ctl("stop")

    def resume(self) -> "PostgresServer":
        self._ctl("start")
        return self

    def stop(self) -> None:
        try:
            if (self.data / "postmaster.pid").exists():
                self._ctl("stop")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
