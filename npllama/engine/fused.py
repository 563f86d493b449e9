"""The reference's element-wise ops, fused into fewer passes over 2-D activations (N, D).

Each function here computes what an op of npllama/ops computes, named in its docstring, and
tests/engine/test_parts.py holds it equal to that op (float64, 1e-10 or closer):

    row_dot                  sum(a * b) over the last axis, kept: one ufunc call
    rms_rstd                 ops.rmsnorm's r = (mean(x**2) + eps) ** -0.5
    rms_backward             ops.rmsnorm_backward, given x and r, written over dy
    sigmoid                  ops.swiglu.sigmoid, in three passes
    cross_entropy_in_place   ops.cross_entropy_forward and _backward at once, over the logits
    frozen_output_loss       ops.linear_forward (the output projection), cross_entropy_forward and
                             their backward to the input, through a frozen weight, by vocabulary blocks
    add_rows                 ops.embedding_backward's scatter-add, by a one-hot GEMM or a sort
"""

from __future__ import annotations

import functools

import numpy as np

from ..ops import IGNORE_INDEX

# Up to this vocabulary the embedding's gradient is summed by a one-hot GEMM (2 V N D flops);
# above, by sorting the ids (70 ms against 3 ms at V = 6144, D = 768, N = 512).
ONE_HOT_MAX_VOCAB = 128

# row_dot(a, b): sum(a * b) over the last axis, kept, (N, D) -> (N, 1). np.vecdot (NumPy >= 2.0) is
# one ufunc call, half of einsum's time at D = 64; NumPy 1.x gets the einsum.
# Both take out= (N, 1).
if hasattr(np, "vecdot"):
    row_dot = functools.partial(np.vecdot, keepdims=True)
else:
    def row_dot(a, b, out=None):
        if out is None:
            return np.einsum("...d,...d->...", a, b)[..., None]
        np.einsum("...d,...d->...", a, b, out=out[..., 0])
        return out


def rms_rstd(x, eps):
    """r = (mean(x**2) + eps) ** -0.5 of each row, as ops.rmsnorm_forward: (N, D) -> (N, 1)."""
    r = row_dot(x, x)
    r *= 1.0 / x.shape[1]
    r += eps
    np.sqrt(r, out=r)
    return np.divide(1.0, r, out=r)


def rms_backward(dy, x, rstd, weight):
    """ops.rmsnorm_backward with the input and r given: (dx, dweight), dx written over dy.

    n = x r,  dweight = sum over rows of dy n,  g = dy w,  dx = r (g - n mean(g n)).
    Shapes: dy, x (N, D); rstd (N, 1); weight (D,) -> dx (N, D), dweight (D,)
    """
    n = x * rstd
    dweight = np.einsum("nd,nd->d", dy, n)
    dy *= weight
    mean_gn = row_dot(dy, n)
    mean_gn *= 1.0 / x.shape[1]
    n *= mean_gn
    dy -= n
    dy *= rstd
    return dy, dweight


def sigmoid(a):
    """ops.swiglu.sigmoid, 1 / (1 + exp(-a)), as a new array, in three passes. NumPy's divide takes
    half the time of its reciprocal, and its exp is SIMD (float32: 0.87 ms on 512 x 704 against
    1.27 for exp2, which calls libm element by element). (exp(-a) overflowing to inf gives the
    right limit, 0; underflowing to 0, the right limit 1.)"""
    s = np.negative(a)
    with np.errstate(over="ignore", under="ignore"):
        np.exp(s, out=s)
    s += 1.0
    return np.divide(1.0, s, out=s)


def cross_entropy_in_place(logits, targets, n_valid):
    """ops.cross_entropy_forward and cross_entropy_backward(1.0) at once, the gradient over the logits.

    loss = (1/n) sum over valid rows of (logsumexp(z) - z_y);  dz = (softmax(z) - onehot(y)) / n
    on valid rows, 0 on ignored ones. n_valid: n, the count of valid targets of the whole batch
    (a shard of it passes the batch's, so the shards' losses and gradients add up).
    logits (N, V) float, targets (N,) ids or -100. Returns: loss (python float), dlogits (the logits' array).
    """
    N = logits.shape[0]
    picked_rows = np.flatnonzero(targets != IGNORE_INDEX)
    picked_ids = targets[picked_rows]
    row_max = logits.max(axis=1, keepdims=True)
    picked = logits[picked_rows, picked_ids]
    logits -= row_max
    np.exp(logits, out=logits)
    sums = logits @ np.ones((logits.shape[1], 1), dtype=logits.dtype)  # (N, V) -> (N, 1), faster than sum
    lse = row_max[picked_rows, 0] + np.log(sums[picked_rows, 0])
    loss = float((lse - picked).sum(dtype=np.float64) / n_valid)
    # softmax / n on valid rows, 0 on the others; then the one-hot term
    scale = np.zeros((N, 1), dtype=logits.dtype)
    scale[picked_rows] = (1.0 / n_valid) / sums[picked_rows]
    logits *= scale
    logits[picked_rows, picked_ids] -= logits.dtype.type(1.0 / n_valid)
    return loss, logits


