"""Stacked weights: projections that read the same input, concatenated so each runs as one GEMM.

[wq; wk; wv] all read the attention norm's output and [w1; w3] the feed-forward norm's, so
stacking them along the output axis turns three (or two) matmuls into one, saves passes over
the activations, and in backward the one GEMM dx = dy @ W also sums the branches' gradients.
Built from the reference's own tables (a LayerWeights of npllama.model.layer_weights), so the
names and the order of the blocks are defined once. A decode step's copies fold the norms into
them as well (folded_layer).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..model import LayerWeights
from .upcast import upcast


# Each StackedLayer projection's members, LayerWeights fields stacked by rows in this order.
STACK_MEMBERS = {"wqkv": ("wq", "wk", "wv"), "wo": ("wo",), "w13": ("w1", "w3"), "w2": ("w2",)}


def stack_members(w: LayerWeights) -> dict:
    """{StackedLayer projection: the tuple of w's arrays stacked into it}, STACK_MEMBERS' order."""
    return {field: tuple(getattr(w, m) for m in members) for field, members in STACK_MEMBERS.items()}


class StackedLayer(NamedTuple):
    """One block's weights as the engine uses them."""
    attention_norm: np.ndarray   # (D,)
    wqkv: np.ndarray             # ((H + 2 KVH) Dh, D): [wq; wk; wv]
    wo: np.ndarray               # (D, H*Dh)
    ffn_norm: np.ndarray         # (D,)
    w13: np.ndarray              # (2F, D): [w1; w3], gate then up
    w2: np.ndarray               # (D, F)


def stack_layer(w: LayerWeights) -> StackedLayer:
    """Stack [wq; wk; wv] and [w1; w3]: views when each stack's members lie next to each other in one
    buffer (adjacent_rows: a file written in FlatLayout's order and mapped), else a copy of them
    (the other matrices are the params themselves). The same values either way, so the same GEMMs."""
    stacks = stack_members(w)
    return StackedLayer(w.attention_norm, stacked_rows(stacks["wqkv"]), w.wo,
                        w.ffn_norm, stacked_rows(stacks["w13"]), w.w2)


def stacked_rows(parts) -> np.ndarray:
    """[parts[0]; parts[1]; ...]: one view of them when they are adjacent (adjacent_rows), else a copy."""
    view = adjacent_rows(parts)
    return np.concatenate(parts) if view is None else view


def adjacent_rows(parts) -> np.ndarray | None:
    """[parts[0]; parts[1]; ...] (rows, in) as one view of their memory when they lie next to each
    other, in order, in one buffer (the same owner: an array, or the object a memoryview exports,
    such as a mapped file), each C-contiguous with the same dtype and columns; None otherwise (a
    caller then copies). A check of addresses, no pass over the data. The view holds the first
    part, and through it the buffer."""
    first = parts[0]
    if not all(p.ndim == 2 and p.flags.c_contiguous and p.dtype == first.dtype and p.shape[1] == first.shape[1]
               for p in parts):
        return None
    owner, end = _buffer_owner(first), _address(first) + first.nbytes
    for p in parts[1:]:
        if _buffer_owner(p) is not owner or _address(p) != end:
            return None
        end += p.nbytes
    return np.lib.stride_tricks.as_strided(first, (sum(p.shape[0] for p in parts), first.shape[1]), first.strides)


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _buffer_owner(a: np.ndarray):
    """The object that owns a's memory: the last array of its .base chain, or what a memoryview there
    views (np.frombuffer makes a memoryview per call, all of one mmap)."""
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return a.obj if isinstance(a, memoryview) else a


class ScaledRows(NamedTuple):
    """Rows of a stacked copy: a parameter w (rows, in) with each row multiplied by factor (in,)."""
    w: np.ndarray
    factor: np.ndarray | None    # in w's dtype; None: w as it is


def norm_gain(norm_weight: np.ndarray) -> np.ndarray:
    """sqrt(D) g for an RMSNorm weight g (D,), in float64 (upcast from float16 / bfloat16 when held so):
    the factor the decode step applies after dividing x by sqrt(sum(x**2) + D eps) (folded_layer)."""
    return upcast(norm_weight, np.float64) * np.sqrt(norm_weight.shape[0], dtype=np.float64)


def folded_layer(w: LayerWeights, head_dim: int) -> tuple[list, list, list, list]:
    """One block's four stacked projections for decoding, [wq; wk; wv], [wo], [-w1; w3] and [w2], as
    lists of ScaledRows: each RMSNorm weight (times sqrt(D)) folded into the matrices that read its
    output, 1/sqrt(Dh) into q's rows and -1 into w1's. With r = (mean(x**2) + eps) ** -0.5,

        (x * r * g) @ W.T = (x / sqrt(sum(x**2) + D eps)) @ (W * (sqrt(D) g)).T

    so a step normalises with one row sum and one division, scales q by nothing, and its SwiGLU
    reads -a (engine/decode.py). A factor is formed in float64 and rounded once to the weights'
    dtype; -1 and the stacking are exact. The copies themselves are made by the caller
    (engine.projections.stacked_copy), in the orientation its products want.
    """
    attention_gain, ffn_gain = norm_gain(w.attention_norm), norm_gain(w.ffn_norm)   # float64, (D,)
    q_factor = (attention_gain * (1.0 / np.sqrt(head_dim))).astype(w.wq.dtype)
    up_factor = ffn_gain.astype(w.w3.dtype)
    return ([ScaledRows(w.wq, q_factor), ScaledRows(w.wk, attention_gain.astype(w.wk.dtype)),
             ScaledRows(w.wv, attention_gain.astype(w.wv.dtype))],
            [ScaledRows(w.wo, None)],
            [ScaledRows(w.w1, -ffn_gain.astype(w.w1.dtype)), ScaledRows(w.w3, up_factor)],
            [ScaledRows(w.w2, None)])
