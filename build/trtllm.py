"""The GPU path: build an FP8 TensorRT-LLM engine with paged KV, and serve it in the pinned container.

    python build/trtllm.py build --checkpoint /models/Llama-3.1-8B-Instruct --engine engines/llama8b \
        [--tp 1] [--calib-dataset /data/cnn_dailymail] [--calib-size 512] [--max-batch-size 64] ... [--dry-run]
    python build/trtllm.py serve --checkpoint ... --engine ... [--dry-run]     (= make serve TARGET=trtllm)
    python build/trtllm.py lora-convert --adapters <lora_dir> --trtllm-dir <TensorRT-LLM checkout> [--dry-run]

`build` runs, inside the pinned image (`docker run --gpus all ...`), ModelOpt FP8 post-training
quantization of weights and KV cache (build/trtllm_quantize.py: the wheel's `quantize_and_export` with
`quantize.py`'s flags, since NGC's image has no examples folder) and `trtllm-build` with paged KV and
paged/FP8 context FMHA, then probes the container (`tensorrt_llm.__version__`, TensorRT version, GPU)
and writes `manifest.json` with what it found and the image's digest. `serve` probes the serving
container the same way and refuses an engine that another TensorRT-LLM, TensorRT, image or GPU
architecture built (NVIDIA's most common support issue), renders the repository for deploy target
`docker` (build/deploy_targets.py), checks the KV sizing, and starts the container with Triton's
ports published on this machine's loopback only. With `--dry-run` both print the commands instead of
running them (no GPU or Docker needed).

LoRA (docs/lora.md) is opt-in: the default engine is built without the LoRA plugin (the FP8 + FP8-KV +
FP8 context FMHA + LoRA plugin combination is the least exercised one). `--lora-target-modules
q,k,v,o,gate,up,down` (HF names, or `all`) enables TensorRT-LLM's LoRA plugin for those modules up to
`--max-lora-rank`, and builds the engine in float16: the backend refuses LoRA weights whose data type is
not the engine's (loraUtils.cpp, build/upstream facts `backend_behaviour.lora_weights_dtype`), and the
weights travel as float16 end to end (`lora-convert --storage-type float16`, the contract's `lora_weights`
TYPE_FP16), as upstream's FP8 + LoRA examples build with `--dtype float16`. `serve --lora-dir` refuses an
engine built without the plugin or in another dtype. `lora-convert` runs upstream's `hf_lora_convert.py`
on every PEFT adapter folder of an adapter directory, writing `model.lora_weights.npy` and
`model.lora_config.npy` beside the PEFT files: what the gateway sends as `lora_weights` / `lora_config`
on an adapter's first request to a replica (gateway/triton_backend.py).
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from build import deploy_targets, engine_admission, lookahead, versions  # noqa: E402
from cpu_engine.hf_config import MAX_SEQ_LEN_CAP, read_config  # noqa: E402
# Triton's admin APIs and the header that opens them: the same as the CPU launcher's (inference, health
# and metadata stay open for the front and the gateway, which run beside tritonserver on loopback)
from build.triton_flags import ADMIN_HEADER, header_forward_flags, restricted_api_flags  # noqa: E402

MANIFEST = "manifest.json"
PROBE_FILE = "container.json"
DOCKER = deploy_targets.get("docker")
HOST_DATA_DIR = ROOT / "runtime" / "data-trtllm"  # `serve --data-dir`: the usage ledger on this machine
# quantize.py recognises CNN/DailyMail by a path containing "cnn_dailymail" (build/upstream facts,
# quantization.calib_dataset_match), so offline calibration data is mounted at such a path
CALIB_MOUNT = "/calib/cnn_dailymail"
H100_80GB_BYTES = 85.5e9  # what an "80 GB" H100 reports (81,559 MiB)
# PEFT module name -> TensorRT-LLM's LoRA module name (trtllm-build --lora_target_modules choices; Llama:
# gate_proj is mlp_h_to_4h, up_proj is mlp_gate, down_proj is mlp_4h_to_h)
TRTLLM_LORA_MODULES = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_dense", "gate": "mlp_h_to_4h",
                       "up": "mlp_gate", "down": "mlp_4h_to_h"}
ALL_LORA_MODULES = ("q", "k", "v", "o", "gate", "up", "down")
# the one data type of LoRA weights on the GPU path: the converter's --storage-type, the engine's --dtype when
# the LoRA plugin is on, and the contract's `lora_weights` (TYPE_FP16, contracts/tensors.py)
LORA_DTYPE = "float16"
BASE_DTYPE = "bfloat16"  # the engine's dtype without LoRA


@dataclass
class BuildArgs:
    checkpoint: Path
    engine: Path
    tp: int = 1
    pp: int = 1
    calib_dataset: str | None = None  # a local folder for offline clusters; default: the HF name (network)
    calib_size: int = 512
    max_batch_size: int = engine_admission.BUILD_MAX_BATCH_SIZE  # the gateway's admission follows it (docs/gpu.md)
    max_num_tokens: int = MAX_SEQ_LEN_CAP
    max_input_len: int = MAX_SEQ_LEN_CAP
    max_seq_len: int = MAX_SEQ_LEN_CAP  # the repository's cap, so the rendered max_seq_len fits the engine
    tokens_per_block: int = engine_admission.BUILD_TOKENS_PER_BLOCK
    trtllm_dir: str | None = None  # a TensorRT-LLM checkout of the pinned tag: use its examples/quantize.py
    lora_target_modules: tuple[str, ...] = ()  # (): no LoRA plugin (the default); else the modules it serves
    max_lora_rank: int = 64  # the CPU engine's default max_lora_rank too
    lookahead: tuple[int, int, int] | None = None  # (W, N, G): build for lookahead decoding (build/lookahead.py)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def dtype(self) -> str:
        """The engine's activation dtype: float16 with LoRA (the weights' dtype must be the engine's), else bfloat16."""
        return LORA_DTYPE if self.lora_target_modules else BASE_DTYPE


