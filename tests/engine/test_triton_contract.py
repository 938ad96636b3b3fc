"""The engine model's tensor handling: request parsing with TensorRT-LLM defaults, and response
assembly (streaming chunks on UTF-8 boundaries, non-streaming with or without the prompt)."""
import numpy as np
import pytest

from text.detokenize import Detokenizer
from cpu_engine.triton_contract import EngineCall, ResponseAssembler, parse_engine_request, stream_interval
from contracts.errors import ServingError
from cpu_engine import RequestOutput, SamplingParams


def arrays(**values):
    out = {}
    for k, v in values.items():
        out[k] = np.array(v)[None] if np.ndim(v) else np.array([[v]])
    return out


def test_parse_applies_trt_llm_defaults_and_word_lists():
    call = parse_engine_request(arrays(
        input_ids=[5, 6, 7, 0], input_lengths=3, request_output_len=4,
        stop_words_list=[[11, 12, 13], [2, 3, -1]], streaming=True))
    assert call.prompt_ids == [5, 6, 7] and call.streaming and call.exclude_input
    p = call.params
    assert p.max_new_tokens == 4 and p.temperature == 1.0 and p.greedy  # top_k = top_p = 0: greedy
    assert p.stop_words == [[11, 12], [13]] and p.bad_words == []
    assert parse_engine_request(arrays(stop=True)).stop


@pytest.mark.parametrize("bad, field", [
    (dict(request_output_len=0), "request_output_len"),
    (dict(input_lengths=9), "input_lengths"),
    (dict(runtime_top_p=1.5), "top_p"),
    (dict(runtime_top_k=-1), "top_k"),
    (dict(temperature=-0.5), "temperature"),
    (dict(min_tokens=-1), "min_tokens"),
])
def test_parse_rejects_bad_values_naming_the_field(bad, field):
    good = dict(input_ids=[1, 2], input_lengths=2, request_output_len=4)
    with pytest.raises(ServingError) as e:
        parse_engine_request(arrays(**{**good, **bad}))
    assert e.value.field == field and e.value.status == 400


def out(ids, finished=False, lps=None):
    return RequestOutput("r", ids, lps, sum(lps or []), finished, "length" if finished else None, None,
                         3, 0, {"kv_cache_reused_blocks": 2, "arrival_time_ns": 10})


def detok():
    table = [b""] * 10
    table[1], table[2], table[3], table[4] = b"a", "é".encode()[:1], "é".encode()[1:], b" b"
    return Detokenizer(table)


def test_streaming_waits_for_complete_characters():
    call = EngineCall([9, 9, 9], SamplingParams(5), streaming=True, return_perf=True)  # no log-probs asked
    asm = ResponseAssembler(call, detok())
    assert [a["output_ids"].tolist() for a, _ in asm.feed(out([1]))] == [[[[1]]]]
    assert asm.feed(out([2])) == []  # first byte of "é" alone: hold it
    (sent, final), = asm.feed(out([3, 4]))
    assert sent["output_ids"].tolist() == [[[2, 3, 4]]] and sent["sequence_length"].tolist() == [[3]]
    assert not final
    (sent, final), = asm.feed(out([], finished=True))
    assert final and sent["output_ids"].shape == (1, 1, 0)
    assert sent["kv_cache_reused_blocks"].tolist() == [[2]] and sent["arrival_time_ns"].dtype == np.int64
    assert "output_log_probs" not in sent


def test_non_streaming_sends_once_with_or_without_the_prompt():
    call = EngineCall([7, 8], SamplingParams(5, return_log_probs=True), exclude_input=False,
                      return_log_probs=True)
    asm = ResponseAssembler(call)
    assert asm.feed(out([1], lps=[-0.5])) == []
    (sent, final), = asm.feed(out([4], finished=True, lps=[-0.25]))
    assert final and sent["output_ids"].tolist() == [[[7, 8, 1, 4]]]
    assert sent["output_log_probs"].tolist() == [[[0.0, 0.0, -0.5, -0.25]]]
    assert "kv_cache_reused_blocks" not in sent  # perf outputs travel only when asked for


