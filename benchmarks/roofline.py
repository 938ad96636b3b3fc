"""The roofline of the layered benchmark's workload (issue 21): how many FLOPs a token of it costs, what
this machine can do at most (int8 and float32 GEMMs, memory bandwidth), and how close each layer of the
stack comes at each concurrency.

    .venv/bin/python benchmarks/roofline.py --out benchmarks/results/roofline.json [--bench PATH]

The FLOPs are counted from the model's config.json, not measured: a throughput is only comparable with a
peak once both are in FLOP/s. The peaks are measured here because the CPU's datasheet figure (and its
turbo clock on a shared VM) says little about what MLAS and OpenBLAS reach in practice. The figures of the
stack come from a `benchmarks/triton_bench.py` results file (its `layers` section). Progress goes to
stderr; the report to `--out` (.json, and .md beside it). Run it on a quiet machine: every figure it
measures is a best-of, and a busy neighbour only lowers it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.triton_bench import machine  # noqa: E402
from build.render import DEFAULT_CHECKPOINT  # noqa: E402
from cpu_engine.hf_config import LlamaConfig, read_config  # noqa: E402
from loadtest.matrix import MATRIX, OUTPUT_TOKENS, PROMPT_TOKENS  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
BENCH_FILES = (RESULTS / "latest-peer.json", RESULTS / "latest-layers.json")  # first found is read
WEIGHT_BYTES = {"int8": 1, "bfloat16": 2, "float32": 4}
GIGA = 1e9


def log(msg: str) -> None:
    print(f"[roofline] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- the model


def layer_matrices(cfg: LlamaConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each matrix of one decoder layer; the engine fuses q/k/v and gate/up, which changes
    no FLOP count."""
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    return {"q": (h, cfg.num_heads * hd), "k": (h, cfg.num_kv_heads * hd), "v": (h, cfg.num_kv_heads * hd),
            "o": (cfg.num_heads * hd, h), "gate": (h, i), "up": (h, i), "down": (i, h)}


def attention_flops(cfg: LlamaConfig, context: float) -> float:
    """One query token against `context` cached positions, all layers: q.k and p.v are each
    n_heads x head_dim multiply-adds a position (GQA shares K/V between heads, not the arithmetic)."""
    return 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context


def workload_flops(cfg: LlamaConfig, prompt_tokens: int, output_tokens: int) -> dict:
    """FLOPs of the benchmark's requests per output token, by part (GFLOP/token). A decode token passes
    every layer's 7 matrices and the LM head (vocab x hidden) and attends over its context, taken at
    the workload's average (prompt + half the output). The prefill (the prompt's tokens through the
    layers, causal attention within the prompt; the LM head only for its last row, counted with the
    first output token) is paid once a request, so it is spread over the request's output tokens.
    Not counted: norms, RoPE, softmax, SiLU, sampling (O(hidden) a token, < 1%). This counts one layer
    pass a request more than the engine runs (the last output token is never fed back: 1 in 192 passes)."""
    layer_params = sum(a * b for a, b in layer_matrices(cfg).values())
    layers = 2 * cfg.num_layers * layer_params
    lm_head = 2 * cfg.vocab_size * cfg.hidden_size
    context = prompt_tokens + output_tokens / 2
    attention = attention_flops(cfg, context)
    prefill_matmul = prompt_tokens * layers
    prefill_attention = attention_flops(cfg, prompt_tokens * (prompt_tokens + 1) / 2)  # positions 1..P
    prefill_request = prefill_matmul + prefill_attention
    decode = layers + lm_head + attention
    total = decode + prefill_request / output_tokens
    # what runs in the weights' dtype (the matmuls) and what stays float32 (attention; docs/engine.md)
    matmul = layers + lm_head + prefill_matmul / output_tokens
    return {"prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "average_context": context,
            "params_per_layer": layer_params, "params_layers": cfg.num_layers * layer_params,
            "params_lm_head": cfg.vocab_size * cfg.hidden_size,
            "layers_gflop": layers / GIGA, "lm_head_gflop": lm_head / GIGA, "attention_gflop": attention / GIGA,
            "decode_gflop": decode / GIGA,
            "prefill_gflop_per_request": prefill_request / GIGA,
            "prefill_attention_gflop_per_request": prefill_attention / GIGA,
            "prefill_gflop_per_token": prefill_request / output_tokens / GIGA,
            "matmul_gflop_per_token": matmul / GIGA, "float32_gflop_per_token": (total - matmul) / GIGA,
            "total_gflop_per_token": total / GIGA}


