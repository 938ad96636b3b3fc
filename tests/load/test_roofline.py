"""benchmarks/roofline.py (issue 21): the analytical FLOP count against a hand count on a made-up model,
and the report's fractions (achieved / peak) on a made-up benchmark file; the measuring path runs once on
tiny shapes."""
import json

import pytest

from benchmarks import roofline
from cpu_engine.hf_config import LlamaConfig

TINY = {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 4, "vocab_size": 10, "tie_word_embeddings": True}
GIGA = 1e9


def tiny() -> LlamaConfig:
    return LlamaConfig.from_hf(TINY)


def test_flops_match_a_hand_count():
    f = roofline.workload_flops(tiny(), prompt_tokens=4, output_tokens=2)
    # a layer: q 8x8 + k 8x4 + v 8x4 + o 8x8 + gate 8x16 + up 8x16 + down 16x8 = 576 weights
    assert f["params_per_layer"] == 576
    assert f["layers_gflop"] * GIGA == pytest.approx(2 * 2 * 576)            # 2 FLOP a weight, 2 layers
    assert f["lm_head_gflop"] * GIGA == pytest.approx(2 * 10 * 8)             # vocab x hidden
    assert f["average_context"] == 5                                          # 4 prompt + 2 / 2
    assert f["attention_gflop"] * GIGA == pytest.approx(2 * 2 * 2 * 2 * 4 * 5)  # q.k, p.v; layers, heads, dim
    assert f["decode_gflop"] * GIGA == pytest.approx(2304 + 160 + 320)
    # prefill: 4 tokens through the layers, causal attention over positions 1 + 2 + 3 + 4 = 10
    assert f["prefill_gflop_per_request"] * GIGA == pytest.approx(4 * 2304 + 2 * 2 * 2 * 2 * 4 * 10)
    assert f["prefill_gflop_per_token"] * GIGA == pytest.approx((9216 + 640) / 2)
    assert f["total_gflop_per_token"] * GIGA == pytest.approx(2784 + 4928)
    assert f["matmul_gflop_per_token"] * GIGA == pytest.approx(2304 + 160 + 9216 / 2)
    assert (f["matmul_gflop_per_token"] + f["float32_gflop_per_token"]) == pytest.approx(f["total_gflop_per_token"])


def test_step_bytes_match_a_hand_count():
    b = roofline.step_bytes(tiny(), "int8", context=5)
    # int8 weights, plus a float32 scale per output channel: (8+4+4+8+16+16+8) x 2 layers + vocab 10
    assert b["weights_bytes"] == 2 * 576 + 80 + 4 * (64 * 2 + 10)
    assert b["kv_bytes_per_stream"] == 2 * 2 * 1 * 4 * 4 * 5                  # K,V x layers x kv heads x dim x fp32
    assert roofline.step_bytes(tiny(), "float32", 5)["weights_bytes"] == 4 * (2 * 576 + 80)


PEAKS = {"int8_gops": 400.0, "float32_gflops": 100.0,
         "decode_shapes": {"1": {"int8": 50.0}, "4": {"int8": 120.0}}}
BENCH = {"date": "made up", "workload": {"prompt_tokens": 4, "output_tokens": 2},
         "layers": {"levels": [
             {"concurrency": 1, "by_layer": {"ensemble": {"output_tok_s": 40.0}, "front": {"output_tok_s": 30.0}}},
             {"concurrency": 4, "by_layer": {"ensemble": {"output_tok_s": 120.0}}}]}}


