"""Block-causal attention: npllama.ops.attention's arithmetic (attention_forward / _backward) without its dead half.

The reference forms every (T, S) score and masks the future with -inf, so at T = 256 half the
scores are computed, exponentiated and multiplied by zero. Here the queries go in blocks of
`block` positions, and the queries of block [s, e) meet only the keys [0, e): keys in a block's
future are never touched, and the -inf mask is added to the (block, block) diagonal tile only.

Layout. A kv head's R query heads are stacked along the rows ordered (t, r), row t*R + r, so
the queries of a block are one contiguous row range for every group. The values carry a
column of ones, v1 = [v | 1], for backward. Per block, with P = exp(S - rowmax(S)) left
unnormalised and l = rowsum(P):

    forward    S = q k^T (+ diagonal mask),  O = P v,  l = P 1,  out = O / l
               (P = exp(S), unless a row's l falls outside SOFTMAX_SUM_RANGE: then exp(S - rowmax(S)))
    backward   dO' = dout / l,  D' = rowsum(dout * out) / l              (FlashAttention-2's D)
               dS  = P * ([dO' | -D'] [v | 1]^T) = P * (dO' v^T - D')   = A * (dA - rowsum(dA * A))
               dq  = dS k,   dk += dS^T q,   dv += P^T dO'

where A = P / l is the reference's att and dA = dout v^T. So the score-sized passes are two: the
exp and, in backward, the product with P (four in a block that must subtract its rows' max). The row sum is a
matrix-vector product (NumPy's sum over short rows is several times slower), and backward's D
term rides in the dS matmul as one more column (forward keeps P v at width Dh: one more column
there costs more than the matvec). Blocks run from the last, which covers every key and so
writes dk and dv whole, back to the first, which adds into their first rows.

q arrives scaled by 1/sqrt(Dh) and rotated (engine/block.py folds both into one pass), so the
dq returned is the gradient of the scaled q: ops.attention_backward's dq, of the unscaled q, is
this one times 1/sqrt(Dh), a factor engine/block.py folds into the conjugate rotation.

A prefill (engine/passes.py) runs the forward on T new positions after `start` cached ones:
the keys and values then hold S = start + T positions, query t sits at start + t, and an
optional additive bias (-inf on keys a query must not see, e.g. a left-padded row's padding)
is added to every tile. Backward, for training, has start = 0 and no bias.
tests/engine/test_attention.py checks this module against ops.attention_forward /
attention_backward in float64 (1e-10).
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import numpy as np

# Queries per block: 32 to 64 measured flat on 2 cores at T = 256; a whole row (no blocks) was
# 8% slower there, and below 32 the per-block calls start to show (b's shape, 6 December 2026: 32,
# 64 and 128 within 2%).
BLOCK = 64

# softmax(s) = exp(s - m) / sum(exp(s - m)) for any m; the reference subtracts each row's max so
# that no exp overflows. A block here (and the decode step, engine/decode.py) exponentiates the
# scores as they are and checks that every row's sum l = sum_s exp(s) lies within this range: there
# no term overflows (each is at most the sum) and a term that underflows (below 2**-126 in float32)
# is off by at most 2**-149, 2**-85 of its row's sum: the result is as accurate as the shifted
# one's. (Values of 2**64 and more aside, where sum_s exp(s) v_s could overflow.) A block whose
# check fails (scores of +-44 and beyond, or NaN) is computed again with each row's max subtracted.
# It saves the max's pass and the subtraction's over every score: measured on the 2-core AMD EPYC
# (6 December 2026, loss_and_grads, alternating) b 1,167 ms against 1,220, c 846 against 861, k
# 3,948 against 4,003.
SOFTMAX_SUM_RANGE = (2.0 ** -64, 2.0 ** 64)


class BlockAttentionCache(NamedTuple):
    q: np.ndarray            # (b, KVH, T*R, Dh) scaled, rotated queries, rows (t, r)
    k: np.ndarray            # (b, KVH, S, Dh), S = T in training
    v1: np.ndarray           # (b, KVH, S, Dh + 1): [v | 1]
    probs: list | None       # per block: P (b, KVH, n*R, e) unnormalised; None: recomputed in backward
    row_max: np.ndarray      # (b, KVH, T*R, 1) the max subtracted before the exp, in the shifted blocks
    shifted: list            # per block: whether its rows' max was subtracted (SOFTMAX_SUM_RANGE)
    inv_sum: np.ndarray      # (b, KVH, T*R, 1) 1 / l
    block: int


def blocks(T: int, block: int) -> list[tuple[int, int]]:
    """The query blocks [s, e) of T positions; the last one may be shorter."""
    return [(s, min(T, s + block)) for s in range(0, T, block)]


@lru_cache(maxsize=64)
def diagonal_mask(n: int, R: int, dtype) -> np.ndarray:
    """(n*R, n) additive mask of a diagonal tile, rows (t, r): -inf where key j is after query t."""
    future = np.arange(n)[None, :] > np.arange(n)[:, None]
    mask = np.repeat(np.where(future, -np.inf, 0.0).astype(dtype), R, axis=0)
    mask.flags.writeable = False
    return mask


def _scores(q, k, s, e, R, start=0, bias_rows=None):
    """Scores of query block [s, e) against keys [0, start + e), the diagonal tile masked, plus the
    bias's rows when given: (b, KVH, n R, start + e)."""
    E = start + e
    S = q[:, :, s * R:e * R] @ k[:, :, :E].swapaxes(-1, -2)
    S[..., start + s:E] += diagonal_mask(e - s, R, S.dtype)
    if bias_rows is not None:
        S += bias_rows[:, :, s * R:e * R, :E]
    return S


