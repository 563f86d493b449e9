"""LoRA on the engine: npllama.lora's arithmetic on frozen stacked weights, with no weight gradient.

The engine block (engine/block.py) runs unchanged except for its four stacked projections,
[wq; wk; wv], wo, [w1; w3] and w2, which here are AdaptedStacks: the frozen matrix, plus LoRA
adapters on some of its members. Per stacked projection, with the adapted members' A stacked
into one (k r, in) matrix:

    forward    y = x W^T                       one GEMM, as the plain engine
               xa = x [A_1; ...; A_k]^T        one thin GEMM for every adapter of the stack
               y[:, rows_j] += xa_j (s B_j)^T  per adapted member
    backward   g = [dy_1 (s B_1) | ... | dy_k (s B_k)]          (N, k r): s (dy_j B_j), side by side
               dx = dy W + g [A_1; ...; A_k]
               dA_j = g_j^T x  (one GEMM for all j),   dB_j = s dy_j^T xa_j

with s folded into the small B_j once per step (no pass over an (N, .) array only scales it),
and never dW = dy^T x, the GEMM that costs as much as the forward. The model-level chain rule
is npllama.model.loss_and_grads with frozen=True (no gradient for the output layer, the norms
or the embedding). Because the base never changes, its stacks are built once, and the params
dict is pointed at views of them (freeze_stacked), so they cost no memory beyond the weights
(the plain engine stacks copies at every call), and the frozen GEMMs are the base model's own:
with B = 0 the logits equal the base model's bit for bit.
tests/engine/test_lora_engine.py checks all of it against npllama.lora (float64, 1e-10).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import numpy as np

from .. import model
from ..config import LlamaConfig
from ..lora import LORA_TARGETS, LoraSpec, adapter_names, weight_name
from ..model import LoraGrads, layer_param_names, layer_weights
from ..ops import linear_backward, linear_forward
from ..ops.linear import LinearCache
from .block import block_backward, block_forward
from .layout import stacked_views
from .memory import release_freed_memory
from .stacked import StackedLayer, stack_layer, unstack

# The members of each stacked projection, in their row order (engine/stacked.py).
STACK_MEMBERS = {"wqkv": ("wq", "wk", "wv"), "wo": ("wo",), "w13": ("w1", "w3"), "w2": ("w2",)}


class AdaptedStack(NamedTuple):
    """A frozen stacked projection with LoRA adapters on some of its members."""
    weight: np.ndarray               # (out, in), frozen: e.g. [wq; wk; wv]
    members: tuple                   # per member: its slice of the output rows
    adapted: tuple                   # the indices of the members that have adapters
    a: np.ndarray | None             # (k r, in): their A matrices, stacked (None without adapters)
    b: tuple                         # per adapted member: s B (out_j, r), the scale folded in
    scale: float                     # s = alpha / r

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape     # the block reads the head counts from it


class AdaptedCache(NamedTuple):
    x: np.ndarray                    # (..., in), the input (a reference)
    w: AdaptedStack
    xa: np.ndarray | None            # (N, k r), x A^T of every adapted member


def adapted_forward(x, w: AdaptedStack):
    """y = x W^T, plus s (x A_j^T) B_j^T on each adapted member's rows. x (..., in) -> y (..., out)."""
    y, _ = linear_forward(x, w.weight)
    if w.a is None:
        return y, AdaptedCache(x, w, None)
    r = w.a.shape[0] // len(w.adapted)
    xa = x.reshape(-1, x.shape[-1]) @ w.a.T                     # (N, in) @ (in, k r) -> (N, k r)
    y2 = y.reshape(-1, y.shape[-1])                             # a view: the adds land in y
    for n, j in enumerate(w.adapted):
        y2[:, w.members[j]] += xa[:, n * r:(n + 1) * r] @ w.b[n].T   # (N, r) @ (r, out_j)
    return y, AdaptedCache(x, w, xa)