def docker_run(mounts: dict[Path, str], inner: str, ports: dict[int, int] | None = None, name: str | None = None,
               env: dict[str, str] | None = None, image: str = versions.TRITON_IMAGE,
               workdir: str | None = None) -> list[str]:
    """`docker run` of the pinned image; published ports bind to this machine's loopback only. `workdir`:
    the models import the project's packages from the project, also where a Python stub ignores PYTHONPATH. An `env` value
    None passes the variable from this process's environment (a secret never appears in the command)."""
    cmd = ["docker", "run", "--rm", "--gpus", "all", "--shm-size=2g", "--ulimit", "memlock=-1",
           "--ulimit", "stack=67108864"]
    if workdir:
        cmd += ["-w", workdir]
    for k, v in (env or {}).items():
        cmd += ["-e", k if v is None else f"{k}={v}"]  # None: the value of this process's environment
    if name:
        cmd += ["--name", name]
    for host, inside in mounts.items():
        cmd += ["-v", f"{Path(host).resolve()}:{inside}"]
    for host_port, port in (ports or {}).items():
        cmd += ["-p", f"127.0.0.1:{host_port}:{port}"]
    return cmd + [image, "bash", "-lc", inner]


# --- what the container really has ------------------------------------------------------------
PROBE_MARKER = "TRTLLM_PROBE_JSON="
PROBE = (  # double quotes only: the code is shell-quoted twice (python3 -c inside bash -lc)
    "import json, subprocess, tensorrt, tensorrt_llm\n"
    "q = subprocess.run([\"nvidia-smi\", \"--query-gpu=name,compute_cap,driver_version\", \"--format=csv,noheader\"],"
    " capture_output=True, text=True).stdout.strip().splitlines()\n"
    "gpus = [dict(zip((\"name\", \"compute_cap\", \"driver\"), (f.strip() for f in line.split(\",\")))) for line in q]\n"
    "print(\"" + PROBE_MARKER + "\" + json.dumps({\"tensorrt_llm_version\": tensorrt_llm.__version__,"
    " \"tensorrt_version\": tensorrt.__version__, \"gpus\": gpus}), flush=True)\n"
)


def probe_command() -> list[str]:
    return ["python3", "-c", PROBE]


def parse_probe(text: str) -> dict:
    """The probe's JSON line among whatever the container printed (TensorRT-LLM prints banners)."""
    lines = [line[len(PROBE_MARKER):] for line in text.splitlines() if line.startswith(PROBE_MARKER)]
    if not lines:
        raise EngineMismatch("the container probe printed no versions (is this the TensorRT-LLM image?)")
    return json.loads(lines[-1])


