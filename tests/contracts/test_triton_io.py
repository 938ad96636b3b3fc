"""contracts/triton_io.py: helpers of the model.py adapters that need no Triton."""
from contracts.triton_io import CancelPoll
from tests.support.clock import Clock


def test_cancel_poll_asks_at_most_once_per_interval_and_a_yes_sticks():
    clock, answers, asked = Clock(100.0), [False, False, True, False], []

    def is_cancelled():
        asked.append(clock.t)
        return answers[len(asked) - 1]

    poll = CancelPoll(is_cancelled, interval_s=0.05, clock=clock)
    assert poll() is False and asked == [100.0]  # the first call asks at once
    for _ in range(10):  # every token within the interval: answered without asking
        clock.t += 0.004
        assert poll() is False
    assert asked == [100.0]
    clock.t += 0.012  # past 50 ms since the last ask: asked again
    assert poll() is False and len(asked) == 2
    clock.t += 0.06
    assert poll() is True and len(asked) == 3
    clock.t += 1.0
    assert poll() is True and len(asked) == 3  # cancelled stays cancelled without asking
