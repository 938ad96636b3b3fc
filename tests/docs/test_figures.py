"""Every figure the README quotes comes from a committed results file (issue 19): each headline names the
file and the text it comes from, and a decimal figure in the README's benchmark section that no headline
accounts for fails."""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"

# README text -> (results file, the text in that file it is read from)
HEADLINES = {
    "| 1 | 105.2 | 77.0 | 75.2 | 77.5 | 0.736x | 0.987x | 0.992x |":
        ("latest-peer.md", "| 1 | 105.2 | 77.0 | 75.2 | 77.5 | 0.736x | 0.987x | 0.992x |"),
    "| 4 | 137.8 | 190.5 | 179.5 | 170.9 | 1.400x | 0.906x | 0.895x |":
        ("latest-peer.md", "| 4 | 137.8 | 190.5 | 179.5 | 170.9 | 1.400x | 0.906x | 0.895x |"),
    "| 16 | 170.6 | 370.4 | 363.3 | 339.4 | 2.430x | 0.933x | 0.934x |":
        ("latest-peer.md", "| 16 | 170.6 | 370.4 | 363.3 | 339.4 | 2.430x | 0.933x | 0.934x |"),
    "3404.8 ms the peer, 955.1 / 835.6 / 804.7 ms": ("latest-peer.md", "| 3404.8 / 955.1 / 835.6 / 804.7 |"),
    "RSS 2254 MB": ("latest-peer.md", "Server resident memory after the runs: 2254 MB"),
    "the front 71 MB": ("latest-peer.md", "the front 71 MB"),
    "0.3851\nGFLOP per output token": ("roofline.md", "| total per token | 0.3851 |"),
    "850.2 GOP/s": ("roofline.md", "| 850.2 GOP/s |"),
    "33.9 GB/s": ("roofline.md", "22.6 / 33.9 GB/s"),
}


def section() -> str:
    text = (ROOT / "README.md").read_text()
    return text[text.index("## Load tests and benchmarks"):text.index("## GPU (H100) path")]


def kl_range() -> str:
    prompts = json.loads((RESULTS / "precision.json").read_text())["prompts"].values()
    kl = [p["kl_mean_nats"] for p in prompts]
    return f"mean KL {min(kl):.3f}-{max(kl):.3f} nats"


def capacity_16_core() -> str:
    """The README's 16-core capacity sentence, made from the 2026-11-28 runs' files: the front against the
    engine read directly in the same report (4 workers), the TTFT p95 it adds at 64 streams, its best tok/s
    at 256 streams and the engine's own there."""
    runs = {p.stem: json.loads(p.read_text())["runs"] for p in RESULTS.glob("2026-11-28-capacity-16core-*.json")}
    same = [{(r["layer"], r["streams"]): r for r in runs[f"2026-11-28-capacity-16core-{n}-workers-4"]}
            for n in ("targets", "overheads-tail")]
    ratio = lambda s: [run[("front", s)]["tok_s"] / run[("engine_http", s)]["tok_s"] for run in same if ("front", s) in run]  # noqa: E731
    at_64 = same[0][("front", 64)]["ttft_ms"]["p95"] - same[0][("engine_http", 64)]["ttft_ms"]["p95"]
    front_256 = [r["tok_s"] for rs in runs.values() for r in rs if r["layer"] == "front" and r["streams"] == 256]
    engine_256 = [run[("engine_http", 256)]["tok_s"] for run in same]
    return (f"{min(ratio(64)):.2f}x the tok/s of the engine read directly at 64 streams (adding {at_64:.0f} ms to "
            f"TTFT p95), {min(ratio(256)):.2f}-{max(ratio(256)):.2f}x at 256 and {min(ratio(1024)):.2f}-"
            f"{max(ratio(1024)):.2f}x at 1,024; the goal of 25,000 tok/s at 256 streams is not met (best "
            f"{max(front_256):,.0f}, against the engine's own {min(engine_256):,.0f}-{max(engine_256):,.0f})")


def served_lane_2_core() -> str:
    """The README's 2-core sentence on the per-token path served: what the compiled lane adds to the relay at 16
    streams, and that against its hot cost (benchmarks/results/2026-11-29-relay-lane-served.json)."""
    report = json.loads((RESULTS / "2026-11-29-relay-lane-served.json").read_text())
    added = report["by_streams"]["16"]["added_us_per_token_mean"]["compiled"]
    return f"adds {added} µs a token to the relay's, {round(added / report['hot']['compiled']['us_per_token'])}x what it costs hot"


def wakeups_2_core() -> str:
    """The README's 2-core sentence on wake-ups: what one costs across the host's two cores and on one, and how
    often the front and the relay are woken a token at 16 streams (benchmarks/results/2026-11-29-wakeups.json)."""
    report = json.loads((RESULTS / "2026-11-29-wakeups.json").read_text())
    cost, by = report["wakeup_cost"]["cpu_us_per_side_median"], report["by_streams"]["16"]
    return (f"costs each side {cost['two_cores/idle/none']} µs of CPU against {cost['one_core/idle/none']} on one "
            f"core (`benchmarks/wakeup_bench.py`), and the front is woken as often a token as the relay "
            f"({by['front']['wakeups_per_token_mean']} and {by['relay']['wakeups_per_token_mean']} times at 16 streams")


def test_the_16_core_capacity_sentence_is_its_results_files():
    assert capacity_16_core() in section().replace("\n", " ")


def test_each_headline_is_in_the_readme_and_in_its_results_file():
    readme = section()
    for quoted, (name, source) in HEADLINES.items():
        assert quoted in readme, quoted
        assert source in (RESULTS / name).read_text(), (name, source)


def test_the_precision_figure_is_the_results_file_range():
    assert kl_range() in section().replace("\n", " ")


def test_no_decimal_figure_without_a_source():
    accounted = " ".join(HEADLINES) + " " + kl_range() + " " + capacity_16_core() + " " + served_lane_2_core() + " " \
        + wakeups_2_core()
    figures = set(re.findall(r"(?<![\w.])\d+\.\d+(?![\w.])", section()))
    assert figures and {f for f in figures if f not in accounted} == set()


def test_the_engine_docs_tables_are_the_engine_and_kernel_results_files():
    """docs/engine.md quotes benchmarks/results/engine.json and kernels.json row for row."""
    doc = (ROOT / "docs" / "engine.md").read_text()
    kernels = json.loads((RESULTS / "kernels.json").read_text())
    for case, v in kernels["cases"].items():
        assert f"| {case} | {v['numpy']:.2f} | {v['compiled']:.2f} | {v['int8']:.2f} |" in doc, case
    engine = json.loads((RESULTS / "engine.json").read_text())
    for lv in engine["levels"]:
        assert (f"| {lv['streams']} | {lv['requests']} | {lv['tok_s']} | {lv['ttft_p50_s']} / {lv['ttft_p95_s']} | "
                f"{lv['step_ms_mean']} ({lv['step_ms_p50']}) |") in doc, lv["streams"]
    assert kernels["date"] in doc and engine["date"] in doc


