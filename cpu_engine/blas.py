"""The OpenBLAS that numpy loaded: which kernel set it runs (for logs and docs) and its thread count.

numpy 1.26's wheel bundles OpenBLAS 0.3.23 built with DYNAMIC_ARCH: it picks kernels from the CPU at
load time, unless `OPENBLAS_CORETYPE` forces a set. That matters a lot for this engine's small-M float32
GEMMs: measured on the 2-core AVX-512 EPYC, the Cooperlake/SkylakeX (AVX-512) kernels run a 16-row
decode step's matmuls ~1.5-2.5x faster than the Haswell (AVX2) ones. The engine logs the kernel set it
got (`LLMEngine.blas_core`) and otherwise leaves the choice to the environment.
"""
from __future__ import annotations

import ctypes
import os

_lib = None


def _openblas():
    """The OpenBLAS shared library numpy has loaded (found through /proc/self/maps), or None."""
    global _lib
    if _lib is not None:
        return _lib or None
    import numpy  # noqa: F401  (make sure numpy's BLAS is loaded)

    path = None
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                name = line.rsplit(" ", 1)[-1].strip()
                if "openblas" in os.path.basename(name).lower() and ".so" in name:
                    path = name
                    break
    except OSError:
        pass
    _lib = False
    if path:
        try:
            _lib = ctypes.CDLL(path)
        except OSError:
            _lib = False
    return _lib or None


def _symbol(lib, *names):
    for name in names:
        try:
            return getattr(lib, name)
        except AttributeError:
            continue
    return None


def core_name() -> str | None:
    lib = _openblas()
    fn = lib and _symbol(lib, "openblas_get_corename64_", "openblas_get_corename")
    if not fn:
        return None
    fn.restype = ctypes.c_char_p
    return fn().decode()


def set_num_threads(n: int) -> bool:
    lib = _openblas()
    fn = lib and _symbol(lib, "openblas_set_num_threads64_", "openblas_set_num_threads")
    if not fn:
        return False
    fn(ctypes.c_int(int(n)))
    return True
