"""Stacked weights: projections that read the same input, concatenated so each runs as one GEMM.

[wq; wk; wv] all read the attention norm's output and [w1; w3] the feed-forward norm's, so
stacking them along the output axis turns three (or two) matmuls into one, saves passes over
the activations, and in backward the one GEMM dx = dy @ W also sums the branches' gradients.
Built from the reference's own tables (npllama.model.layer_weights), so the names and the
order of the blocks are defined once.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..config import LlamaConfig
from ..model import LayerWeights, layer_weights


class StackedLayer(NamedTuple):
    """One block's weights as the engine uses them."""
    attention_norm: np.ndarray   # (D,)
    wqkv: np.ndarray             # ((H + 2 KVH) Dh, D): [wq; wk; wv]
    wo: np.ndarray               # (D, H*Dh)
    ffn_norm: np.ndarray         # (D,)
    w13: np.ndarray              # (2F, D): [w1; w3], gate then up
    w2: np.ndarray               # (D, F)


def stack_layer(w: LayerWeights) -> StackedLayer:
    """Stack [wq; wk; wv] and [w1; w3]: a copy of those matrices (the others are the params themselves)."""
    return StackedLayer(w.attention_norm, np.concatenate((w.wq, w.wk, w.wv)), w.wo,
                        w.ffn_norm, np.concatenate((w.w1, w.w3)), w.w2)


def stack_layers(params: dict, config: LlamaConfig) -> list[StackedLayer]:
    """Every block's weights, stacked: once per training step or generation, not once per call."""
    return [stack_layer(layer_weights(params, i)) for i in range(config.n_layers)]


def fold_norms(w: StackedLayer, head_dim: int, n_heads: int) -> StackedLayer:
    """The layer with each RMSNorm weight (times sqrt(D)) folded into the matrix that reads its output,
    and 1/sqrt(Dh) into the q rows, for decoding: with r = (mean(x**2) + eps) ** -0.5,

        (x * r * g) @ W.T = (x / sqrt(sum(x**2) + D eps)) @ (W * (sqrt(D) g)).T

    so a step normalises with one row sum and one division, and scales q by nothing. The norm
    fields of the result are None; wqkv and w13 are new arrays (the stacked copies, scaled).
    """
    D = w.attention_norm.shape[0]
    scale = np.sqrt(D, dtype=np.float64)
    qkv_rows = np.ones(w.wqkv.shape[0])
    qkv_rows[:n_heads * head_dim] = 1.0 / np.sqrt(head_dim)
    wqkv = w.wqkv * (qkv_rows[:, None] * (w.attention_norm * scale)[None, :]).astype(w.wqkv.dtype)
    w13 = w.w13 * (w.ffn_norm * scale).astype(w.w13.dtype)
    return StackedLayer(None, wqkv, w.wo, None, w13, w.w2)
