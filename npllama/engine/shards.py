"""Batch rows in shards on a few threads: NumPy's element-wise ops run on one core each.

A multi-threaded BLAS parallelises the GEMMs but leaves every element-wise pass (norms,
softmax, SwiGLU, RoPE) on one core. Cutting the batch into shards and running them on one
thread per core, each with a single BLAS thread, parallelises everything: NumPy releases the
GIL inside its ufuncs and BLAS calls. Shards are sized so that a shard's temporaries stay in a
core's cache (measured: 5-10% faster per token than whole batches).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..checks import check_int
from .blas import blas_threads

# Below this many activations per layer (B * T * D) a step takes about a millisecond, and handing
# shards to threads costs more than it saves.
MIN_SHARDED_ACTIVATIONS = 1 << 16
# Activations per layer (rows * T * D) in one shard: small enough for a core's cache.
SHARD_ACTIVATIONS = 1 << 17

_EXECUTORS: dict[int, ThreadPoolExecutor] = {}


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:          # not on Linux
        return os.cpu_count() or 1


def resolve_workers(workers, batch_size: int, seq_len: int, dim: int) -> int:
    """Threads for a pass: `workers` when given (checked), else one per core the process may use,
    at most one per batch row, and one alone for steps too small to share."""
    if workers is not None:
        return min(check_int("workers", workers, 1), batch_size)
    if batch_size * seq_len * dim < MIN_SHARDED_ACTIVATIONS:
        return 1
    return max(1, min(available_cores(), batch_size))


def _executor(workers: int) -> ThreadPoolExecutor:
    if workers not in _EXECUTORS:
        _EXECUTORS[workers] = ThreadPoolExecutor(workers, thread_name_prefix="npllama-shard")
    return _EXECUTORS[workers]


def n_shards(workers: int, batch_size: int, seq_len: int, dim: int) -> int:
    """How many shards run_sharded cuts a (batch_size, seq_len) batch into: at least one per worker,
    and more when rows are large, so that a shard holds about SHARD_ACTIVATIONS."""
    return min(batch_size, max(workers, -(-batch_size * seq_len * dim // SHARD_ACTIVATIONS)))


def pass_footprint(batch_size: int, seq_len: int, dim: int, workers=None) -> tuple[int, int]:
    """(rows whose activations are alive at once, shards whose gradients are held until summed) in
    a sharded pass over batch_size rows: the figures npllama.memory's estimates need."""
    workers = resolve_workers(workers, batch_size, seq_len, dim)
    shards = n_shards(workers, batch_size, seq_len, dim)
    return min(batch_size, workers * -(-batch_size // shards)), shards


def run_sharded(fn, workers: int, dim: int, *row_arrays, indexed: bool = False):
    """[fn(*shard) for contiguous shards of the arrays' rows], run on `workers` threads, in order.

    There are at least `workers` shards, and more when rows are large, so that a shard holds
    about SHARD_ACTIVATIONS. With one worker the shards run one after another in this thread,
    with BLAS as it is; with more, every shard runs with one BLAS thread (restored on return).
    indexed: call fn(j, *shard) with the shard's index j (0, 1, ... in row order).
    """
    B, T = row_arrays[0].shape[:2]
    shards = [((j,) if indexed else ()) + tuple(a[rows] for a in row_arrays)
              for j, rows in enumerate(np.array_split(np.arange(B), n_shards(workers, B, T, dim)))]
    if workers == 1:
        return [fn(*shard) for shard in shards]
    with blas_threads(1):
        futures = [_executor(workers).submit(fn, *shard) for shard in shards]
        return [f.result() for f in futures]
