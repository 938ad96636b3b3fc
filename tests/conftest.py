import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from build.render import DEFAULT_CHECKPOINT  # noqa: E402
from tests.support.server import TritonServer  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """GPU tests run only where an NVIDIA GPU exists; everything else runs everywhere."""
    import shutil
    import subprocess

    has_gpu = False
    if shutil.which("nvidia-smi"):
        has_gpu = subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
    if not has_gpu:
        skip = pytest.mark.skip(reason="no NVIDIA GPU on this machine (nvidia-smi -L failed)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def checkpoint() -> Path:
    if not (DEFAULT_CHECKPOINT / ".prepared.json").is_file():
        pytest.fail(f"{DEFAULT_CHECKPOINT} is not prepared: run `make setup` (make test does it)")
    return DEFAULT_CHECKPOINT


@pytest.fixture(scope="session")
def server(checkpoint):
    """The default CPU repository served by a real tritonserver, shared by the integration tests."""
    with TritonServer() as s:
        yield s
