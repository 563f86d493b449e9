"""Freed memory kept for reuse: glibc's allocator told not to hand a training step's arrays back.

A training step allocates the same large arrays every step (each block's caches, its
temporaries). By default glibc returns freed blocks above a threshold to the OS, mmapped ones
at once and the top of the heap whenever more than a few hundred KB are free there, so every
step faults all its memory in again, page by page: measured 48,000 page faults and 118 ms of
kernel time in a 450 ms step (dim 128, T 128, B 32). Raising the two thresholds (mallopt, as
GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...:glibc.malloc.trim_threshold=... would at start-up)
keeps that memory in the process: 0 faults a step. The process's peak memory is unchanged;
what changes is that it stays at its peak instead of giving memory back between steps.

This is a setting of the whole process and, unlike the BLAS threads, it is not restored: the
training pass makes it once, the first time it runs (engine/training.py). Elsewhere than glibc
(macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# mallopt parameters (glibc malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20          # glibc's largest: arrays above it are still mmapped (and, in NumPy, huge pages)
TRIM_THRESHOLD = (1 << 31) - 1     # never trim the heap's top on its own (malloc_trim still does)

_kept: bool | None = None          # None: not tried yet; then whether glibc took the thresholds


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds, once per process (module docstring; later calls only
    report the first's outcome); True if glibc took them."""
    global _kept
    if _kept is None:
        mallopt = getattr(_libc(), "mallopt", None)           # not glibc: no mallopt
        if mallopt is None:
            _kept = False
        else:
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            _kept = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _kept


def release_freed_memory() -> None:
    """Hand the pages of freed heap memory back to the OS (glibc's malloc_trim; elsewhere nothing).

    glibc keeps the chunks of freed arrays mapped for reuse by later allocations, so without
    this memory that an object stopped using (matrices replaced by copies) stays in the process.
    """
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)
