"""Without a server: the SSE parser the front's clients share (loadtest/sse.py), the peer client's key,
and the layered benchmark's bookkeeping (benchmarks/triton_bench.py: layer choice, the un-throttled
gateway config, per-layer ratios and added TTFT, the report's markdown)."""
import pytest
import yaml

from tests.load.fake_peer import TOKEN_DELAY_S, FakePeer

from benchmarks import triton_bench as tb
from gateway.tenants import parse_config
from loadtest.run import peer_stream
from loadtest.sse import StreamError, event_text, event_usage, parse_line


def test_sse_lines_of_completions_chat_and_llama_cpp():
    for quiet in (b"", b"\n", b": keep-alive", b"event: ping", b"data: [DONE]", "data: [DONE]\n"):
        assert parse_line(quiet) is None
    done = parse_line(b'data: {"choices": [{"index": 0, "text": " Paris", "finish_reason": null}]}\n')
    assert event_text(done) == " Paris" and event_usage(done) is None
    role = parse_line('data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}')
    assert event_text(role) == ""  # the first chat chunk carries no text: not the TTFT
    assert event_text(parse_line(b'data:{"choices":[{"delta":{"content":"Hi"}}]}')) == "Hi"
    assert event_text(parse_line(b'data: {"choices": [{"delta": {}, "finish_reason": "length"}]}')) == ""
    usage = parse_line(b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 8}}')
    assert event_text(usage) == "" and event_usage(usage)["completion_tokens"] == 8
    assert event_text(parse_line(b'data: {"content": " word", "stop": false}')) == " word"


def test_an_error_event_in_the_stream_raises_with_its_code():
    with pytest.raises(StreamError, match="slow down") as e:
        parse_line(b'data: {"error": {"message": "slow down", "type": "rate_limit_error", "code": "rate_limited"}}')
    assert e.value.code == "rate_limited"
    with pytest.raises(StreamError, match="boom"):
        parse_line(b'data: {"error": "boom"}')


def test_peer_stream_sends_the_key_to_an_openai_peer():
    with FakePeer() as peer:
        t = peer_stream(peer.url + "/v1", "hi", 3, api_key="sk-x")
        path, body = peer.httpd.requests[0]
        headers = {k.lower(): v for k, v in peer.httpd.headers[0].items()}
    assert t["text"] == " word" * 3 and path == "/v1/completions" and headers["authorization"] == "Bearer sk-x"
    assert body["min_tokens"] == body["max_tokens"] == 3 and body["ignore_eos"] is True


def test_layers_flag_keeps_the_stack_order_and_rejects_unknown_names():
    assert tb.parse_layers("front,ensemble") == ["ensemble", "front"]
    assert tb.parse_layers("ensemble,gateway,front") == ["ensemble", "gateway", "front"]
    assert tb.parse_layers("front,peer,ensemble") == ["peer", "ensemble", "front"]
    assert tb._below("ensemble", ["peer", "ensemble"]) == "peer"
    for bad in ("", "gateway,gateway", "ensemble,nginx", "peer"):
        with pytest.raises(ValueError):
            tb.parse_layers(bad)
    assert tb._below("front", ["ensemble", "gateway", "front"]) == "gateway"
    assert tb._below("front", ["ensemble", "front"]) == "ensemble" and tb._below("ensemble", ["ensemble"]) is None


def test_the_peer_layer_speaks_openai_completions_with_its_prompt_cache_off():
    timelines = []
    with FakePeer() as peer:
        row = tb.run_level_front(peer.url, None, ["a", "b", "c"], 2, timelines, None, 5, tb.PEER_BODY, "peer")
        bodies = [body for _, body in peer.httpd.requests]
    assert row["requests"] == 3 == len(timelines)
    # throughput: the 3 x 5 forced tokens over the span from the first send to the last receive
    span = max(t["end"] for t in timelines) - min(t["start"] for t in timelines)
    assert row["output_tok_s"] == pytest.approx(3 * 5 / span)
    # and under the peer's own ceiling: each of the 2 streams sends a token at most every TOKEN_DELAY_S
    assert row["output_tok_s"] <= 2 / TOKEN_DELAY_S
    assert all(b["cache_prompt"] is False and b["ignore_eos"] is True and b["max_tokens"] == 5 for b in bodies)