def step_bytes(cfg: LlamaConfig, weight_dtype: str, context: float) -> dict:
    """Bytes one decode step must read: every weight matrix once however many streams it serves (the
    layers' and the LM head's, in the engine's weight dtype; int8 adds a float32 scale per output
    channel), and each stream's K and V (float32) over its context. The embedding is a lookup of one row
    a token, the norms a few KB: left out."""
    per = WEIGHT_BYTES[weight_dtype]
    mats = list(layer_matrices(cfg).values())
    outputs = cfg.num_layers * sum(out for _, out in mats) + cfg.vocab_size
    scales = 4 * outputs if weight_dtype == "int8" else 0
    layers = cfg.num_layers * sum(a * b for a, b in mats) * per
    lm_head = cfg.vocab_size * cfg.hidden_size * per
    return {"weight_dtype": weight_dtype, "layers_bytes": layers, "lm_head_bytes": lm_head, "scale_bytes": scales,
            "weights_bytes": layers + lm_head + scales,
            "kv_bytes_per_stream": cfg.kv_bytes_per_token * context}


# --------------------------------------------------------------------------------------- the machine


def best_seconds(fn, repeats: int, sample_s: float = 0.02) -> float:
    """Per-call seconds: the best of `repeats` samples, each as many calls as fill ~`sample_s` (a small
    GEMM is too short to time alone), after a warm-up call and one that sizes the samples. The best is
    the sample least disturbed by the rest of the machine; the sizing keeps every figure's cost ~0.1 s
    whatever the machine's speed."""
    fn()
    t0 = time.perf_counter()
    fn()
    inner = max(1, min(10_000, int(sample_s / max(time.perf_counter() - t0, 1e-7))))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def ort_session(node_type: str, a_type: int, b: np.ndarray, extra: dict, threads: int):
    """A one-node onnxruntime graph x @ B with B a constant (so MLAS packs it once, as the engine's
    graphs do), on the CPU provider with `threads` intra-op threads."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    out_type = TensorProto.INT32 if node_type == "MatMulInteger" else TensorProto.FLOAT
    inits = [numpy_helper.from_array(b, "B")] + [numpy_helper.from_array(v, k) for k, v in extra.items()]
    inputs = ["A", "B"] + list(extra)
    graph = helper.make_graph([helper.make_node(node_type, inputs, ["Y"])], "gemm",
                              [helper.make_tensor_value_info("A", a_type, ["m", b.shape[0]])],
                              [helper.make_tensor_value_info("Y", out_type, ["m", b.shape[1]])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def gemm_rate(kind: str, m: int, k: int, n: int, threads: int, repeats: int) -> float:
    """GFLOP/s (int8: GOP/s) of [m, k] x [k, n]; kind: float32 (numpy, OpenBLAS), float32-ort (MLAS
    sgemm) or int8 (MLAS u8 x s8 through `MatMulInteger`, as the engine's int8 matmuls)."""
    from onnx import TensorProto

    rng = np.random.default_rng(0)
    flops = 2.0 * m * k * n
    if kind == "float32":
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        out = np.empty((m, n), np.float32)
        seconds = best_seconds(lambda: np.matmul(a, b, out=out), repeats)
    elif kind == "float32-ort":
        a = rng.standard_normal((m, k), dtype=np.float32)
        sess = ort_session("MatMul", TensorProto.FLOAT, rng.standard_normal((k, n), dtype=np.float32), {}, threads)
        seconds = best_seconds(lambda: sess.run(None, {"A": a}), repeats)
    elif kind == "int8":
        a = rng.integers(0, 256, (m, k), dtype=np.uint8)
        b = rng.integers(-127, 128, (k, n), dtype=np.int8)
        sess = ort_session("MatMulInteger", TensorProto.UINT8, b, {"a_zero_point": np.uint8(128)}, threads)
        seconds = best_seconds(lambda: sess.run(None, {"A": a}), repeats)
    else:
        raise ValueError(kind)
    return flops / seconds / GIGA


def read_bandwidth(megabytes: int, threads: int, repeats: int = 3) -> dict:
    """Sequential read GB/s: numpy sums over a float32 array far larger than the caches, on one thread
    and split over `threads` (numpy releases the GIL in the sum), best of `repeats`. A decode step at
    few streams streams every weight once, so this, not the FLOP rate, bounds it."""
    arr = np.ones(megabytes * 2**20 // 4, np.float32)  # written once: every page is backed before timing
    chunks = np.array_split(arr, threads)
    one = best_seconds(lambda: float(arr.sum()), repeats)
    with ThreadPoolExecutor(threads) as pool:
        many = best_seconds(lambda: list(pool.map(lambda c: float(c.sum()), chunks)), repeats)
    return {"array_mb": megabytes, "threads": threads, "one_thread_gb_s": arr.nbytes / one / GIGA,
            "all_threads_gb_s": arr.nbytes / many / GIGA, "gb_s": arr.nbytes / min(one, many) / GIGA}


def measure_peaks(cfg: LlamaConfig, threads: int, gemm: int, int8_rows: int, decode_rows: list[int],
                  repeats: int) -> dict:
    """Big square-ish GEMMs for the machine's peaks, and the decode steps' own shapes (rows = streams,
    hidden x intermediate: the gate/up matmul) for what a step can reach at its size."""
    from cpu_engine import blas

    blas.set_num_threads(threads)  # numpy's OpenBLAS on the same cores as onnxruntime's pool
    h, i = cfg.hidden_size, cfg.intermediate_size
    log(f"float32 GEMM {gemm}x{gemm}x{gemm} (numpy, OpenBLAS) ...")
    f32_numpy = gemm_rate("float32", gemm, gemm, gemm, threads, repeats)
    log(f"  {f32_numpy:.1f} GFLOP/s; float32 GEMM (onnxruntime, MLAS) ...")
    f32_ort = gemm_rate("float32-ort", gemm, gemm, gemm, threads, repeats)
    log(f"  {f32_ort:.1f} GFLOP/s; int8 GEMM {int8_rows}x{gemm}x{gemm} (onnxruntime MatMulInteger) ...")
    i8 = gemm_rate("int8", int8_rows, gemm, gemm, threads, repeats)
    log(f"  {i8:.1f} GOP/s; decode shapes {decode_rows} x {h} x {i} ...")
    decode = {str(r): {"float32_numpy": gemm_rate("float32", r, h, i, threads, repeats),
                       "float32_ort": gemm_rate("float32-ort", r, h, i, threads, repeats),
                       "int8": gemm_rate("int8", r, h, i, threads, repeats)} for r in decode_rows}
    for r, d in decode.items():
        log(f"  {r} rows: int8 {d['int8']:.1f} GOP/s, float32 {d['float32_ort']:.1f} (ort) / "
            f"{d['float32_numpy']:.1f} (numpy) GFLOP/s")
    return {"threads": threads,
            "shapes": {"float32": [gemm, gemm, gemm], "int8": [int8_rows, gemm, gemm], "decode": [h, i]},
            "float32_numpy_gflops": f32_numpy, "float32_ort_gflops": f32_ort,
            # the better of the two float32 GEMM libraries this stack uses is the float32 peak
            "float32_gflops": max(f32_numpy, f32_ort), "int8_gops": i8, "decode_shapes": decode}


# ----------------------------------------------------------------------------------------- the report


def ceilings(flops: dict, bytes_: dict, peaks: dict, bandwidth_gb_s: float, streams: int) -> dict:
    """The tok/s no implementation can beat at `streams` concurrent streams. Compute: the matmuls at the
    GEMM peak of the weights' dtype plus attention at the float32 peak (the two do not overlap in a step).
    Memory: a decode step reads the weights once and each stream's K/V, and yields one token a stream.
    The roofline is the lower of the two."""
    matmul_peak = peaks["int8_gops"] if bytes_["weight_dtype"] == "int8" else peaks["float32_gflops"]
    seconds = flops["matmul_gflop_per_token"] / matmul_peak + flops["float32_gflop_per_token"] / peaks["float32_gflops"]
    compute = 1 / seconds
    memory = streams * bandwidth_gb_s * GIGA / (bytes_["weights_bytes"] + streams * bytes_["kv_bytes_per_stream"])
    return {"streams": streams, "compute_tok_s": compute, "bandwidth_tok_s": memory,
            "roofline_tok_s": min(compute, memory), "bound": "compute" if compute < memory else "memory"}


def load_bench(path: Path | None) -> tuple[Path | None, dict | None]:
    """The layered benchmark's results: `path`, else the first of BENCH_FILES that exists."""
    for p in [path] if path else BENCH_FILES:
        if p.is_file():
            return p, json.loads(p.read_text())
    if path:
        raise SystemExit(f"--bench {path}: no such file")
    return None, None


def bench_levels(bench: dict) -> list[dict]:
    """[{concurrency, by_layer: {layer: tok/s}}]: from the `layers` section, or (a results file of the
    engine alone) its `levels` as the one layer it measured."""
    if bench.get("layers"):
        return [{"concurrency": int(lvl["concurrency"]),
                 "by_layer": {name: float(r["output_tok_s"]) for name, r in lvl["by_layer"].items()}}
                for lvl in bench["layers"]["levels"]]
    layer = (bench.get("workload") or {}).get("layer", "ensemble")
    return [{"concurrency": int(lvl["concurrency"]), "by_layer": {layer: float(lvl["output_tok_s"])}}
            for lvl in bench.get("levels", [])]


def achieved(levels: list[dict], flops: dict, bytes_: dict, peaks: dict, bandwidth_gb_s: float) -> list[dict]:
    """Per level and layer: GFLOP/s = tok/s x GFLOP/token, and its fraction of each peak, of the int8
    rate at the level's decode shape (rows = streams, where measured) and of the roofline's tok/s."""
    out = []
    for lvl in levels:
        conc = lvl["concurrency"]
        roof = ceilings(flops, bytes_, peaks, bandwidth_gb_s, conc)
        shape = peaks["decode_shapes"].get(str(conc))
        rows = {}
        for name, tok_s in lvl["by_layer"].items():
            gflops = tok_s * flops["total_gflop_per_token"]
            rows[name] = {"output_tok_s": tok_s, "gflops": gflops,
                          "of_int8_peak": gflops / peaks["int8_gops"],
                          "of_float32_peak": gflops / peaks["float32_gflops"],
                          "of_int8_decode_shape": gflops / shape["int8"] if shape else None,
                          "of_roofline": tok_s / roof["roofline_tok_s"]}
        out.append({"concurrency": conc, "ceiling": roof, "by_layer": rows})
    return out


def markdown(report: dict) -> str:
    f, p, bw, b = report["flops"], report["peaks"], report["bandwidth"], report["step_bytes"]
    m = report["machine"]
    lines = [f"# Roofline ({report['date']})", "",
             f"`{report['command']}` on {m['cpu']}, {m['cores']} cores (flags: {' '.join(m.get('cpu_flags', []))}); "
             f"weights {b['weight_dtype']}.", "",
             "| GFLOP per output token | value |", "|---|---|"]
    for key in ("layers_gflop", "lm_head_gflop", "attention_gflop", "decode_gflop", "prefill_gflop_per_token",
                "total_gflop_per_token", "matmul_gflop_per_token", "float32_gflop_per_token"):
        lines.append(f"| {key.replace('_gflop', '').replace('_', ' ')} | {f[key]:.4f} |")
    lines += ["", f"Prefill: {f['prefill_gflop_per_request']:.3f} GFLOP a request ({f['prompt_tokens']} tokens), "
              f"over {f['output_tokens']} output tokens; attention at the average context {f['average_context']:g}.",
              "", "| peak | rate |", "|---|---|",
              f"| float32 GEMM {'x'.join(map(str, p['shapes']['float32']))}, numpy | "
              f"{p['float32_numpy_gflops']:.1f} GFLOP/s |",
              f"| float32 GEMM, onnxruntime | {p['float32_ort_gflops']:.1f} GFLOP/s |",
              f"| int8 GEMM {'x'.join(map(str, p['shapes']['int8']))}, MatMulInteger | {p['int8_gops']:.1f} GOP/s |"]
    for rows, d in p["decode_shapes"].items():
        lines.append(f"| decode shape {rows}x{p['shapes']['decode'][0]}x{p['shapes']['decode'][1]}: int8 / "
                     f"float32 ort / float32 numpy | {d['int8']:.1f} / {d['float32_ort']:.1f} / "
                     f"{d['float32_numpy']:.1f} |")
    lines += [f"| read bandwidth, {bw['array_mb']} MB: 1 thread / {bw['threads']} threads | "
              f"{bw['one_thread_gb_s']:.1f} / {bw['all_threads_gb_s']:.1f} GB/s |", "",
              f"A decode step reads {b['weights_bytes'] / 1e6:.1f} MB of weights and "
              f"{b['kv_bytes_per_stream'] / 1e6:.2f} MB of K/V a stream.", "",
              "| streams | compute ceiling tok/s | bandwidth ceiling tok/s | bound |", "|---|---|---|---|"]
    for c in report["ceilings"]:
        lines.append(f"| {c['streams']} | {c['compute_tok_s']:.0f} | {c['bandwidth_tok_s']:.0f} | {c['bound']} |")
    if report["bench"]:
        note = (" (the matmuls run in int8, so a fraction of the float32 peak may pass 100%)"
                if b["weight_dtype"] == "int8" else "")
        lines += ["", f"Achieved, from `{report['bench']['path']}` ({report['bench'].get('date')}): GFLOP/s = "
                  f"tok/s x {f['total_gflop_per_token']:.4f} GFLOP/token{note}.", "",
                  "| streams | layer | tok/s | GFLOP/s | of int8 peak | of float32 peak | of int8 at decode shape "
                  "| of roofline |", "|---|---|---|---|---|---|---|---|"]
        for lvl in report["bench"]["levels"]:
            for name, r in lvl["by_layer"].items():
                shape = "n/a" if r["of_int8_decode_shape"] is None else f"{100 * r['of_int8_decode_shape']:.1f}%"
                lines.append(f"| {lvl['concurrency']} | {name} | {r['output_tok_s']:.1f} | {r['gflops']:.1f} | "
                             f"{100 * r['of_int8_peak']:.1f}% | {100 * r['of_float32_peak']:.1f}% | {shape} | "
                             f"{100 * r['of_roofline']:.1f}% |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=RESULTS / "roofline.json", help="the report (.json, .md beside it)")
    ap.add_argument("--bench", type=Path, help="a triton_bench.py results file (default: "
                    "benchmarks/results/latest-peer.json, else latest-layers.json)")
    ap.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT, help="HF folder (its config.json)")
    ap.add_argument("--weight-dtype", choices=sorted(WEIGHT_BYTES),
                    help="the engine's matmul dtype (default: what the bench file's `auto` resolved to, else "
                         "what it resolves to here)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="intra-op threads (default: all cores)")
    ap.add_argument("--gemm", type=int, default=2048, help="size of the peak GEMMs (float32 n x n x n)")
    ap.add_argument("--int8-rows", type=int, default=256, help="rows of the int8 peak GEMM")
    ap.add_argument("--bandwidth-mb", type=int, default=1024, help="array size of the read-bandwidth test")
    ap.add_argument("--repeats", type=int, default=5, help="timings per figure (the best is kept)")
    args = ap.parse_args(argv)
    command = " ".join(["benchmarks/roofline.py"] + (sys.argv[1:] if argv is None else list(argv)))

    cfg = LlamaConfig.from_hf(read_config(args.checkpoint))
    bench_path, bench = load_bench(args.bench)
    workload = (bench or {}).get("workload") or {}
    prompt = int(workload.get("prompt_tokens", PROMPT_TOKENS))
    output = int(workload.get("output_tokens", OUTPUT_TOKENS))
    weight_dtype = args.weight_dtype or ((bench or {}).get("resolved") or {}).get("weight_dtype")
    if weight_dtype is None:
        from cpu_engine.config import resolve_backends

        weight_dtype = resolve_backends("auto", "auto", "auto")["weight_dtype"]
    if weight_dtype not in WEIGHT_BYTES:
        raise SystemExit(f"weight dtype {weight_dtype!r}: one of {', '.join(WEIGHT_BYTES)}")
    flops = workload_flops(cfg, prompt, output)
    bytes_ = step_bytes(cfg, weight_dtype, flops["average_context"])
    log(f"{flops['total_gflop_per_token']:.4f} GFLOP/output token ({flops['decode_gflop']:.4f} decode + "
        f"{flops['prefill_gflop_per_token']:.4f} prefill); weights {weight_dtype}, "
        f"{bytes_['weights_bytes'] / 1e6:.1f} MB a step")

    levels = bench_levels(bench) if bench else []
    streams = sorted({lvl["concurrency"] for lvl in levels} or {c for c, _ in MATRIX})
    peaks = measure_peaks(cfg, args.threads, args.gemm, args.int8_rows, streams, args.repeats)
    log(f"read bandwidth over {args.bandwidth_mb} MB ...")
    bw = read_bandwidth(args.bandwidth_mb, args.threads)
    log(f"  {bw['one_thread_gb_s']:.1f} GB/s one thread, {bw['all_threads_gb_s']:.1f} GB/s {args.threads} threads")

    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": command,
              "machine": machine(), "checkpoint": str(args.checkpoint),
              "model": {k: getattr(cfg, k) for k in ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                                                     "num_kv_heads", "head_dim", "vocab_size")},
              "flops": flops, "step_bytes": bytes_, "peaks": peaks, "bandwidth": bw,
              "ceilings": [ceilings(flops, bytes_, peaks, bw["gb_s"], s) for s in streams],
              "bench": None}
    if bench:
        shown = bench_path.resolve()
        shown = shown.relative_to(ROOT) if shown.is_relative_to(ROOT) else shown  # the repository's files by their path in it
        report["bench"] = {"path": str(shown), "date": bench.get("date"),
                           "levels": achieved(levels, flops, bytes_, peaks, bw["gb_s"])}
    else:
        log("no benchmark results file: peaks and ceilings only")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    log(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return report


if __name__ == "__main__":
    main()
