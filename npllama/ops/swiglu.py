"""SwiGLU gate (Shazeer 2020), the nonlinearity of LLaMA's feed-forward:

    y = silu(a) * b,   silu(a) = a * s,   s = sigmoid(a) = 1 / (1 + exp(-a))

In the block, a = x @ w1.T (the gate) and b = x @ w3.T (up) come out of one GEMM stacked on
the last axis, ab = [a | b], and y goes through w2 (down): Meta model.py FeedForward,
w2(F.silu(w1(x)) * w3(x)). The op takes that stacked array and returns its gradient in the
same layout, so the model's one backward GEMM reads it with no copy.
"""

from typing import NamedTuple

import numpy as np


class SwiGLUCache(NamedTuple):
    b: np.ndarray            # (..., F) up projection
    s: np.ndarray            # (..., F) sigmoid(a)
    silu: np.ndarray         # (..., F) a * sigmoid(a)


def _sigmoid(a):
    # exp(-a) overflows to inf for very negative a (below about -88 in float32); 1 / inf = 0 is
    # the right limit, so the warning is noise.
    with np.errstate(over="ignore"):
        s = np.exp(np.negative(a))
        s += 1.0
        return np.reciprocal(s, out=s)


def swiglu_forward(ab):
    """y = silu(a) * b with [a | b] = ab.

    Inputs:  ab (..., 2F), gate a = ab[..., :F] and up b = ab[..., F:]
    Returns: y (..., F), cache (b, sigmoid(a), silu(a)). Caching s and silu(a) rather than a costs
             one more (..., F) array and saves recomputing an exp and two products in backward.
    """
    F = ab.shape[-1] // 2
    a, b = ab[..., :F], ab[..., F:]                             # (..., 2F) -> 2 x (..., F)
    s = _sigmoid(a)
    silu = a * s
    return silu * b, SwiGLUCache(b, s, silu)


def swiglu_backward(dy, cache):
    """With s = sigmoid(a), and silu'(a) = s + a * s * (1 - s) = s + silu(a) * (1 - s):

        da = dy * b * (s + silu(a) * (1 - s))
        db = dy * silu(a)
    Shapes: dy (..., F) -> dab (..., 2F), [da | db]
    """
    b, s, silu = cache
    F = s.shape[-1]
    dab = np.empty((*s.shape[:-1], 2 * F), dtype=dy.dtype)
    da, db = dab[..., :F], dab[..., F:]
    np.multiply(dy, silu, out=db)
    np.subtract(1.0, s, out=da)
    da *= silu
    da += s
    da *= b
    da *= dy
    return dab
