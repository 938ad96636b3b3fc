"""Checkpoint formats, configuration parsing and validation, callback failures, BLAS tuning."""
import os

import numpy as np
import pytest

from cpu_engine import EngineConfig, LLMEngine, SamplingParams
from cpu_engine.checkpoint import load_checkpoint
from cpu_engine.config import ConfigError
from cpu_engine.sequence import PERF_FIELDS
from tests.engine.conftest import bf16_round, run_all, write_tiny_checkpoint


def greedy(n, **kw):
    return SamplingParams(max_new_tokens=n, temperature=0.0, **kw)


def test_bf16_and_fp16_sharded_checkpoints_load_exactly(tmp_path):
    f32 = load_checkpoint(write_tiny_checkpoint(tmp_path / "f32", tied=False), "float32")
    bf16 = load_checkpoint(write_tiny_checkpoint(tmp_path / "bf16", tied=False, dtype="BF16", shards=3), "float32")
    fp16 = load_checkpoint(write_tiny_checkpoint(tmp_path / "fp16", tied=False, dtype="F16", shards=2), "float32")
    assert (tmp_path / "bf16" / "model.safetensors.index.json").is_file()
    for loaded, rounding in ((bf16, bf16_round), (fp16, lambda a: a.astype(np.float16).astype(np.float32))):
        assert loaded.embed.dtype == np.float32 and loaded.embed.flags.c_contiguous
        np.testing.assert_array_equal(loaded.embed, rounding(f32.embed))
        np.testing.assert_array_equal(loaded.lm_head.f32, rounding(f32.lm_head.f32))
        np.testing.assert_array_equal(loaded.layers[1].wqkv.f32, rounding(f32.layers[1].wqkv.f32))
        np.testing.assert_array_equal(loaded.layers[0].w_down.f32, rounding(f32.layers[0].w_down.f32))


def test_bf16_checkpoint_serves_like_its_reference(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "bf16", dtype="BF16", shards=2)
    engine = LLMEngine(EngineConfig(str(folder), max_tokens_in_paged_kv_cache=512, tokens_per_block=4,
                                    max_num_tokens=8, weight_dtype="float32"))
    prompt = [5, 17, 33, 2, 9, 120, 77, 3, 1, 4, 200]
    got, final = run_all(engine, {"a": (prompt, greedy(6), None)})["a"]
    ids = list(prompt)
    for _ in range(6):
        ids.append(int(np.argmax(engine.model.forward_reference(ids)[-1])))
    assert got == ids[len(prompt):] and final.finish_reason == "length"


def test_explicit_head_dim(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "hd", hidden=64, heads=4, kv_heads=2, head_dim=32)
    engine = LLMEngine(EngineConfig(str(folder), max_tokens_in_paged_kv_cache=512, tokens_per_block=4,
                                    weight_dtype="float32"))
    assert engine.weights.config.head_dim == 32
    assert engine.weights.layers[0].wqkv.shape == ((4 + 2 * 2) * 32, 64)
    prompt = list(range(1, 14))
    got, _ = run_all(engine, {"a": (prompt, greedy(5), None)})["a"]
    ids = list(prompt)
    for _ in range(5):
        ids.append(int(np.argmax(engine.model.forward_reference(ids)[-1])))
    assert got == ids[len(prompt):]


def test_from_parameters_parses_triton_strings(tiny_dir):
    cfg = EngineConfig.from_parameters({
        "gpt_model_path": str(tiny_dir), "max_batch_size": "8", "enable_kv_cache_reuse": "false",
        "enable_chunked_context": "True", "batch_scheduler_policy": "max_utilization",
        "kv_cache_free_mem_fraction": "0.2", "max_tokens_in_paged_kv_cache": "${max_tokens_in_paged_kv_cache}",
        "num_threads": "1", "max_queue_size": "0", "some_other_key": "ignored"})
    assert cfg.checkpoint_dir == str(tiny_dir) and cfg.max_batch_size == 8
    assert cfg.enable_kv_cache_reuse is False and cfg.enable_chunked_context is True
    assert cfg.batch_scheduler_policy == "max_utilization" and cfg.kv_cache_free_mem_fraction == 0.2
    assert cfg.max_tokens_in_paged_kv_cache == EngineConfig(str(tiny_dir)).max_tokens_in_paged_kv_cache  # unset
    assert cfg.num_threads == 1 and cfg.max_queue_size == 0
    assert cfg.max_seq_len == 512  # min(max_position_embeddings, 8192)
    with pytest.raises(ConfigError, match="enable_kv_cache_reuse"):
        EngineConfig.from_parameters({"gpt_model_path": str(tiny_dir), "enable_kv_cache_reuse": "maybe"})


@pytest.mark.parametrize("field, value", [
    ("max_batch_size", 0), ("max_num_tokens", 0), ("tokens_per_block", 0), ("max_queue_size", -1),
    ("kv_cache_free_mem_fraction", 0.0), ("kv_cache_free_mem_fraction", 1.5),
    ("batch_scheduler_policy", "fifo"), ("num_threads", 0), ("max_tokens_in_paged_kv_cache", 1),
])
def test_config_errors_name_the_field(tiny_dir, field, value):
    with pytest.raises(ConfigError, match=field):
        EngineConfig(str(tiny_dir), **{field: value})
    with pytest.raises(ConfigError, match="checkpoint_dir"):
        EngineConfig("/nonexistent")


def test_a_raising_callback_cancels_only_its_request(make_engine):
    engine = make_engine()
    calls, good = [], []

    def bad(out):
        calls.append(out)
        raise RuntimeError("client handler bug")

    engine.submit("bad", list(range(10)), greedy(20), bad)
    engine.submit("good", list(range(20, 30)), greedy(20), good.append)
    for _ in range(200):
        if not engine.has_work():
            break
        engine.step()
    assert calls[-1].finished and calls[-1].finish_reason == "cancelled"
    assert sum(o.finished for o in calls) == 1
    assert good[-1].finished and good[-1].finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in good) == 20
    engine.kv_manager.pool.assert_consistent()
    assert engine.kv_manager.pool.num_used == 0


def test_outputs_carry_perf_fields_as_attributes(make_engine):
    engine = make_engine()
    out = engine.generate(list(range(12)), greedy(3))
    for name in PERF_FIELDS:
        assert getattr(out, name) == out.perf[name]
    assert out.kv_cache_alloc_total_blocks == out.kv_cache_alloc_new_blocks + out.kv_cache_reused_blocks
    assert out.arrival_time_ns <= out.first_scheduled_time_ns <= out.first_token_time_ns <= out.last_token_time_ns
    assert out.num_prompt_tokens == 12 and out.num_generated_tokens == 3


def test_blas_reports_its_kernels_and_sets_threads(make_engine):
    from cpu_engine import blas

    engine = make_engine(num_threads=1)
    assert engine.blas_core == blas.core_name()
    if os.environ.get("OPENBLAS_CORETYPE") and engine.blas_core:
        assert engine.blas_core.lower() == os.environ["OPENBLAS_CORETYPE"].lower()
    assert blas.set_num_threads(2) == (engine.blas_core is not None)
