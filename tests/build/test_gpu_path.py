"""The GPU path checked on the CPU: the trtllm rendering held against NVIDIA's upstream facts
(build/upstream/tensorrt_llm_backend.json: every parameter key, tensor names and dtypes, the queue
policy), the version pins against the compatibility matrix, the engine manifest and the serve-time
version check, the build and serve commands, and the sizing math. (No GPU here: the commands are
checked, not run; tests/gpu runs them.)"""
import json
import os
import shlex
import sys
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from build import engine_admission, lookahead, render, trtllm, trtllm_quantize, versions
from clients import sizing
from build.triton_flags import ADMIN_HEADER, RESTRICTED_APIS

ROOT = Path(__file__).resolve().parents[2]
FACTS = json.loads((ROOT / "build" / "upstream" / "tensorrt_llm_backend.json").read_text())
UPSTREAM = FACTS["tensorrt_llm_model"]
DTYPES = {v: k for k, v in model_config_pb2.DataType.items()}

LLAMA_13B = {"hidden_size": 5120, "num_attention_heads": 40, "num_key_value_heads": 40, "num_hidden_layers": 40,
             "intermediate_size": 13824, "vocab_size": 32000}
LLAMA31_8B = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
              "intermediate_size": 14336, "vocab_size": 128256}
LLAMA31_70B = {"hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8, "num_hidden_layers": 80,
               "intermediate_size": 28672, "vocab_size": 128256}


@pytest.fixture
def ckpt(tmp_path):
    """A checkpoint folder with Llama-3.1-8B's config (the engine's 8192 cap applies)."""
    ck = tmp_path / "ckpt"
    ck.mkdir()
    (ck / "config.json").write_text(json.dumps({**LLAMA31_8B, "max_position_embeddings": 131072}))
    return ck


def parse(path):
    return text_format.Parse(Path(path).read_text(), model_config_pb2.ModelConfig())


def engine_config(tmp_path, ckpt, overrides=None, deploy=None):
    out = render.render("trtllm", tmp_path / "repo", overrides, checkpoint=ckpt, deploy=deploy)
    return parse(out / "tensorrt_llm" / "config.pbtxt")


# --- the facts file itself ---------------------------------------------------------------------
def test_upstream_facts_name_their_source_and_commit():
    for name, src in FACTS["sources"].items():
        assert src.get("commit") or src.get("url"), name
        if "commit" in src:
            assert src["repo"] and src["path"] and len(src["commit"]) >= 7, name
    for section in ("tensorrt_llm_model", "quantization", "containers", "self_built_image", "llmapi_model",
                    "triton_cli"):
        assert FACTS[section]["source"] in FACTS["sources"], section
    for fact in FACTS["backend_behaviour"].values():
        assert fact["source"] in FACTS["sources"]
    keys = [p["key"] for p in UPSTREAM["parameters"]]
    assert len(keys) == len(set(keys)) == 46
    assert len(UPSTREAM["inputs"]) == 62 and len(UPSTREAM["outputs"]) == 21


# --- finding 1: every upstream parameter key, tensors and dtypes --------------------------------
def _parses_as(kind: str, value: str) -> bool:
    if kind == "int":
        return value.lstrip("-").isdigit()
    if kind == "float":
        try:
            float(value)
            return True
        except ValueError:
            return False
    if kind == "bool":
        return value in ("true", "false", "True", "False", "TRUE", "FALSE", "1", "0")
    if kind == "int_list":
        return all(v.strip().lstrip("-").isdigit() for v in value.split(","))
    if kind.startswith("enum:"):
        return value in kind[5:].split("|")
    return True  # string, path


def test_trtllm_engine_renders_every_upstream_parameter_key(tmp_path, ckpt):
    cfg = engine_config(tmp_path, ckpt)
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    upstream = {p["key"]: p for p in UPSTREAM["parameters"]}
    # exactly upstream's keys, in upstream's order (nothing the backend ignores, nothing missing)
    assert list(render.ENGINE_PARAMETERS["trtllm"]) == [p["key"] for p in UPSTREAM["parameters"]]
    assert set(params) == set(upstream)
    for key, fact in upstream.items():
        value = params[key]
        if fact["read"] == "fixed":
            assert value == fact["template_value"], key
        if fact["read"] in ("required", "must_exist"):
            assert value, f"{key}: the backend has no default for it"
        if value:
            assert _parses_as(fact["parsed_as"], value), (key, value, fact["parsed_as"])
    # the three keys the backend reads with no fallback while building the executor config
    for key in ("tokenizer_dir", "xgrammar_tokenizer_info_path", "guided_decoding_backend"):
        assert upstream[key]["read"] == "no_fallback" and key in params
    assert params["gpt_model_type"] == "inflight_fused_batching"
    assert params["batch_scheduler_policy"] == "guaranteed_no_evict"
    assert params["kv_cache_free_gpu_mem_fraction"] == "0.9"
    assert params["enable_chunked_context"] == "true" and params["exclude_input_in_output"] == "true"
    assert cfg.backend == "tensorrtllm" and cfg.model_transaction_policy.decoupled
    assert [(g.count, g.kind) for g in cfg.instance_group] == [(1, model_config_pb2.ModelInstanceGroup.KIND_CPU)]


def test_trtllm_engine_tensors_match_upstream_names_dtypes_and_shapes(tmp_path, ckpt):
    cfg = engine_config(tmp_path, ckpt)
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    values = {**render.COMMON, **render.TARGET_DEFAULTS["trtllm"], **params}

    def dtype(fact):  # placeholders such as ${logits_datatype} resolve to the rendered knob
        t = fact["data_type"]
        return values[t[2:-1]] if t.startswith("${") else t

    for rendered, facts in ((cfg.input, UPSTREAM["inputs"]), (cfg.output, UPSTREAM["outputs"])):
        by_name = {f["name"]: f for f in facts}
        for t in rendered:
            assert t.name in by_name, f"{t.name} is not a tensor of upstream's tensorrt_llm model"
            f = by_name[t.name]
            assert DTYPES[t.data_type] == dtype(f), t.name
            assert list(t.dims) == f["dims"], t.name
            if rendered is cfg.input:
                assert t.optional == f["optional"], t.name
                assert t.allow_ragged_batch == f.get("allow_ragged_batch", False), t.name
                assert (list(t.reshape.shape) if t.HasField("reshape") else None) == f.get("reshape"), t.name
    required = {f["name"] for f in UPSTREAM["inputs"] if not f["optional"]}
    assert required == {"input_lengths", "request_output_len"}
    assert required <= {t.name for t in cfg.input if not t.optional}
    for key in ("encoder_input_features_data_type", "logits_datatype", "prompt_embedding_table_data_type"):
        assert values[key] in model_config_pb2.DataType.keys()


def test_gpu_engine_declares_only_tensors_the_backend_reads(tmp_path, ckpt):
    from contracts import tensors

    upstream_inputs = {f["name"] for f in UPSTREAM["inputs"]}
    gpu = engine_config(tmp_path, ckpt)
    cpu = parse(render.render("cpu", tmp_path / "cpu", checkpoint=ckpt) / "tensorrt_llm" / "config.pbtxt")
    gpu_inputs, cpu_inputs = {t.name for t in gpu.input}, {t.name for t in cpu.input}
    for t in tensors.CONTRACTS["tensorrt_llm"].inputs:
        assert (t.name in gpu_inputs) == (t.name in upstream_inputs), t.name  # project-only names: CPU only
        assert t.name in cpu_inputs, t.name
    # the ensemble feeds the GPU engine only tensors it declares
    ensemble = parse(render.render("trtllm", tmp_path / "gpu", checkpoint=ckpt) / "ensemble" / "config.pbtxt")
    for step in ensemble.ensemble_scheduling.step:
        if step.model_name == "tensorrt_llm":
            assert set(step.input_map) <= gpu_inputs
            assert set(step.output_map) <= {t.name for t in gpu.output}


def test_other_models_render_the_same_on_both_targets(tmp_path, checkpoint):
    gpu = render.render("trtllm", tmp_path / "gpu", checkpoint=checkpoint)
    cpu = render.render("cpu", tmp_path / "cpu", checkpoint=checkpoint)
    for model in ("preprocessing", "postprocessing", "ensemble"):
        assert (gpu / model / "config.pbtxt").read_text() == (cpu / model / "config.pbtxt").read_text()
    # the gateway differs only in its admission bounds, which come from each target's engine
    bounds = ('key: "max_inflight"', 'key: "max_queue"')
    gateway = [[line for line in (out / "gateway" / "config.pbtxt").read_text().splitlines()
                if not line.startswith(tuple("parameters { " + b for b in bounds))] for out in (gpu, cpu)]
    assert gateway[0] == gateway[1]
    same = {"gateway_max_inflight": "64", "gateway_max_queue": "1024"}
    assert (render.render("trtllm", tmp_path / "g2", same, checkpoint=checkpoint) / "gateway" / "config.pbtxt") \
        .read_text() == (cpu / "gateway" / "config.pbtxt").read_text()


