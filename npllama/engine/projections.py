"""A decode step's linear layers: products over fixed buffers, cut into pieces for one or two threads.

A step (engine.decode.DecodeStep) keeps its activations in buffers made once per decoder, so
each of its linear layers is a Product fixed when the step is made:

    product()      out = x @ W.T for its buffers x (B, in) and out (B, n), W its matrices stacked by rows

A Product is a list of pieces, each one NumPy call on a block of W's rows, made once: a step
then costs no Python beyond calling them. The pieces by the number of rows B:

    B = 1          W @ x: OpenBLAS's gemv on W read in place, or x @ W for a W stored (in, n)
                   (rows_first); so too each row of B <= ROW_BY_ROW rows on BLAS threads
    B > 1          one GEMM per matrix: W @ x.T through transposed copies of x and out for up to
                   FEW_ROWS rows (OpenBLAS then splits W's rows between its threads; a call per
                   CORES_BLOCK_ROWS rows of W), x @ W.T above
    rows_first     x @ W for a W stored (in, n): one call (or one a row, B <= ROW_BY_ROW), for
                   small models (StackedProjections)

each on all cores' BLAS threads when the product is large (B n in >= CORES_MIN_WEIGHTS) and the
process allows them; otherwise on one BLAS thread, where 2 to FEW_ROWS rows go as W @ x.T a
block of rows at a time, each small enough for OpenBLAS's small-matrix kernels (SMALL_GEMM_MNK)
where it has them (SMALL_BLOCKS; else one block), through transposed copies of x and out, shared
with the helper thread (below)

and a matrix held in float16 / bfloat16 (or float32 under float64 activations, in tests) is turned
into the activations' dtype a block of rows at a time, in a buffer that stays in cache
(HALF_BLOCK_ELEMENTS), and multiplied there: DRAM only sees the 2-byte weights.

Two threads. A Product of at least CORES_MIN_WEIGHTS multiply-adds (B n in), or of gemvs a row
through at least GEMV_THREADS_MIN_WEIGHTS weights (below which OpenBLAS keeps a gemv on one thread), through
float weights in x's dtype runs its gemv or GEMM on OpenBLAS's threads (as many as the process allows when the
Product is made, at most one per core), and the rest of the step on one: every core streams the
weights. OpenBLAS's threads spin while they wait, which costs dearly when another job holds a
core (measured with one core busy: 110M 17-19 tokens/s against 23 with the halves below; 15M
115-125 against 177-225). A process that runs with one BLAS thread (npllama.engine.blas_threads(1)
around generation, the advice for a busy machine) gets the halves instead, as do weights held in
half precision (whose upcast is NumPy's, on one core): a Product of at most FEW_ROWS rows through
at least SPLIT_MIN_WEIGHTS weights cuts W's rows in two halves, the second run by the decoder's
helper thread (RowHalves), which sleeps between jobs, while the caller runs the first. Each half
is its own NumPy calls, so the dot products and their sums are the same whichever thread runs them.

Two processes. A one-row step on two cores and two BLAS threads, where the platform has them and
the generation is long enough to pay for it (decode.uses_helper_process), forks a helper process
(engine/helper.py) in their place: every Product of HELPER_MIN_WEIGHTS weights or more gives it the second half of W (a stacked copy's
columns, made as contiguous copies; or W's rows, in place) while the caller computes the first, each
half in blocks too small for OpenBLAS to thread (helper_cuts), x and out in memory the two share
(Activations' empty). Its hand-off costs ~2 us where a thread's costs ~75: products of 83,000 to
249,000 weights, which OpenBLAS keeps on one thread, are then read by both cores too. No copy is
padded for OpenBLAS's threads then.

Two layouts of the weights (engine.decode.DecodeStep picks one by size):

StackedProjections, for small models, where a step costs per NumPy call: [wq; wk; wv] and
[w1; w3] stacked into one matrix each, with sqrt(D) g (the norm's weight) and 1/sqrt(Dh) folded in
and w1 negated (stacked.folded_layer: the step's SwiGLU works with -a, and subtracts the down
projection from the residual; decode.py), each stored in the orientation OpenBLAS runs fastest for
the batch size; a copy read a row at a time a little short of GEMV_THREADS_MIN_WEIGHTS padded with
zero columns up to it (gemv_padding), so that both cores read it. Copies, made once per generation,
each in one pass over its parameters (stacked_copy), all in one block of memory (Arena: 2 MB pages,
which a gemv streams faster; the block kept for the next generation's copies once the step is
closed); the embedding is read in place, and so is a
large classifier (the final norm's gain applied to xn) but in a generation of one or two rows long
enough to pay for its copy (copies_classifier).

InPlaceProjections, for large models, where a step costs per byte of weights read (110M: 438 MB
a token): every matrix read where it is, as model.params holds it (Meta's (out, in) layout; a
memory-mapped file's pages, or float16 / bfloat16), never copied; the gains, the q scale and the
negation are applied to the activations instead (a Product's pre and post calls).

Both normalise the same way: with r = (mean(x**2) + eps) ** -0.5 and the norm's weight g,

    x * r * g = x / sqrt(sum(x**2) + D eps) * (sqrt(D) g)
"""

from __future__ import annotations

import sys
import threading
from functools import partial
from itertools import pairwise

import numpy as np

