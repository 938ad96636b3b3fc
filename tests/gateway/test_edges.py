"""The gateway's typed edges: what they carry to the engine call."""
import numpy as np
import pytest

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