def test_the_peer_gets_a_ratio_but_no_added_ttft_and_no_constants_from_elsewhere():
    order = ["peer", "ensemble"]
    made = {"peer": _runs([50.0, 40.0, 60.0], 0.2), "ensemble": _runs([100.0, 90.0, 110.0], 0.05)}
    layers = tb.summarize_layers(order, {4: {n: made[n][0] for n in order}}, {4: {n: made[n][1] for n in order}}, 3)
    (lvl,) = layers["levels"]
    assert lvl["ratios"] == {"ensemble/peer": pytest.approx(2.0)} and lvl["ttft_p50_added_ms"] == {}
    base = {"date": "d", "machine": tb.machine(), "server_rss_mb": None, "front_rss_mb": None,
            "workload": {"layer": "ensemble", "endpoint": ""}, "levels": [made["ensemble"][0][0]]}
    assert "| n/a |" in tb.markdown({**base, "peer": None})  # never a peer figure from another machine
    assert "| 2.00x |" in tb.markdown({**base, "peer": {"4": {"tok_s": made["ensemble"][0][0]["output_tok_s"] / 2,
                                                              "ttft_p95": 0.2}}})


def test_bench_gateway_config_lets_the_key_in_with_limits_that_never_throttle(tmp_path):
    cfg = parse_config(yaml.safe_load(tb.bench_gateway_config(tmp_path / "gw.yaml", "sk-bench").read_text()))
    tenant = cfg.authenticate("sk-bench")
    assert tenant is not None and tenant.tier == "enterprise" and cfg.authenticate("sk-other") is None
    assert tenant.limits["max_concurrent"] >= 64 and tenant.limits["requests_per_minute"] >= 100_000
    assert tenant.limits["tokens_per_minute"] >= 100_000_000 and tenant.may_use(cfg.catalog["tensorrt_llm"])


def _runs(tok_s_by_round, ttft):
    """Hand-made runs of 4 requests of 8 tokens: each round's tok/s exact, every TTFT `ttft`."""
    runs, timelines = [], []
    for tok_s in tok_s_by_round:
        span = 4 * 8 / tok_s
        results = [{"start": 0.0, "end": span if i == 0 else span / 2, "ttft": ttft, "latency": span, "text": "x"}
                   for i in range(4)]
        runs.append(tb.level_row(results, 4, timelines, None, 8))
    return runs, timelines


def test_layer_summary_ratios_added_ttft_and_markdown():
    order = ["ensemble", "gateway", "front"]
    made = {"ensemble": _runs([100.0, 90.0, 110.0], 0.050), "gateway": _runs([99.0, 88.0, 104.5], 0.052),
            "front": _runs([95.0, 85.0, 100.0], 0.0555)}
    layers = tb.summarize_layers(order, {4: {n: made[n][0] for n in order}}, {4: {n: made[n][1] for n in order}}, 3)
    (lvl,) = layers["levels"]
    assert lvl["by_layer"]["ensemble"]["output_tok_s"] == pytest.approx(100.0)  # the median run
    assert lvl["by_layer"]["gateway"]["rounds_output_tok_s"] == [99.0, 88.0, 104.5]  # round order kept
    assert lvl["ratios"]["gateway/ensemble"] == pytest.approx(88 / 90)  # the median round, not 99 / 100
    assert lvl["ratios"]["front/gateway"] == pytest.approx(95.0 / 99.0)
    assert lvl["round_ratios"]["gateway/ensemble"] == pytest.approx([0.99, 88 / 90, 0.95])
    assert lvl["ttft_p50_added_ms"] == pytest.approx({"gateway": 2.0, "front": 3.5})
    assert lvl["by_layer"]["front"]["requests"] == 12 and lvl["by_layer"]["front"]["ttft_p95"] == pytest.approx(0.0555)
    report = {"date": "d", "machine": tb.machine(), "server_rss_mb": 2000.0, "front_rss_mb": 80.0, "layers": layers,
              "workload": {"layer": "ensemble", "endpoint": tb.LAYER_ENDPOINTS["ensemble"]},
              "levels": [{**made["ensemble"][0][0], "runs_output_tok_s": [90.0, 100.0, 110.0]}]}
    md = tb.markdown(report)
    assert "| streams | requests | output tok/s (median run) |" in md  # the earlier table is still first
    assert "## Layers" in md and "the front 80 MB" in md
    assert "| 4 | 100.0 | 99.0 | 95.0 | 0.978x | 0.960x | 50.0 / 52.0 / 55.5 |" in md
    assert md.rstrip().splitlines()[-1] == "| 4 | 100.0, 90.0, 110.0 | 99.0, 88.0, 104.5 | 95.0, 85.0, 100.0 | " \
                                           "0.990, 0.978, 0.950 | 0.960, 0.966, 0.957 |"
    assert "+2.0 | +3.5 |" in md
