"""A decode step's linear layers, laid out two ways (engine.decode.DecodeStep picks one).

A step asks its projections for these, per block and at the ends (B rows, one position each):

    embed(ids)           (B,) ids -> (B, D) rows of tok_embeddings, in the compute dtype
    qkv(layer, x)        residual x (B, D) -> (B, (H + 2 KVH) Dh): [q / sqrt(Dh) | k | v] of RMSNorm(x)
    o(layer, att)        (B, H Dh) -> (B, D)
    gate_up(layer, x)    residual x (B, D) -> (B, 2F): [w1 | w3] of RMSNorm(x)
    down(layer, g)       (B, F) -> (B, D)
    logits(x)            (B, D) -> (B, V) of the final RMSNorm(x)

Both normalise the same way: with r = (mean(x**2) + eps) ** -0.5 and the norm's weight g,

    x * r * g = x / sqrt(sum(x**2) + D eps) * (sqrt(D) g)

StackedProjections, for small models, where a step costs per NumPy call: [wq; wk; wv] and
[w1; w3] stacked into one matrix each, sqrt(D) g and 1/sqrt(Dh) folded into the matrices
(stacked.fold_norms), each stored in the orientation OpenBLAS runs fastest for the batch size.
Copies of every matrix, made once per generation: a few MB for such models.

InPlaceProjections, for large models, where a step costs per byte of weights read (110M:
438 MB a token): every matrix read where it is, as model.params holds it (Meta's (out, in)
layout; a memory-mapped file's pages, or float16 / bfloat16 weights), never copied. One row
runs np.vecdot(W, x), a dot product per row of W: 1.7-2x the bandwidth of OpenBLAS's gemv on
this layout, W @ x (measured on 2 cores: 17-30 vs 8-15 GB/s, one thread), and as fast as gemv
on a transposed copy. Up to FEW_ROWS rows run small GEMMs on blocks of W's rows (few_rows_gemm),
a large matrix's halves on two threads (RowHalves); more rows, one GEMM per matrix. sqrt(D) g
multiplies the normalised vector, 1/sqrt(Dh) the q part of the output. Half-held matrices go through
ChunkedHalfLinear.
"""

from __future__ import annotations

import threading

import numpy as np

from ..config import LlamaConfig
from ..model import layer_weights, output_weight_name
from .fused import row_dot
from .shards import available_cores
from .stacked import fold_norms, stack_layers
from .upcast import upcast, upcast_into

if hasattr(np, "vecdot"):
    def matvec_into(w, x, out):
        """out (n,) = w (n, in) @ x (in,): one dot product per row of w, read in place."""
        np.vecdot(w, x, out=out)
else:
    def matvec_into(w, x, out):
        np.matmul(w, x, out=out)

# Rows of a half-held matrix turned into float32 at a time: about 2^18 weights, a 1 MB buffer that
# stays in L2 (measured at 110M: 64K-256K weights a block are best, a whole matrix ~10% slower; at
# 7B the larger blocks keep the Python loop, ~8 us a block, under a tenth of a token's time).
# The upcast is compute-bound (~2 G weights/s a core); cutting a matrix's rows among two Python
# threads gained nothing here, with the second core taken by other work (110M float16: 15.5 vs 16.4).
HALF_BLOCK_ELEMENTS = 1 << 18

# OpenBLAS multiplies matrices with M * N * K <= 10^6 by its small-matrix kernels, which skip
# packing the operands (its sgemm_small_kernel_permit on SkylakeX-class CPUs). For a few rows of x,
# W cut into row blocks that small runs 1.5-1.9x faster than one GEMM (measured on one thread, 110M
# shapes, 2-32 rows: 8 rows 40 against 25 GFLOP/s; one row past the bound falls back to 25); with
# another BLAS the blocks cost a Python loop of ~2 us each, a few per cent of a step.
SMALL_GEMM_MNK = 10 ** 6
# Up to this many rows of x, a GEMM through an (out, in) matrix goes in such blocks (few_rows_gemm).
FEW_ROWS = 32


def normalized(x, d_eps):
    """x / sqrt(sum(x**2) + D eps) over the last axis: RMSNorm without its weight and sqrt(D). (B, D) -> (B, D)."""
    ss = row_dot(x, x)
    ss += d_eps
    return x / np.sqrt(ss, out=ss)