from ..config import LlamaConfig
from ..model import layer_param_names, layer_weights, output_weight_name
from .settings import blas_core, blas_threads, get_blas_threads
from .shards import available_cores
from .stacked import ScaledRows, folded_layer, norm_gain, stack_members
from .helper import HelperProcess
from .upcast import upcast_into
from ..errors import NpllamaError

# Rows of a half-held matrix turned into float32 at a time: about 2^18 weights, a 1 MB buffer that
# stays in L2 (measured at 110M: 64K-256K weights a block are best, a whole matrix ~10% slower; at
# 7B the larger blocks keep the Python loop, ~8 us a block, under a tenth of a token's time).
HALF_BLOCK_ELEMENTS = 1 << 18

# One row through W (n, in) read in place: OpenBLAS's gemv (W @ x). Measured on 2 December 2026
# (110M's matrices, cold, one thread): 1.1-1.4x the speed of np.vecdot's dot product per row, which
# an earlier measurement had found faster; whole 110M steps: 38 against 34 tokens/s.
_matvec = np.matmul

# OpenBLAS multiplies matrices with M * N * K <= 10^6 by its small-matrix kernels, which skip
# packing the operands (its sgemm_small_kernel_permit on SkylakeX-class CPUs). For a few rows of x,
# W cut into row blocks that small runs 1.5-1.9x faster than one GEMM (measured on one thread, 110M
# shapes, 2-32 rows: 8 rows 40 against 25 GFLOP/s; one row past the bound falls back to 25).
SMALL_GEMM_MNK = 10 ** 6
# The OpenBLAS cores with small-matrix kernels of their own (AVX-512: its KERNEL.SKYLAKEX, which the
# later Xeons' include). Elsewhere the blocks run slower than one W @ x.T: measured on 6 December
# 2026 on an AMD EPYC (OpenBLAS's Haswell kernels, one thread), 8 rows through 768 x 2048 770 us in
# blocks against 487 as one call, 16 rows through 2304 x 768 1,030 against 831; the time to a short
# prompt's first token, 32 tokens, 110M 146 against 123 ms, 8M 16.6 against 15.3 (8 tokens: level);
# 8 rows a step on one BLAS thread, 110M 114 against 124 tokens/s.
SMALL_KERNEL_CORES = frozenset({"skylakex", "cooperlake", "sapphirerapids"})
SMALL_BLOCKS = blas_core() in SMALL_KERNEL_CORES
# Up to this many rows of x, a GEMM through an (out, in) matrix on one BLAS thread goes in such blocks.
FEW_ROWS = 32