# --- finding 3: the queue bound is the dynamic_batching queue policy ----------------------------
def test_queue_bound_is_rendered_where_the_backend_reads_it(tmp_path, ckpt):
    assert "dynamic_batching.default_queue_policy.max_queue_size" in \
        FACTS["backend_behaviour"]["max_queue_size"]["fact"]
    cfg = engine_config(tmp_path, ckpt, {"max_queue_size": "17"})
    assert cfg.HasField("dynamic_batching")
    assert cfg.dynamic_batching.default_queue_policy.max_queue_size == 17
    assert list(cfg.dynamic_batching.preferred_batch_size) == [int(render.COMMON["triton_max_batch_size"])]
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 0
    assert "max_queue_size" not in cfg.parameters  # a parameter of that name is ignored by the C++ backend
    # the CPU engine model reads its bound from its parameter, as before
    cpu = render.render("cpu", tmp_path / "cpu", {"max_queue_size": "17"}, checkpoint=ckpt)
    cpu_cfg = parse(cpu / "tensorrt_llm" / "config.pbtxt")
    assert cpu_cfg.parameters["max_queue_size"].string_value == "17" and not cpu_cfg.HasField("dynamic_batching")


# --- finding 6: no cross-tenant prefix reuse on the GPU by default ------------------------------
def test_gpu_prefix_reuse_is_off_because_the_backend_ignores_cache_salt(tmp_path, ckpt):
    assert "no cache salt" in FACTS["backend_behaviour"]["request_parameters"]["fact"]
    assert "defaults to true" in FACTS["backend_behaviour"]["kv_reuse_default"]["fact"]  # so it must be rendered
    cfg = engine_config(tmp_path, ckpt)
    assert cfg.parameters["enable_kv_cache_reuse"].string_value == "false"
    # single-tenant deployments may opt back in
    assert engine_config(tmp_path, ckpt, {"enable_kv_cache_reuse": "true"}) \
        .parameters["enable_kv_cache_reuse"].string_value == "true"
    cpu = parse(render.render("cpu", tmp_path / "cpu", checkpoint=ckpt) / "tensorrt_llm" / "config.pbtxt")
    assert cpu.parameters["enable_kv_cache_reuse"].string_value == "true"  # the CPU engine salts per tenant
    doc = (ROOT / "docs" / "gpu.md").read_text()
    assert "## Tenant isolation" in doc and "enable_kv_cache_reuse" in doc


# --- finding 2: pins, the manifest and the serve-time check -------------------------------------
def test_version_pins_match_nvidias_compatibility_matrix():
    row = FACTS["containers"][versions.TRITON_IMAGE]
    assert versions.TENSORRT_LLM_VERSION == row["tensorrt_llm"] == "1.1.0"
    assert versions.TENSORRT_VERSION == row["tensorrt"]
    assert row["cuda"].startswith(versions.CUDA_VERSION)
    assert versions.MIN_DRIVER_VERSION == row["min_driver"]
    assert FACTS["self_built_image"]["tensorrt_llm"] != versions.TENSORRT_LLM_VERSION  # 1.2.1 is not this image
    for doc in ("README.md", "docs/gpu.md"):
        text = (ROOT / doc).read_text()
        assert f"TensorRT-LLM {versions.TENSORRT_LLM_VERSION}" in text, doc
        assert "TensorRT-LLM 1.2.1 engine" not in text and "Pinned in one place (`build/versions.py`): " \
            "TensorRT-LLM 1.2.1" not in text, doc


PROBE_OUTPUT = """[TensorRT-LLM] TensorRT-LLM version: 1.1.0
some banner
TRTLLM_PROBE_JSON={"tensorrt_llm_version": "1.1.0", "tensorrt_version": "10.13.3.9", "gpus": [{"name": "NVIDIA H100 80GB HBM3", "compute_cap": "9.0", "driver": "580.95.05"}]}
"""


def _built_engine(tmp_path, **container):
    probe = {**trtllm.parse_probe(PROBE_OUTPUT), **container}
    m = trtllm.manifest(trtllm.BuildArgs(tmp_path / "ckpt", tmp_path), probe, "nvcr.io/x@sha256:aaa")
    (tmp_path / trtllm.MANIFEST).write_text(json.dumps(m))
    return m


def test_manifest_records_what_the_container_reports(tmp_path):
    probe = trtllm.parse_probe(PROBE_OUTPUT)
    assert probe["tensorrt_llm_version"] == "1.1.0" and probe["gpus"][0]["compute_cap"] == "9.0"
    m = _built_engine(tmp_path)
    assert m["container"]["tensorrt_llm_version"] == "1.1.0" and m["container"]["tensorrt_version"] == "10.13.3.9"
    assert m["container"]["image_digest"] == "nvcr.io/x@sha256:aaa"
    assert m["container"]["gpus"][0]["name"] == "NVIDIA H100 80GB HBM3"
    with pytest.raises(trtllm.EngineMismatch, match="no versions"):
        trtllm.parse_probe("a banner only\n")
    # the build step runs the probe in the build container and keeps its output next to the engine
    steps = trtllm.build_commands(trtllm.BuildArgs(tmp_path, tmp_path))
    assert steps[-1].endswith(f"> /engine/{trtllm.PROBE_FILE}") and "tensorrt_llm.__version__" in steps[-1]


