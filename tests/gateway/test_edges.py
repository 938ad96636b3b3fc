"""The gateway's typed edges: what they carry to the engine call."""
import numpy as np
import pytest

from contracts.errors import ServingError
from gateway.edges import Preprocessed, Sampling


def test_sampling_sends_only_what_was_given_under_the_engine_names():
    assert Sampling().engine_inputs() == {}
    assert Sampling(temperature=0.5, top_k=3, seed=7).engine_inputs() == {
        "temperature": 0.5, "runtime_top_k": 3, "seed": 7}
    assert Sampling(top_p=0.0, min_tokens=0).engine_inputs() == {"runtime_top_p": 0.0, "min_tokens": 0}


def test_preprocessed_reads_preprocessing_tensors_and_keeps_their_shapes():
    stop = np.zeros((1, 2, 0), np.int32)
    prep = Preprocessed.from_tensors({"INPUT_ID": np.array([[5, 6, 7, 0]], np.int32),
                                      "REQUEST_INPUT_LEN": np.array([[3]], np.int32),
                                      "REQUEST_OUTPUT_LEN": np.array([[9]], np.int32), "STOP_WORDS_IDS": stop})
    assert prep.n_input == 3 and prep.token_ids == [5, 6, 7]  # the padding is not a token
    assert prep.request_output_len.shape == (1, 1) and prep.stop_words is stop and prep.end_id is None
    with pytest.raises(KeyError):
        Preprocessed.from_tensors({"INPUT_ID": np.array([[1]])})


FRONT_PREP = {"INPUT_ID": [[5, 6, 7]], "REQUEST_INPUT_LEN": [[3]], "STOP_WORDS_IDS": [[[8, 9], [2, -1]]],
              "BAD_WORDS_IDS": [[[0], [-1]]], "REQUEST_OUTPUT_LEN": [[16]], "OUT_END_ID": [[2]], "OUT_PAD_ID": [[0]],
              "OUT_MIN_TOKENS": [[0]]}


def test_a_prompt_the_front_tokenized_is_taken_as_preprocessing_would_hand_it_on():
    prep = Preprocessed.from_front(FRONT_PREP, vocab_size=10)
    assert prep.n_input == 3 and prep.token_ids == [5, 6, 7]
    assert prep.stop_words.tolist() == [[[8, 9], [2, -1]]] and prep.stop_words.dtype == np.int32
    assert prep.request_output_len.tolist() == [[16]] and prep.end_id.tolist() == [[2]] and prep.pad_id.tolist() == [[0]]


@pytest.mark.parametrize("change", [
    {"INPUT_ID": [[5, 6, 10]]},  # past the vocabulary
    {"INPUT_ID": [[5, -6, 7]]},
    {"INPUT_ID": [[]], "REQUEST_INPUT_LEN": [[0]]},  # no prompt
    {"REQUEST_INPUT_LEN": [[2]]},  # a length that is not the prompt's
    {"INPUT_ID": [5, 6, 7]},  # not [1, n]
    {"OUT_END_ID": [[10]]},
    {"OUT_PAD_ID": [[-1]]},
    {"STOP_WORDS_IDS": [[8, 9], [2, -1]]},  # not [1, 2, k]
    {"BAD_WORDS_IDS": [[[12], [1]]]},
    {"INPUT_ID": [["five"]]},
    {"INPUT_ID": [[2 ** 40]]},
    {"OUT_END_ID": None},
])
def test_a_faulty_prep_from_the_front_is_refused_naming_the_lease(change):
    bad = {**FRONT_PREP, **change}
    if change == {"OUT_END_ID": None}:
        del bad["OUT_END_ID"]
    with pytest.raises(ServingError) as e:
        Preprocessed.from_front(bad, vocab_size=10)
    assert e.value.kind == "invalid_argument" and e.value.field == "lease"


def test_a_prep_from_the_front_is_held_to_preprocessings_cap_and_to_the_requests_max_tokens():
    from gateway.core import GatewayRequest
    from gateway.triton_backend import TritonBackend

    backend = TritonBackend(None, max_output_len=16)
    prep = Preprocessed.from_front(FRONT_PREP, vocab_size=10)  # made for max_tokens 16
    assert backend.prepared(GatewayRequest("k", 16, prepared=prep)) is prep
    with pytest.raises(ServingError, match="at most 16") as e:
        backend.prepared(GatewayRequest("k", 17, prepared=prep))
    assert e.value.field == "max_tokens"
    with pytest.raises(ServingError, match="another max_tokens") as e:
        backend.prepared(GatewayRequest("k", 8, prepared=prep))
    assert e.value.field == "lease"


def test_the_engine_call_of_a_prompt_the_front_tokenized_leaves_out_the_ids_it_came_with():
    from gateway.core import GatewayRequest
    from gateway.triton_backend import TritonBackend

    backend, prep = TritonBackend(None, vocab_size=10), Preprocessed.from_front(FRONT_PREP, vocab_size=10)
    theirs = backend.engine_call("m", GatewayRequest("k", 16, prepared=prep), prep, "acme")["inputs"]
    ours = backend.engine_call("m", GatewayRequest("k", 16), prep, "acme")["inputs"]
    assert ours["input_ids"] == [[5, 6, 7]] and "input_ids" not in theirs
    assert theirs == {k: v for k, v in ours.items() if k != "input_ids"} and theirs["input_lengths"] == [[3]]
