"""The process-wide settings the engine changes, each for the duration of a block and restored.

    with blas_threads(1): ...          OpenBLAS's thread count (every pass and decode step)
    with freed_memory_kept(): ...      glibc keeps freed memory for reuse (a training run)
    adapt_malloc_once()                glibc's own adaptive thresholds raised as far as they go (every pass)

BLAS threads. How many threads NumPy's BLAS may use, changed for the duration of a block.

A batched matmul in NumPy is a loop of small GEMM calls (one per (batch, head) matrix); with
two OpenBLAS threads each call pays a thread hand-off that costs more than the arithmetic, and
on a busy machine far more (measured: 486 ms instead of 2.7 ms for (32, 4, 128, 32) @ ^T). Large
2-D GEMMs do gain from threads. So the attention core asks for one thread, the projections keep
the default. This talks to OpenBLAS through ctypes, as threadpoolctl does, so npllama needs no
extra package: measured here, entering and leaving threadpoolctl's ThreadpoolController.limit
takes 42 us, this 9 us, and a decode step of stories260K takes ~200 us. Where the BLAS is not
OpenBLAS (or not found), blas_threads does nothing.

Freed memory. A training step allocates the same large arrays every step (each block's caches,
its temporaries, the gradients). By default glibc returns freed blocks above a threshold to the
OS, mmapped ones at once and the top of the heap whenever more than a few hundred KB are free
there, so every step faults all its memory in again, page by page: measured 48,000 page faults
and 118 ms of kernel time in a 450 ms step (dim 128, T 128, B 32). Raising the two thresholds
(mallopt, as GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...:glibc.malloc.trim_threshold=...
would at start-up) keeps that memory in the process: no faults a step. The peak is unchanged;
what changes is that the process stays at its peak between steps. freed_memory_kept() sets them
for a block (npllama train wraps its run in it) and sets glibc's defaults back after, handing
the kept pages back; a library user's training loop opts in the same way, explicitly:

    with npllama.engine.freed_memory_kept():
        for step in range(n): loss, grads = model.loss_and_grads(x, y); ...

(glibc's dynamic raising of its mmap threshold stays off after any mallopt: glibc has no call
to turn it back on. That is why the engine's passes do not take the setting for themselves: in
a process that had called mallopt once, PyTorch's training step (cfg a of tools/bench_train.py)
faulted 174,000 pages a step instead of 9,000 and ran 1.7x slower, measured. The setting is the
whole process's, so the process's owner opts in.) Elsewhere than glibc (macOS, musl) it does
nothing.

What the passes do instead is let glibc's own adaptation run its course. Untouched by mallopt,
glibc raises its mmap threshold to the size of the largest mmapped block freed so far (up to
32 MB) and its trim threshold to twice that: a program that once frees a large array stops
handing smaller ones back to the OS. A step of a small model frees no array that large, so its
thresholds stay at a few MB, and each step's freed activations go back to the OS and fault in
again (cfg a: 18,000-21,000 page faults a step, 7% of its time). adapt_malloc_once(), called by every
pass, frees one untouched block just under 32 MB, once per process: the thresholds go where a
program with large arrays takes them anyway, glibc keeps adapting afterwards, and no setting is
made. Measured after it: cfg a's library step faults 1-17 pages instead, and is as fast as
`npllama train`'s; PyTorch's step in the same process faults 400-750 pages instead of 6,000 (it
gains too). The freed memory (at most 64 MB free at the top of each thread's heap) stays the
process's for the next step; release_freed_memory() hands it back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

import numpy  # (also: its BLAS must be loaded before we look for it)

_SYMBOL_PAIRS = [  # (set, get) across OpenBLAS builds: plain, 64-bit-int, NumPy's scipy-openblas
    ("openblas_set_num_threads", "openblas_get_num_threads"),
    ("openblas_set_num_threads64_", "openblas_get_num_threads64_"),
    ("scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"),
    ("scipy_openblas_set_num_threads", "scipy_openblas_get_num_threads"),
]


def _find_openblas():
    """(set, get, core) of the OpenBLAS that NumPy loaded, or None: its thread count's setter and
    getter, and the name of the CPU core its kernels were picked for, lowercase ("haswell",
    "skylakex", ...; None where it does not say)."""
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
                return setter, getter, _core_name(lib, get_name.replace("get_num_threads", "get_corename"))
    return None


def _core_name(lib, symbol: str) -> str | None:
    if not hasattr(lib, symbol):
        return None
    function = getattr(lib, symbol)
    function.restype = ctypes.c_char_p
    name = function()
    return name.decode("ascii", "replace").strip().lower() if name else None


_OPENBLAS = _find_openblas()


def blas_core() -> str | None:
    """The CPU core OpenBLAS picked its kernels for, lowercase ("haswell", "zen", "skylakex", ...), or
    None where the BLAS is not OpenBLAS or does not say."""
    return _OPENBLAS[2] if _OPENBLAS else None


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


# ----------------------------------------------------------------------------- freed memory

# mallopt parameters and glibc's default values (malloc.h, mallopt(3))
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
DEFAULT_THRESHOLD = 128 * 1024     # glibc's default for both
MMAP_THRESHOLD = 32 << 20          # glibc's largest: arrays above it are still mmapped (and, in NumPy, huge pages)
TRIM_THRESHOLD = (1 << 31) - 1     # never trim the heap's top on its own (malloc_trim still does)


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


_LIBC = _libc()
_MALLOPT = getattr(_LIBC, "mallopt", None)      # not glibc: none
if _MALLOPT is not None:
    _MALLOPT.argtypes, _MALLOPT.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
_depth = 0                                      # freed_memory_kept blocks open (nested runs, threads)
_depth_lock = threading.Lock()


def _set_thresholds(mmap: int, trim: int) -> bool:
    return _MALLOPT is not None and bool(_MALLOPT(M_MMAP_THRESHOLD, mmap)) and bool(_MALLOPT(M_TRIM_THRESHOLD, trim))


# glibc's largest adaptive mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit) less room for the
# block's header and page rounding: freeing a block this large raises the thresholds to their top.
ADAPT_BLOCK_BYTES = (32 << 20) - (64 << 10)
_adapted = False


def adapt_malloc_once() -> None:
    """Free one untouched block of ADAPT_BLOCK_BYTES, once per process (module docstring): glibc
    then raises its adaptive thresholds as it would for any program that frees a large array.
    Elsewhere than glibc nothing is done; after a mallopt glibc no longer adapts, and this changes nothing."""
    global _adapted
    if not _adapted and _MALLOPT is not None:
        _adapted = True
        try:
            numpy.empty(ADAPT_BLOCK_BYTES, dtype=numpy.uint8)  # mmapped, never touched, unmapped at once
        except MemoryError:                                     # a tight address-space limit: only speed is lost
            pass


def release_freed_memory() -> None:
    """Hand the pages of freed heap memory back to the OS (glibc's malloc_trim; elsewhere nothing)."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


class freed_memory_kept:
    """Within the block, glibc keeps freed memory for reuse (module docstring); after the
    outermost block, its default thresholds are set back and the kept pages released.
    .active tells whether glibc took the setting."""

    def __enter__(self):
        global _depth
        with _depth_lock:
            _depth += 1
            self.active = _set_thresholds(MMAP_THRESHOLD, TRIM_THRESHOLD) if _depth == 1 else _MALLOPT is not None
        return self

    def __exit__(self, *exc):
        global _depth
        with _depth_lock:
            _depth -= 1
            if _depth == 0 and _MALLOPT is not None:
                _set_thresholds(DEFAULT_THRESHOLD, DEFAULT_THRESHOLD)
                release_freed_memory()
