"""How many threads NumPy's BLAS may use, changed for the duration of a block.

A batched matmul in NumPy is a loop of small GEMM calls (one per (batch, head) matrix); with
two OpenBLAS threads each call pays a thread hand-off that costs more than the arithmetic, and
on a busy machine far more (measured: 486 ms instead of 2.7 ms for (32, 4, 128, 32) @ ^T). Large
2-D GEMMs do gain from threads. So the attention core asks for one thread, the projections keep
the default. This talks to OpenBLAS through ctypes, as threadpoolctl does, so npllama needs no
extra package; where the BLAS is not OpenBLAS (or not found), blas_threads does nothing.
"""

from __future__ import annotations

import ctypes
import os

import numpy  # noqa: F401  (its BLAS must be loaded before we look for it)

_SYMBOL_PAIRS = [  # (set, get) across OpenBLAS builds: plain, 64-bit-int, NumPy's scipy-openblas
    ("openblas_set_num_threads", "openblas_get_num_threads"),
    ("openblas_set_num_threads64_", "openblas_get_num_threads64_"),
    ("scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"),
    ("scipy_openblas_set_num_threads", "scipy_openblas_get_num_threads"),
]


def _find_openblas():
    """(set, get) functions of the OpenBLAS that NumPy loaded, or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower()}
    except OSError:
        return None
    for path in sorted(paths):
        if not os.path.exists(path):
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for set_name, get_name in _SYMBOL_PAIRS:
            if hasattr(lib, set_name) and hasattr(lib, get_name):
                setter, getter = getattr(lib, set_name), getattr(lib, get_name)
                setter.argtypes, setter.restype, getter.restype = [ctypes.c_int], None, ctypes.c_int
                return setter, getter
    return None


_OPENBLAS = _find_openblas()


def get_blas_threads() -> int | None:
    return _OPENBLAS[1]() if _OPENBLAS else None


def set_blas_threads(n: int) -> None:
    if _OPENBLAS:
        _OPENBLAS[0](int(n))


class blas_threads:
    """Run a `with` block with at most n BLAS threads, then restore the previous count (n None: leave it).

    A plain class rather than @contextmanager: it is entered once per decode step, where a
    generator's extra microsecond shows.
    """

    __slots__ = ("n", "previous")

    def __init__(self, n: int | None):
        self.n = n
        self.previous = None

    def __enter__(self):
        if _OPENBLAS is not None and self.n is not None:
            previous = _OPENBLAS[1]()
            if previous != self.n:
                self.previous = previous
                _OPENBLAS[0](self.n)
        return self

    def __exit__(self, *exc):
        if self.previous is not None:
            _OPENBLAS[0](self.previous)
            self.previous = None