class StackedProjections:
    """Stacked, folded copies of the weights, oriented for the batch size (small models)."""

    def __init__(self, params: dict, config: LlamaConfig, batch_size: int, halves: RowHalves | None = None):
        H, Dh = config.n_heads, config.head_dim
        self.halves = halves
        # OpenBLAS picks its kernel by shape. Measured per step (one thread): with 2 rows, x @ W
        # with W stored (in, out) beats (W @ x.T).T with W stored (out, in), as Meta has it, by
        # 1.4x on an 8M model; with 4+ rows the latter wins by up to 1.4x; with one row they tie
        # for dim 288, and x @ W saves ~0.5 us a matmul for dim 64, where calls dominate. Storing
        # (in, out) costs a transposing copy of every matrix at setup, so it is done only where it pays.
        self.rows_first = batch_size == 2 or (batch_size == 1 and config.dim <= 128)
        self.layers = [tuple(self._oriented(m) for m in (w.wqkv, w.wo, w.w13, w.w2))
                       for w in (fold_norms(w, Dh, H) for w in stack_layers(params, config))]
        self.embedding = params["tok_embeddings.weight"]
        norm = params["norm.weight"]
        self.output = self._oriented(params[output_weight_name(config)]
                                     * (norm * np.sqrt(config.dim, dtype=np.float64)).astype(norm.dtype))
        self.d_eps = config.dim * config.norm_eps

    def _oriented(self, w):
        return np.ascontiguousarray(w.T) if self.rows_first else w

    def _linear(self, x, w):
        """x (B, in) -> (B, out) through a matrix stored as _oriented made it."""
        if self.rows_first:
            return x @ w
        if x.shape[0] == 1:                             # one dot product per row, as InPlaceProjections
            out = np.empty((1, w.shape[0]), dtype=x.dtype)
            matvec_into(w, x[0], out[0])
            return out
        if x.shape[0] > FEW_ROWS:
            return x @ w.T
        out = np.empty((x.shape[0], w.shape[0]), dtype=x.dtype)
        few_rows_linear(w, x, out, self.halves)
        return out

    def embed(self, ids):
        return self.embedding.take(ids, axis=0)

    def qkv(self, layer, x):
        return np.ascontiguousarray(self._linear(normalized(x, self.d_eps), layer[0]))

    def o(self, layer, att):
        return self._linear(att, layer[1])

    def gate_up(self, layer, x):
        return self._linear(normalized(x, self.d_eps), layer[2])

    def down(self, layer, g):
        return self._linear(g, layer[3])

    def logits(self, x):
        return np.ascontiguousarray(self._linear(normalized(x, self.d_eps), self.output))


