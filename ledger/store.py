"""The ledger's store: usage records, batch files, batches and batch lines, in SQLite or PostgreSQL.

SQLite (default): one file under the data directory, WAL, one connection per thread. PostgreSQL (a
`postgresql://` URL): several replicas share one ledger and one batch queue. The SQL is the same but for
the placeholders, the blob type, and how a worker claims lines (SKIP LOCKED on PostgreSQL). Inserts of
usage records are keyed by request id and ignore duplicates, so a replayed spool segment is harmless.
"""
from __future__ import annotations

import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from contextlib import contextmanager
from pathlib import Path

from contracts.usage_record import COLUMNS, UsageRecord

BATCH_COLUMNS = ("id", "tenant", "endpoint", "input_file_id", "completion_window", "status", "created_at",
                 "in_progress_at", "finalizing_at", "completed_at", "cancelling_at", "cancelled_at",
                 "expires_at", "expired_at", "output_file_id", "error_file_id", "total", "completed",
                 "failed", "metadata", "errors")
FILE_COLUMNS = ("id", "tenant", "purpose", "filename", "bytes", "created_at")


def schema(blob: str, real: str) -> list[str]:
    return [
        f"""CREATE TABLE IF NOT EXISTS usage (
            request_id TEXT PRIMARY KEY, ts {real} NOT NULL, day TEXT NOT NULL, tenant TEXT NOT NULL,
            tier TEXT NOT NULL, model TEXT NOT NULL, adapter TEXT NOT NULL, prompt_tokens INTEGER NOT NULL,
            completion_tokens INTEGER NOT NULL, cost {real} NOT NULL, ttft_ms {real}, latency_ms {real} NOT NULL,
            outcome TEXT NOT NULL, error_kind TEXT NOT NULL, finish_reason TEXT NOT NULL,
            batch_id TEXT NOT NULL DEFAULT '', provider TEXT NOT NULL DEFAULT '',
            end_user TEXT NOT NULL DEFAULT '', served_from TEXT NOT NULL DEFAULT '')""",
        "CREATE INDEX IF NOT EXISTS usage_tenant_ts ON usage (tenant, ts)",
        f"""CREATE TABLE IF NOT EXISTS files (
            id TEXT PRIMARY KEY, tenant TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
            bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, content {blob} NOT NULL)""",
        """CREATE TABLE IF NOT EXISTS batches (
            id TEXT PRIMARY KEY, tenant TEXT NOT NULL, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL,
            completion_window TEXT NOT NULL, status TEXT NOT NULL, created_at INTEGER NOT NULL,
            in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, cancelling_at INTEGER,
            cancelled_at INTEGER, expires_at INTEGER NOT NULL, expired_at INTEGER, output_file_id TEXT,
            error_file_id TEXT, total INTEGER NOT NULL, completed INTEGER NOT NULL DEFAULT 0,
            failed INTEGER NOT NULL DEFAULT 0, metadata TEXT, errors TEXT)""",
        "CREATE INDEX IF NOT EXISTS batches_tenant ON batches (tenant, created_at)",
        """CREATE TABLE IF NOT EXISTS batch_lines (
            batch_id TEXT NOT NULL, line_no INTEGER NOT NULL, custom_id TEXT NOT NULL, state TEXT NOT NULL,
            body TEXT, result TEXT, worker TEXT, lease_until INTEGER, attempts INTEGER NOT NULL DEFAULT 0,
            PRIMARY KEY (batch_id, line_no))""",
        "CREATE INDEX IF NOT EXISTS batch_lines_state ON batch_lines (state, batch_id)",
    ]


# columns of `usage` added since its first release: a ledger made before them gets them at init
ADDED_COLUMNS = {"provider": "TEXT NOT NULL DEFAULT ''", "end_user": "TEXT NOT NULL DEFAULT ''",
                 "served_from": "TEXT NOT NULL DEFAULT ''"}


def day_of(ts: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(ts))


