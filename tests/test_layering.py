"""Who may import whom (issue 19): product code never imports the tests, the load tests never import the
benchmarks, and the gateway and text packages stay engine-agnostic (they run beside the TensorRT-LLM
engine on the GPU target, where the CPU engine is not installed)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("bls", "build", "benchmarks", "clients", "cpu_engine", "front", "launcher", "loadtest",
           "model_repository")


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


def test_gateway_and_text_do_not_import_the_engine():
    assert offenders(("bls/gateway", "bls/text", "bls/serving"), "cpu_engine") == []
