"""The int8 path of a CPU without VNNI, on any host: qemu-user runs the kernel and precision tests as a
Haswell (AVX2, no AVX-512, no VNNI), whose integer GEMM adds u8 x s8 pairs in saturating int16. On a
VNNI host the rest of tests/engine covers its own 8-bit path; here the 7-bit path runs too.
(qemu's TCG emulates no AVX-512, so AVX-512 without VNNI, which takes the same vpmaddubsw path as AVX2,
runs only on such a host.) docs/engine.md, Precision, lists which paths ran where."""
import json
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT

QEMU = shutil.which("qemu-x86_64")
pytestmark = pytest.mark.skipif(QEMU is None, reason="qemu-x86_64 (Debian's qemu-user, installed by build/system_deps.sh) "
                                                     "is missing: the AVX2 integer path cannot run on this host")
HASWELL = [QEMU, "-cpu", "Haswell-v4"]


def test_the_avx2_int8_path_is_exact_and_tracks_float32_under_qemu(checkpoint, tmp_path):
    from tokenizers import Tokenizer

    from benchmarks.precision_bench import PROMPTS, greedy
    from cpu_engine.checkpoint import load_checkpoint
    from cpu_engine.llama import LlamaModel
    from tests.engine.test_precision import TOKENS

    # float32's greedy text, made here at native speed (a float32 forward pass takes ~5 s emulated);
    # both precisions score it under emulation
    ids = Tokenizer.from_file(str(checkpoint / "tokenizer.json")).encode(PROMPTS["chat"]).ids
    f32 = LlamaModel(load_checkpoint(checkpoint, "float32"), 4096, "onnxruntime", "numpy")
    texts = tmp_path / "texts.json"
    texts.write_text(json.dumps({"chat": greedy(f32, ids, TOKENS)}))
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "LLM_EXPECT_INT8_LIMIT": "63",
           "LLM_PRECISION_TEXTS": str(texts), "OMP_NUM_THREADS": "2"}
    run = subprocess.run([*HASWELL, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/engine/test_quantization.py",
                          "tests/engine/test_precision.py::test_int8_tracks_float32_within_the_stated_bound[chat]"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    out = run.stdout + run.stderr
    assert run.returncode == 0 and " passed" in out and "skipped" not in out, out[-6000:]
