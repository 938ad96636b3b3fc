"""NVIDIA's aiperf (0.13.0, its own venv: build/setup_aiperf.sh) against the front of the session's shared
stack: the client NVIDIA's users benchmark OpenAI-compatible servers with, on chat, completions and
responses, streamed and not. Each run is small (a few requests of a few tokens) and its figures are aiperf's
own export: every request succeeds, each asks for and gets exactly its output tokens (`ignore_eos`), the
streamed ones are timed token by token; the same against the ensemble (Triton's generate_stream), the
front's peer in benchmarks/aiperf.py. aiperf's per-chunk usage (vLLM's `continuous_usage_stats`) is
refused by name, not silently ignored."""
from pathlib import Path

import pytest

from benchmarks import aiperf

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

KEY = "k-loadtest"  # the shared stack's tenant "loadtest": limits that never throttle (tests/support/tenants.py)
REQUESTS, OUTPUT_TOKENS = 6, 12


@pytest.fixture(scope="module")
def stack(shared_stack):
    return shared_stack


def profile(stack, tmp_path: Path, endpoint: str, streaming: bool = True, extra=None):
    out = tmp_path / f"{endpoint}-{streaming}"
    url = stack.front_url if endpoint != "ensemble" else f"http://{stack.http_url}"
    args = aiperf.command(url, stack.stack.tokenizer_dir(), endpoint, concurrency=2, requests=REQUESTS,
                          input_tokens=24, output_tokens=OUTPUT_TOKENS, streaming=streaming, api_key=KEY,
                          artifact_dir=out, extra=extra)
    proc, export = aiperf.run(args, out, timeout_s=240)
    return proc, export, aiperf.records(out)


def test_aiperf_is_installed_by_the_projects_setup():
    assert aiperf.BINARY.is_file(), "run `bash build/setup_aiperf.sh` (make test runs it)"


@pytest.mark.parametrize("endpoint,streaming", [("chat", True), ("completions", True), ("responses", True),
                                                ("chat", False)])
def test_aiperf_profiles_the_front(stack, tmp_path, endpoint, streaming):
    proc, export, records = profile(stack, tmp_path, endpoint, streaming)
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0 and export is not None, log
    figures = aiperf.summary(export)
    assert figures["request_count"]["avg"] == REQUESTS, log
    assert figures["request_error_rate"]["avg"] == 0, log
    assert len(records) == REQUESTS and not any(r.get("error") for r in records), records[:1]
    if endpoint == "responses":
        # aiperf reads the usage only from `response.completed`; an answer cut by max_output_tokens ends
        # with `response.incomplete` (OpenAI's event, which carries it too), so aiperf counts the text
        osl = figures["output_sequence_length"]
        assert OUTPUT_TOKENS - 2 <= osl["min"] <= osl["max"] <= OUTPUT_TOKENS + 2, figures
    else:  # the server's own count: exactly the tokens each request asked for, ignore_eos honoured
        usage = figures["usage_completion_tokens"]
        assert usage["min"] == usage["max"] == OUTPUT_TOKENS, figures
    assert figures["output_token_throughput"]["avg"] > 0
    if streaming:  # timed token by token: a first token, then the gaps between the later ones
        assert figures["time_to_first_token"]["p50"] > 0 and figures["inter_token_latency"]["p50"] > 0, figures
        for r in records:
            gaps = r["metrics"]["inter_chunk_latency"]["value"]
            assert len(gaps) >= OUTPUT_TOKENS - 2, gaps  # the stream's chunks, not one body at the end


def test_aiperf_profiles_the_ensemble_the_fronts_peer(stack, tmp_path):
    """The same client against Triton's own generate_stream of `ensemble` (aiperf's template endpoint), the
    peer benchmarks/aiperf.py sets beside the front's completions: every request streams its tokens."""
    proc, export, records = profile(stack, tmp_path, "ensemble")
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0 and export is not None, log
    figures = aiperf.summary(export)
    assert figures["request_count"]["avg"] == REQUESTS and figures["request_error_rate"]["avg"] == 0, log
    assert len(records) == REQUESTS and not any(r.get("error") for r in records), records[:1]
    osl = figures["output_sequence_length"]  # no usage here: aiperf counts the text (min_tokens = max_tokens)
    assert OUTPUT_TOKENS - 2 <= osl["min"] <= osl["max"] <= OUTPUT_TOKENS + 2, figures
    for r in records:
        assert len(r["metrics"]["inter_chunk_latency"]["value"]) >= OUTPUT_TOKENS - 2


def test_aiperf_per_chunk_usage_is_refused_by_name(stack, tmp_path):
    """aiperf --per-chunk-usage sends stream_options.continuous_usage_stats (vLLM's): the front sends usage
    once, in the last chunk, so it refuses the option with a 400 naming it rather than ignore it."""
    proc, _, records = profile(stack, tmp_path, "chat", extra=["--use-server-token-count", "--per-chunk-usage"])
    assert records and all(r.get("error") for r in records), proc.stdout[-2000:]
    for r in records:
        assert r["error"]["code"] == 400 and "stream_options.continuous_usage_stats" in r["error"]["message"], r
