"""The spool: append-only local files of usage records, one JSON object per line.

The gateway (inside the Triton Python stub, which cannot import database drivers) only appends here: a
record is put on an in-memory list (no I/O on the token path) and a background thread writes the list to
the current segment, `fsync`s it, and seals the segment (rename `.open` -> `.jsonl`) once it is a second
old. The ledger writer (in the front's process, `ledger/writer.py`) loads sealed segments into the store
and deletes a segment only after the store committed it. A segment left `.open` by a process that died
(kill -9) is sealed by the reader once its owner pid is gone; a torn last line is skipped and logged.
Stdlib only.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger("ledger.spool")
OPEN, SEALED = ".open", ".jsonl"


class SpoolWriter:
    def __init__(self, directory: str | Path, prefix: str = "gateway", flush_interval_s: float = 0.2,
                 segment_seconds: float = 1.0):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.prefix, self.flush_interval_s, self.segment_seconds = prefix, flush_interval_s, segment_seconds
        self._pending: list[str] = []
        self._lock = threading.Lock()
        self._io_lock = threading.Lock()
        self._stop = threading.Event()
        self._seq = 0
        self._file = None
        self._path: Path | None = None
        self._opened_at = 0.0
        self.written = 0  # records on disk (fsync'd)
        self.errors = 0
        self._thread = threading.Thread(target=self._run, name="ledger-spool", daemon=True)
        self._thread.start()

    def append(self, line: str) -> None:
        """Queue one record (a JSON line without the newline); never blocks on I/O."""
        with self._lock:
            self._pending.append(line)

    def _run(self) -> None:
        while not self._stop.wait(self.flush_interval_s):
            try:
                self.flush()
            except Exception:  # a full disk must not kill the thread: the records stay pending
                self.errors += 1
                log.exception("usage spool: write to %s failed; retrying", self.dir)

    def flush(self, seal: bool = False) -> None:
        with self._io_lock:
            with self._lock:
                batch, self._pending = self._pending, []
            try:
                if batch:
                    if self._file is None:
                        self._seq += 1
                        self._path = self.dir / f"{self.prefix}-{os.getpid()}-{time.time_ns()}-{self._seq}{OPEN}"
                        self._file = open(self._path, "ab")
                        self._opened_at = time.monotonic()
                    self._file.write(("\n".join(batch) + "\n").encode())
                    self._file.flush()
                    os.fsync(self._file.fileno())
                    self.written += len(batch)
            except BaseException:
                with self._lock:
                    self._pending[:0] = batch
                raise
            if self._file is not None and (seal or time.monotonic() - self._opened_at >= self.segment_seconds):
                self._seal()

    def _seal(self) -> None:
        self._file.close()
        self._file = None
        os.rename(self._path, self._path.with_suffix(SEALED))
        _fsync_dir(self.dir)

    def close(self) -> None:
        """Write and seal everything (on shutdown)."""
        self._stop.set()
        self._thread.join(timeout=5)
        self.flush(seal=True)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sealed_segments(directory: str | Path) -> list[Path]:
    """Sealed segments, oldest first; `.open` segments of dead writers are sealed first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    for p in d.glob(f"*{OPEN}"):
        try:
            pid = int(p.name.split("-")[-3])
        except (ValueError, IndexError):
            continue
        if not _pid_alive(pid):
            log.warning("usage spool: sealing %s left open by dead process %d", p.name, pid)
            try:
                os.rename(p, p.with_suffix(SEALED))
            except FileNotFoundError:
                pass
    def created(p: Path):
        parts = p.name.split("-")
        return (int(parts[-2]) if len(parts) >= 3 and parts[-2].isdigit() else 0, p.name)

    return sorted(d.glob(f"*{SEALED}"), key=created)


def read_segment(path: Path) -> list[dict]:
    """The records of a segment; a torn or invalid line (a writer killed mid-write) is skipped, logged."""
    out = []
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if isinstance(rec, dict):
                out.append(rec)
                continue
        except ValueError:
            pass
        log.warning("usage spool: %s line %d is not a record (torn write?); skipped", path.name, n)
    return out


def backlog(directory: str | Path) -> tuple[int, int]:
    """(segments, bytes) waiting in the spool (sealed or open)."""
    d = Path(directory)
    if not d.is_dir():
        return 0, 0
    n = size = 0
    for p in list(d.glob(f"*{SEALED}")) + list(d.glob(f"*{OPEN}")):
        try:
            size += p.stat().st_size
            n += 1
        except FileNotFoundError:
            pass
    return n, size