def image_digest(image: str = versions.TRITON_IMAGE, run=subprocess.run) -> str | None:
    """The local image's repo digest (or its id when it has none), from `docker image inspect`."""
    out = run(["docker", "image", "inspect", "--format", "{{json .RepoDigests}} {{.Id}}", image],
              capture_output=True, text=True)
    if out.returncode != 0:
        return None
    digests, _, image_id = out.stdout.strip().rpartition(" ")
    found = json.loads(digests or "[]")
    return found[0] if found else image_id or None


def probe_serving_container(run=subprocess.run) -> dict:
    out = run(docker_run({}, shlex.join(probe_command())), capture_output=True, text=True)
    if out.returncode != 0:
        raise EngineMismatch(f"could not probe {versions.TRITON_IMAGE}: {out.stderr.strip()[-400:]}")
    found = parse_probe(out.stdout)
    found["image_digest"] = image_digest(run=run)
    return found


# --- build ------------------------------------------------------------------------------------
def build_commands(a: BuildArgs) -> list[str]:
    """The steps, run in the container with the checkpoint at /ckpt, the engine folder at /engine, this
    project at /project and offline calibration data at CALIB_MOUNT."""
    calib = ["--calib_dataset", CALIB_MOUNT] if a.calib_dataset else []
    script = (f"{a.trtllm_dir}/examples/quantization/quantize.py" if a.trtllm_dir
              else f"{DOCKER.pythonpath}/build/trtllm_quantize.py")
    quantize = [
        "python3", script, "--model_dir", "/ckpt", "--dtype", a.dtype, "--qformat", "fp8", "--kv_cache_dtype", "fp8",
        "--calib_size", str(a.calib_size), *calib, "--tp_size", str(a.tp), "--pp_size", str(a.pp),
        "--output_dir", "/engine/ckpt-fp8",
    ]
    trtllm_build = [
        "trtllm-build", "--checkpoint_dir", "/engine/ckpt-fp8", "--output_dir", "/engine",
        "--kv_cache_type", "paged", "--use_paged_context_fmha", "enable", "--use_fp8_context_fmha", "enable",
        "--gemm_plugin", "auto", "--max_batch_size", str(a.max_batch_size), "--max_num_tokens", str(a.max_num_tokens),
        "--max_input_len", str(a.max_input_len), "--max_seq_len", str(a.max_seq_len),
        "--tokens_per_block", str(a.tokens_per_block), "--multiple_profiles", "enable", "--workers", str(a.world_size),
    ]
    if a.lora_target_modules:
        trtllm_build += ["--lora_plugin", "auto", "--lora_target_modules",
                         *(TRTLLM_LORA_MODULES[m] for m in a.lora_target_modules), "--max_lora_rank", str(a.max_lora_rank)]
    trtllm_build += lookahead.build_flags(a.lookahead)
    probe = shlex.join(probe_command()) + f" > /engine/{PROBE_FILE}"
    return [shlex.join(quantize), shlex.join(trtllm_build), probe]


def build_mounts(a: BuildArgs) -> dict[Path, str]:
    mounts = {a.checkpoint: "/ckpt", a.engine: "/engine", ROOT: DOCKER.pythonpath}
    if a.calib_dataset:
        mounts[Path(a.calib_dataset)] = CALIB_MOUNT
    if a.trtllm_dir:
        mounts[Path(a.trtllm_dir)] = a.trtllm_dir
    return mounts


def manifest(a: BuildArgs, container: dict, digest: str | None) -> dict:
    """What built this engine: the container's own report, the image digest, and the build arguments."""
    return {
        "container": {**container, "image": versions.TRITON_IMAGE, "image_digest": digest},
        "pinned": {"tensorrt_llm_version": versions.TENSORRT_LLM_VERSION, "tensorrt_version": versions.TENSORRT_VERSION,
                   "image": versions.TRITON_IMAGE},
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "checkpoint": str(a.checkpoint),
        "tp_size": a.tp,
        "pp_size": a.pp,
        "quantization": {"weights": "fp8", "kv_cache": "fp8", "lm_head": a.dtype, "embedding": "checkpoint dtype",
                         "calib_size": a.calib_size, "calib_dataset": a.calib_dataset or "cnn_dailymail"},
        "build": {k: getattr(a, k) for k in ("max_batch_size", "max_num_tokens", "max_input_len", "max_seq_len",
                                             "tokens_per_block", "dtype")},
        "lora": {"target_modules": list(a.lora_target_modules), "max_lora_rank": a.max_lora_rank,
                 "weights_dtype": LORA_DTYPE if a.lora_target_modules else None},
        # serve renders decoding_mode lookahead with these (W, N, G) (build/engine_admission.py read_engine)
        "lookahead": list(a.lookahead) if a.lookahead else None,
    }


