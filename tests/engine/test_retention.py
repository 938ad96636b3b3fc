"""KV retention priorities (cpu_engine/retention.py, TensorRT-LLM's retention inputs): a prefix sent with a
high priority outlives newer default prefixes when the pool evicts, until its duration ends; the inputs
are parsed and checked as upstream's backend does; the gateway sends them for session turns."""
import json
import time

import numpy as np
import pytest

from gateway.core import GatewayRequest
from gateway.edges import Preprocessed, Sampling
from gateway.sessions import SessionPolicy, kv_retention
from gateway.triton_backend import TritonBackend
from contracts.tensors import ENGINE
from contracts.errors import ServingError
from cpu_engine.retention import DEFAULT_PRIORITY, parse_retention
from cpu_engine.triton_contract import parse_engine_request
from tests.engine.conftest import run_all
from tests.engine.test_engine import greedy


def run_one(engine, rid, prompt, retention=None, salt=None):
    out = []
    engine.submit(rid, prompt, greedy(2), out.append, cache_salt=salt, retention=retention)
    while engine.has_work():
        engine.step()
    return out[-1]


def fill(engine):
    """A long request that takes every plain block and evicts two cached ones (pool of 16 blocks)."""
    pool = engine.kv_manager.pool
    run_all(engine, {"fill": (list(range(100, 100 + 4 * (pool.num_blocks - 2) - 3)), greedy(1), "x")})


def session_retention(priority=90, duration_ms=60_000):
    return parse_retention([0], [-1], [priority], [duration_ms], priority, duration_ms)


def test_a_prioritized_prefix_outlives_newer_default_ones(make_engine):
    engine = make_engine(enable_kv_cache_reuse=True, tokens_per_block=4, max_tokens_in_paged_kv_cache=64)
    session, other = list(range(1, 10)), list(range(50, 59))  # 2 full blocks each
    run_one(engine, "s", session, session_retention())
    run_one(engine, "o", other)  # newer: plain LRU would evict the session's blocks first
    fill(engine)
    assert run_one(engine, "s2", session).perf["kv_cache_reused_blocks"] == 2
    assert run_one(engine, "o2", other).perf["kv_cache_reused_blocks"] == 0
    engine.kv_manager.pool.check_invariants()


def test_the_priority_ends_with_its_duration(make_engine):
    engine = make_engine(enable_kv_cache_reuse=True, tokens_per_block=4, max_tokens_in_paged_kv_cache=64)
    session, other = list(range(1, 10)), list(range(50, 59))
    run_one(engine, "s", session, session_retention(duration_ms=1))
    run_one(engine, "o", other)
    time.sleep(0.01)
    fill(engine)  # the session's priority is over: least recently used goes first again
    assert run_one(engine, "s2", session).perf["kv_cache_reused_blocks"] == 0
    assert not engine.kv_manager.pool.priority_of or all(
        p == DEFAULT_PRIORITY for p in map(lambda b: engine.kv_manager.pool.priority(b, time.monotonic()),
                                           engine.kv_manager.pool.priority_of.copy()))


def test_retention_inputs_are_parsed_and_checked():
    def arrays(**v):
        base = {"input_ids": np.array([[1, 2, 3]]), "input_lengths": np.array([[3]]),
                "request_output_len": np.array([[4]])}
        return {**base, **{k: np.array([x]) for k, x in v.items()}}

    call = parse_engine_request(arrays(retention_token_range_starts=[0, 8], retention_token_range_ends=[8, -1],
                                       retention_token_range_priorities=[90, 50], retention_decode_priority=[70]))
    r = call.retention
    assert r.ranges == ((0, 8, 90, None), (8, None, 50, None)) and r.decode_priority == 70
    assert r.block_priority(0, 4, 20, 0.0) == (90, None) and r.block_priority(12, 16, 20, 0.0) == (50, None)
    assert r.block_priority(20, 24, 20, 0.0) == (70, None)
    assert parse_engine_request(arrays()).retention is None
    for bad, field in [({"retention_token_range_starts": [0]}, "retention_token_range_ends"),
                       ({"retention_token_range_starts": [0], "retention_token_range_ends": [-1],
                         "retention_token_range_priorities": [101]}, "retention_token_range_priorities"),
                       ({"retention_token_range_starts": [5], "retention_token_range_ends": [3],
                         "retention_token_range_priorities": [50]}, "retention_token_range_ends"),
                       ({"retention_decode_priority": [-1]}, "retention_decode_priority")]:
        with pytest.raises(ServingError) as e:
            parse_engine_request(arrays(**bad))
        assert e.value.field == field


def test_the_gateway_sends_a_session_turns_retention_in_the_engine_contract():
    policy = SessionPolicy(ttl_s=3600, kv_priority=85)
    req = GatewayRequest("k", 4, messages=json.dumps([{"role": "user", "content": "hi"}]),
                         sampling=Sampling(temperature=0.0), kv_retention=kv_retention(policy))
    prep = Preprocessed.from_tensors({"INPUT_ID": np.array([[1, 2, 3]], np.int32),
                                      "REQUEST_INPUT_LEN": np.array([[3]], np.int32),
                                      "REQUEST_OUTPUT_LEN": np.array([[4]], np.int32)})
    values = TritonBackend.engine_values(req, prep)
    as_lists = {k: v.reshape(-1).tolist() for k, v in values.items() if k.startswith("retention")}
    assert as_lists == {"retention_token_range_starts": [0], "retention_token_range_ends": [-1],
                        "retention_token_range_priorities": [85], "retention_token_range_durations_ms": [3_600_000],
                        "retention_decode_priority": [85], "retention_decode_duration_ms": [3_600_000]}
    assert all(ENGINE.input(k).optional for k in as_lists)
    # what the engine makes of them
    call = parse_engine_request({k: np.asarray(v) for k, v in values.items()})
    assert call.retention.block_priority(0, 32, 3, 0.0) == (85, 3600.0)
