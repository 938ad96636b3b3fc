"""The front's settles sent together: the reports that arrive while a settle request is on its way go as
one request once it is answered (a group commit).

Every request the front streams costs the gateway's one process two requests, its admit and its settle,
and each answer it sends is a blocking IPC round trip to tritonserver on its event loop. An admit must be
answered on its own (it may wait for a slot), but a settle is answered at once, so the ones that queue
up while the gateway is busy share a request (gateway/core.py `Leases.settle_all`). Nothing waits for a
timer: with nothing on its way a settle goes in the next turn of the event loop, so the more loaded the
gateway, the more settles each request carries."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from contracts.errors import ServingError, item_answer


class GroupedSettles:
    def __init__(self, send: Callable[[list[dict]], Awaitable[list[dict]]]):
        """`send(reports)`: the gateway's answers to the reports, one each, in order."""
        self._send = send
        self._queue: list[tuple[dict, asyncio.Future]] = []
        self._sending: asyncio.Task | None = None  # held: the loop keeps only a weak reference to a task

    async def settle(self, report: dict) -> dict:
        """The gateway's answer to one report; its refusal as a ServingError. The report is sent even if
        the caller stops waiting."""
        answer = asyncio.get_running_loop().create_future()
        self._queue.append((report, answer))
        if self._sending is None:
            self._sending = asyncio.ensure_future(self._drain())
        return await answer

    async def _drain(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                try:
                    answers = await self._send([report for report, _ in batch])
                    if len(answers) != len(batch):
                        raise ServingError("internal", f"{len(answers)} answers to {len(batch)} settles")
                except Exception as e:  # noqa: BLE001 - each caller gets the failure of its request
                    answers = [e] * len(batch)
                for (_, waiting), answer in zip(batch, answers):
                    if not waiting.done():
                        deliver(waiting, answer)
        finally:
            self._sending = None


def deliver(waiting: asyncio.Future, answer) -> None:
    """A grouped item's answer to its waiter: the answer, its failure as the ServingError it was
    (contracts.errors item_answer), or the exception of its whole request (front/grouped_admits.py too)."""
    if isinstance(answer, BaseException):
        waiting.set_exception(answer)
    else:
        try:
            waiting.set_result(item_answer(answer))
        except ServingError as e:
            waiting.set_exception(e)
