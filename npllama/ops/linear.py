"""Linear layer without bias, in PyTorch's nn.Linear layout: y = x @ W.T.

W has shape (out, in), as in Meta's checkpoints, so weights load without a transpose.
"""

from typing import NamedTuple

import numpy as np


class LinearCache(NamedTuple):
    x: np.ndarray            # (..., in), the input (a reference: no copy is made)
    weight: np.ndarray       # (out, in)


def linear_forward(x, weight):
    """y = x @ W.T.

    Inputs:  x (..., in); weight (out, in)
    Returns: y (..., out), cache (x, W) — dW needs x, dx needs W.
    """
    # One (N, in) @ (in, out) GEMM over all positions: NumPy's matmul of a (B, T, in) array would
    # instead call B small GEMMs, several times slower.
    y = x.reshape(-1, x.shape[-1]) @ weight.T                   # (N, in) @ (in, out) -> (N, out)
    return y.reshape(*x.shape[:-1], weight.shape[0]), LinearCache(x, weight)


def linear_backward(dy, cache):
    """dx = dy @ W;  dW = sum over leading axes of dy^T x, computed as one (out, N) @ (N, in) matmul.

    Inputs:  dy (..., out)
    Returns: dx (..., in), dweight (out, in)
    """
    x, weight = cache
    dy2 = dy.reshape(-1, dy.shape[-1])                          # (..., out) -> (N, out)
    dx = (dy2 @ weight).reshape(x.shape)                        # (N, out) @ (out, in) -> (..., in)
    dweight = dy2.T @ x.reshape(-1, x.shape[-1])                # (out, N) @ (N, in) -> (out, in)
    return dx, dweight