def test_stream_interval_sends_the_first_token_at_once_then_every_n():
    call = EngineCall([9], SamplingParams(8), streaming=True)
    asm = ResponseAssembler(call, stream_interval=3)
    sent = [asm.feed(out([t])) for t in (1, 4, 1, 4, 1, 4)]
    chunks = [[a["output_ids"].reshape(-1).tolist() for a, _ in s] for s in sent]
    assert chunks == [[[1]], [], [], [[4, 1, 4]], [], []]  # TTFT unchanged, then 3 tokens a response
    (last, final), = asm.feed(out([], finished=True))
    assert final and last["output_ids"].reshape(-1).tolist() == [1, 4]  # the rest rides on the final one


@pytest.mark.parametrize("raw, ok", [("1", 1), ("", 1), ("4", 4), ("0", None), ("-2", None), ("two", None)])
def test_stream_interval_parameter(raw, ok):
    if ok is None:
        with pytest.raises(ValueError, match="stream_interval"):
            stream_interval(raw)
    else:
        assert stream_interval(raw) == ok


def test_lookahead_inputs_are_passed_on_by_name_and_perf_outputs_carry_acceptance():
    good = dict(input_ids=[1, 2], input_lengths=2, request_output_len=4)
    assert parse_engine_request(arrays(**good)).lookahead is None
    call = parse_engine_request(arrays(**good, lookahead_ngram_size=4, lookahead_verification_set_size=1))
    assert call.lookahead == {"lookahead_ngram_size": 4, "lookahead_verification_set_size": 1}
    call = parse_engine_request(arrays(**good, return_perf_metrics=True))
    perf = {"kv_cache_alloc_new_blocks": 1, "kv_cache_reused_blocks": 0, "kv_cache_alloc_total_blocks": 1,
            "arrival_time_ns": 1, "first_scheduled_time_ns": 2, "first_token_time_ns": 3, "last_token_time_ns": 4,
            "acceptance_rate": 0.75, "total_accepted_draft_tokens": 6, "total_draft_tokens": 8}
    out = RequestOutput("r", [5], None, 0.0, True, "length", None, 2, 1, perf)
    (tensors, final), = ResponseAssembler(call).feed(out)
    assert final and tensors["acceptance_rate"].dtype == np.float32 and float(tensors["acceptance_rate"][0, 0]) == 0.75
    assert int(tensors["total_draft_tokens"][0, 0]) == 8 and int(tensors["total_accepted_draft_tokens"][0, 0]) == 6


def test_n_sequences_stream_with_their_index_and_only_the_last_end_is_final():
    call = parse_engine_request(arrays(input_ids=[1, 2], input_lengths=2, request_output_len=4, streaming=True,
                                       num_return_sequences=2, return_log_probs=True))
    asm = ResponseAssembler(call, None)

    def seq(index, ids, finished=False, ends=False):
        return RequestOutput("r", ids, [-0.5] * len(ids), 0.0, finished, "length" if finished else None, None,
                             2, 0, {}, sequence_index=index, request_finished=ends)

    (a, final), = asm.feed(seq(1, [7]))
    assert a["sequence_index"].tolist() == [[1]] and a["output_ids"].tolist() == [[[7]]] and not final
    assert a["output_log_probs"].tolist() == [[[-0.5]]]
    assert asm.feed(seq(1, [], finished=True)) == []  # sequence 1 ended, sequence 0 goes on: nothing final
    (b, final), = asm.feed(seq(0, [9], finished=True, ends=True))
    assert b["sequence_index"].tolist() == [[0]] and final
    assert asm.feed(seq(1, [5])) == []  # after the final response nothing more goes out


def test_context_logits_go_out_once_with_their_sequence():
    call = parse_engine_request(arrays(input_ids=[1, 2, 3], input_lengths=3, request_output_len=1,
                                       return_context_logits=True))
    asm = ResponseAssembler(call, None)
    logits = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = RequestOutput("r", [5], None, 0.0, True, "length", None, 3, 1, {}, context_logits=logits)
    (a, final), = asm.feed(out)
    assert final and a["context_logits"].shape == (1, 3, 4) and a["context_logits"][0].tolist() == logits.tolist()
