"""A linear layer with a LoRA adapter (Hu et al. 2021, "LoRA: Low-Rank Adaptation", eq. 3):

    y = x W^T + s (x A^T) B^T,      s = alpha / r

W (out, in) is the frozen pretrained weight; only A (r, in) and B (out, r) train. The layer
acts as the single matrix W' = W + s B A, but W' is never formed: x goes through W and through
the thin pair A, B, so training costs r (in + out) extra numbers per projection and no
gradient of W at all. With B = 0 (the initialisation, as PEFT's) the layer is exactly x W^T.
"""

from typing import NamedTuple

import numpy as np


class LoraCache(NamedTuple):
    x: np.ndarray            # (..., in), the input (a reference: no copy is made)
    weight: np.ndarray       # (out, in), frozen
    a: np.ndarray            # (r, in)
    b: np.ndarray            # (out, r)
    xa: np.ndarray           # (N, r), x A^T: dB needs it, and it is r numbers a position
    scale: float             # s = alpha / r


def lora_forward(x, weight, a, b, *, scale):
    """y = x W^T + s (x A^T) B^T.

    Inputs:  x (..., in); weight W (out, in), frozen; a A (r, in); b B (out, r); scale s = alpha / r
    Returns: y (..., out), cache (x, W, A, B, x A^T, s).
    """
    x2 = x.reshape(-1, x.shape[-1])                             # (..., in) -> (N, in)
    xa = x2 @ a.T                                               # (N, in) @ (in, r) -> (N, r)
    y = x2 @ weight.T + scale * (xa @ b.T)                      # (N, out)
    return y.reshape(*x.shape[:-1], weight.shape[0]), LoraCache(x, weight, a, b, xa, scale)


def lora_backward(dy, cache):
    """Gradients of y = x W^T + s (x A^T) B^T for x, A and B; W is frozen, so there is no dW.

    With dy (N, out) and the input x (N, in) flattened over the leading axes:
        dx = dy W + s (dy B) A                  (N, out) @ (out, in) + s (N, r) @ (r, in)
        dA = s (dy B)^T x                       (r, N) @ (N, in) -> (r, in)
        dB = s dy^T (x A^T)                     (out, N) @ (N, r) -> (out, r)
    Inputs:  dy (..., out)
    Returns: dx (..., in), da (r, in), db (out, r)
    """
    x, weight, a, b, xa, scale = cache
    dy2 = dy.reshape(-1, dy.shape[-1])                          # (..., out) -> (N, out)
    dyb = dy2 @ b                                               # (N, out) @ (out, r) -> (N, r)
    dx = dy2 @ weight + scale * (dyb @ a)                       # (N, in)
    da = scale * (dyb.T @ x.reshape(-1, x.shape[-1]))           # (r, N) @ (N, in) -> (r, in)
    db = scale * (dy2.T @ xa)                                   # (out, N) @ (N, r) -> (out, r)
    return dx.reshape(x.shape), da, db
