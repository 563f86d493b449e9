"""SwiGLU gate (Shazeer 2020), the nonlinearity of LLaMA's feed-forward:

    y = silu(a) * b,   silu(a) = a * s,   s = sigmoid(a) = 1 / (1 + exp(-a))

In the block, a = x @ w1.T (the gate), b = x @ w3.T (up), and y goes through w2 (down):
Meta model.py FeedForward: w2(F.silu(w1(x)) * w3(x)).
"""

from typing import NamedTuple

import numpy as np


class SwiGLUCache(NamedTuple):
    a: np.ndarray            # (..., F) gate pre-activation
    b: np.ndarray            # (..., F) up projection


def _sigmoid(a):
    # exp(-a) overflows to inf for very negative a (below about -88 in float32); 1 / inf = 0 is
    # the right limit, so the warning is noise.
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-a))


def swiglu_forward(a, b):
    """y = a * sigmoid(a) * b.

    Inputs:  a, b (..., F)
    Returns: y (..., F), cache (a, b) — sigmoid(a) is recomputed in backward, saving a (..., F) array.
    """
    return a * _sigmoid(a) * b, SwiGLUCache(a, b)


def swiglu_backward(dy, cache):
    """With s = sigmoid(a), and silu'(a) = s + a * s * (1 - s) = s * (1 + a * (1 - s)):

        da = dy * b * s * (1 + a * (1 - s))
        db = dy * silu(a)
    Shapes: dy (..., F) -> da (..., F), db (..., F)
    """
    a, b = cache
    s = _sigmoid(a)
    silu = a * s
    db = dy * silu
    da = dy * b * (s + silu * (1.0 - s))
    return da, db