# A product of 2 to FEW_ROWS rows (or of one row through half-held weights) through at least this
# many weights is cut in two halves of W's rows, the second on the helper thread (RowHalves). A
# hand-off costs ~20 us; half of a 1 MB matrix read at ~10 GB/s saves ~50.
SPLIT_MIN_WEIGHTS = 1 << 17
# A one-row product through at least this many weights gives half of W to the decoder's helper
# process (engine/helper.py), when it has one: a round trip costs ~2 us there, the time to read
# ~10,000 weights on one core. Measured (6 December 2026, AMD EPYC, 256 new tokens, alternating in
# one process, against one core and OpenBLAS's threads): a step 0.84x the time on 15M's shape, 0.78x
# on 8M's, 0.99x on 110M's; tokens/s after the first 1.12x, 1.22x and 1.00x.
HELPER_MIN_WEIGHTS = 1 << 16
# A product of at least this many multiply-adds (rows x weights) through float weights: OpenBLAS
# on all cores. One row, measured (2 December 2026, cold matrices, per call): 2304 x 768 123 us on
# two threads against 487 on one and 376 in RowHalves' halves; 4096 x 288 (in, out) 96 against
# 192; 768 x 768 59 against 97; below, 1536 x 288 64 against 51 and 864 x 288 79 against 32: the
# threads' wake-up costs more. Whole steps: 110M 43 tokens/s against 38 with the halves. A few
# rows, measured on 2 December 2026 on another 2-core EPYC (whole steps, one GEMM on two threads
# against the small-matrix blocks in halves): 8 rows 8M 2,957 tokens/s against 1,629, 15M 1,799
# against 1,189, 110M 235 against 181; 32 rows 110M 432 against 310. That GEMM is W @ x.T for
# 3 to FEW_ROWS rows: measured on 5 December 2026 on a 2-core Xeon (two threads, weights in L3,
# per call), 8 rows 864 x 288 44 us against 92 as x @ W.T, 768 x 2048 288 against 525, 32000 x 288
# 2,038 against 2,730, faster at 3 to 32 rows on every shape of 8M, 15M and 110M but two small
# ones at 3 and 4 rows; whole steps at 8 rows 8M 2,157 tokens/s against 1,466, 15M 920 against
# 724, 110M 128 against 106.
CORES_MIN_WEIGHTS = 1 << 19
# OpenBLAS runs a matrix-vector product on its threads only from this many weights on (m n >= 115200
# GEMM_MULTITHREAD_THRESHOLD, 4 by default, in its interface/gemv.c; measured on 0.3.31, two threads,
# either orientation: 1599 x 288 25-27 us, 1600 x 288 11-17; 599 x 768 and 600 x 768, 899 x 512 and
# 900 x 512 alike). A gemv a row (one row, or a copy stored (in, n)) through at least this many weights
# runs on all cores, as a product of CORES_MIN_WEIGHTS multiply-adds does.
GEMV_THREADS_MIN_WEIGHTS = 115200 * 4
# A small model's stacked copy read a row at a time (rows_first) just short of GEMV_THREADS_MIN_WEIGHTS
# is padded with zero columns up to it when that makes it at most this much larger: both cores then
# read it, each half the bytes. Dim 288's [-w1; w3] (1536 x 288, 442,368 weights) padded to 1600
# columns: one row's step of 15M's shape 1.63-1.69 ms against 1.38-1.47 (measured 5 December 2026,
# Xeon, six layers' copies and the classifier, weights in L3); a copy of 1100 columns padded to 1600
# still gained 14 us a layer, one of 900 was level, 864 x 288 (qkv) lost 7 us.
GEMV_PAD_MAX_GROWTH = 4 / 3
# A few rows' GEMM W @ x.T on BLAS threads goes this many rows of W a call: OpenBLAS runs a tall W
# (32000 rows) far below its speed on shorter ones. Measured on 5 December 2026 (Xeon, two threads,
# weights out of L2, per product): 8 rows through 32000 x 288 1.9 ms in blocks of 1024 rows against
# 4.1 as one GEMM, 32000 x 768 9.0 against 13.6, 2304 x 768 0.35 against 0.47, 4096 x 768 0.61
# against 0.73; blocks of 1024 as fast as or faster than one GEMM at 3, 4, 16 and 32 rows on every
# shape of 8M, 15M and 110M but 4096 x 288 at 4 rows (0.30 against 0.27).
CORES_BLOCK_ROWS = 1024
# A stacked step's large classifier at one or two rows is read in place (W @ x: OpenBLAS's gemv of
# dot products over rows of `in` numbers) unless the generation runs at least this many steps: then
# it is copied once, folded and stored (in, n), and read as x @ W (its gemv that adds scaled rows of
# the copy), which streams faster where `in` is short. Measured on 6 December 2026 on a 2-core AMD
# EPYC (OpenBLAS's Haswell kernels), 32000 x 288 from DRAM: 1,730 us a step on two threads in place
# against 1,103 for the copy (1T: 2,867 against 1,458); the copy takes 15-17 ms, paid back after
# ~25 steps; whole 240-token generations (7 rounds, alternating) 15M 367 tokens/s against 304, 8M
# 678 against 632. On a 2-core Xeon (5 December 2026) the two read alike (1.20 against 1.25 ms),
# where a copy would pay back after ~300 steps: by these figures, from 128 steps on it costs a Xeon
# at most 4% and gains an EPYC at least 15%.
CLASSIFIER_COPY_MIN_STEPS = 128
# Up to this many rows, a product on BLAS threads or through a matrix stored (in, n) is one gemv a
# row: OpenBLAS's GEMM with M = 2 reads W slower than two gemv calls read it twice (measured on 2
# December 2026, 2 rows, whole steps: 8M 1,458 tokens/s against 753 before, 15M 667 against 317,
# 110M 107 against 56; per call, 110M's 768 x 2048 208 us against 375).
ROW_BY_ROW = 2


