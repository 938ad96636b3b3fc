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


class _Tensor:
    def __init__(self, name, arr):
        self._name, self._arr = name, arr

    def name(self):
        return self._name

    def as_numpy(self):
        return self._arr


class _Request:
    """What `inputs` reads of a pb_utils.InferenceRequest: its input tensors."""

    def __init__(self, **arrays):
        self._inputs = [_Tensor(k, v) for k, v in arrays.items()]

    def inputs(self):
        return list(self._inputs)


def test_inputs_reads_the_contracts_tensors_present_and_checks_the_batch_of_one():
    import numpy as np
    import pytest

    from contracts.errors import ServingError
    from contracts.tensors import GATEWAY
    from contracts.triton_io import inputs

    got = inputs(_Request(text_input=np.array([[b"hi"]]), max_tokens=np.array([[4]]), not_ours=np.array([[1]])),
                 GATEWAY)
    assert set(got) == {"text_input", "max_tokens"} and got["max_tokens"][0][0] == 4  # absent ones absent
    with pytest.raises(ServingError) as e:
        inputs(_Request(max_tokens=np.array([[4], [5]])), GATEWAY)
    assert e.value.field == "max_tokens" and "batch size must be 1" in e.value.message
