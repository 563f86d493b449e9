"""Batch rows in shards on a few threads: NumPy's element-wise ops run on one core each.

A multi-threaded BLAS parallelises the GEMMs but leaves every element-wise pass (norms,
softmax, SwiGLU, RoPE) on one core. Cutting the batch into shards and running them on one
thread per core, each with a single BLAS thread, parallelises everything: NumPy releases the
GIL inside its ufuncs and BLAS calls. Shards are sized so that a shard's temporaries stay near a
core's cache (measured: 5-10% faster per token than whole batches), two or more a worker in a
large pass (SHARD_ACTIVATIONS).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..checks import check_int
from .settings import blas_threads

# Below this many activations per layer (B * T * D) a step takes about a millisecond, and handing
# shards to threads costs more than it saves.
MIN_SHARDED_ACTIVATIONS = 1 << 16
# Activations per layer (rows * T * D) in one shard at most, where the rows allow; a pass of at least
# this many is cut into at least two shards per worker. Measured on the 2-core AMD EPYC (6 December
# 2026, loss_and_grads, medians of 7-15 alternating rounds): 4 shards against 8 (1 << 17 before)
# c (8 x 256 x 288) 851-934 ms against 912-989, b (16 x 256 x 256) 1,184 against 1,283, and a
# (32 x 128 x 128) 260 against 281; 4 against 2: a 274 against 295, b 1,184 against 1,406, c
# 851-934 against 908-950; and p (16 x 64 x 128), below the bound, 2 shards 68.5 ms against 4's 75.1.
# Each shard's weight gradients are one more term to sum (n - 1 additions of every weight), and
# fewer tokens a shard make smaller GEMMs; one shard a worker leaves the workers no way to even out.
SHARD_ACTIVATIONS = 1 << 18

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
    """How many shards run_sharded cuts a (batch_size, seq_len) batch into: at least one per worker
    (two from SHARD_ACTIVATIONS activations on), and more when rows are large, so that a shard holds
    at most about SHARD_ACTIVATIONS; rounded up to the first count that gives every worker as many
    rows (a multiple of workers dividing the rows), where there is one. (4 rows in 3 shards on 2
    threads would run 2 rows on one thread after its 1, while the other waits: a third longer than
    4 shards, with 3 rows' activations alive at once.)"""
    activations = batch_size * seq_len * dim
    per_worker = 2 if activations >= SHARD_ACTIVATIONS else 1
    wanted = min(batch_size, max(per_worker * workers, -(-activations // SHARD_ACTIVATIONS)))
    balanced = [n for n in range(wanted, batch_size + 1) if n % workers == 0 and batch_size % n == 0]
    return balanced[0] if balanced else wanted


def pass_footprint(batch_size: int, seq_len: int, dim: int, workers=None) -> tuple[int, int]:
    """(rows whose activations are alive at once, shards whose gradients are held until summed) in
    a sharded pass over batch_size rows: the figures npllama.memory's estimates need."""
    workers = resolve_workers(workers, batch_size, seq_len, dim)
    shards = n_shards(workers, batch_size, seq_len, dim)
    return min(batch_size, workers * -(-batch_size // shards)), shards


def shard_rows(batch_size: int, seq_len: int, dim: int, workers: int) -> list[slice]:
    """The contiguous row ranges of a batch's shards, in order (n_shards of them)."""
    bounds = np.linspace(0, batch_size, n_shards(workers, batch_size, seq_len, dim) + 1).astype(int)
    return [slice(int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]


def run_sharded(fn, workers: int, dim: int, *row_arrays):
    """[fn(j, rows, *(a[rows] for a in row_arrays)) for each shard j and its row range], in order,
    on `workers` threads.

    There are at least `workers` shards, and more when rows are large, so that a shard holds
    about SHARD_ACTIVATIONS. With one worker the shards run one after another in this thread,
    with BLAS as it is; with more, every shard runs with one BLAS thread (restored on return).
    """
    B, T = row_arrays[0].shape[:2]
    shards = [(j, rows) + tuple(a[rows] for a in row_arrays)
              for j, rows in enumerate(shard_rows(B, T, dim, workers))]
    if workers == 1:
        return [fn(*shard) for shard in shards]
    with blas_threads(1):
        futures = [_executor(workers).submit(fn, *shard) for shard in shards]
        return [f.result() for f in futures]


# ----------------------------------------------------------------------------- gradient sums

class _Slot:
    __slots__ = ("lock", "done", "pending")

    def __init__(self):
        self.lock = threading.Lock()
        self.done = 0            # terms in the array so far
        self.pending = {}        # place in the order -> term, waiting for those before it


class ShardSums:
    """Each gradient slot = the sum of every shard's term, added in one fixed order.

    A slot is keyed (layer, slot) by two ints. Its order starts at shard (layer + slot) mod n and
    goes on cyclically. The first shard in a slot's order writes its term straight into the slot
    (a GEMM with out=); every later one computes its term aside and adds it once the shards before
    it in that order have: the order of the additions, and so the rounding, never depends on which
    thread gets there first, and the terms computed aside (the extra memory traffic) fall on every
    shard alike. A step is reproducible bit for bit, with no per-shard copy of the gradients.
    """

    def __init__(self, n_shards: int):
        self.n_shards = n_shards
        self._slots: dict = {}
        self._lock = threading.Lock()

    def put(self, key: tuple[int, int], dst: np.ndarray, shard: int, term) -> None:
        """dst (+)= term(out) for key (layer, slot): term writes into out (the first shard in the
        slot's order: dst itself) or, given None, returns an array."""
        with self._lock:
            slot = self._slots.setdefault(key, _Slot())
        rank = (shard - key[0] - key[1]) % self.n_shards      # its place in this slot's order
        if rank == 0:
            term(dst)
        else:
            value = term(None)
        with slot.lock:
            if rank == 0:
                slot.done = 1
            else:
                slot.pending[rank] = value
            while slot.done in slot.pending:
                dst += slot.pending.pop(slot.done)
                slot.done += 1


def product(a, b):
    """term(out) for dst (+)= a @ b."""
    return lambda out: np.matmul(a, b, out=out)


def value(x):
    """term(out) for dst (+)= x."""
    return lambda out: x if out is None else np.copyto(out, x)
