"""The engine's training pass: npllama.model.loss_and_grads, fast and lean, on one flat array.

    loss, grads = loss_and_grads(params, config, rope, tokens, targets)   # grads keyed like params

The same chain rule as the reference (model.loss_and_grads, block_forward / block_backward),
with the work laid out for NumPy on a few cores:

  - Flat arrays (engine/layout.py): the parameters are views of one array, so the stacks
    [wq; wk; wv] and [w1; w3] are views too, and the gradients are written into one new flat
    array whose views are returned. Each stacked dW GEMM writes its slot directly.
  - Shards (engine/shards.py): the batch rows in shards on one thread per core. Every shard
    adds its gradient terms into the one gradient array, in a fixed order (ShardSums), so the
    sums are those of one fixed order whatever the threads' timing: a step is reproducible
    bit for bit, and there is no per-shard copy of the gradients.
  - Block-causal attention (engine/attention.py): no score in a query block's future is made.
  - One pass where the reference makes several: RoPE, the 1/sqrt(Dh) scale and the change to
    the attention layout are one complex multiply; the cross-entropy's softmax and gradient
    are computed in place in the logits; SwiGLU overwrites the gate with silu(gate).
  - Memory that a step frees is kept for the next (engine/memory.py: a process-wide glibc
    setting, made once), so the step's arrays are not faulted in again page by page.
  - Only what backward cannot cheaply recompute is kept: per block its input, the two rstd
    columns, q, k, [v | 1], the attention probabilities (up to KEEP_PROBS_MAX_T positions; above,
    their row statistics only), the attention output, h, [silu | up]
    and sigmoid(gate). The norms' outputs and silu * up are recomputed (one multiply each).

tests/engine/ checks loss and every gradient against the reference (float64, 1e-10).
"""

from __future__ import annotations

import math
import threading
from typing import NamedTuple

import numpy as np

from ..config import LlamaConfig
from ..model import output_weight_name
from ..ops import IGNORE_INDEX
from .attention import BLOCK, BlockAttentionCache, attention_backward, attention_forward
from .blas import blas_threads
from .projections import row_dot
from .layout import FlatLayout
from .memory import keep_freed_memory
from .shards import n_shards, resolve_workers, run_sharded
from .stacked import StackedLayer
from ..errors import NpllamaError

LOG2_E = 1.0 / math.log(2.0)
# Up to this many positions the attention probabilities are kept for backward; above, only
# their row statistics, and backward recomputes them (one more q k^T per block): at T = 512 they
# are the largest cache of all (a third of the step's activations at dim 768, 16 heads).
KEEP_PROBS_MAX_T = 256
# Above this vocabulary the embedding's gradient is summed by sorting the ids; below, by a
# one-hot GEMM (2 V N D flops: 70 ms against 3 ms at V = 6144, D = 768, N = 512).
ONE_HOT_MAX_VOCAB = 128


# ----------------------------------------------------------------------------- gradient sums

class _Slot:
    __slots__ = ("lock", "done", "pending")

    def __init__(self):
        self.lock = threading.Lock()
        self.done = 0            # terms in the array so far
        self.pending = {}        # place in the order -> term, waiting for those before it


class ShardSums:
    """Each gradient slot = the sum of every shard's term, added in one fixed order.

    The order starts at a shard that rotates with the slot (slot (i, name) of block i starts at
    shard (i + SLOT_NAMES.index(name)) mod n) and goes on cyclically. The first shard in a slot's
    order writes its term straight into the slot (a GEMM with out=); every later one computes
    its term aside and adds it once the shards before it in that order have: the order of the
    additions, and so the rounding, never depends on which thread gets there first, and the
    terms computed aside (the extra memory traffic) fall on every shard alike.
    """

    def __init__(self, n_shards: int):
        self.n_shards = n_shards
        self._slots: dict = {}
        self._lock = threading.Lock()

    def put(self, key: tuple, dst: np.ndarray, shard: int, term) -> None:
        """dst (+)= term(out) for key (i, name): term writes into out (the first shard in the slot's
        order: dst itself) or, given None, returns an array."""
        with self._lock:
            slot = self._slots.setdefault(key, _Slot())
        i, name = key
        rank = (shard - i - SLOT_NAMES.index(name)) % self.n_shards      # its place in this slot's order
        if rank == 0:
            term(dst)
        else:
            value = term(None)
        with slot.lock:
            if rank == 0:
                slot.done = 1
            else:
                slot.pending[rank] = value
            while slot.done in slot.pending:
                dst += slot.pending.pop(slot.done)
                slot.done += 1


