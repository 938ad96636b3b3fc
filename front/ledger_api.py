"""The front's usage and Batch API routes, and the ledger services its process runs.

`LedgerService` owns the store (SQLite under the data directory, or PostgreSQL), the writer thread that
drains the gateway's usage spool into it, and the batch worker task. Routes stay thin: the caller's tenant
comes from the gateway (`whoami` operation: the same key check as every other request; the front keeps
no keys), and everything is scoped to that tenant, so another tenant's ids answer 404.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from front.batch.jobs import BatchLimits, Jobs, file_object
from front.batch.worker import BatchWorker
from front.keys import api_key
from contracts.errors import ServingError
from ledger import reports
from ledger.store import Store
from ledger.writer import LedgerWriter

log = logging.getLogger("front.ledger")


@dataclass
class LedgerSettings:
    data_dir: Path | None = None  # None: no ledger, no batches (the routes answer 503)
    ledger_url: str | None = None  # postgresql://...; None: SQLite at data_dir/ledger.sqlite3
    batch: BatchLimits = field(default_factory=BatchLimits)
    batch_concurrency: int = 2
    worker_id: str = ""
    worker_key: str | None = None  # the launcher's batch worker key (LLM_BATCH_WORKER_KEY)
    write_spool: bool = True  # move the gateway's spool into the store (one process of a front does)

    @property
    def spool_dir(self) -> Path:
        return self.data_dir / "spool"


class LedgerService:
    def __init__(self, settings: LedgerSettings, lines, metrics, collect):
        """`lines`: what streams a batch line (`.stream(call, key, parameters=...)`): the front's DirectEngine,
        on a lease, or the GatewayClient, through the gateway."""
        self.settings = settings
        url = settings.ledger_url or settings.data_dir / "ledger.sqlite3"
        self.store = Store.open(url)
        self.jobs = Jobs(self.store, settings.batch)
        self.writer = LedgerWriter(self.store, settings.spool_dir, metrics=metrics)
        self.worker = BatchWorker(self.jobs, lines, settings.worker_key or "", settings.worker_id or
                                  f"{socket.gethostname()}-{os.getpid()}", settings.batch_concurrency,
                                  collect=collect, metrics=metrics) if settings.worker_key else None
        self._ready = False
        self._worker_task: asyncio.Task | None = None

    def ensure_ready(self) -> None:
        if not self._ready:
            try:
                self.store.init()
            except Exception as e:
                self.store.reset()
                raise ServingError("unavailable", f"the usage ledger store is unavailable ({type(e).__name__})")
            self._ready = True

    async def start(self) -> None:
        self.settings.spool_dir.mkdir(parents=True, exist_ok=True)
        try:
            await asyncio.to_thread(self.ensure_ready)
        except ServingError as e:
            log.error("%s; records stay spooled until it is reachable", e.message)
        self.writer.ensure_ready = self.ensure_ready
        if self.settings.write_spool:
            self.writer.start()
        if self.worker is not None:
            self._worker_task = asyncio.create_task(self._run_worker())

    async def _run_worker(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.ensure_ready)
                break
            except ServingError:
                await asyncio.sleep(2)
        await self.worker.run()

    async def stop(self) -> None:
        if self.worker is not None:
            await self.worker.stop()
        if self._worker_task is not None:
            self._worker_task.cancel()
        if self.settings.write_spool:
            await asyncio.to_thread(self.writer.close, 5.0)
        self.store.close()

    async def call(self, fn, *args):
        def run():
            self.ensure_ready()
            try:
                return fn(*args)
            except ServingError:
                raise
            except self.store.failures as e:
                self.store.reset()
                log.error("ledger store: %s: %s", type(e).__name__, e)
                raise ServingError("unavailable", "the usage ledger store is unavailable; retry later",
                                   retry_after=5) from None
            except Exception:  # a bug, not the store: said as one (500), the store's connection kept
                log.exception("ledger call %s failed", getattr(fn, "__name__", fn))
                raise ServingError("internal", "the request failed inside the front (logged)") from None
        return await asyncio.to_thread(run)


class LedgerRoutes:
    """Handlers; each runs inside the front's `_guarded` bookkeeping."""

    def __init__(self, front, service: LedgerService | None):
        self.front, self.service = front, service

    def _svc(self) -> LedgerService:
        if self.service is None:
            raise ServingError("unavailable", "the usage ledger is not configured on this server (--data-dir)")
        return self.service

    async def tenant(self, request: Request) -> str:
        return (await self.front.gateway.whoami(api_key(request))).tenant

    # -- usage ----------------------------------------------------------------------------------------
    async def usage(self, request: Request, _start) -> Response:
        svc = self._svc()
        tenant = await self.tenant(request)
        q = request.query_params
        by = q.get("group_by", "day_model")
        try:
            start_ts, end_ts, s, e = reports.window(q.get("start"), q.get("end"))
            if by not in reports.GROUPS:
                raise reports.ReportError(f"group_by: must be one of {', '.join(reports.GROUPS)}, got {by!r}")
        except reports.ReportError as err:
            raise ServingError("invalid_argument", str(err), field=str(err).split(":")[0]) from None
        rows = await svc.call(svc.store.usage_rows, tenant, start_ts, end_ts)
        data = reports.aggregate(rows, by)
        for d in data:
            d.pop("tenant", None)
        return JSONResponse({"object": "list", "tenant": tenant, "start": s, "end": e, "group_by": by,
                             "data": data})

    # -- files ----------------------------------------------------------------------------------------
    async def upload_file(self, request: Request, _start) -> Response:
        svc = self._svc()
        tenant = await self.tenant(request)
        limit = svc.settings.batch.max_file_bytes
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > limit + 64 * 1024:
            raise ServingError("invalid_argument", f"file: the upload is over the limit of {limit} bytes",
                               field="file")
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise ServingError("invalid_argument", "POST /v1/files takes multipart/form-data with 'file' and "
                               "'purpose'", field="file")
        try:
            # read as it arrives; the front's BodyLimit refuses it past the limit (chunked uploads too)
            form = await request.form(max_files=1, max_fields=8)
        except (ServingError, ClientDisconnect):
            raise
        except Exception as e:  # starlette's HTTPException / MultiPartException for a malformed body
            raise ServingError("invalid_argument", f"file: malformed multipart body ({getattr(e, 'detail', e)})",
                               field="file") from None
        try:
            upload, purpose = form.get("file"), form.get("purpose")
            if upload is None or isinstance(upload, str):
                raise ServingError("invalid_argument", "file: required (a JSONL file)", field="file")
            if not isinstance(purpose, str) or not purpose:
                raise ServingError("invalid_argument", "purpose: required ('batch')", field="purpose")
            content = await upload.read(limit + 1)
            name = upload.filename or "upload.jsonl"
        finally:
            await form.close()  # the upload's spooled temp file
        f = await svc.call(svc.jobs.upload, tenant, purpose, name, content)
        return JSONResponse(f)

    async def get_file(self, request: Request, _start) -> Response:
        svc = self._svc()
        tenant = await self.tenant(request)
        f = await svc.call(svc.jobs.file, tenant, request.path_params["file_id"])
        return JSONResponse(file_object(f))

    async def list_files(self, request: Request, _start) -> Response:
        svc = self._svc()
        tenant = await self.tenant(request)
        files = await svc.call(svc.store.list_files, tenant)
        return JSONResponse({"object": "list", "data": [file_object(f) for f in files]})

    async def file_content(self, request: Request, _start) -> Response:
        svc = self._svc()
        tenant = await self.tenant(request)
        f = await svc.call(svc.jobs.file, tenant, request.path_params["file_id"], True)
        return Response(f["content"], media_type="application/jsonl")

    # -- batches --------------------------------------------------------------------------------------
    async def create_batch(self, request: Request, _start) -> Response:
        svc = self._svc()
        tenant = await self.tenant(request)
        body = await self.front._body(request)
        if not isinstance(body, dict):
            raise ServingError("invalid_argument", "the body must be a JSON object")
        return JSONResponse(await svc.call(svc.jobs.create, tenant, body))

    async def get_batch(self, request: Request, _start) -> Response:
        svc = self._svc()
        tenant = await self.tenant(request)
        return JSONResponse(await svc.call(svc.jobs.get, tenant, request.path_params["batch_id"]))

    async def list_batches(self, request: Request, _start) -> Response:
        svc = self._svc()
        tenant = await self.tenant(request)
        q = request.query_params
        try:
            limit = int(q.get("limit", "20"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100:
            raise ServingError("invalid_argument", "limit: must be an integer from 1 to 100", field="limit")
        return JSONResponse(await svc.call(svc.jobs.list, tenant, limit, q.get("after")))

    async def cancel_batch(self, request: Request, _start) -> Response:
        svc = self._svc()
        tenant = await self.tenant(request)
        return JSONResponse(await svc.call(svc.jobs.cancel, tenant, request.path_params["batch_id"]))
