"""Files and batch jobs in the store, as OpenAI's objects.

A batch is created from a `purpose=batch` JSONL file in one transaction: one `batch_lines` row per line.
A line that cannot run (invalid JSON, no custom_id, a duplicate custom_id, another URL than the batch's
endpoint, a body the front would refuse) gets its error result right away; the others are `pending` for
the worker. Every line ends with exactly one result (an output line or an error line), written in the
same transaction as its state, and the output and error files are built from those rows when the last
line is done (`finalize`). Everything is keyed by tenant: another tenant's ids are simply not found.
"""
from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass

from contracts.errors import ServingError, invalid
from front.openai_schema import ResponseBuilder, parse_request
from front.responses_api import ResponsesBuilder, parse_responses, stored_reference
from ledger.store import Store

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
COMPLETION_WINDOWS = {"24h": 24 * 3600}
TERMINAL = ("completed", "failed", "expired", "cancelled")


@dataclass
class BatchLimits:
    max_file_bytes: int = 16 * 1024 * 1024
    max_lines: int = 5000
    max_batches_in_progress: int = 10  # per tenant
    default_max_tokens: int = 256


def parse_body(endpoint: str, body: dict, default_max_tokens: int):
    """A line's body as the front parses it on `endpoint`: (the gateway call, a function from the finished
    Completion to that endpoint's response body). Raises ServingError as the front would."""
    if endpoint == "/v1/responses":
        ref = stored_reference(body)
        if ref.previous is not None or ref.conversation is not None:
            raise invalid("previous_response_id" if ref.previous else "conversation",
                          "a batch line stands alone: send the whole conversation as input")
        if ref.store:
            raise invalid("store", "a batch line's response is in the batch's output file; it is not stored")
        parsed = parse_responses(body, default_max_tokens, ref=ref)
        return parsed.call, ResponsesBuilder(parsed.echo).full
    chat = endpoint == ENDPOINTS[0]
    return parse_request(body, chat, default_max_tokens), ResponseBuilder(chat).full


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def file_object(f: dict) -> dict:
    return {"id": f["id"], "object": "file", "bytes": f["bytes"], "created_at": f["created_at"],
            "filename": f["filename"], "purpose": f["purpose"], "status": "processed"}


def batch_object(b: dict) -> dict:
    return {"id": b["id"], "object": "batch", "endpoint": b["endpoint"],
            "errors": json.loads(b["errors"]) if b["errors"] else None,
            "input_file_id": b["input_file_id"], "completion_window": b["completion_window"],
            "status": b["status"], "output_file_id": b["output_file_id"], "error_file_id": b["error_file_id"],
            "created_at": b["created_at"], "in_progress_at": b["in_progress_at"], "expires_at": b["expires_at"],
            "finalizing_at": b["finalizing_at"], "completed_at": b["completed_at"], "failed_at": None,
            "expired_at": b["expired_at"], "cancelling_at": b["cancelling_at"], "cancelled_at": b["cancelled_at"],
            "request_counts": {"total": b["total"], "completed": b["completed"], "failed": b["failed"]},
            "metadata": json.loads(b["metadata"]) if b["metadata"] else None}


def error_line(batch_id: str, line_no: int, custom_id: str, code: str, message: str, status: int | None = None,
               body: dict | None = None) -> str:
    response = None if status is None else {"status_code": status, "request_id": f"{batch_id}-{line_no}",
                                            "body": body}
    return json.dumps({"id": f"batch_req_{batch_id[6:]}_{line_no}", "custom_id": custom_id, "response": response,
                       "error": {"code": code, "message": message}}, separators=(",", ":"))


def output_line(batch_id: str, line_no: int, custom_id: str, body: dict) -> str:
    return json.dumps({"id": f"batch_req_{batch_id[6:]}_{line_no}", "custom_id": custom_id,
                       "response": {"status_code": 200, "request_id": f"{batch_id}-{line_no}", "body": body},
                       "error": None}, separators=(",", ":"))


