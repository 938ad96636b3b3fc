"""The batch worker: runs pending batch lines at the batch tier.

An asyncio task in the front's process. It claims up to `concurrency` lines at a time (a claim is one
store transaction that marks them `running` under this worker's id), sends each to the gateway with the
launcher's worker key and `on_behalf_of=<tenant>`, `tier=batch` (lowest priority, the tenant's own limits):
as a lease the front streams from the engine (front/engine_direct.py) where it does, else through the gateway;
and writes the line's one result in the same transaction that ends its state. A refusal that says "later"
(429 rate_limited, 503 queue_full / overloaded / unavailable) is waited out (`retry_after`, else a backoff)
and retried, never written as a failure. A worker killed mid-line leaves its lines `running`: the same
worker id (host and port) puts them back to `pending` when it starts again, and a line held past its
lease by a worker that never came back is taken over by another replica. A line's result is written at
most once (`finish_line` checks state and owner), so a retried line never yields two result lines.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random

from front.batch.jobs import Jobs, error_line, output_line, parse_body
from contracts.errors import RETRYABLE_KINDS as RETRYABLE, ServingError
from front.openai_schema import error_body

log = logging.getLogger("batch.worker")


class BatchWorker:
    def __init__(self, jobs: Jobs, lines, worker_key: str, worker_id: str, concurrency: int = 2,
                 lease_s: int = 900, poll_s: float = 0.5, collect=None, metrics=None):
        """`lines`: what streams a line (`.stream(call, key, parameters=...)`: DirectEngine or GatewayClient)."""
        self.jobs, self.store, self.lines = jobs, jobs.store, lines
        self.worker_key, self.worker_id = worker_key, worker_id
        self.concurrency, self.lease_s, self.poll_s = concurrency, lease_s, poll_s
        self.collect = collect  # async (call, pieces) -> front.openai_schema.Completion
        self.metrics = metrics
        self._tasks: set[asyncio.Task] = set()
        self._stop = asyncio.Event()
        self.lines_run = 0

    async def run(self) -> None:
        released = None
        while released is None and not self._stop.is_set():
            try:
                released = await asyncio.to_thread(
                    self.store.release_worker, None if self.store.dialect == "sqlite" else self.worker_id)
            except Exception as e:
                log.warning("batch worker: store unavailable (%s); retrying", e)
                await self._sleep(2)
        if released:
            log.warning("batch worker %s: %d line(s) interrupted by a restart go back to pending",
                        self.worker_id, released)
        ticks = 0
        while not self._stop.is_set():
            try:
                free = self.concurrency - len(self._tasks)
                lines = await asyncio.to_thread(self.store.claim_lines, self.worker_id, free, self.lease_s) \
                    if free > 0 else []
                for line in lines:
                    t = asyncio.create_task(self._line(line))
                    self._tasks.add(t)
                    t.add_done_callback(self._tasks.discard)
                ticks += 1
                if ticks % 20 == 0:
                    await asyncio.to_thread(self.jobs.expire)
                if not lines:
                    waits = [asyncio.ensure_future(self._stop.wait())] + list(self._tasks)
                    done, _ = await asyncio.wait(waits, timeout=self.poll_s, return_when=asyncio.FIRST_COMPLETED)
                    waits[0].cancel()
            except Exception:
                log.exception("batch worker: loop failed; retrying")
                await self._sleep(2)

    async def _sleep(self, s: float) -> None:
        try:
            await asyncio.wait_for(self._stop.wait(), s)
        except asyncio.TimeoutError:
            pass

    async def stop(self) -> None:
        """Stop claiming; lines in flight are abandoned without a result and put back to `pending`."""
        self._stop.set()
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
        try:  # a clean stop hands its lines back at once (a kill -9 leaves them for the restart)
            await asyncio.to_thread(self.store.release_worker, self.worker_id)
        except Exception as e:
            log.warning("batch worker: could not release its lines (%s); they resume on restart", e)

    async def _line(self, line: dict) -> None:
        batch_id, n, custom_id = line["batch_id"], line["line_no"], line["custom_id"]
        ok, result = await self._result(line)
        if result is None:
            return  # stopped: the line stays running and is resumed
        written = await asyncio.to_thread(self.store.finish_line, batch_id, n, self.worker_id, ok, result)
        if written:
            self.lines_run += 1
            if self.metrics is not None:
                self.metrics.batch_lines.labels("completed" if ok else "failed").inc()
            await asyncio.to_thread(self.jobs.finalize, batch_id)
        else:
            log.warning("batch %s line %d (%s): no longer ours; result dropped", batch_id, n, custom_id)

    async def _result(self, line: dict) -> tuple[bool, str | None]:
        batch_id, n, custom_id = line["batch_id"], line["line_no"], line["custom_id"]
        call, render = parse_body(line["endpoint"], json.loads(line["body"]), self.jobs.limits.default_max_tokens)
        params = {"on_behalf_of": line["tenant"], "tier": "batch", "batch_id": batch_id}
        backoff = 0.5
        while not self._stop.is_set():
            try:
                pieces = self.lines.stream(call, self.worker_key, parameters=params)
                try:
                    done = await self.collect(call, pieces)
                finally:
                    await pieces.aclose()
                return True, output_line(batch_id, n, custom_id, render(done))
            except ServingError as e:
                if e.kind not in RETRYABLE:
                    return False, error_line(batch_id, n, custom_id, e.kind, e.message, e.status, error_body(e))
                wait = e.retry_after if e.retry_after else backoff
                backoff = min(backoff * 2, 30.0)
                status = await asyncio.to_thread(self._status, batch_id)
                if status != "in_progress":
                    return False, error_line(batch_id, n, custom_id, "batch_" + (
                        "cancelled" if status in ("cancelling", "cancelled") else "expired"),
                        f"the batch was {status} while this request waited for capacity")
                if self.metrics is not None:
                    self.metrics.batch_retries.labels(e.kind).inc()
                await self._sleep(wait + random.uniform(0, 0.1))
        return False, None

    def _status(self, batch_id: str) -> str:
        b = self.store.get_batch(None, batch_id)
        return b["status"] if b else "cancelled"