def test_the_lora_table_is_the_lora_results_file():
    """docs/benchmarks.md's LoRA table is benchmarks/results/lora.json, row for row."""
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    result = json.loads((RESULTS / "lora.json").read_text())
    by = {(lv["workload"], lv["streams"]): lv for lv in result["levels"] if lv["engine"] == "lora_engine"}
    for streams in sorted({s for _, s in by}):
        base, lora = by[("base", streams)], by[("lora", streams)]
        rounds = [100 * (1 - lo / b) for lo, b in zip(lora["tok_s_rounds"], base["tok_s_rounds"])]
        prefix = f"| {streams} | {base['tok_s']} | {lora['tok_s']} | "
        row = next((line for line in doc.splitlines() if line.startswith(prefix)), None)
        assert row is not None, prefix
        assert f"{result['lora_slowdown_pct'][str(streams)]}%" in row, row
        assert f"({min(rounds):.1f}-{max(rounds):.1f}%)" in row, row
        assert row.endswith(f"| {base['step_ms']} ms | {lora['step_ms']} ms |"), row
    assert result["date"] in doc


def test_the_engine_precision_table_is_the_8_and_7_bit_results_files():
    """docs/engine.md's Precision table quotes precision.json (8-bit) and precision-7bit.json row for row."""
    doc = (ROOT / "docs" / "engine.md").read_text()
    eight, seven = (json.loads((RESULTS / name).read_text()) for name in ("precision.json", "precision-7bit.json"))
    assert seven["int8_weight_bits"] == 7 and eight.get("int8_weight_bits", 8) == 8
    for name, e in eight["prompts"].items():
        s = seven["prompts"][name]
        row = (f"| {name} | {e['top1_agree']:.3f} | {e['kl_mean_nats']:.4f} | {s['top1_agree']:.3f} | "
               f"{s['kl_mean_nats']:.4f} | {s['kl_max_nats']:.3f} |")
        assert row in doc, row


def test_the_capacity_tables_are_the_capacity_results_files():
    """docs/benchmarks.md's Capacity tables are the rows of capacity.md and of the run before the leases."""
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    for name in ("capacity.md", "2026-11-25-capacity-front-via-gateway.md"):
        rows = [line for line in (RESULTS / name).read_text().splitlines() if line.startswith("| ")]
        shown = [row for row in rows if row in doc]
        assert shown and all(row in doc for row in rows if "| front |" in row), name
    runs = json.loads((RESULTS / "capacity.json").read_text())["runs"]
    assert {r["layer"] for r in runs} == {"ensemble", "gateway", "front"} and {r["streams"] for r in runs} == {16, 64, 256, 1024}


def test_the_16_core_capacity_table_is_its_results_files():
    """docs/benchmarks.md's 16-core table is capacity_bench.summary of the runs' files, in the doc's order,
    and each file's .md is what the benchmark makes of its JSON."""
    from benchmarks.capacity_bench import markdown, summary

    order = ["run1-workers-4", "run1-workers-2", "run1-workers-1", "run2-workers-8", "run2-workers-4",
             "run2-workers-2", "run2-workers-1", "run3-workers-8", "run3-stop-storm"]
    reports = {n: json.loads((RESULTS / f"2026-11-26-capacity-16core-{n}.json").read_text()) for n in order}
    assert summary(reports) in (ROOT / "docs" / "benchmarks.md").read_text()
    assert {p.stem.removeprefix("2026-11-26-capacity-16core-") for p in RESULTS.glob("2026-11-26-capacity-16core-*.json")} == set(order)
    for path in [*RESULTS.glob("2026-11-26-capacity-16core-*.json"), *RESULTS.glob("2026-11-26-capacity-stop-storm-*.json")]:
        report = json.loads(path.read_text())
        assert path.with_suffix(".md").read_text() == markdown(report), path.name
        assert report["machine"]["cores"] == (16 if "16core" in path.name else 2)


def test_the_16_core_http_capacity_table_is_its_results_files():
    """The second 16-core table (the front reading the engine over HTTP) is capacity_bench.summary of its
    runs' files, in the doc's order; each was taken on 16 cores, and each .md is its JSON's markdown."""
    from benchmarks.capacity_bench import markdown, summary

    prefix = "2026-11-27-capacity-16core-http-"
    order = [f"run{r}-{n}" for r in (1, 2) for n in ("workers-4", "workers-1", "workers-2", "workers-6", "stop-storm")]
    order.append("engine-256")
    reports = {n: json.loads((RESULTS / f"{prefix}{n}.json").read_text()) for n in order}
    assert summary(reports) in (ROOT / "docs" / "benchmarks.md").read_text()
    assert {p.stem.removeprefix(prefix) for p in RESULTS.glob(f"{prefix}*.json")} == set(order)
    for name, report in reports.items():
        assert (RESULTS / f"{prefix}{name}.md").read_text() == markdown(report), name
        assert report["machine"]["cores"] == 16


def test_the_16_core_targets_tables_are_their_results_files():
    """The third 16-core section (issue 28's targets, two device calls): capacity_bench.summary of its
    reports in the doc's order, and capacity_bench.tails of those with tails; each taken on 16 cores, each
    .md its JSON's markdown."""
    from benchmarks.capacity_bench import markdown, summary, tails

    prefix = "2026-11-28-capacity-16core-"
    order = [f"targets-{n}" for n in ("workers-4", "workers-1", "workers-2", "threads-4", "workers-4-again",
                                      "workers-2-again")]
    order += [f"overheads-{n}" for n in ("tail-workers-4", "short-workers-4", "short-workers-1", "short-workers-2")]
    reports = {n: json.loads((RESULTS / f"{prefix}{n}.json").read_text()) for n in order}
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    assert summary(reports) in doc
    assert tails({n: r for n, r in reports.items() if n.startswith("overheads-")}) in doc
    assert {p.stem.removeprefix(prefix) for p in RESULTS.glob(f"{prefix}*.json")} == set(order)
    for name, report in reports.items():
        assert (RESULTS / f"{prefix}{name}.md").read_text() == markdown(report), name
        assert report["machine"]["cores"] == 16
    for threads in (0, 4):
        assert json.loads((RESULTS / f"2026-11-28-admission-16core-threads-{threads}.json").read_text())["machine"]["cores"] == 16


def test_the_adapter_lease_figures_are_their_results_files():
    """docs/benchmarks.md's adapter requests on leases: the gateway's and tritonserver's µs a token and the
    tok/s of each run, from the capacity reports the summary was made of."""
    text = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    pairs = json.loads((RESULTS / "2026-11-29-adapter-leases.json").read_text())["pairs"]

    def runs(code, key):
        return ", ".join(str(p[key]) for p in pairs if p["code"] == code)

    for path in RESULTS.glob("2026-11-29-adapter-leases-128-tokens-*.json"):
        run = json.loads(path.read_text())["runs"][0]
        row = next(p for p in pairs if p["file"] == path.name)
        assert row["gateway_us_per_token"] == run["cpu_us_per_token"]["gateway_0_0"]
        assert json.loads(path.read_text())["workload"]["adapter"] == "demo-bench"
    assert (f"The gateway's process: {runs('before', 'gateway_us_per_token')} µs a token before against "
            f"{runs('after', 'gateway_us_per_token')} after") in text
    assert (f"tritonserver {runs('before', 'tritonserver_us_per_token')} against "
            f"{runs('after', 'tritonserver_us_per_token')}") in text
    assert f"Streamed: {runs('before', 'tok_s')} tok/s before against {runs('after', 'tok_s')} after" in text


