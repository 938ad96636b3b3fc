"""Rendering: every template renders for every target, parses as a Triton ModelConfig, and matches
the contracts in contracts/tensors.py."""
import json

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from contracts import tensors
from build import render as R

DTYPES = {v: k for k, v in model_config_pb2.DataType.items()}


@pytest.fixture
def fake_checkpoint(tmp_path):
    ck = tmp_path / "ckpt"
    ck.mkdir()
    (ck / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    return ck


def parse(path):
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


@pytest.mark.parametrize("target", R.TARGETS)
def test_every_model_renders_and_matches_its_contract(tmp_path, fake_checkpoint, target):
    out = R.render(target, tmp_path / "repo", checkpoint=fake_checkpoint)
    for model in R.MODELS:
        cfg = parse(out / model / "config.pbtxt")
        contract = tensors.CONTRACTS[model]
        if (model, target) == ("tensorrt_llm", "trtllm"):  # only the tensors the C++ backend knows
            contract = R.upstream_engine_contract()
        assert [i.name for i in cfg.input] == contract.input_names
        assert [o.name for o in cfg.output] == contract.output_names
        for spec, got in zip(contract.inputs, cfg.input):
            assert DTYPES[got.data_type] == spec.data_type
            assert tuple(got.dims) == spec.dims
            assert got.optional == spec.optional
        assert (out / model / "1").is_dir()
        assert "${" not in (out / model / "config.pbtxt").read_text()


def test_cpu_engine_is_python_and_decoupled(tmp_path, fake_checkpoint):
    out = R.render("cpu", tmp_path / "repo", checkpoint=fake_checkpoint, overrides={"max_num_tokens": "256"})
    cfg = parse(out / "tensorrt_llm" / "config.pbtxt")
    assert cfg.backend == "python"
    assert cfg.model_transaction_policy.decoupled
    assert cfg.parameters["max_num_tokens"].string_value == "256"
    assert cfg.parameters["gpt_model_path"].string_value == str(fake_checkpoint)
    assert cfg.parameters["max_seq_len"].string_value == "2048"  # from the checkpoint
    assert (out / "tensorrt_llm" / "1" / "model.py").is_file()


def test_trtllm_engine_has_no_python_model(tmp_path, fake_checkpoint):
    out = R.render("trtllm", tmp_path / "repo", checkpoint=fake_checkpoint)
    cfg = parse(out / "tensorrt_llm" / "config.pbtxt")
    assert cfg.backend == "tensorrtllm"
    assert cfg.parameters["gpt_model_type"].string_value == "inflight_fused_batching"
    assert not (out / "tensorrt_llm" / "1" / "model.py").exists()
    assert (out / "preprocessing" / "1" / "model.py").is_file()


def test_ensemble_wiring_refers_to_real_tensors(tmp_path, fake_checkpoint):
    out = R.render("cpu", tmp_path / "repo", checkpoint=fake_checkpoint)
    cfg = parse(out / "ensemble" / "config.pbtxt")
    available = set(tensors.ENSEMBLE.input_names)
    produced = set()
    for step in cfg.ensemble_scheduling.step:
        contract = tensors.CONTRACTS["tensorrt_llm" if step.model_name == "tensorrt_llm" else step.model_name]
        for key, value in step.input_map.items():
            assert key in contract.input_names, (step.model_name, key)
            assert value in available, (step.model_name, value)
        for key, value in step.output_map.items():
            assert key in contract.output_names, (step.model_name, key)
            available.add(value)
            produced.add(value)
    # every ensemble output is produced by some step
    assert set(tensors.ENSEMBLE.output_names) <= produced


def test_unfilled_placeholder_fails(tmp_path, fake_checkpoint, monkeypatch):
    broken = tmp_path / "templates"
    for model in R.MODELS:
        (broken / model).mkdir(parents=True)
        (broken / model / "config.pbtxt").write_text((R.TEMPLATES / model / "config.pbtxt").read_text())
    cfg = broken / "preprocessing" / "config.pbtxt"
    cfg.write_text(cfg.read_text() + '\nparameters { key: "x" value: { string_value: "${not_a_knob}" } }\n')
    monkeypatch.setattr(R, "TEMPLATES", broken)
    with pytest.raises(R.RenderError, match="not_a_knob"):
        R.render("cpu", tmp_path / "repo", checkpoint=fake_checkpoint)
    assert not (tmp_path / "repo").exists()  # all or nothing


def test_unknown_knob_and_bad_config_are_rejected(tmp_path, fake_checkpoint):
    with pytest.raises(R.RenderError, match="unknown knob"):
        R.render("cpu", tmp_path / "r", {"max_num_tokenz": "1"}, checkpoint=fake_checkpoint)
    with pytest.raises(R.RenderError, match="does not parse"):
        R.render("cpu", tmp_path / "r", {"triton_max_batch_size": "sixty-four"}, checkpoint=fake_checkpoint)


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(R.RenderError, match="prepared checkpoint"):
        R.render("cpu", tmp_path / "r", checkpoint=tmp_path / "nope")


def test_cli_exit_codes(tmp_path, fake_checkpoint, capsys):
    assert R.main(["--target", "cpu", "--out", str(tmp_path / "r"), "--checkpoint", str(fake_checkpoint)]) == 0
    assert R.main(["--out", str(tmp_path / "r"), "--checkpoint", str(fake_checkpoint), "--set", "bogus"]) == 2
    assert "key=value" in capsys.readouterr().err


def test_extra_engine_models_render_from_the_same_template(tmp_path, fake_checkpoint):
    out = R.render("cpu", tmp_path / "repo", checkpoint=fake_checkpoint,
                   extra_engines={"tensorrt_llm_small": {"max_seq_len": "1024", "max_num_tokens": "128"}})
    small = parse(out / "tensorrt_llm_small" / "config.pbtxt")
    assert small.name == "tensorrt_llm_small" and small.backend == "python"
    assert small.parameters["max_seq_len"].string_value == "1024"
    assert parse(out / "tensorrt_llm" / "config.pbtxt").parameters["max_seq_len"].string_value == "2048"
    assert (out / "tensorrt_llm_small" / "1" / "model.py").is_file()
    with pytest.raises(R.RenderError, match="unknown knob"):
        R.render("cpu", tmp_path / "r2", checkpoint=fake_checkpoint, extra_engines={"x": {"bogus": "1"}})


def test_deploy_paths_are_for_the_gpu_target_only(tmp_path, fake_checkpoint):
    with pytest.raises(R.RenderError, match="trtllm target"):
        R.render("cpu", tmp_path / "r", checkpoint=fake_checkpoint, deploy="compose")
    with pytest.raises(R.RenderError, match="unknown deploy target"):
        R.render("trtllm", tmp_path / "r", checkpoint=fake_checkpoint, deploy="moon")
    out = R.render("trtllm", tmp_path / "r", checkpoint=fake_checkpoint, deploy="k8s")
    assert json.loads((out / "render.json").read_text())["deploy"] == "k8s"
    assert parse(out / "tensorrt_llm" / "config.pbtxt").parameters["gpt_model_path"].string_value == "/llm/engine"
    assert R.main(["--target", "trtllm", "--deploy", "compose", "--out", str(tmp_path / "c"),
                   "--checkpoint", str(fake_checkpoint)]) == 0
    assert parse(tmp_path / "c" / "preprocessing" / "config.pbtxt").parameters["tokenizer_dir"].string_value \
        == "/models/checkpoint"
