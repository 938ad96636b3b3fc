"""gateway/batch_gate.py: batch-tier requests fill idle capacity and give way to interactive ones."""
import asyncio

import pytest

from gateway.admission import Stopped
from gateway.batch_gate import BatchGate
from contracts.errors import ServingError


def test_batch_runs_freely_when_idle_and_one_at_a_time_while_interactive_runs():
    async def scenario():
        gate = BatchGate(when_busy=1, max_wait_s=5, quiet_s=0)
        await gate.enter_batch("m")
        await gate.enter_batch("m")  # idle: no limit but the engine slots
        gate.enter_interactive("m")
        third = asyncio.ensure_future(gate.enter_batch("m"))
        await asyncio.sleep(0.05)
        assert not third.done()  # 2 batch requests already run beside interactive traffic
        gate.leave_batch("m")
        await asyncio.sleep(0.05)
        assert not third.done()  # still 1 running: the limit while busy
        gate.leave_batch("m")
        await asyncio.wait_for(third, 1)  # down to 0: one may start
        other = asyncio.ensure_future(gate.enter_batch("m"))
        await asyncio.sleep(0.05)
        assert not other.done()
        gate.leave_interactive("m")  # idle again: it starts at once
        await asyncio.wait_for(other, 1)
        assert gate.models["m"].batch == 2 and gate.open_for_batch("other-model")

    asyncio.run(scenario())


def test_zero_while_busy_waits_then_refuses_with_retry_after():
    async def scenario():
        gate = BatchGate(when_busy=0, max_wait_s=0.2)
        gate.enter_interactive("m")
        with pytest.raises(ServingError) as e:
            await gate.enter_batch("m")
        assert e.value.kind == "overloaded" and e.value.retry_after >= 1.0
        assert gate.models["m"].batch == 0

    asyncio.run(scenario())


def test_batch_waits_for_a_quiet_period_after_interactive_traffic():
    async def scenario():
        gate = BatchGate(when_busy=0, max_wait_s=5, quiet_s=0.3)
        gate.enter_interactive("m")
        gate.leave_interactive("m")
        t0 = asyncio.get_running_loop().time()
        await gate.enter_batch("m")  # nothing runs, but interactive traffic just ended: wait 0.3 s
        assert asyncio.get_running_loop().time() - t0 >= 0.25

    asyncio.run(scenario())


def test_a_stopped_batch_request_leaves_the_gate_without_entering():
    async def scenario():
        gate = BatchGate(when_busy=0, max_wait_s=5)
        gate.enter_interactive("m")
        stopped = asyncio.Event()
        waiting = asyncio.ensure_future(gate.enter_batch("m", stopped))
        await asyncio.sleep(0.05)
        stopped.set()
        with pytest.raises(Stopped):
            await asyncio.wait_for(waiting, 1)  # at once, not after the gate's 5 s
        assert gate.models["m"].batch == 0
        gate.leave_interactive("m")
        await asyncio.wait_for(gate.enter_batch("m"), 1)  # the gate still works for the others

    asyncio.run(scenario())