def test_the_protocol_table_is_its_results_file():
    from benchmarks.capacity_bench import markdown

    report = json.loads((RESULTS / "2026-11-26-engine-protocols.json").read_text())
    written = (RESULTS / "2026-11-26-engine-protocols.md").read_text()
    assert written == markdown(report)
    rows = [line for line in written.splitlines() if line.startswith("| ")]
    assert len(rows) == 5 and all(row in (ROOT / "docs" / "benchmarks.md").read_text() for row in rows)


def test_the_speculative_decoding_tables_are_their_results_files():
    """docs/benchmarks.md quotes each speculative-decoding results file's table row for row, and each table
    is what benchmarks/spec_decode_bench.py's `table` makes of its JSON (the figures come from the runs)."""
    from benchmarks.spec_decode_bench import table

    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    files = sorted(RESULTS.glob("*spec-decode*.json"))
    assert files
    for path in files:
        results = json.loads(path.read_text())
        written = path.with_suffix(".md").read_text()
        assert written == table(results), path.name
        rows = [line for line in written.splitlines() if line.startswith("| ")]
        assert rows and all(row in doc for row in rows), path.name
        assert results["date"] in doc
        assert all(lv["same_tokens_all_pairs"] for lv in results["levels"] if lv["streams"] == 1), path.name


def test_the_early_exit_table_is_its_results_file():
    from benchmarks.early_exit_bench import table

    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    for path in sorted(RESULTS.glob("*early-exit*.json")):
        written = path.with_suffix(".md").read_text()
        assert written == table(json.loads(path.read_text())), path.name
        assert all(row in doc for row in written.splitlines() if row.startswith("| ")), path.name


def noisy_row(name: str) -> str:
    r = json.loads((RESULTS / name).read_text())
    v, e = r["victim"], r["engine"]
    flood = {path: sum(c.values()) for path, c in r["flood"]["answers"].items()}
    refused = sum(c.get("400", 0) + c.get("429", 0) for c in r["flood"]["answers"].values())
    return (f"| `{name}` | {v['idle']['p50_s']} / {v['idle']['p95_s']} | {v['loaded']['p50_s']} / {v['loaded']['p95_s']} "
            f"| {v['p95_loaded_over_idle']}x | {refused} of {sum(flood.values())} | {r['long_streams']['tokens_per_s']} "
            f"| {e['waiting_max']} ({e['waiting_mean']}) |")


def test_the_noisy_neighbour_table_is_its_results_files():
    """docs/benchmarks.md's noisy-neighbour table quotes each committed run, row for row (issue 29)."""
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    names = sorted(p.name for p in RESULTS.glob("*noisy-neighbour*.json"))
    assert names
    for name in names:
        assert noisy_row(name) in doc, noisy_row(name)


def _engine_protocol_rows(name: str) -> list[str]:
    """The rows of a front engine-protocol results file (merged alternated capacity_bench runs) as
    docs/benchmarks.md tabulates them."""
    data = json.loads((RESULTS / name).read_text())
    rows = []
    for streams in (64, 256):
        for run in data["runs"]:
            for r in run["levels"]:
                if r["streams"] == streams:
                    c = r["cpu_us_per_token"]
                    rows.append(f"| {streams} | {run['variant']} | {run['run'].split('-')[0]} | "
                                f"{run['load']['start']['loadavg_1_5_15'][0]} | {round(r['tok_s'])} | "
                                f"{r['ttft_ms']['p95']} | {c.get('front')} | {c.get('tritonserver')} |")
    return rows


def test_the_front_engine_protocol_tables_are_their_results_files():
    """docs/benchmarks.md's gRPC-vs-HTTP front tables (issue 28) quote each run of their files, row for row."""
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    for name in ("2026-11-27-front-engine-protocol.json", "2026-11-27-front-engine-protocol-final.json"):
        rows = _engine_protocol_rows(name)
        assert len(rows) == 8 and all(row in doc for row in rows), name


def _summary_rows(name: str, section: str, keys: tuple[str, ...]) -> list[str]:
    """Rows `| level | arm | values of each run, per key |` of a results file's summary section, as
    docs/benchmarks.md tabulates the front's tokenizing and its grouped settles (issue 28)."""
    summary = json.loads((RESULTS / name).read_text())[section]
    fmt = lambda values: ", ".join(f"{v:g}" for v in values)  # noqa: E731
    return [f"| {level.split()[0]} | {arm} | " + " | ".join(fmt(s[k]) for k in keys) + " |"
            for level, arms in summary.items() for arm, s in arms.items()]


ADMISSION = ("requests_per_s", "admit_p50_ms", "gateway_cpu_us_per_request", "tritonserver_cpu_us_per_request")


@pytest.mark.parametrize("name, section, keys, n", [
    ("2026-11-27-front-tokenizes-prompts.json", "admission_summary",
     ADMISSION + ("preprocessing_cpu_us_per_request", "front_cpu_us_per_request"), 6),
    ("2026-11-27-front-tokenizes-prompts.json", "capacity_summary",
     ("tok_s", "ttft_p50_ms", "gateway_us_per_token", "preprocessing_us_per_token", "all_processes_us_per_token"), 6),
    ("2026-11-27-front-grouped-settles.json", "admission_summary", ADMISSION + ("front_cpu_us_per_request",), 6),
    ("2026-11-27-front-grouped-settles.json", "capacity_summary",
     ("tok_s", "ttft_p50_ms", "itl_p99_ms", "front_us_per_token", "gateway_us_per_token", "tritonserver_us_per_token",
      "all_processes_us_per_token"), 4),
    ("2026-11-28-lease-socket-admission.json", "admission_summary", ADMISSION + ("front_cpu_us_per_request",), 6),
    ("2026-11-28-lease-socket-front-16-tokens.json", "capacity_summary",
     ("tok_s", "ttft_p50_ms", "ttft_p95_ms", "gateway_us_per_token", "tritonserver_us_per_token", "front_us_per_token",
      "all_processes_us_per_token"), 4),    ("2026-11-29-gateway-counted-histograms.json", "admission_summary", ADMISSION, 8),
    ("2026-11-29-admission-clients.json", "admission_summary", ADMISSION + ("front_cpu_us_per_request",), 6),
    ("2026-11-29-stub-pids.json", "capacity_summary", ("ttft_p50_ms", "tail_p50_ms", "admit_wait_ms", "settle_wait_ms"), 6),
    ("2026-11-29-gateway-gc-freeze.json", "capacity_summary",
     ("gateway_gc_full_ms", "gateway_gc_young_ms", "tok_s", "ttft_p99_ms", "gateway_us_per_token"), 2),
    ("2026-11-29-stub-rescan.json", "capacity_summary",
     ("tok_s", "ttft_p50_ms", "ttft_p95_ms", "admit_wait_ms", "tail_p50_ms", "gateway_us_per_token",
      "all_processes_us_per_token"), 2),
    ("2026-11-29-ascii-tokenizer.json", "capacity_summary",
     ("tok_s", "ttft_p50_ms", "ttft_p95_ms", "front_us_per_token", "preprocessing_us_per_token",
      "all_processes_us_per_token"), 6),
])
def test_the_gateway_request_path_tables_are_their_results_files(name, section, keys, n):
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    rows = _summary_rows(name, section, keys)
    assert len(rows) == n and all(row in doc for row in rows), [row for row in rows if row not in doc]


