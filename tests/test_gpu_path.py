"""The GPU path checked on the CPU: sizing math, the trtllm rendering, engine build and serve commands,
and the version manifest. (No GPU here: the commands are checked, not run; tests/gpu runs them.)"""
import json
import shlex

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from build import render, sizing, trtllm, versions

LLAMA_13B = {"hidden_size": 5120, "num_attention_heads": 40, "num_key_value_heads": 40, "num_hidden_layers": 40,
             "intermediate_size": 13824, "vocab_size": 32000}
LLAMA31_8B = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
              "intermediate_size": 14336, "vocab_size": 128256}


def test_kv_bytes_per_token_formula():
    s13 = sizing.ModelShape.from_hf_config(LLAMA_13B)
    assert sizing.kv_bytes_per_token(s13, "fp16") == 2 * 40 * 40 * 128 * 2 == 819_200
    s8 = sizing.ModelShape.from_hf_config(LLAMA31_8B)
    assert sizing.kv_bytes_per_token(s8, "fp8") == 2 * 32 * 8 * 128 * 1 == 65_536
    assert 12.5e9 < s13.params < 13.5e9 and 7.8e9 < s8.params < 8.2e9


def test_13b_fp16_on_80gb_h100():
    p = sizing.plan(sizing.ModelShape.from_hf_config(LLAMA_13B), 80, "fp16", "fp16", seq_len=4096, batch=64)
    assert 25 < p.weights_gb < 27
    assert p.tokens == int(p.kv_cache_gb * 1e9 // 819_200)
    assert p.blocks_per_sequence == 128 and not p.fits and 10 <= p.max_sequences <= 15


def test_llama31_8b_fp8_fits_far_more():
    p = sizing.plan(sizing.ModelShape.from_hf_config(LLAMA31_8B), 80, "fp8", "fp8", seq_len=8192, batch=64)
    assert p.fits and p.max_sequences >= 100


def test_sizing_cli_warns_when_the_batch_cannot_fit(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA_13B))
    assert sizing.main(["--config", str(cfg), "--weights", "fp16", "--kv", "fp16", "--seq-len", "4096",
                        "--batch", "64"]) == 1
    assert "cannot fit" in capsys.readouterr().err


def test_trtllm_render_sets_the_engine_fields(tmp_path, checkpoint):
    out = render.render("trtllm", tmp_path / "repo", checkpoint=checkpoint)
    cfg = text_format.Parse((out / "tensorrt_llm" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    assert cfg.backend == "tensorrtllm" and cfg.model_transaction_policy.decoupled
    assert params["gpt_model_type"] == "inflight_fused_batching"
    assert params["batch_scheduler_policy"] == "guaranteed_no_evict"
    assert params["kv_cache_free_gpu_mem_fraction"] == "0.9"
    assert params["enable_kv_cache_reuse"] == "true" and params["enable_chunked_context"] == "true"
    assert params["max_queue_size"] == "256" and params["exclude_input_in_output"] == "true"
    for key in ("encoder_input_features_data_type", "logits_datatype", "prompt_embedding_table_data_type"):
        assert params[key].startswith("TYPE_")
    # the same preprocessing / postprocessing / ensemble / gateway as on CPU
    cpu = render.render("cpu", tmp_path / "cpu", checkpoint=checkpoint)
    for model in ("preprocessing", "postprocessing", "ensemble", "gateway"):
        assert (out / model / "config.pbtxt").read_text() == (cpu / model / "config.pbtxt").read_text()


def test_build_commands_use_the_fp8_paged_flags(tmp_path):
    a = trtllm.BuildArgs(tmp_path / "ckpt", tmp_path / "engine", tp=2, calib_dataset="/data/cnn", calib_size=256)
    quantize, build = (shlex.split(c) for c in trtllm.build_commands(a))
    q = dict(zip(quantize[::1], quantize[1::1]))
    assert q["--qformat"] == "fp8" and q["--kv_cache_dtype"] == "fp8" and q["--calib_size"] == "256"
    assert q["--calib_dataset"] == "/calib" and q["--tp_size"] == "2"
    b = dict(zip(build, build[1:]))
    for flag, value in {"--kv_cache_type": "paged", "--use_paged_context_fmha": "enable",
                        "--use_fp8_context_fmha": "enable", "--gemm_plugin": "auto",
                        "--multiple_profiles": "enable", "--max_batch_size": "64", "--max_num_tokens": "8192",
                        "--max_input_len": "8192", "--max_seq_len": "16384", "--workers": "2"}.items():
        assert b[flag] == value, flag
    docker = trtllm.docker_run({tmp_path: "/ckpt"}, "true")
    assert versions.TRITON_IMAGE in docker and "--gpus" in docker and "--shm-size=2g" in docker


def test_serving_refuses_an_engine_of_another_version(tmp_path):
    with pytest.raises(trtllm.EngineMismatch, match="not found"):
        trtllm.check_engine(tmp_path)
    a = trtllm.BuildArgs(tmp_path / "ckpt", tmp_path)
    m = trtllm.manifest(a)
    (tmp_path / trtllm.MANIFEST).write_text(json.dumps(m))
    assert trtllm.check_engine(tmp_path)["tensorrt_llm_version"] == versions.TENSORRT_LLM_VERSION
    m["tensorrt_llm_version"] = "1.1.0"
    (tmp_path / trtllm.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(trtllm.EngineMismatch, match="1.1.0.*rebuild"):
        trtllm.check_engine(tmp_path)
    assert trtllm.main(["serve", "--checkpoint", str(tmp_path), "--engine", str(tmp_path),
                        "--repo", str(tmp_path / "repo")]) == 2


def test_serve_command_world_size_and_forwarding(tmp_path):
    one = trtllm.serve_command(tmp_path, tmp_path, tmp_path, 1)
    inner = one[-1]
    assert "mpirun" not in inner and "--http-header-forward-pattern=x-.*|authorization" in inner
    assert "--allow-gpu-metrics=true" in inner
    two = trtllm.serve_command(tmp_path, tmp_path, tmp_path, 2)[-1]
    assert two.startswith("mpirun --allow-run-as-root") and two.count("-n 1 ") == 2
    assert "prefix1_" in two and "--load-model=tensorrt_llm" in two
