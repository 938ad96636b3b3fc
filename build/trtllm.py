"""The GPU path: build an FP8 TensorRT-LLM engine with paged KV, and serve it in the pinned container.

    python build/trtllm.py build --checkpoint /models/Llama-3.1-8B-Instruct --engine /engines/llama8b \
        [--tp 1] [--calib-dataset /data/cnn_dailymail] [--calib-size 512] [--max-batch-size 64] ... [--dry-run]
    python build/trtllm.py serve --checkpoint ... --engine ... [--dry-run]     (= make serve TARGET=trtllm)

`build` runs, inside the pinned image (`docker run --gpus all ...`), ModelOpt FP8 post-training
quantization of weights and KV cache (`examples/quantization/quantize.py --qformat fp8
--kv_cache_dtype fp8`) and `trtllm-build` with paged KV and paged/FP8 context FMHA, then writes
`manifest.json` into the engine folder (versions, image, build arguments). `serve` refuses an engine
whose manifest names another TensorRT-LLM version or image — NVIDIA's most common support issue —
renders the repository for target `trtllm`, checks the KV sizing, and starts the container. With
`--dry-run` both print the commands instead of running them (no GPU or Docker needed).
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

from build import versions  # noqa: E402

TRTLLM_DIR = "/app/tensorrt_llm"  # TensorRT-LLM examples inside the image (override with --trtllm-dir)
MANIFEST = "manifest.json"


@dataclass
class BuildArgs:
    checkpoint: Path
    engine: Path
    tp: int = 1
    pp: int = 1
    dtype: str = "bfloat16"
    calib_dataset: str | None = None  # a local path for offline clusters; default: the HF name
    calib_size: int = 512
    max_batch_size: int = 64
    max_num_tokens: int = 8192
    max_input_len: int = 8192
    max_seq_len: int = 16384
    tokens_per_block: int = 32
    trtllm_dir: str = TRTLLM_DIR

    @property
    def world_size(self) -> int:
        return self.tp * self.pp


def docker_run(mounts: dict[Path, str], inner: str, ports: dict[int, int] | None = None, name: str | None = None,
               env: dict[str, str] | None = None) -> list[str]:
    cmd = ["docker", "run", "--rm", "--gpus", "all", "--shm-size=2g", "--ulimit", "memlock=-1",
           "--ulimit", "stack=67108864"]
    for k, v in (env or {}).items():
        cmd += ["-e", f"{k}={v}"]
    if name:
        cmd += ["--name", name]
    for host, inside in mounts.items():
        cmd += ["-v", f"{Path(host).resolve()}:{inside}"]
    for host_port, port in (ports or {}).items():
        cmd += ["-p", f"{host_port}:{port}"]
    return cmd + [versions.TRITON_IMAGE, "bash", "-lc", inner]


def build_commands(a: BuildArgs) -> list[str]:
    """The two steps, run in the container with the checkpoint at /ckpt and the engine folder at /engine."""
    calib = ["--calib_dataset", "/calib"] if a.calib_dataset else []
    quantize = [
        "python3", f"{a.trtllm_dir}/examples/quantization/quantize.py", "--model_dir", "/ckpt",
        "--dtype", a.dtype, "--qformat", "fp8", "--kv_cache_dtype", "fp8", "--calib_size", str(a.calib_size),
        *calib, "--tp_size", str(a.tp), "--pp_size", str(a.pp), "--output_dir", "/engine/ckpt-fp8",
    ]
    trtllm_build = [
        "trtllm-build", "--checkpoint_dir", "/engine/ckpt-fp8", "--output_dir", "/engine",
        "--kv_cache_type", "paged", "--use_paged_context_fmha", "enable", "--use_fp8_context_fmha", "enable",
        "--gemm_plugin", "auto", "--max_batch_size", str(a.max_batch_size), "--max_num_tokens", str(a.max_num_tokens),
        "--max_input_len", str(a.max_input_len), "--max_seq_len", str(a.max_seq_len),
        "--tokens_per_block", str(a.tokens_per_block), "--multiple_profiles", "enable", "--workers", str(a.world_size),
    ]
    return [shlex.join(quantize), shlex.join(trtllm_build)]


def manifest(a: BuildArgs) -> dict:
    return {
        "tensorrt_llm_version": versions.TENSORRT_LLM_VERSION,
        "image": versions.TRITON_IMAGE,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "checkpoint": str(a.checkpoint),
        "tp_size": a.tp,
        "pp_size": a.pp,
        "quantization": {"weights": "fp8", "kv_cache": "fp8", "calib_size": a.calib_size,
                         "calib_dataset": a.calib_dataset or "cnn_dailymail"},
        "build": {k: getattr(a, k) for k in ("max_batch_size", "max_num_tokens", "max_input_len", "max_seq_len",
                                             "tokens_per_block", "dtype")},
    }


class EngineMismatch(Exception):
    pass


def check_engine(engine: Path) -> dict:
    """Refuse an engine built with another TensorRT-LLM version or image than the one we serve with."""
    path = Path(engine) / MANIFEST
    if not path.is_file():
        raise EngineMismatch(f"{path} not found: build the engine with `python build/trtllm.py build` so its "
                             "versions are recorded")
    m = json.loads(path.read_text())
    if m.get("tensorrt_llm_version") != versions.TENSORRT_LLM_VERSION or m.get("image") != versions.TRITON_IMAGE:
        raise EngineMismatch(
            f"engine {engine} was built with TensorRT-LLM {m.get('tensorrt_llm_version')} in {m.get('image')}, "
            f"but serving uses TensorRT-LLM {versions.TENSORRT_LLM_VERSION} in {versions.TRITON_IMAGE}: "
            "TensorRT engines only load in the exact version that built them; rebuild it")
    return m


def serve_command(engine: Path, repo: Path, checkpoint: Path, world_size: int, http=8000, grpc=8001, metrics=8002,
                  name="triton-trtllm") -> list[str]:
    """tritonserver in the container, one MPI rank per GPU when world_size > 1 (as upstream's
    launch_triton_server.py does, plus the header-forward flags that script cannot pass through)."""
    common = ["/opt/tritonserver/bin/tritonserver", "--model-repository=/repo", "--allow-gpu-metrics=true",
              "--allow-metrics=true", f"--http-port={http}", f"--grpc-port={grpc}", f"--metrics-port={metrics}",
              "--http-header-forward-pattern=x-.*|authorization", "--grpc-header-forward-pattern=x-.*|authorization"]
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
    mounts = {engine: "/engines/engine", repo: "/repo", checkpoint: str(checkpoint.resolve()), ROOT: str(ROOT)}
    # the Python models import bls/ from the project, mounted at the same path
    return docker_run(mounts, inner, {http: http, grpc: grpc, metrics: metrics}, name, {"PYTHONPATH": str(ROOT)})


def _run(cmd: list[str], dry_run: bool) -> None:
    print("$ " + shlex.join(cmd), flush=True)
    if not dry_run:
        subprocess.run(cmd, check=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("build", "serve"):
        s = sub.add_parser(name)
        s.add_argument("--checkpoint", type=Path, required=True, help="HF Llama-family checkpoint folder")
        s.add_argument("--engine", type=Path, required=True, help="engine folder (written by build)")
        s.add_argument("--tp", type=int, default=1)
        s.add_argument("--pp", type=int, default=1)
        s.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
        if name == "build":
            s.add_argument("--calib-dataset", help="local calibration dataset folder (offline clusters)")
            s.add_argument("--calib-size", type=int, default=512)
            for k in ("max_batch_size", "max_num_tokens", "max_input_len", "max_seq_len"):
                s.add_argument("--" + k.replace("_", "-"), type=int, default=BuildArgs.__dataclass_fields__[k].default)
            s.add_argument("--trtllm-dir", default=TRTLLM_DIR)
        else:
            s.add_argument("--repo", type=Path, default=ROOT / "runtime" / "model_repository_trtllm")
            s.add_argument("--gpu-mem-gb", type=float, default=80.0)
            s.add_argument("--http-port", type=int, default=8000)
            s.add_argument("--grpc-port", type=int, default=8001)
            s.add_argument("--metrics-port", type=int, default=8002)
    args = p.parse_args(argv)
    if args.cmd == "build":
        a = BuildArgs(args.checkpoint, args.engine, args.tp, args.pp, calib_dataset=args.calib_dataset,
                      calib_size=args.calib_size, max_batch_size=args.max_batch_size,
                      max_num_tokens=args.max_num_tokens, max_input_len=args.max_input_len,
                      max_seq_len=args.max_seq_len, trtllm_dir=args.trtllm_dir)
        mounts = {a.checkpoint: "/ckpt", a.engine: "/engine"}
        if a.calib_dataset:
            mounts[Path(a.calib_dataset)] = "/calib"
        if not args.dry_run:
            a.engine.mkdir(parents=True, exist_ok=True)
        _run(docker_run(mounts, " && ".join(build_commands(a))), args.dry_run)
        if not args.dry_run:
            (a.engine / MANIFEST).write_text(json.dumps(manifest(a), indent=2) + "\n")
        print(f"[trtllm] engine {'would be' if args.dry_run else 'is'} in {a.engine}", file=sys.stderr)
        return 0
    # serve
    from build.render import render
    from build.sizing import ModelShape, plan

    try:
        m = check_engine(args.engine) if not args.dry_run or (args.engine / MANIFEST).exists() else None
    except EngineMismatch as e:
        print(f"[trtllm] refusing to serve: {e}", file=sys.stderr)
        return 2
    build_cfg = (m or {}).get("build", {"max_batch_size": 64, "max_seq_len": 16384})
    cfg_path = args.checkpoint / "config.json"
    if cfg_path.is_file():
        sizing = plan(ModelShape.from_hf_config(json.loads(cfg_path.read_text())), args.gpu_mem_gb, "fp8", "fp8",
                      build_cfg["max_seq_len"], build_cfg["max_batch_size"])
        print(f"[trtllm] sizing: {sizing.describe(build_cfg['max_seq_len'], build_cfg['max_batch_size'])}",
              file=sys.stderr)
        if not sizing.fits:
            print("[trtllm] warning: the configured batch cannot fit in the KV cache at full length; requests "
                  "will queue (guaranteed_no_evict) — see docs/sizing.md", file=sys.stderr)
    render("trtllm", args.repo, {"tokenizer_dir": str(args.checkpoint.resolve())}, args.checkpoint)
    _run(serve_command(args.engine, args.repo, args.checkpoint, args.tp * args.pp, args.http_port, args.grpc_port,
                       args.metrics_port), args.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
