"""The engine's transformer block: npllama.model.block_forward / block_backward, on 2-D activations.

One implementation serves every pass that runs whole blocks (engine/passes.py): full training,
LoRA training, gradient checkpointing (the same forward run again), the forward of evaluation
and the prefill of generation (keep=False, keys and values written into a KV cache). The same
ops in the same order as the reference block; what differs is how the work is laid out:

  - activations are 2-D, x (N, D) with N = b*T rows, so each projection is one plain GEMM (2 to
    32 rows on one BLAS thread, as a short prompt's prefill: small blocks, projections.linear_rows);
  - [wq; wk; wv] and [w1; w3] run as one GEMM each (a StackedLayer: engine/stacked.py), and in
    backward one GEMM dx = dy @ [W1; W3] sums the branches' gradients the reference adds;
  - RoPE, q's 1/sqrt(Dh) and the change to the attention layout are one complex multiply
    (ops.rope._rotate's arithmetic), and backward's conjugate multiply undoes all three;
  - block-causal attention (engine/attention.py): no score in a query block's future is made;
  - SwiGLU overwrites the gate with silu(gate) and keeps sigmoid(gate) (fused.sigmoid);
  - the norms' outputs and silu * up are recomputed in backward (one multiply each) rather
    than kept: the cache holds the block's input, the two rstd columns, q, k, [v | 1], the
    attention probabilities (engine/attention.py), the attention output, h, [silu | up] and
    sigmoid(gate); a lean cache (LoRA, whose goal is memory) holds [gate | up] and neither
    the sigmoid nor the probabilities nor the attention output: backward remakes them from
    the gate and from q, k, v (the attention's forward run again, the same bits);
  - a stacked weight is a plain matrix or an AdaptedStack (LoRA: engine/lora.py); the weight
    gradients go to a GradSink (fixed-order sums over shards: shards.ShardSums), or nowhere
    when the weights are frozen.
tests/test_backends.py checks every pass built on it against the reference (float64, 1e-10).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import numpy as np

from .attention import BlockAttentionCache, attention_backward, attention_forward
from .cache import DecodeCache
from .fused import rms_backward, rms_rstd, sigmoid
from .lora import AdaptedStack, adapted_backward, adapted_forward
from .projections import linear_rows
from .settings import blas_threads
from .shards import ShardSums, product, value
from .stacked import StackedLayer

# A block's gradient slots (shards.ShardSums keys (layer, slot)): the StackedLayer fields' indices.
SLOTS = {name: i for i, name in enumerate(StackedLayer._fields)}


class Shape(NamedTuple):
    b: int                   # batch rows of the shard
    T: int                   # positions of these queries
    H: int
    KVH: int
    Dh: int
    F: int


class Rotations(NamedTuple):
    """RoPE of T positions as complex multipliers (ops.rope._rotate), q's with 1/sqrt(Dh) folded in."""
    k: np.ndarray            # (T, Dh/2) complex: e^(i p theta)
    q: np.ndarray            # times 1/sqrt(Dh)
    dk: np.ndarray           # backward: the conjugates
    dq: np.ndarray


def rotations(cos, sin, head_dim) -> Rotations:
    """The multipliers of the positions whose rows of the RoPE tables are cos, sin (T, Dh/2)."""
    rot = (cos + 1j * sin).astype(np.result_type(cos.dtype, np.complex64))
    rot_q = rot * (1.0 / math.sqrt(head_dim))
    return Rotations(rot, rot_q, np.conj(rot), np.conj(rot_q))


class KV(NamedTuple):
    """Where a prefill's block writes its keys and values: one layer of a KV cache, the batch
    rows of this shard, and the positions before these queries."""
    cache: object            # engine.decode.DecodeCache, or any npllama.kvcache.KVCache
    layer: int
    rows: slice
    start: int
    written: Callable[[], None] | None = None   # called once these keys are written, before they are read:
    #                                              a shard of positions waits there for the earlier shards'


class GradSink(NamedTuple):
    """Where one shard puts one block's weight gradients: dw (a StackedLayer of views of the
    gradient array; None when the block's own weights are frozen, as in LoRA) through sums."""
    sums: ShardSums
    shard: int
    layer: int
    dw: StackedLayer | None


class BlockCache(NamedTuple):
    x: np.ndarray            # (N, D) the block's input
    rstd1: np.ndarray        # (N, 1) attention_norm's r
    attention: BlockAttentionCache
    att: np.ndarray | None   # (N, H*Dh) attention output, wo's input; None: recomputed (lean)
    h: np.ndarray            # (N, D) after the attention residual
    rstd2: np.ndarray        # (N, 1) ffn_norm's r
    gate_up: np.ndarray      # (N, 2F) [silu(gate) | up]; lean: [gate | up]
    sig: np.ndarray | None   # (N, F) sigmoid(gate); None: recomputed from the gate (lean)
    lora: tuple              # per stacked projection (wqkv, wo, w13, w2): LoRA's x A^T, or None


