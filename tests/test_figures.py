"""Every figure the README quotes comes from a committed results file (issue 19): each headline names the
file and the text it comes from, and a decimal figure in the README's benchmark section that no headline
accounts for fails."""
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# README text -> (results file, the text in that file it is read from)
HEADLINES = {
    "at 16\nstreams 298.8 tok/s": ("latest.md", "| 16 | 48 | 298.8 |"),
    "runs 298.2, 298.8, 312.4": ("latest.md", "| 298.2, 298.8, 312.4 |"),
    "3.05x llama.cpp's figure": ("latest.md", "| 3.05x |"),
    "TTFT p95 0.76 s": ("latest.md", "| 0.47 / 0.76 |"),
    "the peer's 5.62 s": ("peer-reference.json", '"ttft_p95_s": 5.62'),
    "server RSS 2026 MB": ("latest.md", "Server resident memory after the runs: 2026 MB"),
    "47.5 tok/s at 1 stream (0.67x)": ("latest.md", "| 1 | 8 | 47.5 | 40.7, 47.5, 49.7 | 0.67x |"),
    "196.7 tok/s at 16 streams": ("latest-float32.md", "| 16 | 48 | 196.7 |"),
}


def section() -> str:
    text = (ROOT / "README.md").read_text()
    return text[text.index("## Load tests and benchmarks"):text.index("## GPU (H100) path")]


def kl_range() -> str:
    prompts = json.loads((RESULTS / "precision.json").read_text())["prompts"].values()
    kl = [p["kl_mean_nats"] for p in prompts]
    return f"mean KL {min(kl):.3f}-{max(kl):.3f} nats"


def test_each_headline_is_in_the_readme_and_in_its_results_file():
    readme = section()
    for quoted, (name, source) in HEADLINES.items():
        assert quoted in readme, quoted
        assert source in (RESULTS / name).read_text(), (name, source)


def test_the_precision_figure_is_the_results_file_range():
    assert kl_range() in section().replace("\n", " ")


def test_no_decimal_figure_without_a_source():
    accounted = " ".join(HEADLINES) + " " + kl_range()
    figures = set(re.findall(r"(?<![\w.])\d+\.\d+(?![\w.])", section()))
    assert figures and {f for f in figures if f not in accounted} == set()