def test_fractions_are_achieved_over_peak():
    cfg = tiny()
    f = roofline.workload_flops(cfg, 4, 2)
    b = roofline.step_bytes(cfg, "int8", f["average_context"])
    out = roofline.achieved(roofline.bench_levels(BENCH), f, b, PEAKS, bandwidth_gb_s=2.0)
    assert [lvl["concurrency"] for lvl in out] == [1, 4]
    for lvl in out:
        c = lvl["concurrency"]
        compute = 1 / (f["matmul_gflop_per_token"] / 400.0 + f["float32_gflop_per_token"] / 100.0)
        memory = c * 2.0e9 / (b["weights_bytes"] + c * b["kv_bytes_per_stream"])
        assert lvl["ceiling"]["compute_tok_s"] == pytest.approx(compute)
        assert lvl["ceiling"]["bandwidth_tok_s"] == pytest.approx(memory)
        assert lvl["ceiling"]["roofline_tok_s"] == pytest.approx(min(compute, memory))
        for name, r in lvl["by_layer"].items():
            given = next(x for x in BENCH["layers"]["levels"] if x["concurrency"] == c)
            tok_s = given["by_layer"][name]["output_tok_s"]
            assert r["gflops"] == pytest.approx(tok_s * f["total_gflop_per_token"])
            assert r["of_int8_peak"] == pytest.approx(r["gflops"] / 400.0)
            assert r["of_float32_peak"] == pytest.approx(r["gflops"] / 100.0)
            assert r["of_int8_decode_shape"] == pytest.approx(r["gflops"] / PEAKS["decode_shapes"][str(c)]["int8"])
            assert r["of_roofline"] == pytest.approx(tok_s / min(compute, memory))


def test_an_engine_only_results_file_reads_as_one_layer():
    bench = {"workload": {"layer": "ensemble"}, "levels": [{"concurrency": 16, "output_tok_s": 300.0}]}
    assert roofline.bench_levels(bench) == [{"concurrency": 16, "by_layer": {"ensemble": 300.0}}]


def test_rates_are_the_work_over_the_measured_seconds(monkeypatch):
    """Each measured figure is its known amount of work over the seconds best_seconds timed (here a fixed
    1 ms a call), so a wrong FLOP count, shape or unit fails."""
    calls = []
    monkeypatch.setattr(roofline, "best_seconds", lambda fn, repeats, sample_s=0.02: (calls.append(fn), 1e-3)[1])
    assert roofline.gemm_rate("float32", 3, 5, 7, threads=1, repeats=1) == pytest.approx(2 * 3 * 5 * 7 / 1e-3 / GIGA)
    assert roofline.gemm_rate("int8", 16, 64, 32, threads=1, repeats=1) == pytest.approx(2 * 16 * 64 * 32 / 1e-3 / GIGA)
    bw = roofline.read_bandwidth(megabytes=2, threads=2, repeats=1)
    assert bw["one_thread_gb_s"] == bw["all_threads_gb_s"] == bw["gb_s"] == pytest.approx(2 * 2**20 / 1e-3 / GIGA)
    assert len(calls) == 4  # two GEMMs, the one-thread and the threaded read


def test_the_script_end_to_end_on_tiny_shapes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(BENCH))
    out = tmp_path / "roof.json"
    report = roofline.main(["--checkpoint", str(tmp_path), "--bench", str(bench), "--out", str(out),
                            "--weight-dtype", "int8", "--gemm", "64", "--int8-rows", "16",
                            "--bandwidth-mb", "8", "--repeats", "1"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert out.with_suffix(".md").read_text().startswith("# Roofline")
    p, bw = report["peaks"], report["bandwidth"]
    assert set(p["decode_shapes"]) == {"1", "4"} and report["machine"]["cores"] >= 1
    # the peaks are the best of what was measured, and every ceiling is the roofline of those figures
    assert p["float32_gflops"] == max(p["float32_numpy_gflops"], p["float32_ort_gflops"])
    assert bw["gb_s"] == pytest.approx(max(bw["one_thread_gb_s"], bw["all_threads_gb_s"]))
    assert report["ceilings"] == [roofline.ceilings(report["flops"], report["step_bytes"], p, bw["gb_s"], s)
                                  for s in (1, 4)]
    for c in report["ceilings"]:
        assert c["roofline_tok_s"] == min(c["compute_tok_s"], c["bandwidth_tok_s"])
    total = report["flops"]["total_gflop_per_token"]
    row = report["bench"]["levels"][0]["by_layer"]["ensemble"]
    assert row["gflops"] == pytest.approx(40.0 * total)
    assert row["of_int8_peak"] == pytest.approx(40.0 * total / p["int8_gops"])
    assert report["command"].startswith("benchmarks/roofline.py --checkpoint")