def project(x, w):
    """x W^T through a stacked weight: a plain (out, in) matrix, or an AdaptedStack. -> (y, x A^T or None)
    (projections.linear_rows: a few rows on one BLAS thread, a short prompt's prefill, go in small blocks)"""
    if isinstance(w, AdaptedStack):
        return adapted_forward(x, w)
    return linear_rows(x, w), None


def project_backward(dy, x, w, xa, sink: GradSink, field: str):
    """dx = dy W (plus LoRA's term), and W's gradient dy^T x (or the adapters') into the sink."""
    if isinstance(w, AdaptedStack):
        return adapted_backward(dy, x, xa, w, sink)
    if sink.dw is not None:
        sink.sums.put((sink.layer, SLOTS[field]), getattr(sink.dw, field), sink.shard, product(dy.T, x))
    return dy @ w


def _attention_inputs(qkv, rot: Rotations, s: Shape, kv: KV | None):
    """RoPE, q's scale and the attention layout in one complex multiply per q and k; then k, v
    written into the KV cache when prefilling. -> q (b, KVH, T*R, Dh), k (b, KVH, S, Dh), v1 (b, KVH, S, Dh+1)."""
    b, T, H, KVH, Dh, _ = s
    R, Hn = H // KVH, H + 2 * KVH
    cplx = rot.k.dtype
    heads = qkv.view(cplx).reshape(b, T, Hn, Dh // 2)
    q = np.empty((b, KVH, T, R, Dh), dtype=qkv.dtype)                    # rows (t, r) of each group
    np.multiply(heads[:, :, :H].reshape(b, T, KVH, R, Dh // 2).transpose(0, 2, 1, 3, 4),
                rot.q[:, None, :], out=q.view(cplx))
    v_new = qkv.reshape(b, T, Hn, Dh)[:, :, H + KVH:].transpose(0, 2, 1, 3)   # (b, KVH, T, Dh)
    if kv is None:
        k = np.empty((b, KVH, T, Dh), dtype=qkv.dtype)
        np.multiply(heads[:, :, H:H + KVH].transpose(0, 2, 1, 3), rot.k, out=k.view(cplx))
        v1 = np.empty((b, KVH, T, Dh + 1), dtype=qkv.dtype)             # [v | 1]
        v1[..., Dh] = 1.0
        np.copyto(v1[..., :Dh], v_new)
    else:
        k_new = (heads[:, :, H:H + KVH].transpose(0, 2, 1, 3) * rot.k).view(qkv.dtype)   # (b, KVH, T, Dh)
        k, v1 = kv_append(kv, k_new, v_new)
        if kv.written is not None:
            kv.written()
    return q.reshape(b, KVH, T * R, Dh), k, v1


def kv_append(kv: KV, k_new, v_new):
    """Write positions start .. start + T - 1 of this layer's rows, and return every position so
    far as k (b, KVH, S, Dh) and v1 = [v | 1] (b, KVH, S, Dh + 1): views of a DecodeCache, or of
    any other KVCache through its append (then all of its rows, and v1 a copy)."""
    if isinstance(kv.cache, DecodeCache):
        return kv.cache.write(kv.layer, kv.rows, kv.start, k_new, v_new)
    B = kv.cache.batch_size
    assert range(B)[kv.rows] == range(B), "a KVCache of another layout is filled whole, not by shards"
    k, v = kv.cache.append(kv.layer, k_new, v_new, kv.start)
    return k, np.concatenate((v, np.ones(v.shape[:-1] + (1,), dtype=v.dtype)), axis=-1)


def _attend(q, k, v1, s: Shape, **options):
    """attention_forward of q over k, v1 into a new att (N, H*Dh), wo's input layout. -> (att, its cache)"""
    b, T, H, KVH, Dh, _ = s
    att = np.empty((b * T, H * Dh), dtype=q.dtype)
    # many small GEMMs, one per (row, kv head) and query block: one BLAS thread runs them faster
    # than two, whose hand-offs cost more than the arithmetic (a sharded pass has one already)
    with blas_threads(1):
        cache = attention_forward(q, k, v1, att.reshape(b, T, KVH, H // KVH, Dh).transpose(0, 2, 1, 3, 4), **options)
    return att, cache


def block_forward(x, w: StackedLayer, rot: Rotations, s: Shape, eps, *, block: int, keep_probs: bool = True,
                  lean: bool = False, keep: bool = True, kv: KV | None = None, bias=None):
    """model.block_forward on 2-D activations x (N, D), N = b*T.

    w: the block's weights (projections plain or AdaptedStack); rot: the T positions' Rotations;
    keep: False for a pass with no backward (returns out alone, keeping nothing); keep_probs:
    False keeps only the attention probabilities' row statistics (backward recomputes them);
    lean: keep less still (module docstring): no probabilities, attention output or sigmoid;
    kv: write keys and values into a KV cache and attend to every cached position (a prefill);
    bias: None or (b, 1, T, S) additive, 0 or -inf (a padded batch's mask).
    Returns: out (N, D), and the BlockCache when keep.
    """
    b, T, H, KVH, Dh, F = s
    rstd1 = rms_rstd(x, eps)
    xn = x * rstd1
    xn *= w.attention_norm
    qkv, xa_qkv = project(xn, w.wqkv)                                    # (N, D) -> (N, (H + 2 KVH) Dh)
    del xn
    q, k, v1 = _attention_inputs(qkv, rot, s, kv)
    del qkv
    att, c_att = _attend(q, k, v1, s, block=block, keep_probs=keep_probs and keep and not lean,
                         start=0 if kv is None else kv.start, bias=bias)
    h, xa_o = project(att, w.wo)
    h += x                                                               # residual
    rstd2 = rms_rstd(h, eps)
    hn = h * rstd2
    hn *= w.ffn_norm
    gate_up, xa_13 = project(hn, w.w13)                                  # (N, D) -> (N, 2F): [gate | up]
    del hn
    gate, up = gate_up[:, :F], gate_up[:, F:]
    sig = sigmoid(gate)
    if not lean or not keep:
        gate *= sig                                                      # gate -> silu(gate), in place
        g = gate * up
    else:                                                                # gate kept for backward
        g = gate * sig
        g *= up
    out, xa_2 = project(g, w.w2)                                         # (N, F) -> (N, D)
    del g
    out += h                                                             # residual
    if not keep:
        return out
    if lean:
        att = sig = None
    return out, BlockCache(x, rstd1, c_att, att, h, rstd2, gate_up, sig, (xa_qkv, xa_o, xa_13, xa_2))


def block_backward(dout, c: BlockCache, w: StackedLayer, s: Shape, rot: Rotations, sink: GradSink):
    """model.block_backward: dx (N, D); the weights' gradients go into the sink."""
    b, T, H, KVH, Dh, F = s
    R, Hn = H // KVH, H + 2 * KVH
    xa_qkv, xa_o, xa_13, xa_2 = c.lora
    frozen = sink.dw is None
    # undo out = h + w2(silu(gate) * up)
    up, sig = c.gate_up[:, F:], c.sig
    if sig is None:                                                      # recomputed from the gate
        sig = sigmoid(c.gate_up[:, :F])
        silu = c.gate_up[:, :F] * sig
    else:
        silu = c.gate_up[:, :F]
    g = silu * up
    dg = project_backward(dout, g, w.w2, xa_2, sink, "w2")              # (N, D) -> (N, F)
    dgu = np.empty_like(c.gate_up)                                       # [dgate | dup], the w13 layout
    np.multiply(dg, silu, out=dgu[:, F:])                                # dup = dg silu(gate)
    dgate = dgu[:, :F]
    # ops.swiglu_backward: dgate = dg up s (1 + gate (1 - s)) = dg (g + s (up - g))
    np.subtract(up, g, out=dgate)
    dgate *= sig
    dgate += g
    dgate *= dg
    del g, dg, silu, sig
    hn = c.h * c.rstd2
    hn *= w.ffn_norm
    dhn = project_backward(dgu, hn, w.w13, xa_13, sink, "w13")           # sums the gate and up branches
    del hn, dgu
    dh, dnorm = rms_backward(dhn, c.h, c.rstd2, w.ffn_norm)
    if not frozen:
        sink.sums.put((sink.layer, SLOTS["ffn_norm"]), sink.dw.ffn_norm, sink.shard, value(dnorm))
    dh += dout                                                           # residual: skip + branch
    # undo h = x + wo(attention(...))
    att, c_att = c.att, c.attention
    if att is None:                                                      # lean: the forward again, P kept this once
        att, c_att = _attend(c_att.q, c_att.k, c_att.v1, s, block=c_att.block, keep_probs=True)
    datt = project_backward(dh, att, w.wo, xa_o, sink, "wo")             # (N, D) -> (N, H*Dh)
    dqkv = np.empty((b, T, Hn, Dh), dtype=dout.dtype)
    dq, dk = attention_backward(datt.reshape(b, T, KVH, R, Dh), att.reshape(b, T, KVH, R, Dh),
                                c_att, dqkv[:, :, H + KVH:].transpose(0, 2, 1, 3))
    del datt
    # undo RoPE and the scales: the conjugate multiplies, written into the q and k slots of dqkv
    cplx = rot.k.dtype
    dheads = dqkv.view(cplx)                                             # (b, T, Hn, Dh/2)
    np.multiply(dq.view(cplx).reshape(b, KVH, T, R, Dh // 2), rot.dq[:, None, :],
                out=dheads[:, :, :H].reshape(b, T, KVH, R, Dh // 2).transpose(0, 2, 1, 3, 4))
    np.multiply(dk.view(cplx), rot.dk, out=dheads[:, :, H:H + KVH].transpose(0, 2, 1, 3))
    del dq, dk
    dqkv = dqkv.reshape(b * T, Hn * Dh)
    xn = c.x * c.rstd1
    xn *= w.attention_norm
    dxn = project_backward(dqkv, xn, w.wqkv, xa_qkv, sink, "wqkv")       # sums the q, k and v branches
    del xn, dqkv
    dx, dnorm = rms_backward(dxn, c.x, c.rstd1, w.attention_norm)
    if not frozen:
        sink.sums.put((sink.layer, SLOTS["attention_norm"]), sink.dw.attention_norm, sink.shard, value(dnorm))
    dx += dh                                                             # residual: skip + branch
    return dx