class ChunkedHalfLinear:
    """out = x @ W.T for a half-held W (rows, in): a block of rows at a time is turned into float32
    in a buffer that stays in cache (engine.upcast.upcast_into) and multiplied there."""

    def __init__(self, max_in: int, dtype=np.float32):
        self.block_elements = HALF_BLOCK_ELEMENTS
        self.buffer = np.empty(max(self.block_elements, max_in), dtype=dtype)

    def __call__(self, w, x, out):
        """w (rows, in) half-held; x (B, in) and out (B, rows) in the buffer's dtype (float32; float64 in tests)."""
        rows, n_in = w.shape
        step = max(1, self.block_elements // n_in)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            block = self.buffer[:(r1 - r0) * n_in].reshape(r1 - r0, n_in)
            upcast_into(w[r0:r1], block)
            if x.shape[0] == 1:
                matvec_into(block, x[0], out[0, r0:r1])
            elif x.shape[0] <= FEW_ROWS:
                out[:, r0:r1] = few_rows_gemm(block, x)
            else:
                out[:, r0:r1] = x @ block.T


def few_rows_gemm(w, x):
    """x (N, in) @ w.T -> (N, n) for a few rows of x: W @ x.T a block of W's rows at a time, each
    block small enough for BLAS's small-matrix kernels (SMALL_GEMM_MNK)."""
    step = max(1, SMALL_GEMM_MNK // (w.shape[1] * x.shape[0]))
    if step >= w.shape[0]:
        return (w @ x.T).T                                             # small already: one call
    xt = np.ascontiguousarray(x.T)                                     # (in, N)
    out_t = np.empty((w.shape[0], x.shape[0]), dtype=x.dtype)          # (n, N)
    for r0 in range(0, w.shape[0], step):
        np.matmul(w[r0:r0 + step], xt, out=out_t[r0:r0 + step])
    return out_t.T


# A few rows' GEMM of at least this many multiply-adds is cut in two halves of W's rows, the second
# on a helper thread (RowHalves): the small-matrix kernels use one thread, so the second core is
# otherwise idle. Measured at 110M, 8 rows, all of a step's matrices: 40 against 49 ms with the
# other core half taken by other work. A hand-off costs ~20 us, so small matrices stay on one thread.
SPLIT_MIN_MACS = 1 << 21


class RowHalves:
    """out = x @ w.T for a few rows of x, w's rows in two halves: the second on a helper thread,
    the first on the caller's. The same products as few_rows_gemm, though BLAS may sum a dot
    product in another order for the halves' shapes (a rounding difference; the same bits every
    call for the same shapes).

    The helper thread is started on first use and ended by close() (a Decoder closes its own at
    the end of a generate call); it is a daemon, so an interpreter never waits for it.
    """

    def __init__(self):
        self._start, self._done = threading.Event(), threading.Event()
        self._job = self._error = None
        self._thread = None
        self._closing = False

    def _serve(self):
        while True:
            self._start.wait()
            self._start.clear()
            if self._closing:
                return
            w, x, out = self._job
            try:
                out[...] = few_rows_gemm(w, x)
            except BaseException as e:      # handed to the caller, which raises it
                self._error = e
            self._done.set()

    def __call__(self, w, x, out) -> None:
        """Fill out (N, n) = x @ w.T."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="npllama-row-halves", daemon=True)
            self._thread.start()
        half = w.shape[0] // 2
        self._job, self._error = (w[half:], x, out[:, half:]), None
        self._done.clear()
        self._start.set()
        try:
            out[:, :half] = few_rows_gemm(w[:half], x)
        finally:
            self._done.wait()
            self._job = None
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """End the helper thread (it is idle between calls) and wait for it."""
        if self._thread is not None:
            self._closing = True
            self._start.set()
            self._thread.join()
            self._thread = None


def few_rows_linear(w, x, out, halves: RowHalves | None = None):
    """out (N, n) = x (N, in) @ w.T for N <= FEW_ROWS: few_rows_gemm, on two cores (halves) when
    the GEMM is large enough to pay for the hand-off (SPLIT_MIN_MACS) and the process may use two."""
    if (halves is not None and w.shape[0] * w.shape[1] * x.shape[0] >= SPLIT_MIN_MACS and w.shape[0] >= 2
            and available_cores() >= 2):
        halves(w, x, out)
    else:
        out[...] = few_rows_gemm(w, x)


def linear_in_place(w, x, out, half_linear: ChunkedHalfLinear, halves: RowHalves | None = None):
    """out (N, n) = x (N, in) @ w.T with w (n, in) read as it is held, never copied: one dot product
    per row of w for one row of x, small GEMMs for a few (few_rows_linear, on two cores with
    halves), one GEMM for many, and half_linear for a w held in another dtype than x's (float16 /
    bfloat16, or float32 under a float64 x)."""
    if w.dtype != x.dtype:
        half_linear(w, x, out)
    elif x.shape[0] == 1:
        matvec_into(w, x[0], out[0])
    elif x.shape[0] <= FEW_ROWS:
        few_rows_linear(w, x, out, halves)
    else:
        np.matmul(x, w.T, out=out)


class InPlaceProjections:
    """The parameters read where they are (large models, memory-mapped or half-held weights)."""

    def __init__(self, params: dict, config: LlamaConfig, dtype, halves: RowHalves | None = None):
        D, H, KVH, Dh = config.dim, config.n_heads, config.n_kv_heads, config.head_dim
        self.halves = halves
        self.dtype = np.dtype(dtype)
        sqrt_d = np.sqrt(D, dtype=np.float64)

        def gain(norm_weight):          # sqrt(D) g, in the compute dtype (a (D,) copy)
            return (upcast(norm_weight, np.float64) * sqrt_d).astype(self.dtype)

        self.layers = [(w, gain(w.attention_norm), gain(w.ffn_norm))
                       for w in (layer_weights(params, i) for i in range(config.n_layers))]
        self.embedding = params["tok_embeddings.weight"]
        self.output = params[output_weight_name(config)]
        self.final_gain = gain(params["norm.weight"])
        self.d_eps = D * config.norm_eps
        self.q_end, self.qkv_width = H * Dh, (H + 2 * KVH) * Dh
        self.q_scale = self.dtype.type(1.0 / np.sqrt(Dh))
        self.half_linear = ChunkedHalfLinear(max(D, config.hidden_dim), self.dtype)

    def _project(self, ws, x, width):
        """[x @ w.T for w in ws] side by side in one (B, width) array."""
        out = np.empty((x.shape[0], width), dtype=self.dtype)
        start = 0
        for w in ws:
            linear_in_place(w, x, out[:, start:start + w.shape[0]], self.half_linear, self.halves)
            start += w.shape[0]
        return out

    def _normalized(self, x, gain):
        xn = normalized(x, self.d_eps)
        xn *= gain
        return xn

    def embed(self, ids):
        return upcast(self.embedding.take(ids, axis=0), self.dtype)

    def qkv(self, layer, x):
        w, attention_gain, _ = layer
        out = self._project((w.wq, w.wk, w.wv), self._normalized(x, attention_gain), self.qkv_width)
        out[:, :self.q_end] *= self.q_scale
        return out

    def o(self, layer, att):
        return self._project((layer[0].wo,), att, layer[0].wo.shape[0])

    def gate_up(self, layer, x):
        w, _, ffn_gain = layer
        return self._project((w.w1, w.w3), self._normalized(x, ffn_gain), 2 * w.w1.shape[0])

    def down(self, layer, g):
        return self._project((layer[0].w2,), g, layer[0].w2.shape[0])

    def logits(self, x):
        return self._project((self.output,), self._normalized(x, self.final_gain), self.output.shape[0])
