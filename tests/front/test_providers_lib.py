"""The front's upstream calls as a library: the body an upstream gets, the key's sources, and the tries of a
refused upstream (a real closed loopback port) with their full-jitter backoff."""
import asyncio

import pytest

from front.openai_schema import GatewayCall
from front.providers import UpstreamFailed, Upstreams, read_key, redact, upstream_body
from tests.support.server import free_port

ROUTE = {"name": "up", "base_url": "", "model": "their-model", "api_key_env": "P33_TEST_KEY",
         "api_key_file": None, "connect_timeout_s": 1.0, "first_byte_timeout_s": 2.0, "idle_timeout_s": 2.0,
         "max_retries": 3, "backoff_base_s": 0.1, "backoff_max_s": 0.3, "max_retry_after_s": 5.0}


def test_the_upstream_gets_openais_standard_fields_with_its_own_model_name():
    call = GatewayCall(max_tokens=7, messages=[{"role": "user", "content": "hi"}], stop=["\n"],
                       sampling={"temperature": 0.0, "top_p": 0.9, "seed": 3}, user="u-42")
    body = upstream_body("their-model", call)
    assert body == {"model": "their-model", "max_tokens": 7, "stream": True, "stream_options": {"include_usage": True},
                    "messages": [{"role": "user", "content": "hi"}], "temperature": 0.0, "top_p": 0.9, "seed": 3,
                    "stop": ["\n"], "user": "u-42"}
    assert upstream_body("m", GatewayCall(max_tokens=1, text="x"))["prompt"] == "x"


def test_the_key_comes_from_the_environment_or_a_file_and_is_redacted(tmp_path, monkeypatch):
    monkeypatch.setenv("P33_TEST_KEY", "sk-env")
    assert read_key(ROUTE) == "sk-env"
    path = tmp_path / "key"
    path.write_text("sk-file\n")
    assert read_key({**ROUTE, "api_key_env": None, "api_key_file": str(path)}) == "sk-file"
    assert redact("bad key sk-file given", "sk-file") == "bad key [redacted] given"


def test_a_refused_upstream_is_tried_max_retries_more_times_with_full_jitter_backoff(monkeypatch):
    monkeypatch.setenv("P33_TEST_KEY", "sk-env")
    slept = []

    async def sleep(s):
        slept.append(s)

    route = {**ROUTE, "base_url": f"http://127.0.0.1:{free_port()}/v1"}  # nothing listens there
    ups = Upstreams(rng=lambda: 1.0, sleep=sleep)  # the top of each jitter range
    with pytest.raises(UpstreamFailed) as e:
        asyncio.run(ups.open(route, GatewayCall(max_tokens=1, text="x"), 0.0))
    assert e.value.kinds == ["connect"] * 4 and "sk-env" not in e.value.message
    assert slept == pytest.approx([0.1, 0.2, 0.3])  # base * 2**try, capped at backoff_max_s


def test_a_missing_key_fails_at_once_without_a_try(monkeypatch):
    monkeypatch.delenv("P33_TEST_KEY", raising=False)
    with pytest.raises(UpstreamFailed) as e:
        asyncio.run(Upstreams().open({**ROUTE, "base_url": "http://127.0.0.1:9/v1"}, GatewayCall(max_tokens=1), 0.0))
    assert e.value.kinds == ["credentials"] and "P33_TEST_KEY is not set" in e.value.message