def test_the_short_request_profiles_are_their_results_file():
    """The two profile shares docs/benchmarks.md quotes (the front's tokenizing, the gateway's stub rescans)."""
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    profiles = json.loads((RESULTS / "2026-11-29-short-requests-profiles.json").read_text())
    encode = profiles["front"]["self_percent"]["TokenizerBundle.encode (text/tokenization.py:77)"]
    rescan = profiles["gateway"]["threads_percent"]["stub-scan_0"]
    assert f"in {encode}%\nof its samples" in doc and f"found that thread in {rescan}% of its samples" in doc


def test_the_tokenizer_table_is_its_results_file():
    """docs/benchmarks.md's table of one encode, tokenizers' against the product's (issue 28)."""
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    rows = json.loads((RESULTS / "2026-11-29-tokenizer-bench.json").read_text())["rows"]
    lines = [f"| {r['prompt']} | {r['tokens']} | {'yes' if r['ascii'] else 'no'} | {r['tokenizers_us']:g} | "
             f"{r['product_us']:g} | {r['speedup']:g}x |" for r in rows]
    assert len(lines) == 7 and all(line in doc for line in lines), [line for line in lines if line not in doc]
    by = {r["prompt"]: r for r in rows}
    readme, dense = by["README, 16 KiB"], by["not ASCII"]
    assert f"The README as written has {readme['stretches_beyond_ascii']} stretches beyond ASCII" in doc
    assert f"has {dense['stretches_beyond_ascii']} in\n{dense['tokens']} tokens" in doc


@pytest.mark.parametrize("name", ["2026-11-27-aiperf-front-endpoints", "2026-11-27-aiperf-front-vs-ensemble-16",
                                  "2026-11-27-aiperf-front-vs-ensemble-64",
                                  "2026-11-27-aiperf-front-vs-ensemble-64-inflight-64",
                                  "2026-11-28-aiperf-front-vs-ensemble-64-admission-from-engine"])
def test_the_aiperf_tables_are_their_results_files(name):
    """docs/benchmarks.md's aiperf tables: benchmarks/aiperf.py's row of each run, and the front / ensemble
    ratios of each round."""
    from benchmarks import aiperf

    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    report = json.loads((RESULTS / f"{name}.json").read_text())
    assert aiperf.TABLE_HEAD in doc and all(aiperf.table_row(run) in doc for run in report["runs"]), name
    if "ratios_to_ensemble" in report:
        ratios = report["ratios_to_ensemble"]["completions"]
        assert ratios == aiperf.ratios(report, "completions")
        assert "per round: " + ", ".join(f"{x:.3f}" for x in ratios) in doc
    else:  # the three endpoints: the figures the bullets quote
        runs = {run["endpoint"]: run["summary"] for run in report["runs"]}
        osl, prompt = runs["completions"]["output_sequence_length"], runs["chat"]["usage_prompt_tokens"]["avg"]
        assert f"(completions: {osl['min']:g}-{osl['max']:g})" in doc and f"{prompt:g} tokens for aiperf's 64" in doc


@pytest.mark.parametrize("name", ["2026-11-27-layers-16-64-front-http", "2026-11-27-layers-64-front-http-inflight-64",
                                  "2026-11-27-layers-64-front-http-inflight-64-share-100",
                                  "2026-11-28-layers-16-64-front-admission-from-engine"])
def test_the_front_against_ensemble_tables_are_their_results_files(name):
    """docs/benchmarks.md's tables of the front against the ensemble on the real CPU engine: the rows of
    triton_bench's report (its Layers table)."""
    report = (RESULTS / f"{name}.md").read_text()
    rows = [line for line in report[report.index("## Layers"):].splitlines()
            if re.match(r"\| \d+ \| [\d.]+ \| [\d.]+ \| [\d.]+x", line)]
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    assert rows and all(row in doc for row in rows), [row for row in rows if row not in doc]


def test_the_soak_sentence_is_its_results_file():
    soak = json.loads((RESULTS / "2026-11-28-soak-engine-batch-slots-12min.json").read_text())
    doc = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    assert soak["lost_or_hung"] == 0 and not any(soak["counters_after"].values())
    triton = [m["triton_mb"] for m in soak["rss_by_minute"]]
    assert (f"{soak['streams']} streams through the front for 12 minutes" in doc
            and f"{soak['requests']} requests, none lost or hung; {soak['idle_after_s']} s after" in doc
            and f"{soak['outcomes']['http_503_overloaded']} requests were refused with 503 `overloaded`" in doc
            and f"{soak['outcomes']['ok_no_tokens']} successes had no tokens" in doc
            and f"{soak['rss_start']['triton_mb']:.0f} MB at the start, {triton[0]} after one minute, {triton[1]} "
                f"after two, then {min(triton[2:])}-{max(triton[2:])} to the end" in doc
            and f"the front's {soak['rss_start']['front_mb']:.0f} to {soak['rss_end']['front_mb']:.0f} MB" in doc)


def test_the_front_per_token_floor_is_its_results_file():
    """docs/benchmarks.md's account of the front's CPU per token at 16 and 64 streams: the perf table's rows,
    the calls per token and the alternated pairs, from their results file."""
    report = json.loads((RESULTS / "2026-11-28-front-per-token-floor.json").read_text())
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    text = " ".join(doc.split())
    for streams, part in report["front_cpu_by_part_before"].items():
        if streams == "note":
            continue
        n = streams.split()[0]
        pct = lambda key: f"{part[key]}%"  # noqa: E731
        row = (f"| {n} | {part['front_us_per_token']} | {pct('libpython')} | {pct('kernel')} | "
               f"{round(part['uvloop'] + part['libc'], 2)}% | {pct('write (to clients)')} | "
               f"{pct('of which loopback TCP input (tcp_v4_rcv)')} | {pct('read (from the engine)')} | "
               f"{pct('epoll_pwait')} | {pct('finish_task_switch (switched in)')} / "
               f"{pct('irqentry_exit_to_user_mode (preempted)') if 'irqentry_exit_to_user_mode (preempted)' in part else '-'} |")
        assert row in doc, row
    calls = report["python_calls_per_token_64_streams"]
    assert f"**{calls['before (e162876)']} before, {calls['after']} after**" in doc
    for streams in (16, 64):
        us = lambda code: ", ".join(f"{p['front_us_per_token']}" for p in report["pairs"]  # noqa: E731
                                    if p["streams"] == streams and p["code"].startswith(code))
        assert f"{streams} streams {us('before')} µs before against {us('after')} after" in text, streams
    loopback = [(p["tcp_v4_rcv under write (a client's input and wake-up)"],
                 p["tcp_v4_rcv under read (tritonserver's input of the front's ACKs)"])
                for k, p in report["front_cpu_by_part_before"].items() if k != "note"]
    assert (f"({loopback[0][0]}% of the front's samples at 16 streams, {loopback[1][0]}% at 64), and the ACKs of "
            f"its reads run tritonserver's ({loopback[0][1]}%, {loopback[1][1]}%)") in text
    lanes = report["text_events_by_lane_after"]
    assert (f"{lanes['16']['direct']:,} text events went from the engine's read and {lanes['16']['send']} through "
            f"`send` at 16 streams, {lanes['64']['direct']:,} and {lanes['64']['send']} at 64") in text


