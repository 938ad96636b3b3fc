"""front/app.py until_disconnect: the work runs in the caller's task, a watcher reads the ASGI `receive`
and cancels it when the client leaves; the caller then goes on, uncancelled, and an outside cancel stays
the caller's."""
import asyncio

import pytest

from front.app import until_disconnect


def receiver(disconnect_after: float | None, fail: bool = False):
    """An ASGI receive: the body's end at once, then a disconnect after a while (or never, or it fails)."""
    messages = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive():
        if messages:
            return messages.pop()
        if disconnect_after is None:
            await asyncio.Event().wait()
        await asyncio.sleep(disconnect_after)
        if fail:
            raise RuntimeError("the connection cannot be read")
        return {"type": "http.disconnect"}

    return receive


def test_work_that_ends_first_gives_its_result_and_leaves_no_task_behind():
    async def main():
        before = len(asyncio.all_tasks())
        got = await until_disconnect(receiver(None), lambda: asyncio.sleep(0.01, result="done"))
        await asyncio.sleep(0)
        return got, len(asyncio.all_tasks()) - before, asyncio.current_task().cancelling()

    assert asyncio.run(main()) == ("done", 0, 0)


@pytest.mark.parametrize("fail", [False, True], ids=["disconnect", "receive-fails"])
def test_a_client_that_leaves_cancels_the_work_and_the_caller_goes_on(fail):
    cleaned = []

    async def work():
        try:
            await asyncio.sleep(10)
        finally:
            cleaned.append(True)

    async def main():
        got = await until_disconnect(receiver(0.01, fail), work)
        await asyncio.sleep(0.01)  # the caller is not cancelled: it can go on awaiting
        return got, asyncio.current_task().cancelling()

    assert asyncio.run(main()) == (None, 0) and cleaned == [True]


def test_an_outside_cancel_is_not_taken_for_a_disconnect():
    async def main():
        inner = asyncio.ensure_future(until_disconnect(receiver(None), lambda: asyncio.sleep(10)))
        await asyncio.sleep(0.01)
        inner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await inner

    asyncio.run(main())