class Store(ABC):
    """Thread-safe: each thread gets its own connection."""

    dialect = "sqlite"

    def __init__(self):
        self._local = threading.local()
        self._conns: list = []
        self._conns_lock = threading.Lock()

    @staticmethod
    def open(url_or_path: str | Path) -> "Store":
        s = str(url_or_path)
        if s.startswith(("postgresql://", "postgres://")):
            return PostgresStore(s)
        if s.startswith("sqlite:///"):
            s = s[len("sqlite:///"):]
        return SQLiteStore(Path(s))

    # -- connections --------------------------------------------------------------------------------
    @abstractmethod
    def _connect(self):
        """A new connection of this store's database."""

    @property
    @abstractmethod
    def failures(self) -> tuple[type[Exception], ...]:
        """The exceptions that mean the database failed (not a bug in what asked it)."""

    @property
    def conn(self):
        c = getattr(self._local, "conn", None)
        if c is None:
            c = self._connect()
            self._local.conn = c
            with self._conns_lock:
                self._conns.append(c)
        return c

    def reset(self) -> None:
        """Drop this thread's connection (after a failure: the next use reconnects)."""
        c = getattr(self._local, "conn", None)
        self._local.conn = None
        if c is not None:
            try:
                c.close()
            except Exception:
                pass

    def close(self) -> None:
        with self._conns_lock:
            for c in self._conns:
                try:
                    c.close()
                except Exception:
                    pass
            self._conns.clear()
        self._local = threading.local()

    def q(self, sql: str) -> str:
        return sql

    @contextmanager
    def tx(self):
        """A transaction on this thread's connection: commit on success, roll back on error."""
        c = self.conn
        try:
            cur = c.cursor()
            self._begin(cur)
            yield _Cursor(cur, self.q)
            c.commit()
        except BaseException:
            try:
                c.rollback()
            except Exception:
                self.reset()
            raise

    def _begin(self, cur) -> None:
        pass

    def init(self) -> "Store":
        with self.tx() as cur:
            for stmt in self._schema():
                cur.execute(stmt)
        self._add_columns(ADDED_COLUMNS)
        return self

    def _add_columns(self, columns: dict[str, str]) -> None:
        """Columns added to `usage` since its first release, added to a ledger made before them."""
        with self.tx() as cur:
            cur.execute("SELECT * FROM usage LIMIT 0")
            have = {d[0] for d in cur.description}
        for name, decl in columns.items():
            if name not in have:
                with self.tx() as cur:
                    cur.execute(f"ALTER TABLE usage ADD COLUMN {name} {decl}")

    # -- usage ----------------------------------------------------------------------------------------
    def insert_usage(self, records: list[UsageRecord]) -> int:
        """Insert records, ignoring request ids already present; returns how many were new."""
        cols = COLUMNS + ("day",)
        sql = (f"INSERT INTO usage ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))}) "
               "ON CONFLICT (request_id) DO NOTHING")
        new = 0
        with self.tx() as cur:
            for r in records:
                cur.execute(sql, r.row() + (day_of(r.ts),))
                new += max(cur.rowcount, 0)
        return new

    def usage_rows(self, tenant: str | None, start_ts: float, end_ts: float) -> list[dict]:
        sql = f"SELECT {', '.join(COLUMNS)}, day FROM usage WHERE ts >= ? AND ts < ?"
        args: list = [start_ts, end_ts]
        if tenant is not None:
            sql += " AND tenant = ?"
            args.append(tenant)
        with self.tx() as cur:
            cur.execute(sql + " ORDER BY ts", args)
            return [dict(zip(COLUMNS + ("day",), row)) for row in cur.fetchall()]

    def usage_by_id(self, request_id: str) -> dict | None:
        with self.tx() as cur:
            cur.execute(f"SELECT {', '.join(COLUMNS)} FROM usage WHERE request_id = ?", (request_id,))
            row = cur.fetchone()
        return dict(zip(COLUMNS, row)) if row else None

    # -- files ----------------------------------------------------------------------------------------
    def put_file(self, cur, file_id: str, tenant: str, purpose: str, filename: str, content: bytes) -> dict:
        row = (file_id, tenant, purpose, filename, len(content), int(time.time()))
        cur.execute("INSERT INTO files (id, tenant, purpose, filename, bytes, created_at, content) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)", row + (self._blob(content),))
        return dict(zip(FILE_COLUMNS, row))

    def get_file(self, tenant: str, file_id: str, content: bool = False) -> dict | None:
        cols = FILE_COLUMNS + (("content",) if content else ())
        with self.tx() as cur:
            cur.execute(f"SELECT {', '.join(cols)} FROM files WHERE id = ? AND tenant = ?", (file_id, tenant))
            row = cur.fetchone()
        if row is None:
            return None
        d = dict(zip(cols, row))
        if content:
            d["content"] = bytes(d["content"])
        return d

    def list_files(self, tenant: str) -> list[dict]:
        with self.tx() as cur:
            cur.execute(f"SELECT {', '.join(FILE_COLUMNS)} FROM files WHERE tenant = ? ORDER BY created_at",
                        (tenant,))
            return [dict(zip(FILE_COLUMNS, r)) for r in cur.fetchall()]

    def _blob(self, content: bytes):
        return content

    # -- batches --------------------------------------------------------------------------------------
    def get_batch(self, tenant: str | None, batch_id: str, cur=None) -> dict | None:
        sql = f"SELECT {', '.join(BATCH_COLUMNS)} FROM batches WHERE id = ?"
        args = [batch_id]
        if tenant is not None:
            sql += " AND tenant = ?"
            args.append(tenant)
        if cur is not None:
            cur.execute(sql, args)
            row = cur.fetchone()
        else:
            with self.tx() as c:
                c.execute(sql, args)
                row = c.fetchone()
        return dict(zip(BATCH_COLUMNS, row)) if row else None

    def list_batches(self, tenant: str, limit: int = 20, after: str | None = None) -> list[dict]:
        sql = f"SELECT {', '.join(BATCH_COLUMNS)} FROM batches WHERE tenant = ?"
        args: list = [tenant]
        if after:
            sql += " AND (created_at, id) < (SELECT created_at, id FROM batches WHERE id = ? AND tenant = ?)"
            args += [after, tenant]
        with self.tx() as cur:
            cur.execute(sql + " ORDER BY created_at DESC, id DESC LIMIT ?", args + [limit])
            return [dict(zip(BATCH_COLUMNS, r)) for r in cur.fetchall()]

    def claim_lines(self, worker: str, n: int, lease_s: int) -> list[dict]:
        """Up to n runnable lines (pending, or running past their lease) of in-progress batches, oldest
        batch first, marked running by this worker."""
        now = int(time.time())
        with self.tx() as cur:
            cur.execute(self._claim_sql(), (now, n))
            picked = cur.fetchall()
            for batch_id, line_no in picked:
                cur.execute("UPDATE batch_lines SET state = 'running', worker = ?, lease_until = ?, "
                            "attempts = attempts + 1 WHERE batch_id = ? AND line_no = ?",
                            (worker, now + lease_s, batch_id, line_no))
            out = []
            for batch_id, line_no in picked:
                cur.execute("SELECT l.batch_id, l.line_no, l.custom_id, l.body, b.tenant, b.endpoint, l.attempts "
                            "FROM batch_lines l JOIN batches b ON b.id = l.batch_id "
                            "WHERE l.batch_id = ? AND l.line_no = ?", (batch_id, line_no))
                out.append(dict(zip(("batch_id", "line_no", "custom_id", "body", "tenant", "endpoint",
                                     "attempts"), cur.fetchone())))
        return out

    def _claim_sql(self) -> str:
        return ("SELECT l.batch_id, l.line_no FROM batch_lines l JOIN batches b ON b.id = l.batch_id "
                "WHERE b.status = 'in_progress' AND (l.state = 'pending' OR (l.state = 'running' AND "
                "l.lease_until < ?)) ORDER BY b.created_at, l.batch_id, l.line_no LIMIT ?")

    def release_worker(self, worker: str | None) -> int:
        """A restarted (or stopping) worker's running lines go back to pending: they have no result yet.
        worker None: every running line (SQLite: one front per data directory, so all are ours)."""
        with self.tx() as cur:
            if worker is None:
                cur.execute("UPDATE batch_lines SET state = 'pending', worker = NULL WHERE state = 'running'")
            else:
                cur.execute("UPDATE batch_lines SET state = 'pending', worker = NULL WHERE state = 'running' "
                            "AND worker = ?", (worker,))
            return max(cur.rowcount, 0)

    def finish_line(self, batch_id: str, line_no: int, worker: str, ok: bool, result: str) -> bool:
        """Record a line's one result, in the same transaction as its state; False if the line is no
        longer this worker's (cancelled, expired or taken over): then nothing is written."""
        with self.tx() as cur:
            cur.execute("UPDATE batch_lines SET state = ?, result = ?, lease_until = NULL "
                        "WHERE batch_id = ? AND line_no = ? AND state = 'running' AND worker = ?",
                        ("done" if ok else "failed", result, batch_id, line_no, worker))
            if cur.rowcount != 1:
                return False
            col = "completed" if ok else "failed"
            cur.execute(f"UPDATE batches SET {col} = {col} + 1 WHERE id = ?", (batch_id,))
        return True


