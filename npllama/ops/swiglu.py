"""SwiGLU gate (Shazeer 2020), the nonlinearity of LLaMA's feed-forward:

    y = silu(a) * b,   silu(a) = a * s,   s = sigmoid(a) = 1 / (1 + exp(-a))

In the block, a = x @ w1.T is the gate and b = x @ w3.T the up projection, and y goes through
w2 (down): Meta model.py FeedForward, w2(F.silu(w1(x)) * w3(x)).
"""

from typing import NamedTuple

import numpy as np


class SwiGLUCache(NamedTuple):
    b: np.ndarray            # (..., F) up projection
    s: np.ndarray            # (..., F) sigmoid(a)
    silu: np.ndarray         # (..., F) a * sigmoid(a)


def sigmoid(a):
    """1 / (1 + exp(-a)), a new array of a's shape and dtype."""
    # exp(-a) overflows to inf for very negative a (below about -88 in float32); 1 / inf = 0 is
    # the right limit, so the warning is noise.
    with np.errstate(over="ignore"):
        s = np.exp(np.negative(a))
        s += 1.0
        return np.reciprocal(s, out=s)


def swiglu_forward(a, b):
    """y = silu(a) * b.

    Inputs:  a (..., F) gate; b (..., F) up
    Returns: y (..., F), cache (b, sigmoid(a), silu(a)). Caching s and silu(a) rather than a costs
             one more (..., F) array and saves recomputing an exp and two products in backward.
    """
    s = sigmoid(a)
    silu = a * s
    return silu * b, SwiGLUCache(b, s, silu)


def swiglu_backward(dy, cache):
    """With s = sigmoid(a), and silu'(a) = s + a * s * (1 - s) = s + silu(a) * (1 - s):

        da = dy * b * (s + silu(a) * (1 - s))
        db = dy * silu(a)
    Shapes: dy (..., F) -> da (..., F), db (..., F)
    """
    b, s, silu = cache
    da = dy * b * (s + silu * (1.0 - s))
    db = dy * silu
    return da, db