class RowHalves:
    """The decoder's helper thread: runs one list of pieces (calls without arguments) while the
    caller runs another, and returns when both are done.

    The thread is started on first use and ended by close() (a Decoder closes its own at the end
    of a generate call); it is a daemon, so an interpreter never waits for it. It waits on a lock
    between jobs (no spinning): two lock calls a hand-off, the fewest Python has.
    """

    def __init__(self):
        self._go, self._done = threading.Lock(), threading.Lock()
        self._go.acquire()
        self._done.acquire()
        self._job = self._error = self._thread = None

    def _serve(self):
        while True:
            self._go.acquire()
            job = self._job
            if job is None:
                return
            try:
                for piece in job:
                    piece()
            except BaseException as e:      # handed to the caller, which raises it
                self._error = e
            self._done.release()

    def register(self, pieces: list) -> list:
        """The job `run` takes for these pieces: the pieces themselves (HelperProcess's takes an index)."""
        return pieces

    def run(self, theirs: list, ours: list) -> None:
        """Call every piece of `theirs` on the helper thread and of `ours` on this one."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="npllama-row-halves", daemon=True)
            self._thread.start()
        self._job = theirs
        self._go.release()
        try:
            for piece in ours:
                piece()
        finally:
            self._done.acquire()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        """End the helper thread (it is idle between jobs) and wait for it."""
        if self._thread is not None:
            self._job = None
            self._go.release()
            self._thread.join()
            self._thread = None


def _through_buffer(w, block, pieces):
    """Turn w (rows, in), held in another dtype, into block (same shape) and run pieces on it."""
    upcast_into(w, block)
    for piece in pieces:
        piece()


def small_block_rows(n_in: int, rows: int) -> int:
    """Rows of a W (n, n_in) that a product with `rows` rows of x takes a call: so few that OpenBLAS
    runs each call by its small-matrix kernels (SMALL_GEMM_MNK) where it has them (SMALL_BLOCKS),
    else all of W's rows (one call)."""
    if not SMALL_BLOCKS:
        return sys.maxsize
    return max(1, SMALL_GEMM_MNK // (n_in * rows))


def few_rows_product(x, w) -> np.ndarray:
    """x @ w.T (B, n) for 2 to FEW_ROWS rows of x (B, in), on one BLAS thread: W @ x.T a block of
    small_block_rows rows of w (n, in) at a time (one block where OpenBLAS has no small-matrix
    kernels), through a contiguous copy of x.T. One x @ w.T packs all of w for so few rows. A
    prefill of 4 to 32 tokens ran 1.2-1.6x faster this way on 8M's shape, 1.3-2.2x on 110M's; from
    48 tokens on, the two were level (measured 6 December 2026, Xeon, one thread)."""
    B, n_in = x.shape
    xt = np.ascontiguousarray(x.T)
    out_t = np.empty((w.shape[0], B), x.dtype)
    step = small_block_rows(n_in, B)
    for r0 in range(0, w.shape[0], step):
        np.matmul(w[r0:r0 + step], xt, out=out_t[r0:r0 + step])
    return np.ascontiguousarray(out_t.T)


def linear_rows(x, w) -> np.ndarray:
    """x @ w.T (N, n) for x (N, in), w (n, in) of one dtype: few_rows_product for 2 to FEW_ROWS rows
    on one BLAS thread, else one GEMM. The engine's block runs every frozen or plain projection of
    its forward through this one function, so a LoRA model with zero B gives its base's bits."""
    if 2 <= x.shape[0] <= FEW_ROWS and get_blas_threads() == 1:
        return few_rows_product(x, w)
    return x @ w.T


def copies_classifier(n_weights: int, batch_size: int, steps: int | None) -> bool:
    """Whether a stacked decode step of batch_size rows, made for `steps` steps (None: not known),
    copies its classifier of n_weights (folded with the final norm's gain) rather than read it in
    place: a small one always (below CORES_MIN_WEIGHTS: one NumPy call fewer a step), a large one at
    one or two rows for a generation of CLASSIFIER_COPY_MIN_STEPS steps or more."""
    if n_weights < CORES_MIN_WEIGHTS:
        return True
    return batch_size <= ROW_BY_ROW and steps is not None and steps >= CLASSIFIER_COPY_MIN_STEPS


def shares_with_helper(n: int, n_in: int) -> bool:
    """Whether a one-row product through W (n, n_in) gives half of its rows to a helper process."""
    return n >= 2 and n * n_in >= HELPER_MIN_WEIGHTS


def helper_weights(params: dict) -> int:
    """The weights a one-row step shares with a helper process: those of its products that do
    (shares_with_helper; each block's stacks, engine.stacked.stack_members, and the classifier)."""
    i, shapes = 0, []
    while layer_param_names(i).wq in params:
        shapes += [(sum(len(a) for a in stack), stack[0].shape[1])
                   for stack in stack_members(layer_weights(params, i)).values()]
        i += 1
    shapes.append(params.get("output.weight", params["tok_embeddings.weight"]).shape)
    return sum(n * n_in for n, n_in in shapes if shares_with_helper(n, n_in))


def helper_cuts(n: int, n_in: int) -> list[int]:
    """The boundaries of the blocks of rows of W (n, n_in) a one-row product shares with a helper
    process (HELPER_MIN_WEIGHTS): an even number of nearly equal blocks, the first half the caller's,
    each under GEMV_THREADS_MIN_WEIGHTS weights. Neither process's OpenBLAS then starts a thread of
    its own: after a fork it would start its pool anew, and its threads spin some 0.1 s on the cores
    the two processes use (engine/helper.py)."""
    per_half = max(1, -(-(n * n_in) // (2 * (GEMV_THREADS_MIN_WEIGHTS - 2 * n_in))))
    blocks = 2 * per_half
    return [i * n // blocks for i in range(blocks + 1)]


def product_threads() -> int:
    """The BLAS threads a large product runs on: the process's, at most one per core."""
    return min(get_blas_threads() or 1, available_cores())


def gemv_padded_rows(n: int, n_in: int) -> int:
    """The rows of a stacked copy of n rows (n, in) once padded up to GEMV_THREADS_MIN_WEIGHTS: n
    itself when it has as many weights already, or the padding would grow it past GEMV_PAD_MAX_GROWTH."""
    padded = -(-GEMV_THREADS_MIN_WEIGHTS // n_in)
    return padded if n < padded <= n * GEMV_PAD_MAX_GROWTH else n


def gemv_padding(parts: list, rows_first: bool) -> list:
    """The zero rows to stack under parts (ScaledRows) so that a copy read a row at a time reaches
    GEMV_THREADS_MIN_WEIGHTS, where OpenBLAS runs it on every core (gemv_padded_rows): one
    ScaledRows of zeros when the copy is rows_first and the process has two cores' BLAS threads for
    it, else none. (A copy that large is shared with a helper process instead, where a step has one:
    shares_with_helper.) The zero columns of x @ W are never read."""
    n, n_in = sum(p.w.shape[0] for p in parts), parts[0].w.shape[1]
    padded = gemv_padded_rows(n, n_in)
    if not rows_first or product_threads() < 2 or padded == n:
        return []
    return [ScaledRows(np.zeros((padded - n, n_in), parts[0].w.dtype), None)]


class Product:
    """out = x @ W.T for fixed buffers x (B, in) and out (B, n), W = [ws[0]; ws[1]; ...] (n, in)
    stacked by rows, each held (rows, in) in any float dtype; or out = x @ ws[0] with rows_first
    (one matrix stored (in, n') in x's dtype, n' >= n: columns past out's n are zero padding,
    gemv_padding; or, with a HelperProcess, W's blocks of columns side by side, stacked_copy's cuts).
    halves: a RowHalves thread or, for one row, a HelperProcess, which computes the second half of W.
    pre and post are calls made before and after (a norm's gain on x, a scale on out). Calling it
    computes out."""

    def __init__(self, ws, x, out, halves: RowHalves | HelperProcess | None = None, pre=(), post=(),
                 rows_first=False, buffers=(None, None)):
        B, n_in = x.shape
        self.pre, self.post, self.halves, self.cores = list(pre), list(post), None, None
        n = sum(w.shape[1] for w in ws) if rows_first else sum(w.shape[0] for w in ws)
        process = isinstance(halves, HelperProcess)
        if process and B != 1:
            raise NpllamaError(f"a HelperProcess splits one-row products; got {B} rows")
        threads = product_threads()
        gemv_a_row = B == 1 or rows_first
        large = B * n * n_in >= CORES_MIN_WEIGHTS or (gemv_a_row and n * n_in >= GEMV_THREADS_MIN_WEIGHTS)
        if large and threads >= 2 and all(w.dtype == x.dtype for w in ws) and not process:
            self.cores = blas_threads(threads)                        # the step runs on one BLAS thread
        self.row_by_row = B <= ROW_BY_ROW and (rows_first or self.cores is not None)
        if rows_first and n > out.shape[1]:         # W padded with zero columns (gemv_padding): its own out
            wide = np.empty((B, n), x.dtype)
            self.post.append(partial(np.copyto, out, wide[:, :out.shape[1]]))
            out = wide
        if rows_first:                                              # x, out contiguous (Activations)
            if process and len(ws) >= 2:                            # column blocks, the second half the helper's
                ends = np.cumsum([0] + [w.shape[1] for w in ws])
                pieces = [partial(np.dot, x[0], w, out=out[0, a:b]) for w, a, b in zip(ws, ends, ends[1:])]
                self.halves = halves
                self.ours, self.theirs = pieces[:len(ws) // 2], halves.register(pieces[len(ws) // 2:])
                return
            # np.dot: ~1 us a call less than np.matmul; on BLAS threads a row at a time (see ROW_BY_ROW)
            self.ours = ([partial(np.dot, x[b], ws[0], out=out[b]) for b in range(B)] if self.row_by_row
                         else [partial(np.dot, x, ws[0], out=out)])
            return
        self.blocks = FEW_ROWS >= B > 1 and self.cores is None
        self.transposed = self.blocks or (self.cores is not None and FEW_ROWS >= B > ROW_BY_ROW)
        if self.transposed:                         # W @ x.T (in blocks, or one GEMM) through transposed copies
            self.xt, self.out_t = np.empty((n_in, B), x.dtype), np.empty((n, B), x.dtype)
            self.pre.append(partial(np.copyto, self.xt, x.T))
            self.post.insert(0, partial(np.copyto, out, self.out_t.T))
        self.x, self.out = x, out
        rows = [(w, start) for w, start in zip(ws, np.cumsum([0] + [w.shape[0] for w in ws]))]
        if process and shares_with_helper(n, n_in):
            cuts = helper_cuts(n, n_in)         # row blocks, the second half the helper's
            half = len(cuts) // 2
            self.halves = halves
            self.ours = [piece for a, b in zip(cuts[:half], cuts[1:half + 1])
                         for piece in self._pieces(_rows_between(rows, a, b), buffers[0])]
            self.theirs = halves.register([piece for a, b in zip(cuts[half:], cuts[half + 1:])
                                           for piece in self._pieces(_rows_between(rows, a, b), buffers[1])])
        elif halves is not None and not process and B <= FEW_ROWS and self.cores is None and n >= 2 \
                and n * n_in >= SPLIT_MIN_WEIGHTS and available_cores() >= 2:
            self.halves = halves
            self.ours = self._pieces(_rows_between(rows, 0, n // 2), buffers[0])
            self.theirs = halves.register(self._pieces(_rows_between(rows, n // 2, n), buffers[1]))
        else:
            self.ours = self._pieces(rows, buffers[0])

    @property
    def call(self):
        """The fastest callable computing out: the one piece itself when that is all there is."""
        if len(self.ours) == 1 and not (self.pre or self.post or self.halves or self.cores):
            return self.ours[0]
        return self

    def __call__(self):
        for call in self.pre:
            call()
        if self.halves is not None:
            self.halves.run(self.theirs, self.ours)
        elif self.cores is not None:
            with self.cores:
                for piece in self.ours:
                    piece()
        else:
            for piece in self.ours:
                piece()
        for call in self.post:
            call()

    def _pieces(self, rows, buffer):
        """The calls computing out's columns start .. start + len(w) for each (w, start) in rows."""
        pieces = []
        x = self.x
        for w, start in rows:
            if w.dtype == x.dtype:
                pieces += self._same_dtype(w, start)
                continue
            step = max(1, HALF_BLOCK_ELEMENTS // w.shape[1])
            for r0 in range(0, w.shape[0], step):
                part = w[r0:r0 + step]
                block = buffer[:part.size].reshape(part.shape)
                pieces.append(partial(_through_buffer, part, block, self._same_dtype(block, start + r0)))
        return pieces

    def _same_dtype(self, w, start):
        """Pieces for out[:, start:start + len(w)] = x @ w.T, w in x's dtype."""
        x, out = self.x, self.out
        B, rows = x.shape[0], w.shape[0]
        if B == 1 or self.row_by_row:
            return [partial(_matvec, w, x[b], out=out[b, start:start + rows]) for b in range(B)]
        if not self.transposed:
            return [partial(np.matmul, x, w.T, out=out[:, start:start + rows])]
        if not self.blocks:                         # on BLAS threads: CORES_BLOCK_ROWS rows of w a call
            return [partial(np.matmul, w[r0:r0 + CORES_BLOCK_ROWS], self.xt,
                            out=self.out_t[start + r0:start + min(rows, r0 + CORES_BLOCK_ROWS)])
                    for r0 in range(0, rows, CORES_BLOCK_ROWS)]
        step = small_block_rows(w.shape[1], B)
        return [partial(np.matmul, w[r0:r0 + step], self.xt, out=self.out_t[start + r0:start + min(rows, r0 + step)])
                for r0 in range(0, rows, step)]


def _rows_between(rows, lo, hi):
    """[(w, start)] cut to the stacked rows lo .. hi."""
    found = []
    for w, start in rows:
        a, b = max(lo, start), min(hi, start + w.shape[0])
        if a < b:
            found.append((w[a - start:b - start], a))
    return found


# Rows of W copied at a time by stacked_copy: a block's reads and writes stay in cache.
TRANSPOSE_BLOCK_ROWS = 256


def stacked_copy(parts: list, dtype, transposed: bool, cuts: list | None = None, empty=np.empty):
    """[w_1 * f_1; w_2 * f_2; ...] for parts ScaledRows(w_j, f_j), each w_j's rows times its factor
    (none when None), in dtype: one new array (n, in), or its transpose (in, n) C-contiguous when
    `transposed`. Made TRANSPOSE_BLOCK_ROWS rows at a time, each block read once, scaled and written
    while in cache, so a copy is one pass over the parameters. The products are w's (in its dtype)
    and then rounded to dtype, as (w * f).astype(dtype) would be: the same bits.
    Measured on 15M's classifier (32000 x 288, 5 December 2026): a transposed copy 46-50 ms, against
    132 for np.ascontiguousarray(w.T), whose one strided pass misses the cache on every element; a
    one-row step of 15M made in 38-39 ms, against 54-62 when the stacking, the norms' folding and the
    transposition were three passes (and 74-273 before the blocks); 20 ms once its classifier was
    read in place.
    cuts (transposed only): the copy as a list of arrays, its columns cuts[i] .. cuts[i + 1] each, each
    C-contiguous, for a product split between two processes (helper_cuts; a strided block of columns
    costs NumPy a copy a call).
    empty: how each array is made (an Arena's empty: all of a step's copies in one allocation)."""
    n, n_in = sum(p.w.shape[0] for p in parts), parts[0].w.shape[1]
    if cuts is not None and not transposed:
        raise NpllamaError("stacked_copy: cuts only of a transposed copy")
    listed = cuts is not None
    cuts = cuts if listed else [0, n]
    outs = [empty((n_in, b - a) if transposed else (b - a, n_in), dtype) for a, b in zip(cuts, cuts[1:])]
    start = 0
    for w, factor in parts:
        for r0 in range(0, w.shape[0], TRANSPOSE_BLOCK_ROWS):
            block = w[r0:r0 + TRANSPOSE_BLOCK_ROWS]
            if factor is not None:
                block = block * factor
            first, end = start + r0, start + r0 + block.shape[0]
            for out, a, b in zip(outs, cuts, cuts[1:]):
                lo, hi = max(first, a), min(end, b)
                if lo < hi:
                    rows = block[lo - first:hi - first]
                    if transposed:
                        out[:, lo - a:hi - a] = rows.T
                    else:
                        out[lo - a:hi - a] = rows
        start += w.shape[0]
    return outs if listed else outs[0]


class Arena:
    """Arrays carved one after another out of one block of memory of nbytes (and ARENA_ALIGN's slack
    each): a step's copies of the weights, made by StackedProjections.

    One block so that the copies lie in the 2 MB pages NumPy asks the kernel for on an allocation of
    4 MB or more (transparent huge pages, where Linux has them), not in 4 KB ones. A gemv streams a
    copy once a step, and in 4 KB pages every 4 KB is a TLB miss and a stop for the hardware
    prefetcher: 15M's classifier as 22 column blocks of 1.7 MB each (a helper process's cuts) took
    0.75-0.84x the time in one block (AMD EPYC, 6 December 2026).

    The block of a released arena (release(), when its step is closed) is kept for the next Arena
    that fits in it (one block, for the whole process): fresh memory costs page faults, and on the
    VM this was measured on 2 MB pages the host has not backed cost ~3 ms each to touch (61 MB in
    150-240 ms, against 6-9 ms for memory the process touched before). So after a generation of a
    stacked model the process holds its copies' memory (15M: 61 MB) until the next generation
    reuses it, or until release_spare_memory()."""

    def __init__(self, nbytes: int):
        need = nbytes + ARENA_ALIGN                                 # and the first array's alignment
        memory = _spare.pop() if _spare else None
        if memory is None or memory.size < need:
            memory = np.empty(need, np.uint8)
        self.memory = memory
        self.used = -memory.__array_interface__["data"][0] % ARENA_ALIGN

    @staticmethod
    def room(shape, dtype) -> int:
        """The bytes empty(shape, dtype) takes of an arena."""
        return _nbytes(shape, dtype) + ARENA_ALIGN

    def empty(self, shape, dtype) -> np.ndarray:
        """An uninitialised C-contiguous array of the arena, at a multiple of ARENA_ALIGN bytes."""
        size = _nbytes(shape, dtype)
        start = self.used
        if self.memory is None or start + size > self.memory.size:
            raise NpllamaError(f"Arena: no room for {size} bytes at {start} (released, or sized too small)")
        self.used = start + -(-size // ARENA_ALIGN) * ARENA_ALIGN
        return self.memory[start:start + size].view(dtype).reshape(shape)

    def release(self) -> None:
        """Keep the block for the next Arena: every array carved from it is then the next one's to
        overwrite, so the caller uses none of them again (DecodeStep refuses a step once closed)."""
        if self.memory is not None:
            _spare[:] = [self.memory]
            self.memory = None


# Where each of an Arena's arrays starts: a cache line
ARENA_ALIGN = 64


def _nbytes(shape, dtype) -> int:
    return int(np.prod(shape)) * np.dtype(dtype).itemsize

# The one block of memory kept from a released Arena (Arena's docstring)
_spare: list = []


def release_spare_memory() -> int:
    """Free the memory kept from the last closed decode step's copies (Arena); the bytes freed."""
    freed = sum(block.nbytes for block in _spare)
    _spare.clear()
    return freed


def half_buffers(params: dict, dtype, max_in: int):
    """Two upcast buffers (one a thread) when some matrix is not held in dtype, else (None, None)."""
    if all(a.dtype == dtype for a in params.values()):
        return None, None
    return tuple(np.empty(max(HALF_BLOCK_ELEMENTS, max_in), dtype=dtype) for _ in range(2))


def linear_in_place(w, x, out):
    """out (N, n) = x (N, in) @ w.T with w (n, in) read as it is held, never copied: a Product made for
    the call, upcasting blocks of w through a buffer of HALF_BLOCK_ELEMENTS when w is held in another
    dtype than x's (none otherwise)."""
    buffer = None if w.dtype == x.dtype else np.empty(max(HALF_BLOCK_ELEMENTS, w.shape[1]), dtype=x.dtype)
    Product([w], x, out, buffers=(buffer, None))()


class Activations:
    """A step's buffers, made once per decoder, for batch_size rows in the compute dtype: the
    projections read and write them (Product), the step's other ops work between them."""

    def __init__(self, config: LlamaConfig, batch_size: int, dtype, empty=np.empty):
        """empty: how each buffer is made (HelperProcess.empty: in memory a helper process shares)."""
        B, D, H, KVH, Dh, F = (batch_size, config.dim, config.n_heads, config.n_kv_heads, config.head_dim,
                               config.hidden_dim)
        self.x = empty((B, D), dtype)                         # the residual stream
        self.xn = empty((B, D), dtype)                        # a norm's output: input of qkv, gate_up, logits
        self.qkv = empty((B, (H + 2 * KVH) * Dh), dtype)     # [q / sqrt(Dh) | k | v]
        self.att = empty((B, H * Dh), dtype)                  # attention's output: input of o
        self.res = empty((B, D), dtype)                       # o's and down's output, added to the residual
        self.ab = empty((B, 2 * F), dtype)                    # [-a | b] = [-w1 xn | w3 xn]
        self.g = empty((B, F), dtype)                         # -silu(a) b: input of down
        self.logits = empty((B, config.vocab_size), dtype)


class StackedProjections:
    """Stacked, folded copies of the weights, oriented for the batch size (small models)."""

    def __init__(self, params: dict, config: LlamaConfig, acts: Activations,
                 halves: RowHalves | HelperProcess | None = None, steps: int | None = None):
        B, Dh = acts.xn.shape[0], config.head_dim
        # OpenBLAS picks its kernel by shape. Measured per step (one thread): with 2 rows, x @ W
        # with W stored (in, out) beats (W @ x.T).T with W stored (out, in), as Meta has it, by
        # 1.4x on an 8M model; with 4+ rows the latter wins by up to 1.4x. With one row x @ W
        # wins too (2 December 2026, 8M: 340-350 tokens/s against 240; per call 1.3-1.7x on
        # dim 288's wide matrices, level on the down projection). Storing (in, out) costs a
        # transposing copy of every matrix at setup, so it is done only where it pays. (Two rows
        # now go one x[b] @ W a row, ROW_BY_ROW: 8M 1,458 tokens/s against 753 as one call.)
        rows_first = B <= ROW_BY_ROW
        dtype = acts.xn.dtype

        process = isinstance(halves, HelperProcess)

        def copy_of(parts):
            """How a product holds parts: (the rows stacked_copy copies, any padding included; the helper
            process's cuts, or None), or None where the parameter is read in place."""
            n, n_in = sum(len(p.w) for p in parts), parts[0].w.shape[1]
            if len(parts) == 1 and parts[0].factor is None and not rows_first:
                return None
            if process and shares_with_helper(n, n_in):
                return parts, helper_cuts(n, n_in)
            return parts + gemv_padding(parts, rows_first), None

        # Every product's parts, and how it holds them, first: the copies then go in one Arena.
        layers = [folded_layer(layer_weights(params, i), Dh) for i in range(config.n_layers)]
        classifier = params[output_weight_name(config)]
        final_gain = norm_gain(params["norm.weight"])
        copied_classifier = copies_classifier(classifier.size, B, steps)
        folded_classifier = [ScaledRows(classifier, final_gain.astype(classifier.dtype))]
        layer_copies = [[copy_of(parts) for parts in products] for products in layers]
        classifier_copy = copy_of(folded_classifier) if copied_classifier else None
        planned = [copy for copies in layer_copies for copy in copies] + [classifier_copy]
        arena = Arena(sum(Arena.room((b - a, held[0].w.shape[1]), dtype) for held, cuts in filter(None, planned)
                          for a, b in pairwise(cuts or [0, sum(len(p.w) for p in held)])))

        def product(parts, copy, x, out):
            if copy is None:
                ws = [parts[0].w.astype(dtype, copy=False)]        # read in place: no copy to make
            else:
                held, cuts = copy
                ws = stacked_copy(held, dtype, transposed=rows_first, cuts=cuts, empty=arena.empty)   # cuts: one row
                ws = ws if cuts is not None else [ws]
            return Product(ws, x, out, halves, rows_first=rows_first).call

        self.layers = []
        for (qkv, o, gate_up, down), (qkv_copy, o_copy, gate_up_copy, down_copy) in zip(layers, layer_copies):
            self.layers.append((product(qkv, qkv_copy, acts.xn, acts.qkv), product(o, o_copy, acts.att, acts.res),
                                product(gate_up, gate_up_copy, acts.xn, acts.ab),
                                product(down, down_copy, acts.g, acts.res)))
        # A large classifier (CORES_MIN_WEIGHTS and more) is read in place, its norm's gain applied
        # to xn (a row of D numbers) instead, unless a long generation pays for its copy
        # (copies_classifier, CLASSIFIER_COPY_MIN_STEPS): the copy costs 15M 15-20 ms and 37 MB a
        # generation call. A small one (stories260K's 512 x 64) is folded into a copy: its step costs
        # per call, and the multiply of xn is one more (7,370-7,580 tokens/s against 6,920-7,360 read
        # in place).
        if not copied_classifier:
            self.logits = Product([classifier.astype(dtype, copy=False)], acts.xn, acts.logits, halves,
                                  pre=[partial(np.multiply, acts.xn, final_gain.astype(dtype), out=acts.xn)]).call
        else:
            self.logits = product(folded_classifier, classifier_copy, acts.xn, acts.logits)
        self.embedding = params["tok_embeddings.weight"].astype(dtype, copy=False)
        self.arena = arena

    def embed(self, ids, out):
        """out (B, D) = the embeddings of ids (B,)."""
        self.embedding.take(ids, axis=0, out=out)       # the method: 0.6 us a step less than np.take

    def release(self) -> None:
        """Hand the copies' memory on to the next step's (Arena.release): this one is not used again."""
        self.arena.release()


class InPlaceProjections:
    """The parameters read where they are (large models, memory-mapped or half-held weights)."""

    def __init__(self, params: dict, config: LlamaConfig, acts: Activations,
                 halves: RowHalves | HelperProcess | None = None):
        D, H, Dh, F = config.dim, config.n_heads, config.head_dim, config.hidden_dim
        self.dtype = dtype = acts.xn.dtype
        buffers = half_buffers(params, dtype, max(D, F))

        def gain(norm_weight):          # sqrt(D) g, in the compute dtype (a (D,) copy)
            return norm_gain(norm_weight).astype(dtype)

        def product(ws, x, out, pre=(), post=()):
            return Product(ws, x, out, halves, pre, post, buffers=buffers).call

        q, minus_a = acts.qkv[:, :H * Dh], acts.ab[:, :F]
        q_scale = np.array(1.0 / np.sqrt(Dh), dtype)
        self.layers = []
        for w in (layer_weights(params, i) for i in range(config.n_layers)):
            attention_gain, ffn_gain = gain(w.attention_norm), gain(w.ffn_norm)
            self.layers.append((
                product((w.wq, w.wk, w.wv), acts.xn, acts.qkv,
                        pre=[partial(np.multiply, acts.xn, attention_gain, out=acts.xn)],
                        post=[partial(np.multiply, q, q_scale, out=q)]),
                product((w.wo,), acts.att, acts.res),
                product((w.w1, w.w3), acts.xn, acts.ab, pre=[partial(np.multiply, acts.xn, ffn_gain, out=acts.xn)],
                        post=[partial(np.negative, minus_a, out=minus_a)]),
                product((w.w2,), acts.g, acts.res)))
        final_gain = gain(params["norm.weight"])
        self.logits = product((params[output_weight_name(config)],), acts.xn, acts.logits,
                              pre=[partial(np.multiply, acts.xn, final_gain, out=acts.xn)])
        self.embedding = params["tok_embeddings.weight"]

    def release(self) -> None:
        """Nothing to hand on: no copies."""

    def embed(self, ids, out):
        """out (B, D) = the embeddings of ids (B,), in out's dtype."""
        upcast_into(self.embedding.take(ids, axis=0), out)