# A block's gradient slots, and the model's (block index n_layers), in the order ShardSums rotates
SLOT_NAMES = ("w2", "w13", "ffn_norm", "wo", "wqkv", "attention_norm", "output", "norm", "embedding")


def _product(a, b):
    """term(out) for dst (+)= a @ b."""
    return lambda out: np.matmul(a, b, out=out)


def _value(x):
    return lambda out: x if out is None else np.copyto(out, x)


# ----------------------------------------------------------------------------- small ops

def rms_rstd(x, eps):
    """r = (mean(x**2) + eps) ** -0.5 of each row: (N, D) -> (N, 1)."""
    r = row_dot(x, x)
    r *= 1.0 / x.shape[1]
    r += eps
    np.sqrt(r, out=r)
    return np.divide(1.0, r, out=r)


def rms_backward(dy, x, rstd, weight):
    """ops.rmsnorm_backward with the input and r given: (dx, dweight), dx over dy's memory.

    n = x r,  dweight = sum over rows of dy n,  g = dy w,  dx = r (g - n mean(g n)).
    """
    n = x * rstd
    dweight = np.einsum("nd,nd->d", dy, n)
    dy *= weight
    mean_gn = row_dot(dy, n)
    mean_gn *= 1.0 / x.shape[1]
    n *= mean_gn
    dy -= n
    dy *= rstd
    return dy, dweight


def sigmoid(a):
    """1 / (1 + exp(-a)) as a new array, with exp(-a) as exp2(-a log2(e)): NumPy's exp2 takes half
    the time of its exp (though far more where it underflows, which here takes a > 87), and its
    divide half that of its reciprocal. (exp2 overflowing to inf gives the right limit, 0.)"""
    s = np.multiply(a, -LOG2_E)
    with np.errstate(over="ignore"):
        np.exp2(s, out=s)
    s += 1.0
    return np.divide(1.0, s, out=s)


def cross_entropy_in_place(logits, targets, normalizer):
    """ops.cross_entropy forward and backward at once, the gradient written over the logits.

    loss = (1/n) sum over valid rows of (logsumexp(z) - z_y);  dz = (softmax(z) - onehot(y)) / n
    on valid rows, 0 on ignored ones. logits (N, V) float, targets (N,) ids or -100.
    Returns: loss (python float), dlogits (the logits' array).
    """
    N = logits.shape[0]
    valid = targets != IGNORE_INDEX
    picked_rows = np.flatnonzero(valid)
    picked_ids = targets[picked_rows]
    row_max = logits.max(axis=1, keepdims=True)
    picked = logits[picked_rows, picked_ids]
    logits -= row_max
    np.exp(logits, out=logits)
    sums = logits @ np.ones((logits.shape[1], 1), dtype=logits.dtype)  # (N, V) -> (N, 1), faster than sum
    lse = row_max[picked_rows, 0] + np.log(sums[picked_rows, 0])
    loss = float((lse - picked).sum(dtype=np.float64) / normalizer)
    # softmax / n on valid rows, 0 on the others; then the one-hot term
    scale = np.zeros((N, 1), dtype=logits.dtype)
    scale[picked_rows] = (1.0 / normalizer) / sums[picked_rows]
    logits *= scale
    logits[picked_rows, picked_ids] -= logits.dtype.type(1.0 / normalizer)
    return loss, logits


def embedding_term(ids, dx, vocab_size):
    """term(out) for dW (+)= the scatter-add of dx's rows into the rows ids (ops.embedding_backward)."""
    def term(out):
        if out is None:
            out = np.zeros((vocab_size, dx.shape[1]), dtype=dx.dtype)
        else:
            out.fill(0)
        return add_rows(out, ids, dx)
    return term


def add_rows(dst, ids, rows):
    """dst[ids[j]] += rows[j] for every j, repeated ids summed. Returns dst."""
    V = dst.shape[0]
    if V <= ONE_HOT_MAX_VOCAB:
        one_hot = np.zeros((V, len(ids)), dtype=rows.dtype)
        one_hot[ids, np.arange(len(ids))] = 1
        dst += one_hot @ rows                                             # (V, N) @ (N, D)
        return dst
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
    dst[sorted_ids[starts]] += np.add.reduceat(rows[order], starts, axis=0)
    return dst


