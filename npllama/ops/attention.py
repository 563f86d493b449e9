"""Causal grouped-query attention core (Ainslie et al. 2023), after the projections and RoPE.

    scores = (q / sqrt(Dh)) @ k^T         masked with -inf where key s is in query t's future
    att    = softmax(scores)              over the key axis, stabilised by the row max
    out    = att @ v

Grouped-query: H query heads share KVH key/value heads, R = H // KVH query heads per group
(Meta model.py repeat_kv; llama2.c kv_mul). Instead of repeating k and v R times, the R query
heads of a group are stacked along the row axis, (B, H, T, Dh) -> (B, KVH, R*T, Dh), so one
batched matmul per group serves them all and k, v are never copied. In backward, the same
stacking makes each matmul that produces dk or dv contract over all R*T rows of the group:
that contraction *is* the sum over the group's query heads that weight sharing demands.

One core serves training and decoding: q holds T positions, k and v hold S >= T positions
(a KV cache plus this chunk), and query t (absolute position S - T + t) sees keys 0 .. S - T + t.
"""

import math
from typing import NamedTuple

import numpy as np


class AttentionCache(NamedTuple):
    q_scaled: np.ndarray     # (B, KVH, R*T, Dh) q / sqrt(Dh), grouped rows
    k: np.ndarray            # (B, KVH, S, Dh)
    v: np.ndarray            # (B, KVH, S, Dh)
    att: np.ndarray          # (B, KVH, R*T, S) softmax probabilities
    out: np.ndarray          # (B, KVH, R*T, Dh) the output, for the softmax backward's row sums
    scale: float             # 1 / sqrt(Dh)
    n_rep: int               # R, query heads per key/value head


def causal_mask(T, S):
    """(T, S) booleans, True where query t (absolute position S - T + t) may attend key s."""
    return np.arange(S)[None, :] <= np.arange(S - T, S)[:, None]


def attention_forward(q, k, v, mask=None):
    """Numbered stages; attention_backward undoes them in reverse.

    Inputs:  q (B, H, T, Dh); k, v (B, KVH, S, Dh) with H % KVH == 0 and S >= T;
             mask: None for causal, or booleans broadcasting to (B, T, S), True = may attend
             (used for left-padded batches; every row must allow at least one key).
    Returns: out (B, H, T, Dh); cache (q / sqrt(Dh), k, v, att, out, 1 / sqrt(Dh), R), see
             AttentionCache. att is cached, not recomputed: recomputing it would cost the two
             largest matmuls again; out is cached for the softmax backward's row sums.
    """
    B, H, T, Dh = q.shape
    KVH, S = k.shape[1], k.shape[2]
    assert H % KVH == 0 and S >= T and k.shape == v.shape == (B, KVH, S, Dh), f"{q.shape=} {k.shape=} {v.shape=}"
    R = H // KVH
    scale = 1.0 / math.sqrt(Dh)
    # 1. scaled scores, one matmul per (batch, kv head): the R query heads of a group as rows.
    q_scaled = q.reshape(B, KVH, R * T, Dh) * scale              # (B, H, T, Dh) -> (B, KVH, R*T, Dh)
    scores = q_scaled @ k.swapaxes(-1, -2)                       # -> (B, KVH, R*T, S)
    # 2. mask the future with -inf (an additive bias: one pass, and exp(-inf) is exactly 0).
    #    A single query (decoding) is the newest position: every key is in its past.
    if mask is not None or T > 1:
        allowed = causal_mask(T, S) if mask is None else np.broadcast_to(mask, (B, T, S))
        bias = np.where(allowed, 0.0, -np.inf).astype(scores.dtype)
        if bias.ndim == 2:
            scores += np.tile(bias, (R, 1))                      # (T, S) -> (R*T, S)
        else:
            scores += np.tile(bias[:, None], (1, 1, R, 1))       # (B, T, S) -> (B, 1, R*T, S)
    # 3. softmax over keys, shifted by the row max (every row keeps its diagonal, so max is finite).
    scores -= scores.max(axis=-1, keepdims=True)
    att = np.exp(scores, out=scores)
    att /= att.sum(axis=-1, keepdims=True)
    # 4. weighted sum of values.
    out = att @ v                                                # (B, KVH, R*T, S) @ (B, KVH, S, Dh)
    return out.reshape(B, H, T, Dh), AttentionCache(q_scaled, k, v, att, out, scale, R)


def attention_backward(dout, cache):
    """Gradients of out = softmax(mask((q / sqrt(Dh)) @ k^T)) @ v.

        dv     = att^T @ dout                     (sums the group's R heads: rows are R*T long)
        datt   = dout @ v^T
        dscore = att * (datt - rowsum(datt * att))   (softmax Jacobian; masked entries have att = 0)
                                                     rowsum(datt * att) = rowsum(dout * out)
        dq     = (dscore @ k) / sqrt(Dh)
        dk     = dscore^T @ (q / sqrt(Dh))         (again a sum over the group's R heads)
    Shapes: dout (B, H, T, Dh) -> dq (B, H, T, Dh), dk (B, KVH, S, Dh), dv (B, KVH, S, Dh)
    """
    q_scaled, k, v, att, out, scale, R = cache
    B, KVH, RT, Dh = q_scaled.shape
    dout = dout.reshape(B, KVH, RT, Dh)                          # (B, H, T, Dh) -> (B, KVH, R*T, Dh)
    # undo 4: out = att @ v
    dv = att.swapaxes(-1, -2) @ dout                             # (B, KVH, S, R*T) @ (B, KVH, R*T, Dh)
    datt = dout @ v.swapaxes(-1, -2)                             # -> (B, KVH, R*T, S)
    # undo 3: the softmax, in place: dscores = att * (datt - rowsum(datt * att)). The row sum
    # equals rowsum(dout * out), since datt = dout @ v^T and out = att @ v (FlashAttention-2's D):
    # a sum over Dh instead of over S, and no (R*T, S) temporary.
    datt -= np.sum(dout * out, axis=-1, keepdims=True)
    dscores = np.multiply(datt, att, out=datt)
    # undo 2: the mask added a constant, so it passes gradients through (they are 0 there anyway).
    # undo 1: scores = q_scaled @ k^T
    dq = (dscores @ k) * scale                                   # (B, KVH, R*T, S) @ (B, KVH, S, Dh)
    dk = dscores.swapaxes(-1, -2) @ q_scaled                     # (B, KVH, S, R*T) @ (B, KVH, R*T, Dh)
    return dq.reshape(B, KVH * R, RT // R, Dh), dk, dv