def attention_forward(q, k, v1, out, *, block: int = BLOCK, keep_probs: bool = True, start: int = 0,
                      bias=None) -> BlockAttentionCache:
    """Causal attention of q over k, v1 = [v | 1], written into out.

    Inputs:  q (b, KVH, T*R, Dh), rows (t, r), scaled and rotated; k (b, KVH, S, Dh), any strides;
             v1 (b, KVH, S, Dh + 1) whose last column is 1; S = start + T;
             out: (b, KVH, T, R, Dh), typically a view of the (b, T, H*Dh) input of wo;
             keep_probs: cache each block's P (False: only the row max and 1/l, and backward
             recomputes P with one more q k^T per block: less memory, a few % more time);
             start: positions before these queries (a prefill after cached ones);
             bias: None, or additive (b, 1, T, S) (0 or -inf) added to every query's scores.
    Returns: the cache for attention_backward.
    """
    b, KVH, TR, Dh = q.shape
    S = k.shape[2]
    T = S - start
    R = TR // T
    bias_rows = None if bias is None else np.repeat(bias, R, axis=2)    # (b, 1, T, S) -> (b, 1, T*R, S), rows (t, r)
    row_max = np.empty((b, KVH, TR, 1), dtype=q.dtype)
    inv_sum = np.empty((b, KVH, TR, 1), dtype=q.dtype)
    probs = [] if keep_probs else None
    shifted = []
    ones = np.ones((S, 1), dtype=q.dtype)
    low, high = SOFTMAX_SUM_RANGE
    for s, e in blocks(T, block):
        rows = slice(s * R, e * R)
        l = inv_sum[:, :, rows]
        P = _scores(q, k, s, e, R, start, bias_rows)
        with np.errstate(over="ignore"):                                # an overflow fails the check below
            np.exp(P, out=P)                                            # no max subtracted (SOFTMAX_SUM_RANGE)
        np.matmul(P, ones[:start + e], out=l)                           # l: a matvec, far faster than P.sum
        shift = not (low <= np.minimum.reduce(l, axis=None) and np.maximum.reduce(l, axis=None) <= high)
        if shift:                                                       # again, each row's max subtracted
            P = _scores(q, k, s, e, R, start, bias_rows)
            np.max(P, axis=-1, keepdims=True, out=row_max[:, :, rows])
            P -= row_max[:, :, rows]
            np.exp(P, out=P)
            np.matmul(P, ones[:start + e], out=l)
        shifted.append(shift)
        O = P @ v1[:, :, :start + e, :Dh]                               # (b, KVH, n R, Dh)
        np.divide(1.0, l, out=l)                                        # NumPy's divide beats its reciprocal
        n = e - s
        np.multiply(O.reshape(b, KVH, n, R, Dh), inv_sum[:, :, rows].reshape(b, KVH, n, R, 1), out=out[:, :, s:e])
        if keep_probs:
            probs.append(P)
    return BlockAttentionCache(q, k, v1, probs, row_max, shifted, inv_sum, block)


def attention_backward(dout, out, cache: BlockAttentionCache, dv):
    """Gradients of out = softmax(causal(q k^T)) v, as ops.attention_backward (module docstring).

    Inputs:  dout, out (b, T, KVH, R, Dh): the gradient and the value of out, in wo's input layout;
             dv: (b, KVH, T, Dh) array (or view) that receives dv.
    The forward's start must have been 0 and its bias None (training).
    Returns: dq (b, KVH, T*R, Dh) of the scaled q, rows (t, r); dk (b, KVH, T, Dh).
    """
    q, k, v1, probs, row_max, shifted, inv_sum, block = cache
    b, KVH, TR, Dh = q.shape
    T = k.shape[2]
    assert TR % T == 0, f"backward of a prefill: {q.shape=} {k.shape=}"
    R = TR // T
    # [dO' | -D'] with dO' = dout / l and D' = rowsum(dout * out) / l, in the rows (t, r) of q
    d_rows = np.einsum("btkrd,btkrd->bktr", dout, out)[..., None]       # (b, KVH, T, R, 1) sums over Dh
    do1 = np.empty((b, KVH, T, R, Dh + 1), dtype=q.dtype)
    inv = inv_sum.reshape(b, KVH, T, R, 1)
    np.multiply(dout.transpose(0, 2, 1, 3, 4), inv, out=do1[..., :Dh])   # (b, T, KVH, R, Dh) -> (b, KVH, T, R, Dh)
    np.multiply(d_rows, inv, out=do1[..., Dh:])
    np.negative(do1[..., Dh:], out=do1[..., Dh:])
    do1 = do1.reshape(b, KVH, TR, Dh + 1)
    dq = np.empty_like(q)
    dk = np.empty_like(k)
    for index, (s, e) in reversed(list(enumerate(blocks(T, block)))):
        rows = slice(s * R, e * R)
        if probs is None:                                               # P as the forward made it
            P = _scores(q, k, s, e, R)
            if shifted[index]:
                P -= row_max[:, :, rows]
            np.exp(P, out=P)
        else:
            P = probs[index]
        dS = do1[:, :, rows] @ v1[:, :, :e].swapaxes(-1, -2)           # dO' v^T - D', (b, KVH, n R, e)
        dS *= P
        np.matmul(dS, k[:, :, :e], out=dq[:, :, rows])
        if e == T:                                                      # the last block: every key, written whole
            np.matmul(dS.swapaxes(-1, -2), q[:, :, rows], out=dk)
            np.matmul(P.swapaxes(-1, -2), do1[:, :, rows, :Dh], out=dv)
        else:
            dk[:, :, :e] += dS.swapaxes(-1, -2) @ q[:, :, rows]
            dv[:, :, :e] += P.swapaxes(-1, -2) @ do1[:, :, rows, :Dh]
    return dq, dk