# ----------------------------------------------------------------------------- one block

class Rotations(NamedTuple):
    """RoPE as complex multipliers (ops.rope._rotate), q's with the 1/sqrt(Dh) scale folded in."""
    k: np.ndarray            # (T, Dh/2) complex: e^(i p theta)
    q: np.ndarray            # times 1/sqrt(Dh)
    dk: np.ndarray           # backward: the conjugates
    dq: np.ndarray


def rotations(rope, T, head_dim) -> Rotations:
    cos, sin = rope
    rot = (cos[:T] + 1j * sin[:T]).astype(np.result_type(cos.dtype, np.complex64))
    rot_q = rot * (1.0 / math.sqrt(head_dim))
    return Rotations(rot, rot_q, np.conj(rot), np.conj(rot_q))


class Shape(NamedTuple):
    b: int                   # batch rows of the shard
    T: int
    H: int
    KVH: int
    Dh: int
    F: int


class BlockCache(NamedTuple):
    x: np.ndarray            # (N, D) the block's input
    rstd1: np.ndarray        # (N, 1) attention_norm's r
    attention: BlockAttentionCache
    att: np.ndarray          # (N, H*Dh) attention output, wo's input
    h: np.ndarray            # (N, D) after the attention residual
    rstd2: np.ndarray        # (N, 1) ffn_norm's r
    silu_up: np.ndarray      # (N, 2F) [silu(gate) | up]
    sig: np.ndarray          # (N, F) sigmoid(gate)