def test_the_relay_floor_is_its_results_file():
    """docs/benchmarks.md's floor section: the relay's and the front's cost per token by output tokens, the
    split per request and per token, the perf parts, the fast lane bench and the pairs, from their file;
    and the file's table from the three capacity reports it names."""
    report = json.loads((RESULTS / "2026-11-28-front-relay-floor.json").read_text())
    text = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    for n_out in (16, 128, 512):
        runs = json.loads((RESULTS / f"2026-11-28-front-relay-floor-{n_out}-tokens.json").read_text())["runs"]
        for row in (r for r in report["relay_and_front"] if r["output_tokens"] == n_out):
            by = {r["layer"]: r for r in runs if r["streams"] == row["streams"]}
            assert row["front_us_per_token"] == by["front"]["cpu_us_per_token"]["front"]
            assert row["relay_us_per_token"] == by["engine_relay"]["cpu_us_per_token"]["relay"]
            assert row["front_over_relay"] == round(row["front_us_per_token"] / row["relay_us_per_token"], 2)
            assert (f"| {n_out} | {row['streams']} | {row['relay_us_per_token']} | {row['front_us_per_token']} | "
                    f"{row['front_over_relay']}x |") in text
    for s, part in report["front_per_request_and_per_token"].items():
        if s == "note":
            continue
        assert (f"{s} streams {part['front_us_per_request']:,} µs a request and {part['front_us_per_token_marginal']} "
                f"µs a token (the relay's {part['relay_us_per_token_512']})") in text
    for who, perf in report["perf_16_streams_512_tokens"].items():
        if who == "note":
            continue
        parts = ", ".join(f"{k} {v}" for k, v in perf["us_per_token_by_part"].items())
        assert f"{who} {perf['us_per_token_in_the_profiled_run']} µs ({parts})" in text
    lane = report["fast_lane_hot"]
    after, before = lane["after (d90d716)"], lane["before (a099ab9)"]
    assert (f"is {after['us_per_token']} µs and {after['python_calls_per_token']:g} Python calls a token "
            f"({before['us_per_token']} µs and {before['python_calls_per_token']:g} calls before") in text
    for s in (16, 64):
        us = lambda code: ", ".join(f"{p['front_us_per_token']}" for p in report["pairs"]  # noqa: E731
                                    if p["streams"] == s and p["code"].startswith(code))
        assert f"{s} streams {us('before')} µs before against {us('after')} after" in text, s
    lane = report["fast_lane_in_a_serving_process"]
    for s in (16, 64):
        rounds = [r for r in lane["rounds"] if r["streams"] == s]
        for r in rounds:
            run = json.loads((RESULTS / f"2026-11-28-relay-{r['relay']}-{r['round']}.json").read_text())["runs"]
            assert r["relay_us_per_token"] == next(x for x in run if x["streams"] == s)["cpu_us_per_token"]["relay"]
        us = lambda mode: [r["relay_us_per_token"] for r in rounds if r["relay"] == mode]  # noqa: E731
        added = lane["fast_lane_us_per_token_added_mean"][str(s)]
        assert added == round(sum(us("fast-lane")) / 2 - sum(us("plain")) / 2, 1)
        assert (f"{s} streams {', '.join(map(str, us('plain')))} µs plain against "
                f"{', '.join(map(str, us('fast-lane')))} with it (+{added})") in text


@pytest.mark.parametrize("prefix", ["2026-11-28-front-per-request", "2026-11-28-front-httptools",
                                    "2026-11-28-front-gc-freeze", "2026-11-28-front-settle-once",
                                    "2026-11-28-front-gc-freeze-startup", "2026-11-29-token-lane",
                                    "2026-11-29-adapter-leases"])
def test_a_before_after_section_is_its_results_file(prefix):
    """docs/benchmarks.md's before/after sections (the front's cost per request): the summary file is what
    benchmarks/before_after.py makes of the capacity reports beside it, and the docs quote each pair's front
    µs per token, the means, the changes and the ratios to tritonserver from it."""
    from benchmarks.before_after import means, pairs

    report = json.loads((RESULTS / f"{prefix}.json").read_text())
    assert report["pairs"] == pairs(prefix) and report["means"] == means(report["pairs"])
    text = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    for key, m in report["means"].items():
        n_out, streams = int(key.split()[0]), int(key.split(", ")[1].split()[0])
        runs = lambda side: ", ".join(str(p["front_us_per_token"]) for p in report["pairs"]  # noqa: E731
                                      if (p["output_tokens"], p["streams"], p["code"]) == (n_out, streams, side))
        b, a = m["before"], m["after"]
        assert (f"{streams} streams {runs('before')} µs a token before against {runs('after')} after (means "
                f"{b['front_us_per_token']} and {a['front_us_per_token']}, {m['change_percent']:+}%; over "
                f"tritonserver's own cost in the same run {b['front_over_tritonserver']} and "
                f"{a['front_over_tritonserver']}, {m['change_percent_over_tritonserver']:+}%)") in text, key


def test_the_protocol_table_is_its_results_file():
    """docs/benchmarks.md's httptools section: each protocol's µs and Python calls a request, and the figures
    its text draws from them."""
    protocols = json.loads((RESULTS / "2026-11-28-protocol-bench.json").read_text())["protocols"]
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    for result in protocols.values():
        assert f"| {result['us_per_request']} | {result['python_calls_per_request']} |" in text
    before = next(r for name, r in protocols.items() if name.endswith(":BoundedH11Protocol"))
    now = protocols["front (BoundedHttpToolsProtocol)"]
    assert (f"({before['python_calls_per_request']:.0f} Python calls and {before['us_per_request']:.0f} µs a request "
            f"in the protocol alone, against {now['python_calls_per_request']:.0f} calls and "
            f"{now['us_per_request']:.0f} µs now") in " ".join(text.split())