def test_probe_runs_and_reports_the_containers_versions(tmp_path):
    """The probe's own code, run against stand-ins for the image's modules and nvidia-smi."""
    import os
    import subprocess

    (tmp_path / "tensorrt.py").write_text("__version__ = '10.13.3.9'\n")
    (tmp_path / "tensorrt_llm.py").write_text("print('[TensorRT-LLM] TensorRT-LLM version: 1.1.0')\n"
                                              "__version__ = '1.1.0'\n")
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 9.0, 580.95.05'\n")
    smi.chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    (tmp_path / "python3").symlink_to(sys.executable)
    inner = trtllm.docker_run({}, shlex.join(trtllm.probe_command()))[-1]  # what the container's bash -lc runs
    out = subprocess.run(["bash", "-c", inner], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert trtllm.parse_probe(out.stdout) == {
        "tensorrt_llm_version": "1.1.0", "tensorrt_version": "10.13.3.9",
        "gpus": [{"name": "NVIDIA H100 80GB HBM3", "compute_cap": "9.0", "driver": "580.95.05"}]}


def test_image_digest_comes_from_docker_inspect():
    class Out:
        def __init__(self, rc, stdout):
            self.returncode, self.stdout = rc, stdout

    assert trtllm.image_digest(run=lambda *a, **k: Out(0, '["nvcr.io/nvidia/t@sha256:abc"] sha256:id\n')) == \
        "nvcr.io/nvidia/t@sha256:abc"
    assert trtllm.image_digest(run=lambda *a, **k: Out(0, "[] sha256:id\n")) == "sha256:id"
    assert trtllm.image_digest(run=lambda *a, **k: Out(1, "")) is None


def test_serving_refuses_an_engine_the_serving_container_cannot_load(tmp_path):
    with pytest.raises(trtllm.EngineMismatch, match="not found"):
        trtllm.check_engine(tmp_path)
    (tmp_path / trtllm.MANIFEST).write_text(json.dumps({"tensorrt_llm_version": "1.1.0", "image": "x"}))
    with pytest.raises(trtllm.EngineMismatch, match="no container probe"):
        trtllm.check_engine(tmp_path)  # the old manifest format: pins compared with themselves
    _built_engine(tmp_path)
    serving = {**trtllm.parse_probe(PROBE_OUTPUT), "image_digest": "nvcr.io/x@sha256:aaa"}
    assert trtllm.check_engine(tmp_path, serving)["warnings"] == []
    for change, match in (({"tensorrt_llm_version": "1.2.1"}, "TensorRT-LLM 1.2.1"),
                          ({"tensorrt_version": "10.14.1.48"}, "TensorRT 10.14.1.48"),
                          ({"image_digest": "nvcr.io/x@sha256:bbb"}, "tag moved"),
                          ({"gpus": [{"name": "NVIDIA A100", "compute_cap": "8.0"}]}, "compute capability")):
        with pytest.raises(trtllm.EngineMismatch, match=match):
            trtllm.check_engine(tmp_path, {**serving, **change})
    warned = trtllm.check_engine(tmp_path, {**serving, "gpus": [{"name": "NVIDIA H200", "compute_cap": "9.0"}]})
    assert "H200" in warned["warnings"][0]
    _built_engine(tmp_path, tensorrt_llm_version="1.2.1")  # built by another version than the pin
    with pytest.raises(trtllm.EngineMismatch, match="pins 1.1.0"):
        trtllm.check_engine(tmp_path)


def test_serve_refuses_before_starting_anything(tmp_path, ckpt, monkeypatch, capsys):
    _built_engine(tmp_path)
    started = []
    monkeypatch.setattr(trtllm, "probe_serving_container",
                        lambda: {**trtllm.parse_probe(PROBE_OUTPUT), "tensorrt_llm_version": "1.2.1"})
    monkeypatch.setattr(trtllm, "_run", lambda cmd, dry: started.append(cmd))
    assert trtllm.main(["serve", "--checkpoint", str(ckpt), "--engine", str(tmp_path),
                        "--repo", str(tmp_path / "repo")]) == 2
    assert started == [] and "refusing to serve" in capsys.readouterr().err
    monkeypatch.setattr(trtllm, "probe_serving_container",
                        lambda: {**trtllm.parse_probe(PROBE_OUTPUT), "image_digest": "nvcr.io/x@sha256:aaa"})
    monkeypatch.setattr(trtllm, "front_command", lambda *a: [sys.executable, "-c", "import time; time.sleep(60)"])
    assert trtllm.main(["serve", "--checkpoint", str(ckpt), "--engine", str(tmp_path),
                        "--repo", str(tmp_path / "repo")]) == 0
    assert len(started) == 1 and started[0][0] == "docker"


def test_serve_starts_the_front_as_the_public_door_beside_the_container(tmp_path, ckpt, capsys, monkeypatch):
    monkeypatch.delenv("LLM_FRONT_KEY", raising=False)
    assert trtllm.main(["serve", "--checkpoint", str(ckpt), "--engine", str(tmp_path), "--repo",
                        str(tmp_path / "repo"), "--dry-run", "--front-host", "0.0.0.0", "--front-port", "9100",
                        "--grpc-port", "8101"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("$ ")]
    front = next(i for i, line in enumerate(lines) if " -m front " in line)
    docker = next(i for i, line in enumerate(lines) if line.startswith("$ docker run") and "--name" in line)
    assert front < docker
    assert "--host 0.0.0.0 --port 9100 --triton-grpc 127.0.0.1:8101" in lines[front]
    assert "-p 127.0.0.1:8101:8101" in lines[docker]  # Triton's ports stay on this machine's loopback
    # its own streams from the engine: the checkpoint's tokenizer, and a key for its leases drawn for this start,
    # which the container gets by name from this environment and which is never printed
    assert f"--tokenizer-dir {ckpt}" in lines[front] and "-e LLM_FRONT_KEY " in lines[docker]
    key = os.environ["LLM_FRONT_KEY"]
    assert len(key) >= 24 and not any(key in line for line in lines)


# --- finding 7: the build and serve defaults, calibration data, the quantize step ---------------
def test_build_defaults_agree_with_the_rendered_cap(tmp_path, ckpt, capsys):
    a = trtllm.BuildArgs(ckpt, tmp_path)
    rendered = render.resolve_values("trtllm", {}, ckpt)["max_seq_len"]
    assert a.max_seq_len == int(rendered) == 8192 and a.max_input_len <= a.max_seq_len
    overrides, warnings = trtllm.serve_plan({"max_seq_len": a.max_seq_len}, ckpt)
    assert warnings == [] and overrides == {"max_seq_len": "8192"}
    # an engine built shorter than the checkpoint allows caps the repository, with a warning
    overrides, warnings = trtllm.serve_plan({"max_seq_len": 4096}, ckpt)
    assert overrides == {"max_seq_len": "4096"} and "4096" in warnings[0]
    # serve with the defaults and a default-built engine prints no warning and renders the engine's cap
    (tmp_path / "engine").mkdir()
    _built_engine(tmp_path / "engine")
    assert trtllm.main(["serve", "--checkpoint", str(ckpt), "--engine", str(tmp_path / "engine"),
                        "--repo", str(tmp_path / "repo"), "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert "warning" not in err and "fits" in err
    assert parse(tmp_path / "repo" / "preprocessing" / "config.pbtxt").parameters["max_seq_len"].string_value == "8192"


def test_build_commands_use_the_fp8_paged_flags_and_recognised_calibration_data(tmp_path):
    a = trtllm.BuildArgs(tmp_path / "ckpt", tmp_path / "engine", tp=2, calib_dataset="/data/cnn", calib_size=256)
    quantize, build, _ = (shlex.split(c) for c in trtllm.build_commands(a))
    q = dict(zip(quantize, quantize[1:]))
    assert q["--qformat"] == "fp8" and q["--kv_cache_dtype"] == "fp8" and q["--calib_size"] == "256"
    assert q["--tp_size"] == "2"
    # quantize.py treats a path as CNN/DailyMail only if it contains "cnn_dailymail"
    assert "containing 'cnn_dailymail'" in FACTS["quantization"]["calib_dataset_match"]
    assert "cnn_dailymail" in q["--calib_dataset"]
    mounts = trtllm.build_mounts(a)
    assert mounts[Path("/data/cnn")] == q["--calib_dataset"]
    # NGC's image has no examples/ folder: the quantize step is this project's shim, mounted with it
    assert quantize[1] == "/project/build/trtllm_quantize.py" and mounts[trtllm.ROOT] == "/project"
    assert shlex.split(trtllm.build_commands(trtllm.BuildArgs(tmp_path, tmp_path, trtllm_dir="/src/trtllm"))[0])[1] \
        == "/src/trtllm/examples/quantization/quantize.py"
    b = dict(zip(build, build[1:]))
    for flag, value in {"--kv_cache_type": "paged", "--use_paged_context_fmha": "enable",
                        "--use_fp8_context_fmha": "enable", "--gemm_plugin": "auto",
                        "--multiple_profiles": "enable", "--max_batch_size": "64", "--max_num_tokens": "8192",
                        "--max_input_len": "8192", "--max_seq_len": "8192", "--workers": "2"}.items():
        assert b[flag] == value, flag
    docker = trtllm.docker_run({tmp_path: "/ckpt"}, "true")
    assert versions.TRITON_IMAGE in docker and "--gpus" in docker and "--shm-size=2g" in docker


def test_quantize_shim_passes_only_the_keywords_the_installed_version_takes():
    seen = {}

    def quantize_and_export(*, model_dir, output_dir, qformat, kv_cache_dtype, calib_dataset, seed,
                            quantize_lm_head=False):
        seen.update(locals())

    options = trtllm_quantize.parse(["--model_dir", "/ckpt", "--output_dir", "/out", "--calib_dataset",
                                     "/calib/cnn_dailymail"])
    trtllm_quantize.call_with_known_keywords(quantize_and_export, options)
    assert seen["model_dir"] == "/ckpt" and seen["qformat"] == "fp8" and seen["kv_cache_dtype"] == "fp8"
    assert seen["quantize_lm_head"] is False and seen["calib_dataset"] == "/calib/cnn_dailymail"

    def newer(*, model_dir, something_new):
        pass

    with pytest.raises(SystemExit, match="something_new"):
        trtllm_quantize.call_with_known_keywords(newer, options)


def test_quantize_shim_runs_as_the_build_container_runs_it(tmp_path):
    """build/trtllm_quantize.py as a script, against a stand-in for the wheel's quantize_and_export."""
    import os
    import subprocess

    pkg = tmp_path / "tensorrt_llm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "quantization.py").write_text(
        "import json, os\n"
        "def quantize_and_export(*, model_dir, output_dir, dtype, qformat, kv_cache_dtype, calib_dataset, calib_size,\n"
        "                        tp_size, pp_size, device, seed, quantize_lm_head=False):\n"
        "    json.dump(dict(locals()), open(os.environ['SEEN'], 'w'))\n")
    quantize = shlex.split(trtllm.build_commands(trtllm.BuildArgs(tmp_path, tmp_path, calib_dataset="/d"))[0])
    assert quantize[1] == "/project/build/trtllm_quantize.py"
    seen = tmp_path / "seen.json"
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "SEEN": str(seen)}
    out = subprocess.run([sys.executable, str(ROOT / "build" / "trtllm_quantize.py"), *quantize[2:]],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(seen.read_text())
    assert got["qformat"] == "fp8" and got["kv_cache_dtype"] == "fp8" and got["model_dir"] == "/ckpt"
    assert got["calib_dataset"] == trtllm.CALIB_MOUNT and got["output_dir"] == "/engine/ckpt-fp8"
    assert got["calib_size"] == 512 and got["tp_size"] == 1 and got["quantize_lm_head"] is False


def test_the_gpu_tests_fit_their_own_timeouts_and_use_this_interpreter():
    sys.path.insert(0, str(ROOT))
    from tests.gpu import conftest as gpu, test_gpu_lora as lora, test_gpu_smoke as smoke

    for module in (smoke, lora):
        timeout = next(m.args[0] for m in module.pytestmark if m.name == "timeout")
        assert gpu.BUILD_TIMEOUT_S + gpu.READY_TIMEOUT_S + module.CHECKS_BUDGET_S < timeout, module.__name__
    assert gpu.PYTHON == sys.executable
    for name in ("conftest.py", "test_gpu_smoke.py", "test_gpu_lora.py"):
        src = (ROOT / "tests" / "gpu" / name).read_text()
        assert '"python"' not in src and "'python'" not in src, name


def test_serve_command_world_size_forwarding_and_loopback(tmp_path):
    one = trtllm.serve_command(tmp_path, tmp_path, tmp_path, 1, admin_key="k")
    inner = one[-1]
    assert "mpirun" not in inner and "--http-header-forward-pattern=x-.*|authorization" in inner
    assert "--allow-gpu-metrics=true" in inner and "--model-repository=/repo" in inner
    assert f"--http-restricted-api={RESTRICTED_APIS}:{ADMIN_HEADER}=k" in inner
    assert f"--grpc-restricted-protocol={RESTRICTED_APIS}:{ADMIN_HEADER}=k" in inner
    assert "model-repository" in RESTRICTED_APIS and "logging" in RESTRICTED_APIS
    assert one[one.index("-w") + 1] == "/project"  # the models import the project's packages from the working directory too
    published = [one[i + 1] for i, a in enumerate(one) if a == "-p"]
    assert published and all(p.startswith("127.0.0.1:") for p in published)
    two = trtllm.serve_command(tmp_path, tmp_path, tmp_path, 2)[-1]
    assert two.startswith("mpirun --allow-run-as-root") and two.count("-n 1 ") == 2
    assert "prefix1_" in two and "--load-model=tensorrt_llm" in two
    assert "admin-key=***" in trtllm.redact(shlex.join(one)) and "admin-key=k" not in trtllm.redact(shlex.join(one))


# --- finding 8: sizing ------------------------------------------------------------------------
def test_kv_bytes_per_token_formula():
    s13 = sizing.ModelShape.from_hf_config(LLAMA_13B)
    assert sizing.kv_bytes_per_token(s13, "fp16") == 2 * 40 * 40 * 128 * 2 == 819_200
    s8 = sizing.ModelShape.from_hf_config(LLAMA31_8B)
    assert sizing.kv_bytes_per_token(s8, "fp8") == 2 * 32 * 8 * 128 * 1 == 65_536
    s70 = sizing.ModelShape.from_hf_config(LLAMA31_70B)
    assert sizing.kv_bytes_per_token(s70, "fp8", tp=4) == 2 * 80 * 2 * 128 * 1 == 40_960
    assert 12.5e9 < s13.params < 13.5e9 and 7.8e9 < s8.params < 8.2e9 and 70e9 < s70.params < 71e9


def test_13b_fp16_on_80gb_h100():
    p = sizing.plan(sizing.ModelShape.from_hf_config(LLAMA_13B), 80, "fp16", "fp16", seq_len=4096, batch=64)
    assert 25 < p.weights_gb < 27
    assert p.tokens == int(p.kv_cache_gb * 1e9 // 819_200)
    assert p.blocks_per_sequence == 128 and not p.fits and 10 <= p.max_sequences <= 15


def test_fp8_keeps_embedding_and_lm_head_in_bf16():
    assert "lm_head stays unquantized" in FACTS["quantization"]["lm_head"]
    s8 = sizing.ModelShape.from_hf_config(LLAMA31_8B)
    p = sizing.plan(s8, trtllm.H100_80GB_BYTES / 1e9, "fp8", "fp8", seq_len=8192, batch=64)
    assert 9.0 < p.weights_gb < 9.2  # not 8.0: 1.05 B embedding + LM head parameters stay at 2 bytes
    assert p.fits and p.max_sequences == 124
    assert sizing.plan(s8, 85.5, "fp8", "fp8", 8192, 64, quantize_lm_head=True).weights_gb < p.weights_gb
    s70 = sizing.ModelShape.from_hf_config(LLAMA31_70B)
    p70 = sizing.plan(s70, 85.5, "fp8", "fp8", seq_len=8192, batch=64, tp=4)
    assert 19.5 < p70.weights_gb < 20.0 and p70.max_sequences == 171
    doc = (ROOT / "docs" / "sizing.md").read_text()
    for shape, tp in ((s8, 1), (s70, 4)):
        line = sizing.plan(shape, 85.5, "fp8", "fp8", 8192, 64, tp=tp).describe(8192, 64)
        assert line in doc, line  # the worked examples are the tool's own output


def test_sizing_cli_warns_when_the_batch_cannot_fit(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA_13B))
    assert sizing.main(["--config", str(cfg), "--weights", "fp16", "--kv", "fp16", "--seq-len", "4096",
                        "--batch", "64"]) == 1
    assert "cannot fit" in capsys.readouterr().err


# --- LoRA on the GPU path (issue 20) -------------------------------------------------------------
LORA = FACTS["lora"]


def test_lora_facts_name_their_source():
    assert LORA["source"] in FACTS["sources"] and LORA["build"]["source"] in FACTS["sources"]


def test_build_enables_the_lora_plugin_with_upstream_module_names(tmp_path):
    a = trtllm.BuildArgs(tmp_path / "ckpt", tmp_path / "engine", max_lora_rank=32,
                         lora_target_modules=trtllm.parse_lora_modules("all"))
    build = shlex.split(trtllm.build_commands(a)[1])
    i = build.index("--lora_target_modules")
    modules = build[i + 1: build.index("--max_lora_rank")]
    # every HF module maps to the name upstream's converter gives it, each a flag trtllm-build knows
    assert modules == [LORA["hf_to_trtllm_modules"][f"{m}_proj"] for m in trtllm.ALL_LORA_MODULES]
    for flag in ("--lora_target_modules", "--max_lora_rank"):
        assert flag in LORA["build"]["flags"]
    assert build[build.index("--lora_plugin") + 1] == "auto" and build[build.index("--max_lora_rank") + 1] == "32"
    assert "--lora_plugin" in LORA["build"]["lora_plugin"]
    plain = shlex.split(trtllm.build_commands(trtllm.BuildArgs(tmp_path, tmp_path, lora_target_modules=()))[1])
    assert not any(f.startswith("--lora") or f == "--max_lora_rank" for f in plain)
    assert trtllm.parse_lora_modules("q_proj, v") == ("q", "v") and trtllm.parse_lora_modules("none") == ()
    with pytest.raises(SystemExit, match="qkv"):
        trtllm.parse_lora_modules("qkv")
    assert trtllm.BuildArgs.max_lora_rank == LORA["build"]["max_lora_rank_default"]


def test_lora_convert_runs_upstreams_converter_on_each_adapter(tmp_path, capsys):
    for name in ("demo-a", "demo-b"):
        (tmp_path / "loras" / name).mkdir(parents=True)
        (tmp_path / "loras" / name / "adapter_config.json").write_text("{}")
    (tmp_path / "loras" / "not-an-adapter").mkdir()
    mounts, commands = trtllm.lora_convert_commands(tmp_path / "loras", "/src/trtllm")
    assert mounts[tmp_path / "loras"] == "/loras"
    args = LORA["convert_args"]
    for name, cmd in zip(("demo-a", "demo-b"), commands):
        c = shlex.split(cmd)
        assert c[1] == "/src/trtllm/examples/" + FACTS["sources"]["hf_lora_convert"]["path"].split("/")[-1]
        assert c[c.index(args["input"]) + 1] == c[c.index(args["output"]) + 1] == f"/loras/{name}"
        assert c[c.index(args["storage_type"]) + 1] == "float16" in args["storage_types"]
    assert len(commands) == 2
    assert trtllm.main(["lora-convert", "--adapters", str(tmp_path / "loras"), "--trtllm-dir", "/src/trtllm",
                        "--dry-run"]) == 0
    printed = capsys.readouterr()
    assert printed.out.count("hf_lora_convert.py") + printed.err.count("hf_lora_convert.py") == 2


def test_the_gateway_sends_what_the_converter_writes(tmp_path):
    """The file names the gateway looks for are the converter's outputs, and the engine declares the
    three LoRA inputs with upstream's names, types and shapes."""
    from gateway.engine_limits import EngineLimits

    folder = tmp_path / "demo"
    folder.mkdir()
    for f in LORA["convert_outputs"].values():
        (folder / f).write_bytes(b"")
    assert EngineLimits(lora_dir=str(tmp_path)).converted_lora("demo") is not None
    facts = {f["name"]: f for f in UPSTREAM["inputs"]}
    cfg = engine_config(tmp_path, _ckpt(tmp_path))
    rendered = {t.name: t for t in cfg.input}
    for name in ("lora_task_id", "lora_weights", "lora_config"):
        assert name in rendered and DTYPES[rendered[name].data_type] == facts[name]["data_type"], name
        assert list(rendered[name].dims) == facts[name]["dims"], name
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    for key in ("lora_cache_optimal_adapter_size", "lora_cache_max_adapter_size", "lora_cache_gpu_memory_fraction",
                "lora_cache_host_memory_bytes"):
        assert key in params and key in {p["key"] for p in UPSTREAM["parameters"]}, key
    assert render.render("trtllm", tmp_path / "r2", {"lora_cache_max_adapter_size": "128"}, checkpoint=_ckpt(tmp_path))


def _ckpt(tmp_path):
    ck = tmp_path / "ck"
    if not ck.exists():
        ck.mkdir()
        (ck / "config.json").write_text(json.dumps({**LLAMA31_8B, "max_position_embeddings": 131072}))
    return ck


def test_the_gpu_lora_tests_demo_keys_are_the_example_tenants_with_and_without_the_adapter():
    """tests/gpu/test_gpu_lora.py asks with two demo keys of deploy/gateway.example.yaml: they must still
    belong to a tenant allowed demo-support and to one that is not."""
    import yaml

    from gateway.tenants import hash_key
    from tests.gpu.test_gpu_lora import ALLOWED, OTHER

    tenants = yaml.safe_load((ROOT / "deploy" / "gateway.example.yaml").read_text())["tenants"]
    owner = {k: t for t in tenants.values() for k in t["api_key_sha256"]}
    assert "demo-support" in owner[hash_key(ALLOWED)].get("allowed_adapters", [])
    assert "demo-support" not in owner[hash_key(OTHER)].get("allowed_adapters", [])


def test_serve_with_a_lora_dir_mounts_it_read_only_where_lora_dir_is_rendered(tmp_path):
    from build import deploy_targets

    cmd = trtllm.serve_command(tmp_path / "engine", tmp_path / "repo", tmp_path, 1, lora_dir=tmp_path / "loras")
    assert f"{(tmp_path / 'loras').resolve()}:{deploy_targets.LORA_DIR}:ro" in cmd
    assert not any(deploy_targets.LORA_DIR in a for a in trtllm.serve_command(tmp_path, tmp_path, tmp_path, 1))
    # lora-convert writes the .npy files into the folder that serve then mounts at the same path
    (tmp_path / "loras" / "demo").mkdir(parents=True)
    (tmp_path / "loras" / "demo" / "adapter_config.json").write_text("{}")
    mounts, _ = trtllm.lora_convert_commands(tmp_path / "loras", "/trtllm")
    assert mounts[tmp_path / "loras"] == deploy_targets.LORA_DIR


# --- the gateway's admission bounds from the engine (issue 28, item 4) ----------------------------
ENGINE_FACTS = FACTS["engine_config"]


def _engine_dir(tmp_path, name="engine", max_batch_size=64, max_seq_len=8192, tokens_per_block=32, tp=1,
                dtype="bfloat16", quant_algo="FP8", kv_cache_quant_algo="FP8"):
    """An engine folder whose config.json has the layout trtllm-build writes (build/upstream facts,
    engine_config.fields): only the fields that admission reads, at the paths the runtime reads them."""
    cfg = {"version": versions.TENSORRT_LLM_VERSION}
    for field, value in {"max_batch_size": max_batch_size, "max_seq_len": max_seq_len,
                         "tokens_per_block": tokens_per_block, "tp_size": tp, "pp_size": 1, "dtype": dtype,
                         "quant_algo": quant_algo, "kv_cache_quant_algo": kv_cache_quant_algo}.items():
        *parents, leaf = ENGINE_FACTS["fields"][field].split(".")
        node = cfg
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    engine = tmp_path / name
    engine.mkdir()
    (engine / "config.json").write_text(json.dumps(cfg))
    return engine


def _gateway(out):
    params = parse(out / "gateway" / "config.pbtxt").parameters
    return int(params["max_inflight"].string_value), int(params["max_queue"].string_value)


def _admission(out):
    return json.loads((out / "render.json").read_text())["admission"]


def test_engine_config_facts_name_their_source():
    for key in ("source", "written_by", "quant_algo_source"):
        assert ENGINE_FACTS[key] in FACTS["sources"], key
    assert ENGINE_FACTS["fields"]["max_batch_size"] == "build_config.max_batch_size"
    assert "'version'" in ENGINE_FACTS["layout"] and "build_config" in ENGINE_FACTS["layout"]
    # the backend never narrows the engine's batch: the executor runs max_batch_size sequences at once
    assert "maxBatchSize std::nullopt" in FACTS["backend_behaviour"]["max_batch_size"]["fact"]
    assert set(render.ENGINE_PARAMETERS["trtllm"]).isdisjoint({"max_batch_size", "max_engine_batch_size"})


def test_gateway_admission_is_the_engines_max_batch_size(tmp_path, ckpt):
    """An engine built for 64 sequences (Llama-3.1-8B FP8 on an H100 80GB: 124 fit at 8192, docs/sizing.md)
    renders 64 slots and 16 queue places per slot, on every GPU deploy target."""
    engine = _engine_dir(tmp_path)
    out = render.render("trtllm", tmp_path / "repo", checkpoint=ckpt, engine_dir=engine)
    assert _gateway(out) == (64, 64 * engine_admission.QUEUE_PER_SLOT) == (64, 1024)
    a = _admission(out)
    assert a["engine_max_batch_size"] == 64 and a["kv_sequences"] == 124 and a["warnings"] == []
    assert a["engine"].endswith("config.json build_config.max_batch_size")
    for deploy in ("docker", "compose", "k8s"):
        assert _gateway(render.render("trtllm", tmp_path / deploy, checkpoint=ckpt, engine_dir=engine,
                                      deploy=deploy)) == (64, 1024), deploy
    # the CPU target by the same rule, from its own engine's batch
    cpu = render.render("cpu", tmp_path / "cpu", checkpoint=ckpt)
    assert _gateway(cpu) == (64, 1024) and _admission(cpu)["from"] == "the CPU engine's max_engine_batch_size"


def test_gateway_admission_is_bounded_by_what_the_kv_cache_holds(tmp_path, ckpt):
    # 128 sequences built, 124 fit at 8192 on an H100 80GB: the KV cache is the bound
    big = _engine_dir(tmp_path, "big", max_batch_size=128)
    out = render.render("trtllm", tmp_path / "r1", checkpoint=ckpt, engine_dir=big)
    assert _gateway(out) == (124, 124 * 16) and _admission(out)["from"] == "KV cache at max_seq_len"
    plan = sizing.plan(sizing.ModelShape.from_hf_config(LLAMA31_8B), 40, "fp8", "fp8", 8192, 128)
    assert _gateway(render.render("trtllm", tmp_path / "r2", checkpoint=ckpt, engine_dir=big, gpu_mem_gb=40))[0] \
        == plan.max_sequences < 64
    # a hard cap on the cache: 262,144 tokens = 8,192 blocks of 32 = 32 sequences of 256 blocks
    capped = render.render("trtllm", tmp_path / "r3", {"max_tokens_in_paged_kv_cache": "262144"}, checkpoint=ckpt,
                           engine_dir=big)
    assert _gateway(capped) == (32, 512)
    # a shorter engine holds more sequences of its own length: 4096 tokens -> 249 fit, 128 built
    short = _engine_dir(tmp_path, "short", max_batch_size=128, max_seq_len=4096)
    assert _gateway(render.render("trtllm", tmp_path / "r4", checkpoint=ckpt, engine_dir=short))[0] == 128
    # 70B over four GPUs (per-GPU plan, docs/sizing.md): 171 sequences of 8192 fit, 256 built
    ck70 = tmp_path / "ck70"
    ck70.mkdir()
    (ck70 / "config.json").write_text(json.dumps({**LLAMA31_70B, "max_position_embeddings": 131072}))
    e70 = _engine_dir(tmp_path, "e70", max_batch_size=256, tp=4)
    assert _gateway(render.render("trtllm", tmp_path / "r5", checkpoint=ck70, engine_dir=e70))[0] == 171
    # the 13B FP16 example of docs/sizing.md: 15 sequences of 4,096 tokens fit, 64 built
    ck13 = tmp_path / "ck13"
    ck13.mkdir()
    (ck13 / "config.json").write_text(json.dumps({**LLAMA_13B, "max_position_embeddings": 4096}))
    e13 = _engine_dir(tmp_path, "e13", max_seq_len=4096, dtype="float16", quant_algo=None, kv_cache_quant_algo=None)
    assert _gateway(render.render("trtllm", tmp_path / "r7", checkpoint=ck13, engine_dir=e13)) == (15, 240)
    # a quantization the arithmetic does not know leaves the KV bound unknown, never guessed
    odd = _engine_dir(tmp_path, "odd", max_batch_size=128, quant_algo="W4A16_AWQ")
    out = render.render("trtllm", tmp_path / "r6", checkpoint=ckpt, engine_dir=odd)
    assert _gateway(out)[0] == 128 and _admission(out)["kv_sequences"] is None


def test_an_explicit_admission_bound_wins(tmp_path, ckpt):
    engine = _engine_dir(tmp_path)
    out = render.render("trtllm", tmp_path / "r1", {"gateway_max_inflight": "24"}, checkpoint=ckpt, engine_dir=engine)
    assert _gateway(out) == (24, 24 * 16) and _admission(out)["from"] == "explicit"
    out = render.render("trtllm", tmp_path / "r2", {"gateway_max_queue": "10"}, checkpoint=ckpt, engine_dir=engine)
    assert _gateway(out) == (64, 10)
    out = render.render("trtllm", tmp_path / "r3", {"gateway_max_inflight": "100"}, checkpoint=ckpt, engine_dir=engine)
    assert _gateway(out)[0] == 100 and "more than the engine's max_batch_size 64" in _admission(out)["warnings"][0]
    with pytest.raises(render.RenderError, match="positive integer"):
        render.render("trtllm", tmp_path / "r4", {"gateway_max_inflight": "lots"}, checkpoint=ckpt, engine_dir=engine)
    # CPU: the CPU engine's batch, 16 queued per slot; an explicit value wins there too (a warning above the batch)
    assert _gateway(render.render("cpu", tmp_path / "c0", checkpoint=ckpt)) == (64, 1024)
    assert _gateway(render.render("cpu", tmp_path / "c1", {"max_engine_batch_size": "8"}, checkpoint=ckpt)) == (8, 128)
    out = render.render("cpu", tmp_path / "c2", {"max_engine_batch_size": "8", "gateway_max_inflight": "12"},
                        checkpoint=ckpt)
    assert _gateway(out) == (12, 192) and "more than the engine's max_batch_size 8" in _admission(out)["warnings"][0]
    with pytest.raises(render.RenderError, match="max_engine_batch_size must be a positive integer"):
        render.render("cpu", tmp_path / "c3", {"max_engine_batch_size": "0"}, checkpoint=ckpt)


def test_a_missing_engine_is_an_error_or_the_documented_build_default(tmp_path, ckpt, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(render.RenderError, match="neither config.json .* nor manifest.json"):
        render.render("trtllm", tmp_path / "r", checkpoint=ckpt, engine_dir=empty)
    assert render.main(["--target", "trtllm", "--out", str(tmp_path / "r"), "--checkpoint", str(ckpt),
                        "--engine-dir", str(empty)]) == 2
    assert "neither config.json" in capsys.readouterr().err
    # no engine named (a cluster render whose engine lives on a volume): build/trtllm.py build's default,
    # said in render.json and on the command line
    assert trtllm.BuildArgs.max_batch_size == engine_admission.BUILD_MAX_BATCH_SIZE == 64
    assert render.main(["--target", "trtllm", "--deploy", "k8s", "--out", str(tmp_path / "k"),
                        "--checkpoint", str(ckpt)]) == 0
    err = capsys.readouterr().err
    assert "warning: no engine read (the trtllm-build output folder: render.py --engine-dir" in err and "gateway_max_inflight 64" in err
    a = _admission(tmp_path / "k")
    assert a["engine"] is None and "no engine read" in a["from"] and _gateway(tmp_path / "k") == (64, 1024)
    # with --engine-dir the command line names the engine's value and where it came from
    engine = _engine_dir(tmp_path, max_batch_size=48)
    assert render.main(["--target", "trtllm", "--deploy", "compose", "--out", str(tmp_path / "c"),
                        "--checkpoint", str(ckpt), "--engine-dir", str(engine)]) == 0
    err = capsys.readouterr().err
    assert "warning" not in err and "gateway_max_inflight 48, gateway_max_queue 768 (engine max_batch_size" in err
    assert render.main(["--target", "cpu", "--out", str(tmp_path / "x"), "--checkpoint", str(ckpt),
                        "--engine-dir", str(engine)]) == 2


def test_the_engine_config_wins_over_the_manifest(tmp_path, ckpt):
    """build/trtllm.py build's manifest records what it gave trtllm-build; the engine's own config.json
    (what the runtime reads) wins where both exist."""
    engine = tmp_path / "engine"
    engine.mkdir()
    m = trtllm.manifest(trtllm.BuildArgs(ckpt, engine, max_batch_size=32), trtllm.parse_probe(PROBE_OUTPUT), None)
    (engine / trtllm.MANIFEST).write_text(json.dumps(m))
    out = render.render("trtllm", tmp_path / "r1", checkpoint=ckpt, engine_dir=engine)
    assert _gateway(out) == (32, 512) and _admission(out)["engine"].endswith("manifest.json build.max_batch_size")
    (engine / "config.json").write_text((_engine_dir(tmp_path, "real", max_batch_size=40) / "config.json").read_text())
    assert _gateway(render.render("trtllm", tmp_path / "r2", checkpoint=ckpt, engine_dir=engine)) == (40, 640)
    # without --deploy, a gpt_model_path that is a folder on this machine is the engine read
    assert _gateway(render.render("trtllm", tmp_path / "r3", {"gpt_model_path": str(engine)}, checkpoint=ckpt)) \
        == (40, 640)


def test_serve_renders_the_admission_of_the_engine_it_serves(tmp_path, ckpt, capsys):
    engine = tmp_path / "engine"
    engine.mkdir()
    m = trtllm.manifest(trtllm.BuildArgs(ckpt, engine, max_batch_size=32), trtllm.parse_probe(PROBE_OUTPUT), None)
    (engine / trtllm.MANIFEST).write_text(json.dumps(m))
    assert trtllm.main(["serve", "--checkpoint", str(ckpt), "--engine", str(engine), "--repo", str(tmp_path / "repo"),
                        "--dry-run"]) == 0
    assert _gateway(tmp_path / "repo") == (32, 512)
    assert "[trtllm] admission: gateway_max_inflight 32, gateway_max_queue 512" in capsys.readouterr().err
    # an engine not built yet (a dry run): the build default, with the warning
    assert trtllm.main(["serve", "--checkpoint", str(ckpt), "--engine", str(tmp_path / "none"), "--repo",
                        str(tmp_path / "repo2"), "--dry-run"]) == 0
    assert _gateway(tmp_path / "repo2") == (64, 1024) and "no engine read" in capsys.readouterr().err


def test_deploy_instructions_render_with_the_engine(tmp_path):
    """compose and Kubernetes say to render with --engine-dir, so their gateway follows the engine."""
    compose = (ROOT / "deploy" / "docker-compose.yml").read_text()
    assert compose.count("--engine-dir") >= 2  # the single and the scale-out repositories
    for name in ("triton.yaml", "scale-out.yaml"):
        assert "--engine-dir" in (ROOT / "deploy" / "k8s" / name).read_text(), name
    for doc in ("gpu.md", "sizing.md"):
        assert "gateway_max_inflight" in (ROOT / "docs" / doc).read_text(), doc


# --- issue 31: what would fail at serve time ------------------------------------------------------
def test_lora_is_opt_in_and_float16_end_to_end(tmp_path):
    """Item 1: the backend refuses LoRA weights whose dtype is not the engine's; the adapters are converted
    to float16 and the contract sends them as FP16, so a LoRA engine is built in float16. Without LoRA the
    default engine has no LoRA plugin (the least exercised build combination stays out of a first run)."""
    fact = FACTS["backend_behaviour"]["lora_weights_dtype"]
    assert fact["source"] in FACTS["sources"] and "same data type as base model" in fact["fact"]
    assert FACTS["sources"][fact["source"]]["path"].endswith("loraUtils.cpp")
    from contracts import tensors

    numpy_of = {"float16": "TYPE_FP16", "bfloat16": "TYPE_BF16"}
    assert tensors.CONTRACTS["tensorrt_llm"].input("lora_weights").data_type == numpy_of[trtllm.LORA_DTYPE]
    assert trtllm.LORA_DTYPE in LORA["convert_args"]["storage_types"]
    plain = trtllm.BuildArgs(tmp_path, tmp_path)
    assert plain.lora_target_modules == () and plain.dtype == trtllm.BASE_DTYPE == "bfloat16"
    quantize, build, _ = (shlex.split(c) for c in trtllm.build_commands(plain))
    assert not any(f.startswith("--lora") for f in build) and quantize[quantize.index("--dtype") + 1] == "bfloat16"
    lora = trtllm.BuildArgs(tmp_path, tmp_path, lora_target_modules=trtllm.parse_lora_modules("q,v"))
    quantize, build, _ = (shlex.split(c) for c in trtllm.build_commands(lora))
    assert quantize[quantize.index("--dtype") + 1] == "float16" and "--lora_plugin" in build
    m = trtllm.manifest(lora, trtllm.parse_probe(PROBE_OUTPUT), None)
    assert m["build"]["dtype"] == "float16" and m["lora"]["weights_dtype"] == "float16"
    assert m["quantization"]["lm_head"] == "float16"
    _, commands = trtllm.lora_convert_commands(tmp_path, "/t")
    assert commands == []  # no adapter folders here; the storage type is checked below with one
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "adapter_config.json").write_text("{}")
    c = shlex.split(trtllm.lora_convert_commands(tmp_path, "/t")[1][0])
    assert c[c.index("--storage-type") + 1] == trtllm.LORA_DTYPE
    # the CLI's default builds without the plugin
    p = trtllm.parse_lora_modules
    assert p("none") == () and p("all") == trtllm.ALL_LORA_MODULES


def test_serve_refuses_adapters_on_an_engine_that_cannot_take_them(tmp_path, ckpt, monkeypatch, capsys):
    """An engine built without the plugin, or in bfloat16 (an older build), fails on the first request that
    carries weights: serve --lora-dir refuses it before starting anything."""
    started = []
    monkeypatch.setattr(trtllm, "_run", lambda cmd, dry: started.append(cmd))
    monkeypatch.setattr(trtllm, "front_command", lambda *a: [sys.executable, "-c", "pass"])
    loras = tmp_path / "loras"
    loras.mkdir()
    for name, args, match in (("plain", {}, "without the LoRA plugin"),
                              ("bf16", {"lora_target_modules": ("q",)}, "built in bfloat16")):
        engine = tmp_path / name
        engine.mkdir()
        m = trtllm.manifest(trtllm.BuildArgs(ckpt, engine, **args), trtllm.parse_probe(PROBE_OUTPUT), None)
        if name == "bf16":
            m["build"]["dtype"] = "bfloat16"  # what the build before this fix wrote
        (engine / trtllm.MANIFEST).write_text(json.dumps(m))
        assert trtllm.main(["serve", "--checkpoint", str(ckpt), "--engine", str(engine), "--repo",
                            str(tmp_path / "repo"), "--dry-run", "--lora-dir", str(loras)]) == 2
        assert match in capsys.readouterr().err and started == []
    good = tmp_path / "good"
    good.mkdir()
    m = trtllm.manifest(trtllm.BuildArgs(ckpt, good, lora_target_modules=("q",)), trtllm.parse_probe(PROBE_OUTPUT), None)
    (good / trtllm.MANIFEST).write_text(json.dumps(m))
    assert trtllm.main(["serve", "--checkpoint", str(ckpt), "--engine", str(good), "--repo", str(tmp_path / "repo"),
                        "--dry-run", "--lora-dir", str(loras)]) == 0
    # without --lora-dir an engine with no plugin serves as before
    assert trtllm.main(["serve", "--checkpoint", str(ckpt), "--engine", str(tmp_path / "plain"), "--repo",
                        str(tmp_path / "repo"), "--dry-run"]) == 0


def test_perf_metrics_outputs_are_all_declared(tmp_path, ckpt):
    """Item 2: with return_perf_metrics the backend writes ten outputs, the speculative-decoding three
    included; Triton fails a response carrying an undeclared output, so the engine and the ensemble declare
    all of them."""
    fact = FACTS["backend_behaviour"]["perf_metrics_outputs"]
    assert fact["source"] in FACTS["sources"] and "whether or not" in fact["fact"]
    written = UPSTREAM["perf_metrics_outputs"]
    assert {"acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens"} <= set(written)
    upstream_out = {f["name"]: f for f in UPSTREAM["outputs"]}
    cfg = engine_config(tmp_path, ckpt)
    declared = {t.name: t for t in cfg.output}
    for name in written:
        assert name in declared, f"{name}: written by the backend, not declared"
        assert DTYPES[declared[name].data_type] == upstream_out[name]["data_type"], name
    ensemble = parse(render.render("trtllm", tmp_path / "e", checkpoint=ckpt) / "ensemble" / "config.pbtxt")
    assert set(written) <= {t.name for t in ensemble.output}


def test_a_suffixed_container_version_is_the_pinned_release(tmp_path):
    """Item 7: NGC containers report suffixed versions (25.11: 1.0.3.2510); the pin names the release."""
    assert versions.is_pinned_release("1.1.0") and versions.is_pinned_release("1.1.0.2512")
    for other in ("1.0.3.2510", "1.1.0rc5", "1.1.1", "1.1", "", "1.1.0.post1"):
        assert not versions.is_pinned_release(other), other
    _built_engine(tmp_path, tensorrt_llm_version="1.1.0.2512")
    serving = {**trtllm.parse_probe(PROBE_OUTPUT), "tensorrt_llm_version": "1.1.0.2512",
               "image_digest": "nvcr.io/x@sha256:aaa"}
    assert trtllm.check_engine(tmp_path, serving)["warnings"] == []
    with pytest.raises(trtllm.EngineMismatch, match="1.1.0.2512"):  # built and served: still the exact same build
        trtllm.check_engine(tmp_path, {**serving, "tensorrt_llm_version": "1.1.0.2601"})


def test_the_recorded_trtllm_build_source_is_a_1x_commit():
    src = FACTS["sources"]["trtllm_build_command"]
    assert src["commit"] != "008b2b8d23af95e4e19fa6f354f9c5f6349b2bfc"  # a 0.x commit (auto_parallel flags)
    assert "1.x" in src["note"]


# --- guided decoding (structured outputs, required tool calls) on the GPU ---------------------------
def test_guided_decoding_renders_xgrammar_with_the_tokenizer_info_the_backend_reads(tmp_path, checkpoint):
    """The three keys the backend reads with no fallback (guided_decoding_keys): the backend is xgrammar and the
    info path names a file of this repository holding what upstream's generate_xgrammar_tokenizer_info.py
    writes (encoded_vocab in id order, tokenizer_str, stop_token_ids), as the container sees it."""
    from tokenizers import Tokenizer

    out = render.render("trtllm", tmp_path / "repo", checkpoint=checkpoint)
    params = {k: v.string_value for k, v in parse(out / "tensorrt_llm" / "config.pbtxt").parameters.items()}
    assert params["guided_decoding_backend"] == "xgrammar"
    info_path = Path(params["xgrammar_tokenizer_info_path"])
    assert info_path == (out / "tensorrt_llm" / render.XGRAMMAR_INFO).resolve() and info_path.is_file()
    info = json.loads(info_path.read_text())
    tok = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    assert set(info) == {"encoded_vocab", "tokenizer_str", "stop_token_ids"}
    assert len(info["encoded_vocab"]) == tok.get_vocab_size(with_added_tokens=True)
    assert all(tok.token_to_id(t) == i for i, t in enumerate(info["encoded_vocab"]))
    assert info["encoded_vocab"][2] == "<|im_end|>"
    assert info["stop_token_ids"] == [tok.token_to_id("<|im_end|>")]
    assert Tokenizer.from_str(info["tokenizer_str"]).encode("Paris").ids == tok.encode("Paris").ids
    # the engine takes the guide inputs under upstream's names, types and shapes
    names = {t.name for t in parse(out / "tensorrt_llm" / "config.pbtxt").input}
    assert {"guided_decoding_guide_type", "guided_decoding_guide"} <= names
    # in a container: the path under the repository's mount
    compose = render.render("trtllm", tmp_path / "compose", checkpoint=checkpoint, deploy="compose")
    params = {k: v.string_value for k, v in parse(compose / "tensorrt_llm" / "config.pbtxt").parameters.items()}
    assert params["xgrammar_tokenizer_info_path"] == f"/repo/tensorrt_llm/{render.XGRAMMAR_INFO}"
    assert (compose / "tensorrt_llm" / render.XGRAMMAR_INFO).is_file()
    # off: both keys empty (the backend then leaves guided decoding off), no file
    off = render.render("trtllm", tmp_path / "off", {"guided_decoding_backend": ""}, checkpoint=checkpoint)
    params = {k: v.string_value for k, v in parse(off / "tensorrt_llm" / "config.pbtxt").parameters.items()}
    assert params["guided_decoding_backend"] == params["xgrammar_tokenizer_info_path"] == ""
    assert not (off / "tensorrt_llm" / render.XGRAMMAR_INFO).exists()


def test_the_guide_types_are_upstreams():
    """The values of guided_decoding_guide_type the gateway accepts are the ones the C++ backend maps
    (getGuidedDecodingParamsFromTensors): a name it does not map would pass the gateway and be dropped there."""
    from contracts.tensors import GUIDE_TYPES

    assert GUIDE_TYPES == ("json", "json_schema", "regex", "ebnf_grammar")
    assert FACTS["backend_behaviour"]["guide_types"]["values"] == list(GUIDE_TYPES)


# --- speculative decoding: lookahead (build/lookahead.py) ----------------------------------------
SPEC_FACTS = FACTS["speculative_decoding"]


def test_lookahead_is_a_method_the_c_plus_plus_runtime_runs_with_fp8():
    assert SPEC_FACTS["source"] in FACTS["sources"] and SPEC_FACTS["method"] == "lookahead"
    assert any("FP8" in s for s in SPEC_FACTS["support_matrix"])
    assert any("C++ runtime" in s for s in SPEC_FACTS["support_matrix"])
    assert any("Paged KV" in s for s in SPEC_FACTS["support_matrix"])
    # the rendered keys and their parse types are upstream's
    keys = {p["key"]: p["parsed_as"] for p in UPSTREAM["parameters"]}
    assert "lookahead" in keys["decoding_mode"].split(":", 1)[1].split("|")
    assert all(keys[k] == "int" for k in lookahead.KEYS)
    inputs = {t["name"]: t for t in UPSTREAM["inputs"]}
    assert all(inputs[k]["data_type"] == "TYPE_INT32" and inputs[k]["optional"] for k in lookahead.KEYS)


# (7, 7, 7) -> 83 is upstream's own example (its README builds --max_draft_len=83 for --lookahead_config=[7,7,7])
@pytest.mark.parametrize("wng, draft", [((4, 4, 4), 2 + 7 * 3), ((7, 7, 7), 83), ((1, 2, 1), 0 + 1 * 1),
                                        ((2, 8, 1), 6 + 2 * 7)])
def test_max_draft_len_is_upstreams_formula(wng, draft):
    # upstream: (0 if N == 1 else N - 2) + (W - 1 + G) * (N - 1)
    assert "(windows_size - 1 + verification_set_size) * (ngram_size - 1)" in SPEC_FACTS["max_draft_len"]
    assert lookahead.max_draft_len(*wng) == draft


def test_build_for_lookahead_adds_upstreams_flags_and_records_the_config(tmp_path):
    plain = shlex.split(trtllm.build_commands(trtllm.BuildArgs(tmp_path, tmp_path))[1])
    assert "--speculative_decoding_mode" not in plain and "--max_draft_len" not in plain
    a = trtllm.BuildArgs(tmp_path, tmp_path, lookahead=(4, 4, 4))
    build = shlex.split(trtllm.build_commands(a)[1])
    b = dict(zip(build, build[1:]))
    assert b["--speculative_decoding_mode"] == SPEC_FACTS["build_flags"]["--speculative_decoding_mode"]
    assert b["--max_draft_len"] == "23"
    # with FP8 and paged KV, as every engine here
    assert b["--use_fp8_context_fmha"] == "enable" and b["--kv_cache_type"] == "paged"
    assert trtllm.manifest(a, {}, None)["lookahead"] == [4, 4, 4]
    with pytest.raises(ValueError, match="W,N,G"):
        lookahead.parse("4,1,4")


def _params(out):
    return {k: v.string_value for k, v in parse(out / "tensorrt_llm" / "config.pbtxt").parameters.items()}


def test_serving_a_lookahead_engine_renders_its_config_and_refuses_a_mismatch(tmp_path, ckpt):
    # an engine build/trtllm.py built with --lookahead 4,4,4: config.json max_draft_len 23, manifest (4, 4, 4)
    engine = _engine_dir(tmp_path)
    cfg = json.loads((engine / "config.json").read_text())
    cfg["build_config"]["max_draft_len"] = 23
    (engine / "config.json").write_text(json.dumps(cfg))
    (engine / "manifest.json").write_text(json.dumps({"lookahead": [4, 4, 4]}))
    p = _params(render.render("trtllm", tmp_path / "repo", checkpoint=ckpt, engine_dir=engine))
    assert (p["decoding_mode"], p["lookahead_window_size"], p["lookahead_ngram_size"],
            p["lookahead_verification_set_size"]) == ("lookahead", "4", "4", "4")
    # explicit knobs must fit the engine's max_draft_len
    with pytest.raises(render.RenderError, match="max_draft_len 83; this one has 23"):
        render.render("trtllm", tmp_path / "r2", {"decoding_mode": "lookahead", "lookahead_window_size": "7",
                                                  "lookahead_ngram_size": "7", "lookahead_verification_set_size": "7"},
                      checkpoint=ckpt, engine_dir=engine)
    with pytest.raises(render.RenderError, match="decoding_mode=lookahead"):
        render.render("trtllm", tmp_path / "r3", {"decoding_mode": ""}, checkpoint=ckpt, engine_dir=engine)
    # a plain engine: lookahead is refused, and the default renders plain decoding
    plain = _engine_dir(tmp_path, name="plain")
    with pytest.raises(render.RenderError, match="max_draft_len 23; this one has 0"):
        render.render("trtllm", tmp_path / "r4", {"decoding_mode": "lookahead", **dict(zip(lookahead.KEYS, "444"))},
                      checkpoint=ckpt, engine_dir=plain)
    p = _params(render.render("trtllm", tmp_path / "r5", checkpoint=ckpt, engine_dir=plain))
    assert p["decoding_mode"] == "" and p["lookahead_ngram_size"] == ""
    with pytest.raises(render.RenderError, match="lookahead_window_size"):
        render.render("trtllm", tmp_path / "r6", {"decoding_mode": "lookahead"}, checkpoint=ckpt)
    # the CPU engine's draft-model mode is not a value the tensorrtllm backend takes
    with pytest.raises(render.RenderError, match="draft_tokens_external is the CPU engine's"):
        render.render("trtllm", tmp_path / "r7", {"decoding_mode": "draft_tokens_external"}, checkpoint=ckpt)


def test_the_engine_contract_carries_the_lookahead_inputs_and_acceptance_outputs(tmp_path, ckpt):
    model = engine_config(tmp_path, ckpt)
    names = {i.name: i for i in model.input}
    for key in lookahead.KEYS:
        assert DTYPES[names[key].data_type] == "TYPE_INT32" and names[key].optional and names[key].allow_ragged_batch
    outs = {o.name for o in model.output}
    assert {"acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens"} <= outs


def test_openai_log_probs_n_and_penalties_travel_under_upstreams_names(tmp_path, ckpt):
    """What docs/openai-api.md maps onto the engine is declared on the GPU target with upstream's names (the
    dtypes and shapes are checked above for every rendered tensor)."""
    cfg = engine_config(tmp_path, ckpt)
    inputs, outputs = {t.name for t in cfg.input}, {t.name for t in cfg.output}
    assert {"return_log_probs", "return_context_logits", "return_generation_logits", "num_return_sequences",
            "presence_penalty", "frequency_penalty", "embedding_bias"} <= inputs
    assert {"output_log_probs", "cum_log_probs", "context_logits", "generation_logits", "sequence_index"} <= outputs
