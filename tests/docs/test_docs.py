"""The docs are self-contained (issue 19): nothing points at files outside the repository, and every
relative link of README.md and docs/ names a file that exists."""
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUTSIDE = re.compile(r"\.\./shared|shared/reference|\breference/(?:triton-2\.51|tensorrt-llm-backend|peers|"
                     r"baseline-llama-cpp)\.md|ARCHITECTURE\.md")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def tracked_text_files():
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode == 0:
        names = listed.stdout.splitlines()
    else:  # an exported tree without .git: every file but the caches and build outputs
        skip = {".git", ".venv", ".cache", "runtime", "engines", "node_modules", "__pycache__"}
        names = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if not skip & set(p.relative_to(ROOT).parts)]
    for name in names:
        path = ROOT / name
        if path.suffix in (".md", ".py", ".yaml", ".yml", ".sh", ".pbtxt", ".txt") or name == "Makefile":
            if path.is_file():
                yield path


def test_the_outside_pattern_matches_what_it_should():
    assert OUTSIDE.search("see ../shared/reference/peers.md") and OUTSIDE.search("(reference/triton-2.51.md §0)")
    assert not OUTSIDE.search("shared-memory APIs") and not OUTSIDE.search("contracts/")


def test_nothing_points_outside_the_repository():
    me = Path(__file__).resolve()
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in tracked_text_files() if p.resolve() != me
            for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if OUTSIDE.search(line)]
    assert hits == []


def test_relative_links_resolve():
    broken = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in LINK.findall(doc.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert broken == []