# --- serve ------------------------------------------------------------------------------------
class EngineMismatch(Exception):
    pass


def check_engine(engine: Path, serving: dict | None = None) -> dict:
    """Refuse an engine that this serving container cannot load. `serving` is the serving container's
    probe (probe_serving_container); without it (dry run) only the pins are compared. Returns the
    manifest with a `warnings` list."""
    path = Path(engine) / MANIFEST
    if not path.is_file():
        raise EngineMismatch(f"{path} not found: build the engine with `python build/trtllm.py build` so what "
                             "built it is recorded")
    m = json.loads(path.read_text())
    built = m.get("container")
    if not isinstance(built, dict) or not built.get("tensorrt_llm_version"):
        raise EngineMismatch(f"{path} records no container probe (an older manifest): rebuild the engine")
    rebuild = "TensorRT engines only load in the exact version that built them; rebuild it"
    if not versions.is_pinned_release(built["tensorrt_llm_version"]):
        raise EngineMismatch(f"engine {engine} was built by TensorRT-LLM {built['tensorrt_llm_version']}, but "
                             f"build/versions.py pins {versions.TENSORRT_LLM_VERSION}: {rebuild}")
    warnings = []
    if serving is not None:
        for key, what in (("tensorrt_llm_version", "TensorRT-LLM"), ("tensorrt_version", "TensorRT")):
            if built.get(key) != serving.get(key):
                raise EngineMismatch(f"engine {engine} was built by {what} {built.get(key)}, but the serving "
                                     f"container has {what} {serving.get(key)}: {rebuild}")
        if built.get("image_digest") and serving.get("image_digest") and \
                built["image_digest"] != serving["image_digest"]:
            raise EngineMismatch(f"engine {engine} was built in image {built['image_digest']}, but serving uses "
                                 f"{serving['image_digest']} (the tag moved?): {rebuild}")
        built_gpus, serving_gpus = built.get("gpus") or [], serving.get("gpus") or []
        if built_gpus and serving_gpus:
            if built_gpus[0].get("compute_cap") != serving_gpus[0].get("compute_cap"):
                raise EngineMismatch(f"engine {engine} was built for compute capability "
                                     f"{built_gpus[0].get('compute_cap')}, this GPU is "
                                     f"{serving_gpus[0].get('compute_cap')}: {rebuild}")
            if built_gpus[0].get("name") != serving_gpus[0].get("name"):
                warnings.append(f"engine built on {built_gpus[0].get('name')}, serving on "
                                f"{serving_gpus[0].get('name')}: TensorRT advises building on the GPU model "
                                "that serves")
    m["warnings"] = warnings
    return m


def check_lora(m: dict) -> None:
    """Refuse to serve adapters on an engine that cannot take them: built without the LoRA plugin, or in a dtype
    other than the adapters' float16 (the backend rejects weights of another dtype on the first request that
    carries them: build/upstream facts `backend_behaviour.lora_weights_dtype`)."""
    lora = m.get("lora") or {}
    if not lora.get("target_modules"):
        raise EngineMismatch("--lora-dir: the engine was built without the LoRA plugin; rebuild it with "
                             "`build/trtllm.py build --lora-target-modules all` (docs/lora.md)")
    dtype = (m.get("build") or {}).get("dtype")
    if dtype != LORA_DTYPE:
        raise EngineMismatch(f"--lora-dir: the engine was built in {dtype}, but LoRA weights are {LORA_DTYPE} "
                             "and the backend requires the engine's dtype; rebuild it with this build/trtllm.py")


def tritonserver_args(model_repository: str, http=8000, grpc=8001, metrics=8002, address="127.0.0.1",
                      metrics_address="0.0.0.0", admin_key: str | None = None) -> list[str]:
    """tritonserver's flags on every GPU deploy target: HTTP and gRPC on `address` (loopback where the
    front runs beside it), metrics on their own port for Prometheus only, the header-forward flags the
    gateway needs for API keys, and the admin APIs behind a key."""
    args = ["/opt/tritonserver/bin/tritonserver", f"--model-repository={model_repository}",
            f"--http-address={address}", f"--grpc-address={address}", f"--metrics-address={metrics_address}",
            f"--http-port={http}", f"--grpc-port={grpc}", f"--metrics-port={metrics}",
            "--allow-metrics=true", "--allow-gpu-metrics=true",
            *header_forward_flags()]
    if admin_key:
        args += restricted_api_flags(admin_key)
    return args


