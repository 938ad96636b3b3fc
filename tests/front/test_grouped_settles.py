"""The front's settles sent together (front/grouped_settles.py): the first goes at once, the ones that
queue while it is answered go as one request, each caller gets its own answer or error, and a report is
sent even when its caller stops waiting."""
import asyncio

import pytest

from contracts.errors import ServingError, item_error
from front.grouped_settles import GroupedSettles


class Gateway:
    """Answers each batch of reports after `delay`: `{"settled": id}`, or an error for ids starting "gone"."""

    def __init__(self, delay=0.02, fail=False):
        self.batches, self.delay, self.fail = [], delay, fail

    async def send(self, reports):
        self.batches.append([r["id"] for r in reports])
        await asyncio.sleep(self.delay)
        if self.fail:
            raise ServingError("unavailable", "the gateway is restarting")
        return [item_error(ServingError("not_found", "unknown or expired lease", field="lease")) if r["id"].startswith("gone")
                else {"settled": r["id"]} for r in reports]


def test_settles_that_queue_while_one_is_answered_go_together_and_each_gets_its_answer():
    gateway = Gateway()
    settles = GroupedSettles(gateway.send)

    async def main():
        first = asyncio.ensure_future(settles.settle({"id": "a"}))
        await asyncio.sleep(0.005)  # "a" is on its way
        rest = [asyncio.ensure_future(settles.settle({"id": i})) for i in ("b", "gone-c", "d")]
        got = await asyncio.gather(first, *rest, return_exceptions=True)
        later = await settles.settle({"id": "e"})  # nothing on its way: it goes alone
        return got, later

    got, later = asyncio.run(main())
    assert gateway.batches == [["a"], ["b", "gone-c", "d"], ["e"]]
    assert got[0] == {"settled": "a"} and got[1] == {"settled": "b"} and got[3] == {"settled": "d"}
    assert isinstance(got[2], ServingError) and got[2].kind == "not_found" and got[2].field == "lease"
    assert later == {"settled": "e"}


def test_a_failed_request_fails_each_of_its_settles_and_the_next_ones_go_on():
    gateway = Gateway(fail=True)
    settles = GroupedSettles(gateway.send)

    async def main():
        got = await asyncio.gather(*(settles.settle({"id": i}) for i in "ab"), return_exceptions=True)
        gateway.fail = False
        return got, await settles.settle({"id": "c"})

    got, after = asyncio.run(main())
    assert all(isinstance(e, ServingError) and e.kind == "unavailable" for e in got)
    assert after == {"settled": "c"} and gateway.batches == [["a", "b"], ["c"]]


def test_a_report_is_sent_even_when_its_caller_stops_waiting():
    gateway = Gateway()
    settles = GroupedSettles(gateway.send)

    async def main():
        waiting = asyncio.ensure_future(settles.settle({"id": "a"}))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.sleep(0.05)

    asyncio.run(main())
    assert gateway.batches == [["a"]]


def test_answers_that_do_not_match_the_reports_fail_every_caller():
    async def short(reports):
        return [{"settled": "x"}]

    async def main():
        return await asyncio.gather(*(GroupedSettles(short).settle({"id": i}) for i in "a"),
                                    *(s.settle({"id": i}) for s in [GroupedSettles(short)] for i in "bc"),
                                    return_exceptions=True)

    got = asyncio.run(main())
    assert got[0] == {"settled": "x"}  # one report, one answer
    assert all(isinstance(e, ServingError) and e.kind == "internal" for e in got[1:])
