"""RMSNorm (Zhang & Sennrich 2019), as in Meta's model.py:

    y = w * n,   n = x * r,   r = (mean(x**2) + eps) ** -0.5

with the mean over the last axis only (normalising over the sequence axis would let a position
see the future). Computed in at least float32 (Meta: `self._norm(x.float()).type_as(x)`).
"""

from typing import NamedTuple

import numpy as np


class RMSNormCache(NamedTuple):
    x: np.ndarray            # (..., D) input, in the compute dtype
    weight: np.ndarray       # (D,)
    rstd: np.ndarray         # (..., 1) r, the reciprocal root-mean-square


def _compute_dtype(dtype):
    return dtype if dtype in (np.float32, np.float64) else np.result_type(dtype, np.float32)


def rmsnorm_forward(x, weight, eps):
    """y = w * x * r, r = (mean(x**2, last axis) + eps) ** -0.5.

    Inputs:  x (..., D); weight (D,); eps > 0
    Returns: y (..., D) in x's dtype, cache (x, w, r). n = x * r is recomputed in backward
             rather than cached: one multiply saves a whole (..., D) array of memory.
    """
    xc = x.astype(_compute_dtype(x.dtype), copy=False)
    D = x.shape[-1]
    # einsum forms each row's sum of squares in one pass, without an (..., D) temporary.
    sum_sq = np.einsum("...d,...d->...", xc, xc)[..., None]                      # (..., D) -> (..., 1)
    rstd = 1.0 / np.sqrt(sum_sq / D + eps)
    y = (xc * rstd).astype(x.dtype, copy=False)
    y *= weight
    return y, RMSNormCache(xc, weight, rstd)


def rmsnorm_backward(dy, cache):
    """Gradient of y = w * n, n = x * r.

    With g = dy * w:   dw = sum over leading axes of (dy * n)
                       dx = r * (g - n * mean(g * n))          (mean over the last axis)
    The second term is r's contribution: dr/dx_j = -r**3 * x_j / D = -r**2 * n_j / D, so
    sum_j g_j * x_j * dr/dx_i = -r * n_i * mean(g * n).
    Shapes: dy (..., D) -> dx (..., D), dweight (D,)
    """
    x, weight, rstd = cache
    D = x.shape[-1]
    n = x * rstd
    dweight = np.einsum("nd,nd->d", dy.reshape(-1, D), n.reshape(-1, D))
    g = dy * weight
    mean_gn = np.einsum("...d,...d->...", g, n)[..., None] / D                   # (..., D) -> (..., 1)
    # dx = r * (g - n * mean(g * n)), in place on the two temporaries
    n *= mean_gn
    g -= n
    g *= rstd
    return g.astype(dy.dtype, copy=False), dweight.astype(weight.dtype, copy=False)