def serve_command(engine: Path, repo: Path, checkpoint: Path, world_size: int, http=8000, grpc=8001, metrics=8002,
                  name="triton-trtllm", admin_key: str | None = None, data_dir: Path = HOST_DATA_DIR,
                  lora_dir: Path | None = None) -> list[str]:
    """tritonserver in the container, one MPI rank per GPU when world_size > 1 (as upstream's
    launch_triton_server.py does, plus the flags that script cannot pass through). Inside the container
    it listens on all interfaces (Docker publishes to the container's address); on this machine the
    ports are published on 127.0.0.1 only."""
    common = tritonserver_args(DOCKER.model_repository, http, grpc, metrics, address="0.0.0.0",
                               admin_key=admin_key)
    if world_size == 1:
        inner = shlex.join(common)
    else:
        ranks = []
        for rank in range(world_size):
            extra = [f"--backend-config=python,shm-region-prefix-name=prefix{rank}_", "--disable-auto-complete-config"]
            if rank:
                extra += ["--model-control-mode=explicit", "--load-model=tensorrt_llm"]
            ranks.append("-n 1 " + shlex.join(common + extra))
        inner = "mpirun --allow-run-as-root " + " : ".join(ranks)
    mounts = serve_mounts(engine, repo, checkpoint, data_dir)
    if lora_dir is not None:  # the adapters (PEFT folders and their converted .npy files), read-only
        mounts[Path(lora_dir)] = deploy_targets.LORA_DIR + ":ro"
    # the gateway spools usage records into the data folder, which the front (beside the container, with
    # --data-dir on the same folder) loads into the ledger; the batch worker's key from the environment
    env = {"PYTHONPATH": DOCKER.pythonpath, "LLM_DATA_DIR": deploy_targets.DATA_DIR, "LLM_BATCH_WORKER_KEY": None,
           "LLM_FRONT_KEY": None}  # the front's leases (docs/gateway.md): the key the front beside it holds
    return docker_run(mounts, inner, {http: http, grpc: grpc, metrics: metrics}, name, env, workdir=DOCKER.pythonpath)


def serve_mounts(engine: Path, repo: Path, checkpoint: Path, data_dir: Path = HOST_DATA_DIR) -> dict[Path, str]:
    """The docker target's mount map (build/deploy_targets.py) filled with this machine's folders."""
    by_path = {DOCKER.model_repository: repo, DOCKER.paths["gpt_model_path"]: engine,
               DOCKER.paths["tokenizer_dir"]: checkpoint, DOCKER.pythonpath: ROOT, deploy_targets.DATA_DIR: data_dir}
    assert set(by_path) == set(DOCKER.mounts), "build/deploy_targets.py and serve_mounts disagree"
    return {host: inside for inside, host in by_path.items()}


def serve_plan(build_cfg: dict, checkpoint: Path) -> tuple[dict[str, str], list[str]]:
    """Render overrides that match the engine, and warnings where the engine and the checkpoint disagree:
    the repository's `max_seq_len` cap must not exceed what the engine was built for."""
    from build.render import checkpoint_limits

    warnings = []
    engine_len = int(build_cfg["max_seq_len"])
    cap = int(checkpoint_limits(checkpoint).get("max_seq_len", engine_len))
    if engine_len != cap:
        warnings.append(f"the engine was built for max_seq_len {engine_len}, the checkpoint's cap is {cap}: "
                        f"serving with {min(engine_len, cap)}")
    return {"max_seq_len": str(min(engine_len, cap))}, warnings


def redact(text: str) -> str:
    """Commands are printed: never the admin key."""
    import re

    return re.sub(r"(admin-key=)[^\s',]+", r"\1***", text)  # ADMIN_HEADER ends in admin-key


def lora_convert_commands(adapters: Path, trtllm_dir: str) -> tuple[dict[Path, str], list[str]]:
    """(mounts, commands): upstream's hf_lora_convert.py on each PEFT adapter folder, output beside it."""
    script = f"{trtllm_dir}/examples/hf_lora_convert.py"
    names = sorted(p.name for p in Path(adapters).iterdir() if (p / "adapter_config.json").is_file())
    inside = deploy_targets.LORA_DIR
    commands = [shlex.join(["python3", script, "-i", f"{inside}/{n}", "-o", f"{inside}/{n}", "--storage-type", LORA_DTYPE])
                for n in names]
    return {Path(adapters): inside, Path(trtllm_dir): trtllm_dir}, commands


