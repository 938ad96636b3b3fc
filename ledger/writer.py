"""The ledger writer: drains the spool into the store, off every request path.

Runs as a thread of the front's process (the launcher's process tree, where database drivers import).
Each sealed segment is inserted in one transaction and deleted only after the commit, so a crash between
the two replays the segment, which the store ignores (request ids are primary keys). When the store is
unreachable the segments stay in the spool: requests are still served, `llm_ledger_write_failures_total`
counts the failed attempts, the log says so once per outage, and the backlog is replayed when the store
is back. `close()` (on shutdown) drains whatever the gateway sealed before it stopped.
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from contracts.usage_record import UsageRecord
from ledger.spool import backlog, read_segment, sealed_segments
from ledger.store import Store

log = logging.getLogger("ledger.writer")


class LedgerWriter:
    def __init__(self, store: Store, spool_dir: str | Path, interval_s: float = 0.5, metrics=None,
                 max_backoff_s: float = 10.0):
        self.store, self.spool_dir = store, Path(spool_dir)
        self.interval_s, self.max_backoff_s = interval_s, max_backoff_s
        self.metrics = metrics  # front/metrics.py FrontMetrics or None
        self.written = 0
        self.failures = 0
        self.healthy = True
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.ensure_ready = lambda: None  # creates the schema once the store is reachable

    def start(self) -> "LedgerWriter":
        self._thread = threading.Thread(target=self._run, name="ledger-writer", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        delay = self.interval_s
        while not self._stop.wait(delay):
            delay = self.interval_s if self.drain() else min(max(delay * 2, 1.0), self.max_backoff_s)

    def drain(self) -> bool:
        """Load every sealed segment; False if the store failed (the rest waits for the next try)."""
        with self._lock:
            try:
                self.ensure_ready()
                for seg in sealed_segments(self.spool_dir):
                    records = []
                    for d in read_segment(seg):
                        try:
                            records.append(UsageRecord.from_dict(d))
                        except (TypeError, ValueError) as e:
                            log.warning("usage spool: %s: bad record skipped: %s", seg.name, e)
                    self.written += self.store.insert_usage(records)
                    seg.unlink()
                if not self.healthy:
                    log.warning("usage ledger: the store is reachable again; the spool is replayed")
                self.healthy = True
                return True
            except Exception as e:
                self.failures += 1
                if self.metrics is not None:
                    self.metrics.ledger_failures.inc()
                if self.healthy:
                    log.error("usage ledger: cannot write to the store (%s: %s); records stay spooled in %s "
                              "and are replayed when it is back", type(e).__name__, str(e).strip()[:200],
                              self.spool_dir)
                self.healthy = False
                self.store.reset()
                return False
            finally:
                if self.metrics is not None:
                    segments, size = backlog(self.spool_dir)
                    self.metrics.spool_segments.set(segments)
                    self.metrics.spool_bytes.set(size)
                    self.metrics.ledger_up.set(1 if self.healthy else 0)

    def close(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        deadline = time.monotonic() + timeout_s
        while not self.drain() and time.monotonic() < deadline:
            time.sleep(0.5)