def test_the_settle_once_and_frozen_heap_figures_are_their_results_files():
    """docs/benchmarks.md's 'A request leaves nothing behind': the gateway's µs a token, the objects found in
    cycles and the full passes' stalls, from the capacity reports the summaries were made of."""
    text = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    once = json.loads((RESULTS / "2026-11-28-front-settle-once.json").read_text())["pairs"]

    def runs(pairs, n_out, streams, side, value):
        return ", ".join(str(value(p)) for p in pairs if (p["output_tokens"], p["streams"], p["code"]) ==
                         (n_out, streams, side))

    def collected(p):
        report = json.loads((RESULTS / p["file"]).read_text())
        return sum(next(r for r in report["runs"] if r["streams"] == p["streams"])["front_gc"]["collected"].values())

    gateway = lambda p: p["gateway_us_per_token"]  # noqa: E731
    assert (f"spent {runs(once, 16, 16, 'before', gateway)} µs per streamed token before against "
            f"{runs(once, 16, 16, 'after', gateway)} after at 16 tokens and 16 streams, and "
            f"{runs(once, 16, 64, 'before', gateway)} against {runs(once, 16, 64, 'after', gateway)} at 64 "
            "streams") in text
    assert (f"{runs(once, 16, 16, 'before', collected)} before against {runs(once, 16, 16, 'after', collected)} "
            f"after at 16 tokens and 16 streams; {runs(once, 16, 64, 'before', collected)} against "
            f"{runs(once, 16, 64, 'after', collected)} at 64 streams; at 128 tokens "
            f"{runs(once, 128, 16, 'before', collected)}") in text
    at_128 = [p for p in once if (p["output_tokens"], p["streams"]) == (128, 64)]
    assert (f"the front cost {min(p['front_us_per_token'] for p in at_128)} to "
            f"{max(p['front_us_per_token'] for p in at_128)} µs a token at 64 streams") in text
    assert (f"was {min(p['tritonserver_us_per_token'] for p in at_128)}-"
            f"{max(p['tritonserver_us_per_token'] for p in at_128)} µs a token") in text
    frozen = json.loads((RESULTS / "2026-11-28-front-gc-freeze-startup.json").read_text())["pairs"]
    for side in ("before", "after"):
        ps = [p for p in frozen if p["code"] == side]
        each = [p["front_gc_pause_ms"]["2"] / p["front_gc_passes"]["2"] for p in ps]
        assert (f"{', '.join(str(p['front_gc_passes']['2']) for p in ps)} {side}, "
                f"{'stalling the loop ' if side == 'before' else ''}"
                f"{', '.join(str(p['front_gc_pause_ms']['2']) for p in ps)} ms in all "
                f"({min(each):.1f}-{max(each):.1f} ms each)") in text
    young = [p["front_gc_passes"]["0"] for p in frozen]
    young_ms = [p["front_gc_pause_ms"]["0"] for p in frozen]
    assert f"({min(young)}-{max(young)} a window, {min(young_ms)}-{max(young_ms)} ms of stalls in all)" in text


def test_the_gateway_stub_profile_figures_are_its_results_file():
    """docs/benchmarks.md's 'Why one gateway stops near 1,000 pairs a second': the loop's shares of wall
    time and the GIL's samples by thread, and the response-thread comparison, from the profile's file."""
    text = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    profile = json.loads((RESULTS / "2026-11-28-gateway-stub-profile.json").read_text())
    share = {k: round(100 * v) for k, v in profile["event_loop_wall_share"].items()}
    operation = share["the lease operation itself (gateway.operation: admit or settle)"]
    tensors, parsing = share["building the answer's tensors"], share["parsing the request (parse_gateway_request)"]
    assert (f"its event loop spent {share['sender.send of the answer (one final response)']}% of its wall time in "
            f"`sender.send` of an answer, {operation}% in the lease operation itself, {tensors}% building the "
            f"answer's tensor, {parsing}% parsing the request, {share['the loop idle']}% idle") in text
    gil, possible = profile["gil_samples_by_thread"], profile["gil_possible_samples"]
    others = gil["stub main"] + gil["metrics"]
    assert (f"the loop held it in {round(100 * gil['event loop'] / possible)}% of the samples and the stub's "
            f"other threads in {round(100 * others / possible)}%") in text
    runs = profile["response_threads"]

    def span(threads, key):
        values = [r[key] for r in runs if r["gateway_response_threads"] == threads]
        return f"{min(values):,.0f}-{max(values):,.0f}"
    assert (f"{span(1, 'requests_per_s')} pairs/s against {span(0, 'requests_per_s')} with the loop's own sends, "
            f"the stub's CPU per pair {span(1, 'gateway_cpu_us_per_request')} µs against "
            f"{span(0, 'gateway_cpu_us_per_request')}") in text


def test_the_grouped_admits_figures_are_their_results_files():
    """docs/benchmarks.md's 'Admits in groups': the gateway alone (its table), the front's 64-stream pairs and
    the first version's 16-core runs, from their results files."""
    from benchmarks.capacity_bench import markdown

    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    text = " ".join(doc.split())

    def span(values, fmt="{:,.0f}"):
        return f"{fmt.format(min(values))}-{fmt.format(max(values))}"

    runs = {side: [r for k in (1, 2, 3) for r in json.loads(
        (RESULTS / f"2026-11-28-grouped-admits-admission-{side}-{k}.json").read_text())["runs"]]
        for side in ("before", "after")}
    for c in (1, 16, 64):
        at = {side: [r for r in rs if r["concurrency"] == c] for side, rs in runs.items()}
        rate = {side: span([r["requests_per_s"] for r in rs]) for side, rs in at.items()}
        cpu = {side: span([r["cpu_us_per_request"]["gateway_0_0"] for r in rs]) for side, rs in at.items()}
        assert f"| {c} | {rate['before']} | {rate['after']} | {cpu['before']} | {cpu['after']} |" in doc

    def pair(n, side):
        return [next(r for r in json.loads((RESULTS / f"2026-11-28-grouped-admits-{n}-tokens-{side}-{k}.json")
                                           .read_text())["runs"] if r["streams"] == 64) for k in (1, 2)]
    both = lambda rs, f: " and ".join(f(r) for r in rs)  # noqa: E731
    b, a = pair(16, "before"), pair(16, "after")
    tok_s = lambda rs: both(rs, lambda r: f"{r['tok_s']:,.0f}")  # noqa: E731
    assert f"{tok_s(b)} tok/s before, {tok_s(a)} after" in text
    gateway = lambda rs: span([r["cpu_us_per_token"]["gateway_0_0"] for r in rs])  # noqa: E731
    assert f"CPU per streamed token {gateway(b)} µs before, {gateway(a)} after" in text
    p50 = lambda rs, key: both(rs, lambda r: f"{r[key]['p50']:.0f}")  # noqa: E731
    assert f"TTFT p50 {p50(b, 'ttft_ms')} ms before, {p50(a, 'ttft_ms')} after" in text
    assert f"the tail (the settle) p50 {p50(b, 'tail_ms')} ms before, {p50(a, 'tail_ms')} after" in text
    b, a = pair(128, "before"), pair(128, "after")
    assert f"the tail p50 {p50(b, 'tail_ms')} ms before, {p50(a, 'tail_ms')} after" in text

    first = json.loads((RESULTS / "2026-11-28-grouped-admits-16core-first-admission.json").read_text())["runs"]
    assert ", ".join(f"{r['requests_per_s']:,.0f}" for r in first[:2]) + f" and {first[2]['requests_per_s']:,.0f} pairs" in text
    for name in ("short-workers-4", "workers-4"):
        report = json.loads((RESULTS / f"2026-11-28-grouped-admits-16core-first-{name}.json").read_text())
        assert report["machine"]["cores"] == 16
        assert (RESULTS / f"2026-11-28-grouped-admits-16core-first-{name}.md").read_text() == markdown(report)
        assert f"{report['runs'][0]['tok_s']:,.0f} tok/s" in text


