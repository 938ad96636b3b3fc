"""The front's admits sent together: the admits that arrive while two groups are on their way to the
gateway without an answer go as the next group, once one of those has its first answer (a group commit, as
front/grouped_settles.py does for settles).

Every answer the gateway sends is an IPC round trip that blocks its one process's event loop; half of that
loop's time went to them (py-spy of its stub: benchmarks/results/2026-11-28-gateway-stub-profile.json).
One group is one request and, for the admits decided at once, one answer (gateway/core.py
`Leases.admit_group`); an admit that waits in the gateway's admission queue is answered later, on its own.
Nothing waits for a timer while the gateway keeps up: an admit goes in the next turn of the event loop
when fewer than `in_flight` groups wait for their first answer, so admits group only once the gateway
falls behind. The next group waits `gate_s` at most: groups whose admits all wait in the admission queue
hold the ones behind them no longer."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from contracts.errors import ServingError
from contracts.tensors import MAX_ADMITS_PER_GROUP, MAX_JSON_PARAMETER_CHARS
from front.grouped_settles import deliver

GATE_S = 0.01
IN_FLIGHT = 2
GROUP_BYTES = MAX_JSON_PARAMETER_CHARS - 1024  # the serialized admits of one group, with room for its frame

# send_one(admit): the gateway's grant to one admit sent alone (raises its refusal); send_group(items): its
# answers to a group of serialized admits, as they come ({stream_id: answer}); serialize(admit): an admit as
# a group's item
SendOne = Callable[[object], Awaitable[dict]]
SendGroup = Callable[[list[bytes]], AsyncIterator[dict]]


class GroupedAdmits:
    def __init__(self, send_one: SendOne, send_group: SendGroup, serialize: Callable[[object], bytes],
                 gate_s: float = GATE_S, in_flight: int = IN_FLIGHT, on_sent: Callable[[int], None] | None = None):
        """`in_flight`: groups that may be on their way without an answer before the next waits for one. A
        group of one goes as a single admit (its tensors, no JSON to build or read). `on_sent(n)`: a request
        with n admits went (the front's metrics)."""
        self._send_one, self._send_group, self._serialize = send_one, send_group, serialize
        self.on_sent = on_sent
        self.gate_s, self.in_flight = gate_s, in_flight
        self._queue: list[tuple[str, object, asyncio.Future]] = []
        self._sending: asyncio.Task | None = None  # held: the loop keeps only a weak reference to a task
        self._groups: set[asyncio.Task] = set()
        self._unanswered = 0
        self._answered = asyncio.Event()  # a group has had its first answer since the drain last looked

    async def admit(self, stream_id: str, admit: object) -> dict:
        """The gateway's grant for one admit (`admit`: what send_one and serialize take); its refusal as a
        ServingError. The admit is sent even if the caller stops waiting (the caller sends the gateway's
        `stop` for its stream_id, which takes it out of the admission queue)."""
        answer = asyncio.get_running_loop().create_future()
        self._queue.append((stream_id, admit, answer))
        if self._sending is None:
            self._sending = asyncio.ensure_future(self._drain())
        return await answer

    def withdraw(self, stream_id: str) -> bool:
        """Take an admit whose caller left out of the queue if it has not been sent: its answer is
        `cancelled`, and the gateway never hears of it. False once it is on its way (the caller's `stop`
        reaches it there)."""
        for i, (queued, _, answer) in enumerate(self._queue):
            if queued == stream_id:
                del self._queue[i]
                if not answer.done():
                    answer.set_exception(ServingError("cancelled", "the client left before its admit was sent"))
                return True
        return False

    async def _drain(self) -> None:
        try:
            while self._queue:
                if self._unanswered >= self.in_flight:
                    self._answered.clear()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._answered.wait(), self.gate_s)
                    if not self._queue:  # withdrawn meanwhile
                        break
                batch = self._next_group()
                if self.on_sent is not None:
                    self.on_sent(len(batch))
                self._unanswered += 1
                group = asyncio.ensure_future(self._group(batch))
                self._groups.add(group)
                group.add_done_callback(self._groups.discard)
        finally:
            self._sending = None

    def _next_group(self) -> list[tuple[str, object, asyncio.Future, bytes | None]]:
        """The admits waiting longest, as many as one request holds (the gateway's bounds on a group), each
        serialized when there are several."""
        if len(self._queue) == 1:
            (stream_id, admit, answer), = self._queue
            self._queue = []
            return [(stream_id, admit, answer, None)]
        size, batch = 0, []
        for stream_id, admit, answer in self._queue[:MAX_ADMITS_PER_GROUP]:
            item = self._serialize(admit)
            size += len(item) + 1
            if batch and size > GROUP_BYTES:
                break
            batch.append((stream_id, admit, answer, item))
        self._queue = self._queue[len(batch):]
        return batch

    async def _group(self, batch: list[tuple[str, object, asyncio.Future, bytes | None]]) -> None:
        waiting = {stream_id: future for stream_id, _, future, _ in batch}
        answered = False
        try:
            if len(batch) == 1:
                (stream_id, admit, future, _), = batch
                grant = await self._send_one(admit)
                waiting.clear()
                if not future.done():
                    future.set_result(grant)
                return
            async for answers in self._send_group([item for _, _, _, item in batch]):
                if not answered:
                    answered = self._first_answer()
                for stream_id, answer in answers.items():
                    future = waiting.pop(stream_id, None)
                    if future is not None and not future.done():
                        deliver(future, answer)
            if waiting:
                raise ServingError("internal", f"the gateway did not answer {len(waiting)} admit(s) of a group")
        except Exception as e:  # noqa: BLE001 - each admit still waiting gets the failure of its group
            for future in waiting.values():
                if not future.done():
                    future.set_exception(e)
        finally:
            if not answered:
                self._first_answer()

    def _first_answer(self) -> bool:
        self._unanswered -= 1
        self._answered.set()
        return True
