"""The transformer block on stacked weights: npllama.model.block_forward / block_backward, faster.

The same ops in the same order as the reference block; what differs is only how the work is
laid out for NumPy:
  - [wq; wk; wv] and [w1; w3] run as one GEMM each (engine.stacked), and in backward one GEMM
    dx = dy @ [W1; W3] sums the branches' gradients that the reference adds explicitly;
  - SwiGLU reads the stacked [gate | up] output as two views and writes its gradient into the
    two halves of one array, so the backward GEMM reads it with no copy;
  - the attention core's batched matmuls are many small GEMMs, which run faster on one BLAS
    thread than on two (the hand-off costs more than the arithmetic: see engine/blas.py).
tests/engine/ checks that this block gives the reference's outputs and gradients (1e-10, float64).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..ops import (attention_backward, attention_forward, linear_backward, linear_forward, rmsnorm_backward,
                   rmsnorm_forward, rope_backward, rope_forward, swiglu_backward, swiglu_forward)
from .blas import blas_threads
from .stacked import StackedLayer, unstack


class StackedBlockCache(NamedTuple):
    attention_norm: tuple
    wqkv: tuple
    rope_q: tuple
    rope_k: tuple
    attention: tuple
    wo: tuple
    ffn_norm: tuple
    w13: tuple
    swiglu: tuple
    w2: tuple


def block_forward(x, w: StackedLayer, cos, sin, *, eps, kv=None, start_pos=0, mask=None, project=linear_forward):
    """npllama.model.block_forward on stacked weights; same arguments, w a StackedLayer.

    project: the projection op of the four stacked matrices (LoRA passes its frozen-weight-plus-
    adapters pair and its own weight type: engine/lora.py).
    """
    B, T, D = x.shape
    Dh = 2 * cos.shape[-1]
    H = w.wo.shape[1] // Dh
    KVH = (w.wqkv.shape[0] // Dh - H) // 2
    xn, c_attention_norm = rmsnorm_forward(x, w.attention_norm, eps)
    qkv, c_wqkv = project(xn, w.wqkv)                                       # (B, T, (H + 2 KVH) Dh)
    heads = qkv.reshape(B, T, H + 2 * KVH, Dh).transpose(0, 2, 1, 3)        # -> (B, H + 2 KVH, T, Dh)
    q, k, v = heads[:, :H], heads[:, H:H + KVH], heads[:, H + KVH:]        # (B, H | KVH | KVH, T, Dh)
    q, c_rope_q = rope_forward(q, cos, sin)
    k, c_rope_k = rope_forward(k, cos, sin)
    if kv is not None:
        kv_cache, layer = kv
        k, v = kv_cache.append(layer, k, v, start_pos)                      # (B, KVH, S, Dh)
    with blas_threads(1):
        att, c_attention = attention_forward(q, k, v, mask)
    att = att.transpose(0, 2, 1, 3).reshape(B, T, H * Dh)                  # (B, H, T, Dh) -> (B, T, H*Dh)
    o, c_wo = project(att, w.wo)
    h = x + o
    hn, c_ffn_norm = rmsnorm_forward(h, w.ffn_norm, eps)
    ab, c_w13 = project(hn, w.w13)                                          # (B, T, 2F): [gate | up]
    F = ab.shape[-1] // 2
    g, c_swiglu = swiglu_forward(ab[..., :F], ab[..., F:])
    f, c_w2 = project(g, w.w2)
    out = h + f
    cache = StackedBlockCache(c_attention_norm, c_wqkv, c_rope_q, c_rope_k, c_attention, c_wo,
                              c_ffn_norm, c_w13, c_swiglu, c_w2)
    return out, cache


def block_backward(dout, cache: StackedBlockCache, *, project_backward=linear_backward, gradients=unstack):
    """npllama.model.block_backward on stacked weights. Returns dx and the gradients (LayerWeights).

    project_backward, gradients: the projection's backward and how the StackedLayer of its
    gradients becomes the block's (LoRA passes its own: engine/lora.py).
    """
    B, T, D = dout.shape
    KVH, R = cache.attention.k.shape[1], cache.attention.n_rep
    H = KVH * R
    Dh = D // H
    dg, dw2 = project_backward(dout, cache.w2)
    F = dg.shape[-1]
    dab = np.empty((B, T, 2 * F), dtype=dout.dtype)                        # [dgate | dup], the w13 layout
    swiglu_backward(dg, cache.swiglu, out=(dab[..., :F], dab[..., F:]))
    dhn, dw13 = project_backward(dab, cache.w13)                            # sums the w1 and w3 branches
    dh_branch, dffn_norm = rmsnorm_backward(dhn, cache.ffn_norm)
    dh = dout + dh_branch
    datt, dwo = project_backward(dh, cache.wo)
    datt = datt.reshape(B, T, H, Dh).transpose(0, 2, 1, 3)                 # (B, T, H*Dh) -> (B, H, T, Dh)
    with blas_threads(1):
        dq, dk, dv = attention_backward(datt, cache.attention)
    dk = rope_backward(dk, cache.rope_k)
    dq = rope_backward(dq, cache.rope_q)
    # each head's gradient goes back into its slot of the stacked qkv
    dqkv = np.empty((B, T, H + 2 * KVH, Dh), dtype=dout.dtype)
    dqkv[:, :, :H] = dq.transpose(0, 2, 1, 3)                              # (B, H, T, Dh) -> (B, T, H, Dh)
    dqkv[:, :, H:H + KVH] = dk.transpose(0, 2, 1, 3)
    dqkv[:, :, H + KVH:] = dv.transpose(0, 2, 1, 3)
    dxn, dwqkv = project_backward(dqkv.reshape(B, T, -1), cache.wqkv)      # sums the q, k and v branches
    dx_branch, dattention_norm = rmsnorm_backward(dxn, cache.attention_norm)
    dx = dh + dx_branch
    return dx, gradients(StackedLayer(dattention_norm, dwqkv, dwo, dffn_norm, dw13, dw2), H, KVH)