class Jobs:
    def __init__(self, store: Store, limits: BatchLimits | None = None):
        self.store = store
        self.limits = limits or BatchLimits()

    # -- files ----------------------------------------------------------------------------------------
    def upload(self, tenant: str, purpose: str, filename: str, content: bytes) -> dict:
        if purpose != "batch":
            raise ServingError("invalid_argument", f"purpose: only 'batch' files are accepted, got {purpose!r}",
                               field="purpose")
        if len(content) > self.limits.max_file_bytes:
            raise ServingError("invalid_argument", f"file: {len(content)} bytes is over the limit of "
                               f"{self.limits.max_file_bytes} bytes", field="file")
        if not content.strip():
            raise ServingError("invalid_argument", "file: the file is empty", field="file")
        lines = _lines(content)
        if len(lines) > self.limits.max_lines:
            raise ServingError("invalid_argument", f"file: {len(lines)} lines is over the limit of "
                               f"{self.limits.max_lines} requests per batch file", field="file")
        with self.store.tx() as cur:
            return file_object(self.store.put_file(cur, new_id("file"), tenant, purpose, filename[:255], content))

    def file(self, tenant: str, file_id: str, content: bool = False) -> dict:
        f = self.store.get_file(tenant, file_id, content)
        if f is None:
            raise ServingError("not_found", f"no file {file_id!r}", field="file_id")
        return f

    # -- batches --------------------------------------------------------------------------------------
    def create(self, tenant: str, body: dict) -> dict:
        input_file_id, endpoint = body.get("input_file_id"), body.get("endpoint")
        window = body.get("completion_window", "24h")
        metadata = body.get("metadata")
        if not isinstance(input_file_id, str) or not input_file_id:
            raise ServingError("invalid_argument", "input_file_id: required", field="input_file_id")
        if endpoint not in ENDPOINTS:
            raise ServingError("invalid_argument", f"endpoint: must be one of {', '.join(ENDPOINTS)}, got "
                               f"{endpoint!r}", field="endpoint")
        if window not in COMPLETION_WINDOWS:
            raise ServingError("invalid_argument", f"completion_window: only '24h' is supported, got {window!r}",
                               field="completion_window")
        if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16 or not all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                for k, v in metadata.items())):
            raise ServingError("invalid_argument", "metadata: at most 16 string pairs (keys up to 64, values "
                               "up to 512 characters)", field="metadata")
        f = self.store.get_file(tenant, input_file_id, content=True)
        if f is None:
            raise ServingError("not_found", f"no file {input_file_id!r}", field="input_file_id")
        if f["purpose"] != "batch":
            raise ServingError("invalid_argument", f"input_file_id: file {input_file_id!r} is not a batch file",
                               field="input_file_id")
        now = int(time.time())
        batch_id = new_id("batch")
        rows = self._lines(batch_id, endpoint, f["content"])
        failed = sum(1 for r in rows if r[3] == "failed")
        with self.store.tx() as cur:
            cur.execute("SELECT COUNT(*) FROM batches WHERE tenant = ? AND status IN "
                        "('validating', 'in_progress', 'finalizing', 'cancelling')", (tenant,))
            if cur.fetchone()[0] >= self.limits.max_batches_in_progress:
                raise ServingError("rate_limited", f"tenant has {self.limits.max_batches_in_progress} batches "
                                   "in progress already; wait for one to finish")
            cur.execute("INSERT INTO batches (id, tenant, endpoint, input_file_id, completion_window, status, "
                        "created_at, in_progress_at, expires_at, total, completed, failed, metadata) "
                        "VALUES (?, ?, ?, ?, ?, 'in_progress', ?, ?, ?, ?, 0, ?, ?)",
                        (batch_id, tenant, endpoint, input_file_id, window, now, now,
                         now + COMPLETION_WINDOWS[window], len(rows), failed,
                         json.dumps(metadata) if metadata else None))
            for r in rows:
                cur.execute("INSERT INTO batch_lines (batch_id, line_no, custom_id, state, body, result) "
                            "VALUES (?, ?, ?, ?, ?, ?)", r)
        self.finalize(batch_id)  # a batch of only bad lines is done at once
        return batch_object(self.store.get_batch(tenant, batch_id))

    def _lines(self, batch_id: str, endpoint: str, content: bytes) -> list[tuple]:
        rows, seen = [], set()
        for n, raw in enumerate(_lines(content), 1):
            custom_id = ""
            try:
                try:
                    line = json.loads(raw)
                except ValueError as e:
                    raise _Bad("invalid_json", f"line {n}: not valid JSON ({e})")
                if not isinstance(line, dict):
                    raise _Bad("invalid_request", f"line {n}: must be a JSON object")
                custom_id = line.get("custom_id")
                if not isinstance(custom_id, str) or not custom_id:
                    custom_id = "" if not isinstance(custom_id, str) else custom_id
                    raise _Bad("missing_custom_id", f"line {n}: custom_id must be a non-empty string")
                if custom_id in seen:
                    raise _Bad("duplicate_custom_id", f"line {n}: custom_id {custom_id!r} is used by an "
                               "earlier line")
                seen.add(custom_id)
                if line.get("method", "POST") != "POST":
                    raise _Bad("invalid_method", f"line {n}: method must be POST")
                if line.get("url") != endpoint:
                    raise _Bad("invalid_url", f"line {n}: url must be the batch's endpoint {endpoint!r}, got "
                               f"{line.get('url')!r}")
                body = line.get("body")
                if not isinstance(body, dict):
                    raise _Bad("invalid_request", f"line {n}: body must be a JSON object")
                if body.get("stream"):
                    raise _Bad("invalid_request", f"line {n}: stream is not supported in a batch")
                try:
                    parse_body(endpoint, body, self.limits.default_max_tokens)
                except ServingError as e:
                    raise _Bad(e.kind, f"line {n}: {e.message}", e.status, e)
                rows.append((batch_id, n, custom_id, "pending", json.dumps(body), None))
            except _Bad as bad:
                body = None
                if bad.error is not None:
                    from front.openai_schema import error_body
                    body = error_body(bad.error)
                rows.append((batch_id, n, custom_id, "failed", None,
                             error_line(batch_id, n, custom_id, bad.code, bad.message, bad.status, body)))
        return rows

    def get(self, tenant: str, batch_id: str) -> dict:
        self.finalize(batch_id)
        b = self.store.get_batch(tenant, batch_id)
        if b is None:
            raise ServingError("not_found", f"no batch {batch_id!r}", field="batch_id")
        return batch_object(b)

    def list(self, tenant: str, limit: int = 20, after: str | None = None) -> dict:
        if after and self.store.get_batch(tenant, after) is None:  # another tenant's id is unknown here too
            raise ServingError("not_found", f"no batch {after!r}", field="after")
        rows = self.store.list_batches(tenant, limit + 1, after)
        data = [batch_object(b) for b in rows[:limit]]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit}

    def cancel(self, tenant: str, batch_id: str) -> dict:
        now = int(time.time())
        with self.store.tx() as cur:
            b = self.store.get_batch(tenant, batch_id, cur)
            if b is None:
                raise ServingError("not_found", f"no batch {batch_id!r}", field="batch_id")
            if b["status"] in TERMINAL or b["status"] == "cancelling":
                if b["status"] not in ("cancelled", "cancelling"):
                    raise ServingError("invalid_argument", f"batch {batch_id!r} is {b['status']}; it cannot be "
                                       "cancelled")
            else:
                cur.execute("UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE id = ?",
                            (now, batch_id))
                # lines nobody runs yet end now; lines being run finish (their result is kept)
                self._fail_pending(cur, batch_id, "batch_cancelled", "the batch was cancelled before this "
                                   "request ran")
        self.finalize(batch_id)
        return self.get(tenant, batch_id)

    def _fail_pending(self, cur, batch_id: str, code: str, message: str) -> None:
        cur.execute("SELECT line_no, custom_id FROM batch_lines WHERE batch_id = ? AND state = 'pending'",
                    (batch_id,))
        pending = cur.fetchall()
        for line_no, custom_id in pending:
            cur.execute("UPDATE batch_lines SET state = 'failed', result = ? WHERE batch_id = ? AND line_no = ? "
                        "AND state = 'pending'", (error_line(batch_id, line_no, custom_id, code, message),
                                                  batch_id, line_no))
        if pending:
            cur.execute("UPDATE batches SET failed = failed + ? WHERE id = ?", (len(pending), batch_id))

    def expire(self) -> int:
        """Batches past their completion window: the lines not run end as `batch_expired`."""
        now = int(time.time())
        with self.store.tx() as cur:
            cur.execute("SELECT id FROM batches WHERE status = 'in_progress' AND expires_at <= ?", (now,))
            ids = [r[0] for r in cur.fetchall()]
            for batch_id in ids:
                cur.execute("UPDATE batches SET status = 'expiring' WHERE id = ?", (batch_id,))
                self._fail_pending(cur, batch_id, "batch_expired", "the batch expired before this request ran")
        for batch_id in ids:
            self.finalize(batch_id)
        return len(ids)

    def finalize(self, batch_id: str) -> bool:
        """When no line is pending or running: build the output and error files and end the batch, in one
        transaction (a crash in between leaves the batch as it was, and the next call does it)."""
        with self.store.tx() as cur:
            b = self.store.get_batch(None, batch_id, cur)
            if b is None or b["status"] not in ("in_progress", "cancelling", "expiring"):
                return False
            cur.execute("SELECT COUNT(*) FROM batch_lines WHERE batch_id = ? AND state IN ('pending', 'running')",
                        (batch_id,))
            if cur.fetchone()[0]:
                return False
            cur.execute("SELECT state, result FROM batch_lines WHERE batch_id = ? ORDER BY line_no", (batch_id,))
            out, err = [], []
            for state, result in cur.fetchall():
                (out if state == "done" else err).append(result)
            now = int(time.time())
            output_id = error_id = None
            if out:
                output_id = new_id("file")
                self.store.put_file(cur, output_id, b["tenant"], "batch_output", f"{batch_id}_output.jsonl",
                                    ("\n".join(out) + "\n").encode())
            if err:
                error_id = new_id("file")
                self.store.put_file(cur, error_id, b["tenant"], "batch_output", f"{batch_id}_error.jsonl",
                                    ("\n".join(err) + "\n").encode())
            status, col = {"in_progress": ("completed", "completed_at"), "cancelling": ("cancelled", "cancelled_at"),
                           "expiring": ("expired", "expired_at")}[b["status"]]
            cur.execute(f"UPDATE batches SET status = ?, finalizing_at = ?, {col} = ?, output_file_id = ?, "
                        "error_file_id = ? WHERE id = ?", (status, now, now, output_id, error_id, batch_id))
        return True


class _Bad(Exception):
    def __init__(self, code: str, message: str, status: int | None = None, error: ServingError | None = None):
        super().__init__(message)
        self.code, self.message, self.status, self.error = code, message, status, error


def _lines(content: bytes) -> list[bytes]:
    return [ln for ln in content.splitlines() if ln.strip()]