class _Cursor:
    def __init__(self, cur, q):
        self._cur, self._q = cur, q

    def execute(self, sql, args=()):
        self._cur.execute(self._q(sql), tuple(args))
        return self

    def fetchone(self):
        return self._cur.fetchone()

    def fetchall(self):
        return self._cur.fetchall()

    @property
    def rowcount(self):
        return self._cur.rowcount

    @property
    def description(self):
        return self._cur.description


class SQLiteStore(Store):
    dialect = "sqlite"

    def __init__(self, path: Path):
        super().__init__()
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def _connect(self):
        c = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
        c.execute("PRAGMA journal_mode=WAL")
        c.execute("PRAGMA synchronous=FULL")
        c.execute("PRAGMA busy_timeout=30000")
        return _SQLiteConn(c)

    @property
    def failures(self) -> tuple[type[Exception], ...]:
        return sqlite3.Error, OSError

    def _schema(self):
        return schema("BLOB", "REAL")

    def _begin(self, cur) -> None:
        cur.execute("BEGIN IMMEDIATE")


class _SQLiteConn:
    """sqlite3 in autocommit mode with explicit BEGIN IMMEDIATE, so a claim is one write transaction."""

    def __init__(self, c):
        self.c = c

    def cursor(self):
        return self.c.cursor()

    def commit(self):
        if self.c.in_transaction:
            self.c.execute("COMMIT")

    def rollback(self):
        if self.c.in_transaction:
            self.c.execute("ROLLBACK")

    def close(self):
        self.c.close()


class PostgresStore(Store):
    dialect = "postgresql"

    def __init__(self, url: str, connect_timeout_s: int = 5):
        super().__init__()
        self.url, self.connect_timeout_s = url, connect_timeout_s

    def _connect(self):
        import psycopg  # only the front's process imports it (never the Triton stub)

        return psycopg.connect(self.url, connect_timeout=self.connect_timeout_s)

    @property
    def failures(self) -> tuple[type[Exception], ...]:
        import psycopg

        return psycopg.Error, OSError

    def _schema(self):
        return schema("BYTEA", "DOUBLE PRECISION")

    def q(self, sql: str) -> str:
        return sql.replace("%", "%%").replace("?", "%s")

    def _claim_sql(self) -> str:
        return super()._claim_sql() + " FOR UPDATE OF l SKIP LOCKED"

    def init(self) -> "Store":
        with self.tx() as cur:  # several replicas may start at once: one creates the schema
            cur.execute("SELECT pg_advisory_xact_lock(716016)")
            for stmt in self._schema():
                cur.execute(stmt)
            for name, decl in ADDED_COLUMNS.items():
                cur.execute(f"ALTER TABLE usage ADD COLUMN IF NOT EXISTS {name} {decl}")
        return self
