import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from build.render import DEFAULT_CHECKPOINT  # noqa: E402
from tests.support.server import TritonServer  # noqa: E402
from tests.support.tenants import standard_config, write_config  # noqa: E402


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
def shared_stack(checkpoint, tmp_path_factory):
    """One stack for every module that needs nothing but the default knobs, the front and the standard
    tenants (tests/support/tenants.py standard_config: each module's own and the demo tenants): booted by
    the first module that asks, stopped at the end of the session. Other modules' traffic is visible on
    it: a test that counts state uses its module's own tenant or compares before and after. Never stop,
    kill or reconfigure it from a test."""
    cfg = write_config(tmp_path_factory.mktemp("shared") / "gateway.yaml", standard_config())
    with TritonServer(overrides={"gateway_config": str(cfg)}, front=True) as s:
        yield s


@pytest.fixture(scope="session")
def server(shared_stack):
    """The shared stack under the name the Triton-level tests (ensemble, clients, load) use; its demo
    tenants (deploy/gateway.example.yaml) answer their sk-demo-* keys."""
    return shared_stack