def frozen_output_loss(xn, w, targets, n_valid, block_rows):
    """ops.linear_forward (the output projection), ops.cross_entropy_forward and their backward to xn
    (ops.cross_entropy_backward, ops.linear_backward's dx) at once, through an output weight w that
    takes no gradient (LoRA's frozen classifier), without ever forming the (N, V) logits: the
    softmax is accumulated over blocks of block_rows rows of w, online, as FlashAttention
    accumulates its rows.

        z = xn w^T (N, V),  loss = (1/n) sum over valid rows of (lse(z) - z_y),
        dxn = dloss/dxn = (1/n) (softmax(z) w - w_y) on valid rows, 0 on ignored ones

    Block by block, with z_b = xn w_b^T (N, block) and per row a running max m (from -inf),
    s = sum exp(z - m) and a = sum exp(z - m) w (N, D), both from 0:

        m' = max(m, rowmax(z_b)),  c = exp(m - m'),  p_b = exp(z_b - m'),
        s <- c s + rowsum(p_b),     a <- c a + p_b w_b,  m <- m'

    so that in the end lse = m + log(s) and softmax(z) w = a / s; z_y = xn . w_y, a row dot.
    Each block of w is read once; the two GEMMs a block are (N, D) x (D, block) and (N, block) x
    (block, D), as fast as whole-row chunks of 128 rows and 1.5x the speed of 48-row ones.
    xn (N, D) float, w (V, D), targets (N,) ids or -100; n_valid: the batch's valid targets (a
    shard passes the batch's, so the shards' losses and gradients add up).
    Returns: loss (python float), dxn (N, D).
    """
    N, V = xn.shape[0], w.shape[0]
    dtype = xn.dtype
    picked_rows = np.flatnonzero(targets != IGNORE_INDEX)
    picked_ids = targets[picked_rows]
    block_rows = min(block_rows, V)
    m, m_next = np.full((N, 1), -np.inf, dtype), np.empty((N, 1), dtype)
    s, c = np.zeros((N, 1), dtype), np.empty((N, 1), dtype)
    a, term = np.zeros_like(xn), np.empty_like(xn)
    z_block, ones = np.empty((N, block_rows), dtype), np.ones((block_rows, 1), dtype)
    for v0 in range(0, V, block_rows):
        w_b = w[v0:v0 + block_rows]
        z = z_block[:, :w_b.shape[0]]
        np.matmul(xn, w_b.T, out=z)
        np.max(z, axis=1, keepdims=True, out=m_next)
        np.maximum(m_next, m, out=m_next)
        np.subtract(m, m_next, out=c)
        np.exp(c, out=c)                                                # the first block: exp(-inf) = 0
        z -= m_next
        np.exp(z, out=z)                                                # p_b
        s *= c
        s += z @ ones[:w_b.shape[0]]                                    # a matvec, far faster than z.sum(1)
        a *= c
        np.matmul(z, w_b, out=term)
        a += term
        m, m_next = m_next, m
    w_y = w[picked_ids]                                                 # (n, D)
    lse = m[picked_rows, 0] + np.log(s[picked_rows, 0])
    loss = float((lse - row_dot(xn[picked_rows], w_y)[:, 0]).sum(dtype=np.float64) / n_valid)
    a /= s
    a[picked_rows] -= w_y
    scale = np.zeros((N, 1), dtype=dtype)
    scale[picked_rows] = 1.0 / n_valid
    a *= scale
    return loss, a


def add_rows(dst, ids, rows):
    """ops.embedding_backward's scatter-add into dst: dst[ids[j]] += rows[j] for every j, repeated
    ids summed. dst (V, D), ids (N,), rows (N, D). Returns dst."""
    V = dst.shape[0]
    if V <= ONE_HOT_MAX_VOCAB:
        one_hot = np.zeros((V, len(ids)), dtype=rows.dtype)
        one_hot[ids, np.arange(len(ids))] = 1
        dst += one_hot @ rows                                             # (V, N) @ (N, D)
        return dst
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
    dst[sorted_ids[starts]] += np.add.reduceat(rows[order], starts, axis=0)
    return dst
