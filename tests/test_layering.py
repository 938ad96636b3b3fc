"""Who may import whom (issues 19 and 32): one one-way graph over every package, in the order a request
travels over the shared contracts underneath; product code never imports the tests; the gateway and text
packages stay engine-agnostic (they run beside the TensorRT-LLM engine on the GPU target, where the CPU
engine is not installed)."""
import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("contracts", "text", "gateway", "ledger", "cpu_engine", "front", "model_repository", "build", "benchmarks",
           "clients", "launcher", "loadtest")


def imported_modules(path: Path) -> set[str]:
    mods = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.add(node.module)
    return mods


def files(*dirs: str):
    for d in dirs:
        yield from sorted((ROOT / d).rglob("*.py"))


def offenders(dirs, forbidden: str) -> list[str]:
    return [f"{p.relative_to(ROOT)} imports {m}" for p in files(*dirs) for m in sorted(imported_modules(p))
            if m == forbidden or m.startswith(forbidden + ".")]


def test_the_layering_check_sees_imports(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("import tests.support.server\nfrom cpu_engine.engine import X\nfrom . import y\n")
    assert imported_modules(p) == {"tests.support.server", "cpu_engine.engine"}


def test_no_product_module_imports_the_tests():
    assert offenders(PRODUCT, "tests") == []


def test_load_tests_do_not_import_the_benchmarks():
    assert offenders(("loadtest",), "benchmarks") == []


# every package and what it may import: a new package must be placed here, and nothing may import upward
MAY_IMPORT = {
    "contracts": set(),  # the contracts: tensors, errors, usage record, measurement definitions
    "text": {"contracts"},  # tokenizing, chat template, detokenizing
    "ledger": {"contracts"},  # the durable usage ledger and its reports
    "gateway": {"contracts", "text"},  # the policy engine (BLS): auth, limits, admission, routing
    "cpu_engine": {"contracts", "text"},  # the CPU engine behind the tensorrt_llm contract
    "front": {"contracts", "text", "ledger"},  # the OpenAI-compatible API and the Batch API
    "model_repository": {"contracts", "text", "gateway", "cpu_engine", "ledger"},  # thin adapters
    # the tools around the product
    "clients": {"contracts", "gateway", "cpu_engine", "ledger"},
    "build": {"contracts", "text", "gateway", "cpu_engine", "clients"},
    "launcher": {"build", "front", "ledger"},
    "loadtest": {"contracts", "clients", "build", "launcher"},
    "benchmarks": {"contracts", "text", "gateway", "cpu_engine", "front", "ledger", "model_repository",
                   "clients", "build", "launcher", "loadtest"},
}


def package_of(module: str) -> str | None:
    name = module.split(".")[0]
    return name if name in MAY_IMPORT else None


def _source_dirs() -> list[Path]:
    """The checkout's top folders of source, not what git ignores (`make serve` renders runtime/, whose
    model.py files are copies of model_repository/'s)."""
    dirs = [d for d in ROOT.iterdir() if d.is_dir() and not d.name.startswith(".") and d.name != "tests"]
    ignored = subprocess.run(["git", "check-ignore", *[d.name for d in dirs]], cwd=ROOT, capture_output=True,
                             text=True).stdout.split()
    return [d for d in dirs if d.name not in ignored]


def test_every_package_is_placed_in_the_graph():
    dirs = _source_dirs()
    found = {package_of(".".join(p.relative_to(ROOT).with_suffix("").parts)) for d in dirs for p in d.rglob("*.py")}
    found.discard(None)
    on_disk = {d.name for d in dirs if any(d.rglob("*.py"))}
    assert on_disk <= set(MAY_IMPORT), sorted(on_disk - set(MAY_IMPORT))
    assert found == set(MAY_IMPORT)


def test_the_graph_is_one_way():
    """MAY_IMPORT has no cycle: packages can be listed so that each imports only those before it."""
    order, left = [], dict(MAY_IMPORT)
    while left:
        ready = [p for p, deps in left.items() if deps <= set(order)]
        assert ready, f"a cycle among {sorted(left)}"
        order += sorted(ready)
        for p in ready:
            del left[p]


def test_each_package_imports_only_what_it_may():
    bad = []
    for package in MAY_IMPORT:
        folder = ROOT / package
        for path in sorted(folder.rglob("*.py")):
            for module in sorted(imported_modules(path)):
                target = package_of(module)
                if target is not None and target != package and target not in MAY_IMPORT[package]:
                    bad.append(f"{path.relative_to(ROOT)} imports {module}")
    assert bad == []


def test_gateway_and_text_do_not_import_the_engine():
    assert offenders(("gateway", "text", "contracts"), "cpu_engine") == []


def test_no_module_imports_itself_back():
    """Within packages too: no cycle of modules (a lazy import inside a function counts: it still ties the two
    modules together). `from package import module` is an edge to that module, not to the package."""
    paths = {}
    for package in MAY_IMPORT:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            paths[name.removesuffix(".__init__")] = path
    edges = {}
    for name, path in paths.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in paths else node.module
                               for a in node.names)
        edges[name] = {t for t in targets if t in paths and t != name}
    state, cycles = {}, []

    def visit(name, trail):
        state[name] = "open"
        for nxt in sorted(edges[name]):
            if state.get(nxt) == "open":
                cycles.append(trail[trail.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[name] = "done"

    for name in sorted(paths):
        if name not in state:
            visit(name, [name])
    assert cycles == []