def test_the_gateway_loop_after_grouped_admits_is_its_results_file():
    text = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    after = json.loads((RESULTS / "2026-11-28-gateway-stub-profile.json").read_text())["after_grouped_admits"]
    share = {k: round(100 * v) for k, v in after["event_loop_wall_share"].items()}
    pick = lambda prefix: next(v for k, v in share.items() if k.startswith(prefix))  # noqa: E731
    group, single = pick("sender.send of a group"), pick("sender.send of a single")
    assert (f"{group + single}% of its wall time in `sender.send` ({group}% a group's answer, {single}% a settle's), "
            f"against 50% before; {pick('admitting')}% admitting, {pick('settling')}% settling, "
            f"{pick('reading the group')}% reading a group's admits, {pick('the JSON of the request')}% the JSON of "
            f"its lease parameter and {pick('the JSON of a group')}% that of its answer (the standard library's "
            f"`json`), {pick('the loop idle')}% idle") in text


def test_the_gateway_json_figures_are_their_results_files():
    """docs/benchmarks.md's 'The gateway's JSON': the loop's JSON share from the profile, the pairs' table."""
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    text = " ".join(doc.split())
    profile = json.loads((RESULTS / "2026-11-28-gateway-stub-profile.json").read_text())["gateway_json"]
    share = lambda side, prefix: next(100 * v for k, v in profile[f"loop_gil_share_{side}"].items()  # noqa: E731
                                      if k.startswith(prefix))
    assert f"JSON {share('before', 'json'):.1f}% before, {share('after', 'json'):.1f}% after" in text
    assert f"`asdict` {share('before', 'dataclasses'):.1f}% before, none after" in text
    assert not any(k.startswith("dataclasses") for k in profile["loop_gil_share_after"])
    for c in (16, 64):
        def at(side, key):
            return [next(key(r) for r in json.loads((RESULTS / f"2026-11-28-gateway-json-admission-{side}-{k}.json")
                                                    .read_text())["runs"] if r["concurrency"] == c) for k in range(1, 8)]
        rate = {side: at(side, lambda r: r["requests_per_s"]) for side in ("before", "after")}
        cpu = {side: at(side, lambda r: r["cpu_us_per_request"]["gateway_0_0"]) for side in ("before", "after")}
        cell = lambda v: f"{sum(v) / 7:,.0f} ({min(v):,.0f}-{max(v):,.0f})"  # noqa: E731
        higher = sum(a > b for a, b in zip(rate["after"], rate["before"]))
        assert (f"| {c} | {cell(rate['before'])} | {cell(rate['after'])} | {higher} of 7 | "
                f"{sum(cpu['before']) / 7:.0f} / {sum(cpu['after']) / 7:.0f} |") in doc


def test_the_gateway_python_figures_are_their_results_files():
    """docs/benchmarks.md's 'The gateway's own Python per pair': the policy bench's pairs, the served pairs,
    and the front's 16-token pairs, from their results files."""
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    text = " ".join(doc.split())
    load = lambda name: json.loads((RESULTS / name).read_text())["runs"]  # noqa: E731
    policy = {side: [load(f"2026-11-28-gateway-policy-{side}-{k}.json") for k in (1, 2, 3)] for side in ("before", "after")}
    best = {(side, g): [min(next(r for r in runs if r["group"] == g)["us_per_pair"]) for runs in policy[side]]
            for side in ("before", "after") for g in (1, 16)}
    for g in (1, 16):
        assert all(a < b for a, b in zip(best[("after", g)], best[("before", g)]))  # lower in every pair
        cells = [", ".join(f"{v:.0f}" for v in best[(side, g)]) for side in ("before", "after")]
        assert f"| {g} | {cells[0]} | {cells[1]} |" in doc
    span = lambda v: f"{min(v):.0f}-{max(v):.0f}"  # noqa: E731
    assert f"cost {span(best[('before', 1)])} µs a pair alone and {span(best[('before', 16)])} in groups" in text
    served = {}
    for c in (16, 64):
        def at(side, key):
            return [next(key(r) for r in load(f"2026-11-28-gateway-python-admission-{side}-{k}.json")
                         if r["concurrency"] == c) for k in range(1, 6)]
        rate = {side: at(side, lambda r: r["requests_per_s"]) for side in ("before", "after")}
        cpu = {side: at(side, lambda r: r["cpu_us_per_request"]["gateway_0_0"]) for side in ("before", "after")}
        served[c] = cpu
        cell = lambda v: f"{sum(v) / 5:,.0f} ({min(v):,.0f}-{max(v):,.0f})"  # noqa: E731
        higher = sum(a > b for a, b in zip(rate["after"], rate["before"]))
        assert (f"| {c} | {cell(rate['before'])} | {cell(rate['after'])} | {higher} of 5 | "
                f"{sum(cpu['before']) / 5:.0f} / {sum(cpu['after']) / 5:.0f} |") in doc
    assert f"({sum(served[64]['before']) / 5:.0f} µs on average at 64 in flight" in text
    front = {(side, k): load(f"2026-11-28-gateway-python-16-tokens-{side}-{k}.json")[0]
             for side in ("before", "after") for k in (1, 2, 3)}
    tok = lambda side: ", ".join(f"{front[(side, k)]['tok_s']:,.0f}" for k in (1, 2, 3))  # noqa: E731
    gw = lambda side: ", ".join(f"{front[(side, k)]['cpu_us_per_token']['gateway_0_0']:.1f}" for k in (1, 2, 3))  # noqa: E731
    assert f"{tok('before')} tok/s before against {tok('after')} after" in text
    assert f"the gateway {gw('before')} µs a streamed token before against {gw('after')} after" in text


def test_the_token_lane_figures_are_their_results_files():
    """docs/benchmarks.md's token lane: the hot bench's table, the relay's and the front's costs in the window
    after the pairs, and the profile's shares, from their files."""
    text = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    for lane, r in json.loads((RESULTS / "2026-11-29-token-lane-hot.json").read_text())["lanes"].items():
        assert f"| {lane} | {r['us_per_token']} | {r['python_calls_per_token']:g} |" in text
    cost = {}
    for lane in ("compiled", "python"):
        for run in json.loads((RESULTS / f"2026-11-29-token-lane-relay-{lane}.json").read_text())["runs"]:
            who = "relay" if run["layer"] == "engine_relay" else "front"
            cost[lane, who, run["streams"]] = run["cpu_us_per_token"][who]
    assert (f"cost {cost['compiled', 'relay', 16]} and {cost['python', 'relay', 16]} µs a token at 16 streams in two "
            f"runs after the pairs ({cost['compiled', 'relay', 64]} and {cost['python', 'relay', 64]} at 64)") in text
    assert (f"the front cost {cost['compiled', 'front', 16]} (compiled) and {cost['python', 'front', 16]} (python) µs "
            f"a token at 16 streams, {cost['compiled', 'front', 64]} and {cost['python', 'front', 64]} at 64") in text
    profile = json.loads((RESULTS / "2026-11-29-token-lane-profile.json").read_text())
    inc, own = profile["front"]["inclusive_percent"], profile["front"]["self_percent"]
    assert (f"one run, {profile['run']['cpu_us_per_token']['front']} µs a token; "
            f"`benchmarks/results/2026-11-29-token-lane-profile.json`): the engine's reads (`_Connection.data_received`) "
            f"in {inc['_Connection.data_received (front/engine_http.py:152)']}% + "
            f"{inc['_Connection.data_received (front/engine_http.py:149)']}% of its samples, of which the socket write "
            f"of each read's events (`DirectBody.flush`) {inc['DirectBody.flush (front/connections.py:177)']}% and the "
            f"lane's call {own['_Connection._read (front/engine_http.py:165)']}%; a request's ASGI path (Starlette's app "
            f"and the front's handler) "
            f"{inc['wrap_app_handling_exceptions.<locals>.wrapped_app (starlette/_exception_handler.py:42)']}%; the "
            f"event loop's own C code (uvloop's reads, waits and callbacks, under `Runner.run`) "
            f"{own['Runner.run (asyncio/runners.py:118)']}%") in text