def parse_lora_modules(text: str) -> tuple[str, ...]:
    """`q,k,v,o,gate,up,down` (or the *_proj names) -> module keys; `all` -> the seven; `none` -> ()."""
    if text.strip().lower() in ("none", ""):
        return ()
    if text.strip().lower() == "all":
        return ALL_LORA_MODULES
    mods = tuple(m.strip().removesuffix("_proj") for m in text.split(",") if m.strip())
    unknown = [m for m in mods if m not in TRTLLM_LORA_MODULES]
    if unknown:
        raise SystemExit(f"--lora-target-modules: unknown module(s) {', '.join(unknown)} "
                         f"(choose among {', '.join(TRTLLM_LORA_MODULES)}, or none)")
    return mods


def _run(cmd: list[str], dry_run: bool) -> None:
    print("$ " + redact(shlex.join(cmd)), flush=True)
    if not dry_run:
        subprocess.run(cmd, check=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("lora-convert", help="convert PEFT adapters with upstream's hf_lora_convert.py")
    c.add_argument("--adapters", type=Path, required=True, help="the adapter directory (lora_dir)")
    c.add_argument("--trtllm-dir", required=True, help="a TensorRT-LLM checkout of the pinned tag (examples/)")
    c.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    for name in ("build", "serve"):
        s = sub.add_parser(name)
        s.add_argument("--checkpoint", type=Path, required=True, help="HF Llama-family checkpoint folder")
        s.add_argument("--engine", type=Path, required=True, help="engine folder (written by build)")
        s.add_argument("--tp", type=int, default=1)
        s.add_argument("--pp", type=int, default=1)
        s.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
        if name == "build":
            s.add_argument("--calib-dataset", help="local CNN/DailyMail dataset folder (offline clusters); "
                                                   f"mounted at {CALIB_MOUNT}")
            s.add_argument("--calib-size", type=int, default=512)
            for k in ("max_batch_size", "max_num_tokens", "max_input_len", "max_seq_len"):
                s.add_argument("--" + k.replace("_", "-"), type=int, default=BuildArgs.__dataclass_fields__[k].default)
            s.add_argument("--trtllm-dir", help="a TensorRT-LLM checkout of the pinned tag: use its "
                                                "examples/quantization/quantize.py instead of build/trtllm_quantize.py")
            s.add_argument("--lora-target-modules", default="none",
                           help="LoRA modules the engine takes adapters for (HF names: q,k,v,o,gate,up,down), all, "
                                f"or none (the default: no LoRA plugin); with LoRA the engine is built in {LORA_DTYPE}")
            s.add_argument("--max-lora-rank", type=int, default=BuildArgs.max_lora_rank)
            s.add_argument("--lookahead", metavar="W,N,G", type=lookahead.parse,
                           help="build for lookahead decoding with these maxima (speculative decoding; docs/gpu.md); "
                                "serve then renders decoding_mode lookahead with them")
        else:
            s.add_argument("--repo", type=Path, default=ROOT / "runtime" / "model_repository_trtllm")
            s.add_argument("--gpu-mem-gb", type=float, default=H100_80GB_BYTES / 1e9,
                           help="GPU memory in 1e9 bytes (an '80 GB' H100 has 85.5)")
            s.add_argument("--http-port", type=int, default=8000)
            s.add_argument("--grpc-port", type=int, default=8001)
            s.add_argument("--metrics-port", type=int, default=8002)
            s.add_argument("--front-host", default="127.0.0.1", help="the front's (public) address")
            s.add_argument("--front-port", type=int, default=9000)
            s.add_argument("--admin-key", help=f"key for Triton's admin APIs (header {ADMIN_HEADER}); default: "
                                               "$TRITON_ADMIN_KEY, else the admin APIs stay closed to all")
            s.add_argument("--lora-dir", type=Path, help="a folder of LoRA adapters (PEFT, converted with "
                           "lora-convert): mounted at /loras and rendered as lora_dir (docs/lora.md)")
            s.add_argument("--data-dir", type=Path, default=HOST_DATA_DIR,
                           help="the usage ledger's folder (mounted at /data for the gateway's spool; the front "
                                "keeps the SQLite ledger and batch files there; docs/usage.md)")
    args = p.parse_args(argv)
    if args.cmd == "lora-convert":
        mounts, commands = lora_convert_commands(args.adapters, args.trtllm_dir)
        _run(docker_run(mounts, " && ".join(commands) or "true"), args.dry_run)
        return 0
    if args.cmd == "build":
        return _build(args)
    return _serve(args)


def _build(args) -> int:
    a = BuildArgs(args.checkpoint, args.engine, args.tp, args.pp, calib_dataset=args.calib_dataset,
                  calib_size=args.calib_size, max_batch_size=args.max_batch_size,
                  max_num_tokens=args.max_num_tokens, max_input_len=args.max_input_len,
                  max_seq_len=args.max_seq_len, trtllm_dir=args.trtllm_dir,
                  lora_target_modules=parse_lora_modules(args.lora_target_modules), max_lora_rank=args.max_lora_rank,
                  lookahead=args.lookahead)
    if not args.dry_run:
        a.engine.mkdir(parents=True, exist_ok=True)
    _run(docker_run(build_mounts(a), " && ".join(build_commands(a))), args.dry_run)
    if args.dry_run:
        print(f"[trtllm] engine would be in {a.engine}", file=sys.stderr)
        return 0
    container = parse_probe((a.engine / PROBE_FILE).read_text())
    m = manifest(a, container, image_digest())
    (a.engine / MANIFEST).write_text(json.dumps(m, indent=2) + "\n")
    print(f"[trtllm] engine is in {a.engine}: TensorRT-LLM {container['tensorrt_llm_version']}, TensorRT "
          f"{container['tensorrt_version']}, {', '.join(g.get('name', '?') for g in container.get('gpus', []))}",
          file=sys.stderr)
    if not versions.is_pinned_release(container["tensorrt_llm_version"]):
        print(f"[trtllm] error: {versions.TRITON_IMAGE} has TensorRT-LLM {container['tensorrt_llm_version']}, "
              f"build/versions.py pins {versions.TENSORRT_LLM_VERSION}: fix the pin", file=sys.stderr)
        return 2
    return 0


def _serve(args) -> int:
    import os

    from build.render import render
    from clients.sizing import ModelShape, plan

    try:
        serving = None if args.dry_run else probe_serving_container()
        if args.dry_run:
            print("$ " + shlex.join(docker_run({}, shlex.join(probe_command()))) + "   # the serving container's "
                  "versions, compared with the engine's manifest", flush=True)
        m = check_engine(args.engine, serving) if not args.dry_run or (args.engine / MANIFEST).exists() else None
        if m is not None and args.lora_dir is not None:
            check_lora(m)
    except EngineMismatch as e:
        print(f"[trtllm] refusing to serve: {e}", file=sys.stderr)
        return 2
    for w in (m or {}).get("warnings", []):
        print(f"[trtllm] warning: {w}", file=sys.stderr)
    build_cfg = (m or {}).get("build", {"max_batch_size": BuildArgs.max_batch_size,
                                        "max_seq_len": BuildArgs.max_seq_len})
    overrides, warnings = serve_plan(build_cfg, args.checkpoint)
    for w in warnings:
        print(f"[trtllm] warning: {w}", file=sys.stderr)
    seq_len = int(overrides["max_seq_len"])
    cfg_path = args.checkpoint / "config.json"
    if cfg_path.is_file():
        sizing = plan(ModelShape.from_hf_config(read_config(cfg_path)), args.gpu_mem_gb, "fp8", "fp8",
                      seq_len, build_cfg["max_batch_size"], tp=args.tp)
        print(f"[trtllm] sizing: {sizing.describe(seq_len, build_cfg['max_batch_size'])}", file=sys.stderr)
        if not sizing.fits:
            print("[trtllm] warning: the configured batch cannot fit in the KV cache at full length; requests "
                  "will queue (guaranteed_no_evict) — see docs/sizing.md", file=sys.stderr)
    if args.lora_dir is not None:
        overrides["lora_dir"] = deploy_targets.LORA_DIR
    # the gateway's admission bounds from this engine (its max_batch_size, at most what the KV cache holds at
    # max_seq_len on --gpu-mem-gb): a dry run without a built engine renders the build default, and says so
    engine_dir = args.engine if any((args.engine / f).is_file() for f in ("config.json", MANIFEST)) else None
    render("trtllm", args.repo, overrides, args.checkpoint, deploy="docker", engine_dir=engine_dir,
           gpu_mem_gb=args.gpu_mem_gb)
    admission = json.loads((args.repo / "render.json").read_text())["admission"]
    for w in admission["warnings"]:
        print(f"[trtllm] warning: {w}", file=sys.stderr)
    print(f"[trtllm] admission: gateway_max_inflight {admission['gateway_max_inflight']}, gateway_max_queue "
          f"{admission['gateway_max_queue']} ({admission['from']}; KV: {admission['kv_from']})", file=sys.stderr)
    admin_key = args.admin_key or os.environ.get("TRITON_ADMIN_KEY") or _random_key()
    # the batch worker's key, as the CPU launcher does: the front and the gateway (through `docker -e`)
    # read it from this environment, so it is never on a command line
    os.environ.setdefault("LLM_BATCH_WORKER_KEY", _random_key())
    # the front's key for its leases, new at every start as the CPU launcher's: the front streams from the
    # engine itself and the gateway admits and settles each request (docs/gateway.md)
    os.environ.setdefault("LLM_FRONT_KEY", _random_key())
    if not args.dry_run:
        (args.data_dir / "spool").mkdir(parents=True, exist_ok=True)
    front = front_command(args.front_host, args.front_port, args.grpc_port, args.data_dir, args.http_port,
                          args.checkpoint)
    print("$ " + shlex.join(front) + "   # the public door, beside the container", flush=True)
    front_proc = None if args.dry_run else subprocess.Popen(front, cwd=ROOT)
    try:
        _run(serve_command(args.engine, args.repo, args.checkpoint, args.tp * args.pp, args.http_port,
                           args.grpc_port, args.metrics_port, admin_key=admin_key, data_dir=args.data_dir,
                           lora_dir=args.lora_dir), args.dry_run)
    finally:
        if front_proc is not None:
            front_proc.terminate()
            front_proc.wait(timeout=40)
    return 0


def front_command(host: str, port: int, grpc_port: int, data_dir: Path = HOST_DATA_DIR,
                  http_port: int = 8000, tokenizer_dir: Path | None = None) -> list[str]:
    """The OpenAI-compatible front on this machine, talking to the container's loopback-published gRPC
    (the gateway) and HTTP (the engine's token streams and the lease operations); it loads the gateway's
    spooled usage records from `data_dir` into the ledger. `tokenizer_dir`: the checkpoint on this machine
    (mounted in the container as the repository's tokenizer_dir), for the front's own streams."""
    return [sys.executable, "-m", "front", "--host", host, "--port", str(port),
            "--triton-grpc", f"127.0.0.1:{grpc_port}", "--triton-http", f"127.0.0.1:{http_port}",
            "--data-dir", str(data_dir), *front_stream_args(tokenizer_dir)]


# Front processes on a GPU target. On 16 cores with the simulated engine at an H100's pace, 2 and 4 carried
# the engine's whole rate at 256 streams (24,541-24,708 tok/s against its 25,060) where 1 carried 0.90x of it
# (docs/benchmarks.md, "On 16 cores, a third time"); 4 leaves room for short requests and 1,024 streams.
GPU_FRONT_WORKERS = 4


def front_stream_args(tokenizer_dir: Path | str | None) -> list[str]:
    """What makes the front stream from the engine itself on a GPU target, with LLM_FRONT_KEY in its and the
    gateway's environment: the engine's tokenizer (the repository's tokenizer_dir, as the front sees it) and
    its worker processes. Without them every token would cross the gateway's one Python process, which
    carries about 1,100-1,500 tok/s on 16 cores (issue 28), a tenth of what an H100 makes."""
    return ["--workers", str(GPU_FRONT_WORKERS)] + (["--tokenizer-dir", str(tokenizer_dir)] if tokenizer_dir else [])


def container_front_args(target: str) -> list[str]:
    """The front's arguments where it runs beside tritonserver in one container (compose) or pod (k8s):
    the public door on 9000, Triton on the loopback, its metrics for Prometheus, its own streams."""
    return ["--host", "0.0.0.0", "--port", "9000", "--triton-grpc", "127.0.0.1:8001", "--metrics-host", "0.0.0.0",
            *front_stream_args(deploy_targets.get(target).paths["tokenizer_dir"])]


def _random_key() -> str:
    import secrets

    return secrets.token_urlsafe(24)  # nobody holds it: the admin APIs stay closed


if __name__ == "__main__":
    sys.exit(main())
