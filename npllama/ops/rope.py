"""Rotary position embedding (Su et al. 2021), Meta's interleaved layout.

Each head's features are taken in neighbouring pairs (x[2i], x[2i+1]) and the pair at position
p is rotated by the angle p * theta_i, theta_i = rope_theta ** (-2i / Dh):

    y[2i]   = x[2i] * cos - x[2i+1] * sin
    y[2i+1] = x[2i] * sin + x[2i+1] * cos

(Meta model.py apply_rotary_emb does this with complex numbers; Hugging Face rotates the
halves (x[i], x[i + Dh/2]) instead, which npllama/io/hf.py reconciles by permuting wq/wk rows:
permute_hf_to_meta on load, permute_meta_to_hf on save.)
A rotation is orthogonal, so the backward is the rotation by -angle.
"""

from typing import NamedTuple

import numpy as np


class RoPECache(NamedTuple):
    cos: np.ndarray          # (T, Dh/2) or broadcastable to (..., T, Dh/2)
    sin: np.ndarray


def rope_frequencies(head_dim, theta=10000.0):
    """theta_i = theta ** (-2i / Dh) for i in [0, Dh/2), in float64: the angle per position of pair i.

    (Meta's precompute_freqs_cis; Hugging Face stores the same numbers as rotary_emb.inv_freq.)
    """
    return 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)        # (Dh/2,)


def rope_tables(head_dim, max_seq_len, theta=10000.0, dtype=np.float32):
    """cos and sin of p * theta_i for p in [0, max_seq_len), i in [0, Dh/2).

    Computed in float64 and rounded once to `dtype`, so a float32 table is correctly rounded.
    Returns: cos, sin, each (max_seq_len, Dh/2)
    """
    angles = np.outer(np.arange(max_seq_len, dtype=np.float64), rope_frequencies(head_dim, theta))  # (P, Dh/2)
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


def _rotate(x, cos, sin):
    """Rotate pairs (x[2i], x[2i+1]) by the angles whose cosines and sines are given.

    The pair read as the complex number x[2i] + i x[2i+1], times cos + i sin, is exactly
        y[2i] = x[2i] cos - x[2i+1] sin,   y[2i+1] = x[2i] sin + x[2i+1] cos
    (Meta's apply_rotary_emb uses torch.view_as_complex the same way). Viewing the float array
    as complex costs nothing, and one complex multiply is one pass instead of eight strided ones.
    """
    if x.strides[-1] != x.itemsize:              # the complex view needs each pair adjacent
        x = np.ascontiguousarray(x)
    complex_dtype = np.result_type(x.dtype, np.complex64)
    rotation = (cos + 1j * sin).astype(complex_dtype)                       # (T, Dh/2)
    return (x.view(complex_dtype) * rotation).view(x.dtype)                 # (..., T, Dh/2) complex -> (..., T, Dh)


def rope_forward(x, cos, sin):
    """Rotate each pair (2i, 2i+1) of the last axis by its position's angle.

    Inputs:  x (..., T, Dh), e.g. (B, H, T, Dh); cos, sin (T, Dh/2) for the positions of x
             (rows start_pos .. start_pos + T - 1 of rope_tables), or any shape broadcasting
             to (..., T, Dh/2).
    Returns: y (..., T, Dh), a new array; cache (cos, sin) — x is not needed.
    """
    return _rotate(x, cos, sin), RoPECache(cos, sin)


def rope_backward(dy, cache):
    """dx = rotation of dy by -angle (the transpose of an orthogonal rotation is its inverse):

        dx[2i]   =  dy[2i] * cos + dy[2i+1] * sin
        dx[2i+1] = -dy[2i] * sin + dy[2i+1] * cos
    Shapes: dy (..., T, Dh) -> dx (..., T, Dh)
    """
    return _rotate(dy, cache.cos, -cache.sin)