def adapted_backward(dy, cache: AdaptedCache):
    """dx, and per member its LoraGrads (None for a member without adapters); W gets no gradient.

    Shapes: dy (..., out) -> dx (..., in); dA_j (r, in), dB_j (out_j, r).
    """
    x, w, xa = cache
    dx, _ = linear_backward(dy, LinearCache(x, w.weight), weight_grad=False)
    grads = [None] * len(w.members)
    if w.a is None:
        return dx, tuple(grads)
    k = len(w.adapted)
    r = w.a.shape[0] // k
    dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
    g = np.empty((dy2.shape[0], k * r), dtype=dy.dtype)        # [dy_1 (s B_1) | ... | dy_k (s B_k)], (N, k r)
    for n, j in enumerate(w.adapted):
        np.matmul(dy2[:, w.members[j]], w.b[n], out=g[:, n * r:(n + 1) * r])
    dx2 = dx.reshape(-1, dx.shape[-1])                          # a view: the add lands in dx
    dx2 += g @ w.a                                              # (N, k r) @ (k r, in)
    da = g.T @ x2                                               # (k r, N) @ (N, in) -> (k r, in)
    for n, j in enumerate(w.adapted):
        db = w.scale * (dy2[:, w.members[j]].T @ xa[:, n * r:(n + 1) * r])   # (out_j, N) @ (N, r)
        grads[j] = LoraGrads(da[n * r:(n + 1) * r], db)
    return dx, tuple(grads)


def adapter_gradients(g: StackedLayer, n_heads: int, n_kv_heads: int) -> list:
    """A block's adapter gradients from the StackedLayer of adapted_backward's results, in the
    order of npllama.lora.adapter_names (targets in block order, A then B)."""
    by_target = {}
    for field, members in STACK_MEMBERS.items():
        by_target.update(zip(members, getattr(g, field)))
    return [d for t in LORA_TARGETS if by_target[t] is not None for d in by_target[t]]


# ----------------------------------------------------------------------------- the model

def freeze_stacked(params: dict, config: LlamaConfig) -> list[StackedLayer]:
    """Every block's weights stacked once, for a model whose weights no longer change.

    The params dict is pointed at views of the stacks (the same values), so the stacks and the
    params share memory instead of the engine copying [wq; wk; wv] and [w1; w3] at every call.
    When the params are views of one flat array (npllama.Llama's layout), the stacks are views of
    it already, and nothing is copied.
    """
    views = stacked_views(params, config)
    if views is not None:
        return views
    frozen = []
    for i in range(config.n_layers):
        stacked = stack_layer(layer_weights(params, i))
        params.update(zip(layer_param_names(i), unstack(stacked, config.n_heads, config.n_kv_heads)))
        frozen.append(stacked)
    release_freed_memory()
    return frozen


def adapted_stack(weight: np.ndarray, members: tuple, sizes: list[int], i: int, adapters: dict,
                  spec: LoraSpec) -> AdaptedStack:
    """One stacked projection of block i with the adapters of its members that spec targets."""
    ends = np.cumsum(sizes)
    rows = tuple(slice(int(e - s), int(e)) for s, e in zip(sizes, ends))
    stems = [weight_name(i, t).removesuffix(".weight") for t in members]
    adapted = tuple(j for j, t in enumerate(members) if spec.rank and t in spec.targets)
    a = np.concatenate([adapters[stems[j] + ".lora_a"] for j in adapted]) if adapted else None
    b = tuple(spec.scale * adapters[stems[j] + ".lora_b"] for j in adapted)
    return AdaptedStack(weight, rows, adapted, a, b, spec.scale)


def adapted_layers(frozen: list[StackedLayer], adapters: dict, config: LlamaConfig,
                   spec: LoraSpec) -> list[StackedLayer]:
    """The blocks' frozen stacks (freeze_stacked) with the current adapters: once per step."""
    Dh, F = config.head_dim, config.hidden_dim
    sizes = {"wqkv": [config.n_heads * Dh, config.n_kv_heads * Dh, config.n_kv_heads * Dh],
             "wo": [config.dim], "w13": [F, F], "w2": [config.dim]}
    return [w._replace(**{field: adapted_stack(getattr(w, field), members, sizes[field], i, adapters, spec)
                          for field, members in STACK_MEMBERS.items()})
            for i, w in enumerate(frozen)]


def lora_blocks(frozen: list[StackedLayer], adapters: dict, config: LlamaConfig, spec: LoraSpec) -> model.Blocks:
    """The engine's blocks with adapters, for engine.passes.forward / loss_and_grads (frozen=True)."""
    return model.Blocks(adapted_layers(frozen, adapters, config, spec),
                        partial(block_forward, project=adapted_forward),
                        partial(block_backward, project_backward=adapted_backward, gradients=adapter_gradients),
                        lambda i: adapter_names(i, spec))
