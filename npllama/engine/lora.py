"""LoRA on the engine: npllama.lora's arithmetic on frozen stacked weights, with no weight gradient.

The engine block (engine/block.py) runs unchanged except for its four stacked projections,
[wq; wk; wv], wo, [w1; w3] and w2, which here are AdaptedStacks: the frozen matrix, plus LoRA
adapters on some of its members. Per stacked projection, with the adapted members' A stacked
into one (k r, in) matrix (ops.lora_forward / lora_backward, fused across a stack's members):

    forward    y = x W^T                       one GEMM, as the plain engine
               xa = x [A_1; ...; A_k]^T        one thin GEMM for every adapter of the stack
               y[:, rows_j] += xa_j (s B_j)^T  per adapted member
    backward   g = [dy_1 (s B_1) | ... | dy_k (s B_k)]          (N, k r): s (dy_j B_j), side by side
               dx = dy W + g [A_1; ...; A_k]
               dA_j = g_j^T x  (one GEMM for all j),   dB_j = s dy_j^T xa_j

with s folded into the small B_j once per call (no pass over an (N, .) array only scales it),
and never dW = dy^T x, the GEMM that costs as much as the forward. The frozen GEMMs are the
base model's own, so with B = 0 the logits equal the base model's bit for bit.
tests/test_backends.py checks it against npllama.lora (float64, 1e-10).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..config import LlamaConfig
from ..lora import LoraSpec, weight_name
from .projections import linear_rows
from .shards import product
from .stacked import STACK_MEMBERS, StackedLayer

# The members of each stacked projection, in their row order (engine/stacked.py).
# shards.ShardSums slots of a stack's adapter gradients: dA at base, each dB_j at base + 1 + j,
# clear of the block's slots (engine/block.py SLOTS) and the model's (engine/passes.py).
_SLOT_BASE = 16


class AdaptedStack(NamedTuple):
    """A frozen stacked projection with LoRA adapters on some of its members."""
    weight: np.ndarray               # (out, in), frozen: e.g. [wq; wk; wv]
    members: tuple                   # per member: its slice of the output rows
    adapted: tuple                   # the indices of the members that have adapters
    a: np.ndarray | None             # (k r, in): their A matrices, stacked (None without adapters)
    b: tuple                         # per adapted member: s B (out_j, r), the scale folded in
    scale: float                     # s = alpha / r
    da: np.ndarray | None            # (k r, in): where their dA go (views of the call's gradients)
    db: tuple                        # per adapted member: where its dB (out_j, r) goes
    slot: int                        # the first of its ShardSums slots

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape


def adapted_forward(x, w: AdaptedStack):
    """y = x W^T, plus s (x A_j^T) B_j^T on each adapted member's rows. x (N, in) -> y (N, out), xa (N, k r).
    x W^T is the plain block's product (projections.linear_rows), so zero B gives the base's bits."""
    y = linear_rows(x, w.weight)
    if w.a is None:
        return y, None
    r = w.a.shape[0] // len(w.adapted)
    xa = x @ w.a.T                                                # (N, in) @ (in, k r) -> (N, k r)
    for n, j in enumerate(w.adapted):
        y[:, w.members[j]] += xa[:, n * r:(n + 1) * r] @ w.b[n].T   # (N, r) @ (r, out_j)
    return y, xa


def adapted_backward(dy, x, xa, w: AdaptedStack, sink):
    """dx (N, in) = dy W + g A; dA and dB of every adapted member into the sink (engine/block.GradSink)."""
    dx = dy @ w.weight
    if w.a is None:
        return dx
    k = len(w.adapted)
    r = w.a.shape[0] // k
    g = np.empty((dy.shape[0], k * r), dtype=dy.dtype)          # [dy_1 (s B_1) | ... | dy_k (s B_k)], (N, k r)
    for n, j in enumerate(w.adapted):
        np.matmul(dy[:, w.members[j]], w.b[n], out=g[:, n * r:(n + 1) * r])
    dx += g @ w.a                                               # (N, k r) @ (k r, in)
    sink.sums.put((sink.layer, w.slot), w.da, sink.shard, product(g.T, x))   # (k r, N) @ (N, in)
    for n, j in enumerate(w.adapted):
        sink.sums.put((sink.layer, w.slot + 1 + n), w.db[n], sink.shard,
                      _scaled_product(w.scale, dy[:, w.members[j]].T, xa[:, n * r:(n + 1) * r]))
    return dx


def _scaled_product(s, a, b):
    """term(out) for dst (+)= s (a @ b)."""
    def term(out):
        out = np.matmul(a, b, out=out)
        out *= s
        return out
    return term


def adapted_layers(frozen: list[StackedLayer], adapters: dict, config: LlamaConfig, spec: LoraSpec):
    """The blocks' frozen stacks with the current adapters, and fresh arrays for their gradients.

    Returns: layers (per block a StackedLayer whose four projections are AdaptedStacks) and grads
    (keyed and shaped like adapters: views of the arrays the AdaptedStacks' da / db are).
    """
    Dh, F = config.head_dim, config.hidden_dim
    sizes = {"wqkv": [config.n_heads * Dh, config.n_kv_heads * Dh, config.n_kv_heads * Dh],
             "wo": [config.dim], "w13": [F, F], "w2": [config.dim]}
    layers, grads = [], {}
    for i, w in enumerate(frozen):
        stacks = {}
        for field, members in STACK_MEMBERS.items():
            stack, stack_grads = _adapted_stack(getattr(w, field), members, sizes[field], i, adapters, spec,
                                                _SLOT_BASE + 8 * StackedLayer._fields.index(field))
            stacks[field] = stack
            grads.update(stack_grads)
        layers.append(w._replace(**stacks))
    return layers, {name: grads[name] for name in adapters}


def _adapted_stack(weight, members, sizes, i, adapters, spec, slot):
    """One stacked projection of block i with the adapters of its members that spec targets."""
    ends = np.cumsum(sizes)
    rows = tuple(slice(int(e - s), int(e)) for s, e in zip(sizes, ends))
    stems = [weight_name(i, t).removesuffix(".weight") for t in members]
    adapted = tuple(j for j, t in enumerate(members) if spec.rank and t in spec.targets)
    if not adapted:
        return AdaptedStack(weight, rows, (), None, (), spec.scale, None, (), slot), {}
    a = np.concatenate([adapters[stems[j] + ".lora_a"] for j in adapted])
    b = tuple(spec.scale * adapters[stems[j] + ".lora_b"] for j in adapted)
    da = np.empty_like(a)
    db = tuple(np.empty_like(adapters[stems[j] + ".lora_b"]) for j in adapted)
    r = spec.rank
    grads = {}
    for n, j in enumerate(adapted):
        grads[stems[j] + ".lora_a"] = da[n * r:(n + 1) * r]
        grads[stems[j] + ".lora_b"] = db[n]
    return AdaptedStack(weight, rows, adapted, a, b, spec.scale, da, db, slot), grads