def block_forward(x, w: StackedLayer, rot: Rotations, s: Shape, eps, block, keep_probs):
    """model.block_forward on 2-D activations x (N, D), N = b*T; returns (out (N, D), BlockCache)."""
    b, T, H, KVH, Dh, F = s
    R, Hn = H // KVH, H + 2 * KVH
    rstd1 = rms_rstd(x, eps)
    xn = x * rstd1
    xn *= w.attention_norm
    qkv = xn @ w.wqkv.T                                                  # (N, D) -> (N, Hn*Dh)
    del xn
    # RoPE, q's scale and the attention layout in one complex multiply per q and k
    cplx = rot.k.dtype
    heads = qkv.view(cplx).reshape(b, T, Hn, Dh // 2)
    q = np.empty((b, KVH, T, R, Dh), dtype=x.dtype)                      # rows (t, r) of each group
    np.multiply(heads[:, :, :H].reshape(b, T, KVH, R, Dh // 2).transpose(0, 2, 1, 3, 4),
                rot.q[:, None, :], out=q.view(cplx))
    k = np.empty((b, KVH, T, Dh), dtype=x.dtype)
    np.multiply(heads[:, :, H:H + KVH].transpose(0, 2, 1, 3), rot.k, out=k.view(cplx))
    v1 = np.empty((b, KVH, T, Dh + 1), dtype=x.dtype)                   # [v | 1]
    v1[..., Dh] = 1.0
    np.copyto(v1[..., :Dh], qkv.reshape(b, T, Hn, Dh)[:, :, H + KVH:].transpose(0, 2, 1, 3))
    del qkv, heads
    att = np.empty((b * T, H * Dh), dtype=x.dtype)
    c_att = attention_forward(q.reshape(b, KVH, T * R, Dh), k, v1,
                                  att.reshape(b, T, KVH, R, Dh).transpose(0, 2, 1, 3, 4),
                                  block=block, keep_probs=keep_probs)
    h = att @ w.wo.T
    h += x                                                               # residual
    rstd2 = rms_rstd(h, eps)
    hn = h * rstd2
    hn *= w.ffn_norm
    silu_up = hn @ w.w13.T                                               # (N, D) -> (N, 2F): [gate | up]
    del hn
    gate, up = silu_up[:, :F], silu_up[:, F:]
    sig = sigmoid(gate)
    gate *= sig                                                          # gate -> silu(gate), in place
    out = (gate * up) @ w.w2.T                                           # (N, F) -> (N, D)
    out += h                                                             # residual
    return out, BlockCache(x, rstd1, c_att, att, h, rstd2, silu_up, sig)


def block_backward(dout, c: BlockCache, w: StackedLayer, dw: StackedLayer, s: Shape, rot: Rotations,
                   sums: ShardSums, shard: int, layer: int):
    """model.block_backward: dx (N, D); the weights' gradients go into dw's slots through sums."""
    b, T, H, KVH, Dh, F = s
    R, Hn = H // KVH, H + 2 * KVH
    # undo out = h + w2(silu(gate) * up)
    silu, up = c.silu_up[:, :F], c.silu_up[:, F:]
    g = silu * up
    sums.put((layer, "w2"), dw.w2, shard, _product(dout.T, g))
    dg = dout @ w.w2                                                     # (N, D) -> (N, F)
    dgu = np.empty_like(c.silu_up)                                       # [dgate | dup], the w13 layout
    np.multiply(dg, silu, out=dgu[:, F:])                                # dup = dg silu(gate)
    dgate = dgu[:, :F]
    # dgate = dg up s (1 + gate (1 - s)) = dg (g + s (up - g))
    np.subtract(up, g, out=dgate)
    dgate *= c.sig
    dgate += g
    dgate *= dg
    del g, dg
    hn = c.h * c.rstd2
    hn *= w.ffn_norm
    sums.put((layer, "w13"), dw.w13, shard, _product(dgu.T, hn))
    del hn
    dhn = dgu @ w.w13                                                    # sums the gate and up branches
    del dgu
    dh, dnorm = rms_backward(dhn, c.h, c.rstd2, w.ffn_norm)
    sums.put((layer, "ffn_norm"), dw.ffn_norm, shard, _value(dnorm))
    dh += dout                                                           # residual: skip + branch
    # undo h = x + wo(attention(...))
    sums.put((layer, "wo"), dw.wo, shard, _product(dh.T, c.att))
    datt = dh @ w.wo                                                     # (N, D) -> (N, H*Dh)
    dqkv = np.empty((b, T, Hn, Dh), dtype=dout.dtype)
    dq, dk = attention_backward(datt.reshape(b, T, KVH, R, Dh), c.att.reshape(b, T, KVH, R, Dh),
                                c.attention, dqkv[:, :, H + KVH:].transpose(0, 2, 1, 3))
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
    sums.put((layer, "wqkv"), dw.wqkv, shard, _product(dqkv.T, xn))
    del xn
    dxn = dqkv @ w.wqkv                                                  # sums the q, k and v branches
    del dqkv
    dx, dnorm = rms_backward(dxn, c.x, c.rstd1, w.attention_norm)
    sums.put((layer, "attention_norm"), dw.attention_norm, shard, _value(dnorm))
    dx += dh                                                             # residual: skip + branch
    return dx


# ----------------------------------------------------------------------------- the model

class Step(NamedTuple):
    """What every shard of one call shares."""
    config: LlamaConfig
    views: dict              # name -> view of params
    gviews: dict             # name -> view of grads
    layers: list             # per block: StackedLayer views of params
    dlayers: list            # per block: StackedLayer views of grads
    rotations: Rotations
    normalizer: int
    sums: ShardSums
    block: int
    keep_probs: bool
    recompute: bool          # gradient checkpointing: keep each block's input only


def shard_loss_and_grads(step: Step, shard: int, tokens, targets) -> float:
    """model.loss_and_grads of one shard of rows; its gradient terms go into step.grads. Returns its loss."""
    cfg = step.config
    b, T = tokens.shape
    s = Shape(b, T, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden_dim)
    rot = step.rotations
    views, gviews = step.views, step.gviews
    ids = tokens.reshape(-1)
    x = np.take(views["tok_embeddings.weight"], ids, axis=0)               # (N,) -> (N, D)
    caches = []                             # per block: its BlockCache, or its input when recomputing
    last = len(step.layers) - 1
    for i, w in enumerate(step.layers):
        x_in = x
        x, c = block_forward(x, w, rot, s, cfg.norm_eps, step.block, step.keep_probs)
        # the last block's backward comes next: its cache is kept, not recomputed at once
        caches.append(x_in if step.recompute and i < last else c)
    rstd = rms_rstd(x, cfg.norm_eps)
    xn = x * rstd
    xn *= views["norm.weight"]
    out_name = output_weight_name(cfg)
    w_out = views[out_name]
    logits = xn @ w_out.T                                                # (N, D) -> (N, V)
    # The chain rule starts here: dloss = 1.0, and the loss divides by the batch's valid targets.
    loss, dlogits = cross_entropy_in_place(logits, targets.reshape(-1), step.normalizer)
    if cfg.tie_embeddings:
        dxn = dlogits @ w_out
        dw_out = dlogits.T @ xn                                          # kept: the embedding adds into it
    else:
        step.sums.put((cfg.n_layers, "output"), gviews[out_name], shard, _product(dlogits.T, xn))
        dxn = dlogits @ w_out
    del logits, dlogits, xn
    dx, dnorm = rms_backward(dxn, x, rstd, views["norm.weight"])
    step.sums.put((cfg.n_layers, "norm"), gviews["norm.weight"], shard, _value(dnorm))
    for i in reversed(range(cfg.n_layers)):
        c = caches.pop()
        if step.recompute and i < last:     # the same forward on the same input: the same cache, bit for bit
            _, c = block_forward(c, step.layers[i], rot, s, cfg.norm_eps, step.block, step.keep_probs)
        dx = block_backward(dx, c, step.layers[i], step.dlayers[i], s, rot, step.sums, shard, i)
        del c
    demb = gviews["tok_embeddings.weight"]
    if cfg.tie_embeddings:                  # one matrix read twice: the output's term plus the embedding's
        add_rows(dw_out, ids, dx)
        step.sums.put((cfg.n_layers, "embedding"), demb, shard, _value(dw_out))
    else:
        step.sums.put((cfg.n_layers, "embedding"), demb, shard, embedding_term(ids, dx, cfg.vocab_size))
    return loss


def loss_and_grads(params: dict, config: LlamaConfig, rope, tokens, targets, *, workers=None,
                   block: int | None = None, keep_probs: bool | None = None, recompute: bool = False):
    """Mean cross-entropy of checked tokens and targets (B, T) and every parameter's gradient.

    params: the model's parameters; when they are views of one flat array (FlatLayout, as
    npllama.Llama keeps them) nothing is copied, otherwise they are gathered into one first.
    rope: (cos, sin) tables of model_rope_tables. workers: threads (engine.shards.resolve_workers).
    block: query positions per attention block (BLOCK). keep_probs: False recomputes
    the attention probabilities in backward instead of keeping them (less memory, a few % slower);
    None keeps them up to KEEP_PROBS_MAX_T positions.
    recompute: gradient checkpointing (engine/recompute.py): keep only each block's input and run
    its forward again in backward; the same arithmetic, so the same bits, for a third more compute.
    Returns: loss (python float), grads: views of one new flat array, keyed like params.
    """
    n_valid = int(np.count_nonzero(targets != IGNORE_INDEX))
    if n_valid == 0:
        raise NpllamaError("every target is -100 (ignored): the mean cross-entropy has no terms")
    workers = resolve_workers(workers, *tokens.shape, config.dim)
    keep_freed_memory()                     # once per process: no page faults for each step's arrays
    layout = FlatLayout(config)
    flat = layout.base_of(params)
    if flat is None:                        # not the engine's layout: one copy for this call
        flat = layout.new(params["tok_embeddings.weight"].dtype)
        for name, view in layout.views(flat).items():
            view[...] = params[name]
    grads = layout.new(flat.dtype)
    step = Step(config, layout.views(flat), layout.views(grads),
                [layout.stacked(flat, i) for i in range(config.n_layers)],
                [layout.stacked(grads, i) for i in range(config.n_layers)],
                rotations(rope, tokens.shape[1], config.head_dim), n_valid, ShardSums(n_shards(workers, *tokens.shape, config.dim)),
                BLOCK if block is None else block,
                tokens.shape[1] <= KEEP_PROBS_MAX_T if keep_probs is None else keep_probs, recompute)
    # One BLAS thread throughout, also with one worker: at these sizes OpenBLAS's second thread
    # costs more in hand-offs than it adds (a 1024 x 128 x 704 GEMM: 94 GF/s alone, 23 on two).
    with blas_threads(1):
        losses = run_sharded(lambda j, x, y: shard_loss_and_grads(step, j, x, y), workers, config.dim,
                             tokens, targets, indexed=True)
    return sum(losses), step.gviews