def test_the_gateway_loop_options_are_their_results_file():
    """docs/benchmarks.md's 'The gateway's loop: measured and not kept': each side's µs a pair by in-flight
    level, and the perf split, from the one results file."""
    report = json.loads((RESULTS / "2026-11-29-gateway-loop-options.json").read_text())
    text = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    by = report["gateway_us_per_pair_by_concurrency"]
    us = lambda values: ", ".join(map(str, values))  # noqa: E731
    for key, (now, other) in (("event_loop", ("asyncio (current)", "uvloop")),
                              ("metrics_tick", ("50 ms (current)", "1 s"))):
        for level, sides in by[key].items():
            assert sides == {side: [r["gateway_us_per_pair"] for e in report[key] for r in e["runs"]
                                    if r["concurrency"] == int(level) and (e.get("loop") or e.get("tick")) == side]
                             for side in (now, other)}, (key, level)
            assert f"{us(sides[now])} against {us(sides[other])}" in text, (key, level)
    perf = report["perf_gateway_stub"]["percent_by_dso"]
    assert f"{perf['libpython3.11']}% of its samples in `perf`" in text and f"the kernel {perf['kernel']}%" in text


def test_the_served_per_token_path_is_its_results_file():
    """docs/benchmarks.md's 'The per-token path served' and the README's sentence on it: the relay's µs a token
    by lane and round, the means added, the hot figures, the diagnostics without the parse and with the front
    alone on a core, from the one results file."""
    report = json.loads((RESULTS / "2026-11-29-relay-lane-served.json").read_text())
    text = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    for s in (16, 64):
        us = {mode: [r["relay_us_per_token"] for r in sorted(report["runs"], key=lambda r: r["round"])
                     if r["relay"] == mode and r["streams"] == s] for mode in ("plain", "compiled", "python")}
        means = report["by_streams"][str(s)]
        for mode, values in us.items():
            assert len(values) == 3 and means["relay_us_per_token_mean"][mode] == round(sum(values) / 3, 1), (s, mode)
        added = {mode: round(means["relay_us_per_token_mean"][mode] - means["relay_us_per_token_mean"]["plain"], 1)
                 for mode in ("compiled", "python")}
        assert added == means["added_us_per_token_mean"], s
        j = lambda values: ", ".join(map(str, values))  # noqa: E731
        assert (f"{j(us['plain'])}" in text and f"{j(us['compiled'])}" in text and f"(+{added['compiled']})" in text
                and f"{j(us['python'])}" in text and f"(+{added['python']})" in text), s
    hot = report["hot"]
    assert (f"{hot['compiled']['us_per_token']} µs a token compiled, {hot['python']['us_per_token']} Python"
            in text)
    assert served_lane_2_core() in " ".join(section().split())
    diag = report["without_the_json_parse"]["runs"]
    as_is = ", ".join(str(r["relay_us_per_token"]) for r in diag if r["lane"] == "compiled")
    without = ", ".join(str(r["relay_us_per_token"]) for r in diag if r["lane"] != "compiled")
    assert f"{as_is} µs as it is against {without} without the parse" in text
    pinned = report["front_on_a_core_of_its_own"]["runs"]
    free = ", ".join(str(r["front_us_per_token"]) for r in pinned if r["front"] == "shares both cores")
    alone = ", ".join(str(r["front_us_per_token"]) for r in pinned if r["front"] != "shares both cores")
    assert f"{free} µs a token sharing both cores against {alone} alone" in text


def test_what_a_wake_up_costs_is_its_results_files():
    """docs/benchmarks.md's 'What a wake-up costs on this host' and the README's sentence on it: the summary's
    figures are its source files' (the wake-up bench's medians, each capacity report's CPU and wake-ups a token)
    and the doc's tables and means are the summary's."""
    import statistics

    report = json.loads((RESULTS / "2026-11-29-wakeups.json").read_text())
    source = json.loads((RESULTS / "2026-11-29-wakeup-cost.json").read_text())
    cost, rounds = report["wakeup_cost"]["cpu_us_per_side_median"], report["wakeup_cost"]["rounds"]
    assert report["wakeup_cost"]["work_hot_us"] == source["work_hot_us"]
    for r in source["runs"]:
        assert r["cpu_us_per_side"] in rounds[f"{r['placement']}/{r['others']}/{r['work']}"]
    for key, values in rounds.items():
        assert cost[key] == statistics.median(values) and len(values) == 3, key
    for key, added in report["wakeup_cost"]["added_by_work_us"].items():
        where, work = key.rsplit("/", 1)
        assert added == round(cost[key] - cost[f"{where}/none"], 2), key
    for r in report["runs"]:
        run = next(x for x in json.loads((RESULTS / r["file"]).read_text())["runs"]
                   if x["layer"] == r["layer"] and x["streams"] == r["streams"])
        process = "front" if r["layer"] == "front" else "relay"
        assert (run["cpu_us_per_token"][process], run["switches_per_token"][process]["voluntary"]) == \
            (r["us_per_token"], r["wakeups_per_token"]), r
    text = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    j = lambda values: ", ".join(map(str, values))  # noqa: E731
    for streams, rows in report["by_streams"].items():
        for label, row in rows.items():
            assert len(row["us_per_token"]) == 3 and row["us_per_token_mean"] == round(sum(row["us_per_token"]) / 3, 1)
            assert row["wakeups_per_token_mean"] == round(sum(row["wakeups_per_token"]) / 3, 3)
            assert (f"| {streams} | {label} | {j(row['us_per_token'])} | {row['us_per_token_mean']} | "
                    f"{j(row['wakeups_per_token'])} | {row['wakeups_per_token_mean']} |") in text, (streams, label)
    for placement in ("one_core", "two_cores"):
        for others in ("idle", "busy"):
            cells = " | ".join(str(cost[f"{placement}/{others}/{w}"]) for w in ("none", "token", "lane compiled", "lane python"))
            assert f"| {placement.replace('_', ' ')} | {others} | {cells} |" in text, (placement, others)
    added = report["wakeup_cost"]["added_by_work_us"]
    hot = report["wakeup_cost"]["work_hot_us"]
    assert (f"(compiled lane) adds {added['two_cores/idle/lane compiled']} µs a side there "
            f"({added['two_cores/busy/lane compiled']} with the other core busy), {added['one_core/idle/lane compiled']} "
            f"on one core, against {hot['lane compiled']} hot") in text
    assert wakeups_2_core() in " ".join(section().split())
