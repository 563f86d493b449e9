"""The engine's whole-model passes: npllama.model.forward / loss_and_grads (and npllama.lora's), fast.

    loss, grads = loss_and_grads(params, config, rope, tokens, targets, lora=None, checkpointing=False)
    logits = forward(params, config, rope, tokens, kv_cache=None, start_pos=0, mask=None, lora=None,
                     last_only=False)

The model-level chain rule is the reference's; every block runs engine/block.py, the one block
of the engine, whatever the pass:

  - Shards (engine/shards.py): the batch rows in contiguous shards on one thread per core,
    each with one BLAS thread. Every shard adds its gradient terms into the one gradient array
    in a fixed order (ShardSums), so a step gives the same bits whatever the threads' timing.
  - Flat arrays (engine/layout.py): when the parameters are views of one array (npllama.Llama
    allocates them so), the stacks [wq; wk; wv] and [w1; w3] are views too, and the gradients
    are views of one flat array that the stacked dW GEMMs write directly (an earlier call's
    that nothing holds any more, or a new one: layout.gradient_array). Other parameters
    (a loaded file's) are stacked into copies for the call.
  - LoRA (lora given: engine/lora.py): the same pass on frozen stacks with adapters; no
    gradient of the output layer, the norms or the embedding is formed.
  - Gradient checkpointing: each block keeps only its input in the forward, and is run again
    just before its backward (the last block's cache is kept, since its backward comes next).
    The same arithmetic on the same input, so the same bits, for about a third more compute.
  - The cross-entropy's softmax and gradient are computed in place in the logits (fused.py).
  - A forward keeps nothing (each block's activations are dropped once the next has its
    input), computes the last position's logits only when asked (all a prefill needs), writes
    keys and values into a KV cache by shard rows, and reads weights held in float16 /
    bfloat16 one layer at a time, upcast (engine/upcast.py).
"""

from __future__ import annotations

import threading
from functools import partial
from typing import Callable, NamedTuple

import numpy as np

from ..config import LlamaConfig
from ..model import layer_weights, output_weight_name
from ..ops import count_valid
from .attention import BLOCK
from .block import KV, GradSink, Rotations, Shape, block_backward, block_forward, rotations
from .cache import DecodeCache
from .fused import add_rows, cross_entropy_in_place, frozen_output_loss, rms_backward, rms_rstd
from .layout import FlatLayout, gradient_array, stacked_views
from .lora import adapted_layers
from .projections import FEW_ROWS, linear_in_place
from .settings import adapt_malloc_once, blas_threads
from .shards import ShardSums, _executor, available_cores, n_shards, product, resolve_workers, run_sharded, value
from .stacked import stack_layer
from .upcast import float_params, upcast

# Up to this many positions the attention probabilities are kept for backward; above, only
# their row statistics, and backward recomputes them (one more q k^T per block): at T = 512 they
# are the largest cache of all (a third of the step's activations at dim 768, 16 heads).
KEEP_PROBS_MAX_T = 256
# The model-level gradient slots of ShardSums, keyed (n_layers, slot), clear of the blocks' slots.
OUTPUT_SLOT, NORM_SLOT, EMBEDDING_SLOT = 6, 7, 8
# Below this many activations (B * T * D) a forward's GEMMs are small, and a second BLAS thread
# costs more than it saves, ruinously so on a busy machine (an 8-token prompt of an 8M model: 9 ms
# a GEMM on two threads under load, against well under 1 ms on one).
MIN_THREADED_ACTIVATIONS = 1 << 16
# A prefill of fewer rows than cores shares its positions between the cores (position_shards, each
# core on one BLAS thread) once each core gets FEW_ROWS positions or more (fewer: each shard reads
# all the weights for little arithmetic) and T * n_params multiply-adds reach this many a core
# (fewer: the shards' hand-offs in every layer cost more than the second core saves). Measured on
# 6 December 2026 (Xeon, the prefill alone, one shard against two): 8M 128 tokens 23.4 -> 19.8 ms,
# 15M 64 tokens 18.6 -> 18.1 and 128 tokens 26.9 -> 23.7, 110M 64 tokens 171 -> 135; slower in two:
# stories260K at 128 and 256 tokens (3.6 against 4.9 ms, 7.5 against 8.8), 110M at 16 (75 against 84).
POSITION_SHARD_MIN_MACS = 1 << 28


def block_layers(params: dict, config: LlamaConfig, dtype, lazy: bool = False):
    """Block i's weights as a StackedLayer: views of a flat array, or new stacked copies (upcast
    from float16 / bfloat16 when held so). Returns a list, or with lazy a function of i that
    makes one layer's copies when that layer runs (a forward then holds one layer's copies)."""
    views = stacked_views(params, config)
    if views is not None:
        return views.__getitem__ if lazy else views
    floats = float_params(params, dtype)

    def layer(i):
        return stack_layer(layer_weights(floats, i))
    return layer if lazy else [layer(i) for i in range(config.n_layers)]


# ----------------------------------------------------------------------------- training

# Logits a frozen classifier (LoRA) forms at a time: a shard's rows times a block of the vocabulary
# (fused.frozen_output_loss), at least CLASSIFIER_MIN_BLOCK rows of the weight a block. 2^18 (1 MB of
# float32) is 128 rows x 2048 of the 110M shape's 32000, where blocks of 1024 to 8192 were within 3%
# of each other (one thread, 5 December 2026: 123-126 ms a shard against 189 for the 48-row chunks
# of whole logits rows this replaced, whose every chunk read the whole classifier again).
CLASSIFIER_BLOCK_ELEMENTS = 1 << 18
CLASSIFIER_MIN_BLOCK = 256


class TrainPass(NamedTuple):
    """What every shard of one loss_and_grads call shares."""
    config: LlamaConfig
    params: dict
    layers: list             # per block: its StackedLayer (LoRA: AdaptedStacks)
    dlayers: list | None     # per block: StackedLayer views of the gradients; None when frozen (LoRA)
    grads: dict | None       # name -> view of the gradients; None when frozen
    rotations: Rotations
    n_valid: int
    sums: ShardSums
    block: int
    keep_probs: bool
    lean: bool
    checkpointing: bool


def loss_and_grads(params: dict, config: LlamaConfig, rope, tokens, targets, *, lora=None,
                   checkpointing: bool = False, workers=None, block: int | None = None,
                   keep_probs: bool | None = None):
    """Mean cross-entropy of checked tokens and targets (B, T) and its gradients.

    rope: (cos, sin) tables of model_rope_tables. lora: None, or a backend.LoraAdapters whose
    adapters are what trains (params frozen). workers: threads (engine.shards.resolve_workers).
    block: query positions per attention block (attention.BLOCK). keep_probs: False recomputes
    the attention probabilities in backward instead of keeping them; None keeps them up to
    KEEP_PROBS_MAX_T positions. With LoRA the blocks keep a lean cache (engine/block.py: no
    probabilities, attention output or sigmoid, whatever keep_probs says): its goal is memory
    (the base's weights, frozen, are its only other large arrays).
    checkpointing: gradient checkpointing (module docstring).
    Returns: loss (python float), grads keyed like params (views of one flat array, layout.gradient_array), or
    like lora's adapters.
    """
    n_valid = count_valid(targets)
    adapt_malloc_once()                     # freed activations are then kept for the next step (settings.py)
    B, T = tokens.shape
    workers = resolve_workers(workers, B, T, config.dim)
    dtype = rope[0].dtype
    if lora is None:
        layout = FlatLayout(config)
        flat_grads = gradient_array(layout, params, dtype)     # reused once nothing holds it (layout.py)
        grads = layout.views(flat_grads)
        dlayers = [layout.stacked(flat_grads, i) for i in range(config.n_layers)]
        layers = block_layers(params, config, dtype)
    else:
        layers, grads = adapted_layers(block_layers(params, config, dtype), lora.params, config, lora.spec)
        dlayers = None
    step = TrainPass(config, params, layers, dlayers, None if lora else grads,
                     rotations(rope[0][:T], rope[1][:T], config.head_dim), n_valid,
                     ShardSums(n_shards(workers, B, T, config.dim)), BLOCK if block is None else block,
                     T <= KEEP_PROBS_MAX_T if keep_probs is None else keep_probs,
                     lora is not None, checkpointing)
    # One BLAS thread throughout, also with one worker: at these sizes OpenBLAS's second thread
    # costs more in hand-offs than it adds (a 1024 x 128 x 704 GEMM: 94 GF/s alone, 23 on two).
    with blas_threads(1):
        losses = run_sharded(lambda j, rows, x, y: _shard_loss_and_grads(step, j, x, y), workers, config.dim,
                             tokens, targets)
    return sum(losses), grads


def _shard_loss_and_grads(p: TrainPass, shard: int, tokens, targets) -> float:
    """model.loss_and_grads of one shard of rows; its gradient terms go into p's sums. Returns its loss."""
    cfg = p.config
    b, T = tokens.shape
    s = Shape(b, T, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden_dim)
    rot, eps, L = p.rotations, cfg.norm_eps, cfg.n_layers
    frozen = p.grads is None
    ids = tokens.reshape(-1)
    x = np.take(p.params["tok_embeddings.weight"], ids, axis=0)          # (N,) -> (N, D)
    caches = []                             # per block: its BlockCache, or its input when recomputing
    for i, w in enumerate(p.layers):
        x_in = x
        x, c = block_forward(x, w, rot, s, eps, block=p.block, keep_probs=p.keep_probs,
                             lean=p.lean)
        # the last block's backward comes next: its cache is kept, not recomputed at once
        caches.append(x_in if p.checkpointing and i < L - 1 else c)
    rstd = rms_rstd(x, eps)
    norm_w = p.params["norm.weight"]
    xn = x * rstd
    xn *= norm_w
    out_name = output_weight_name(cfg)
    w_out = p.params[out_name]
    y = targets.reshape(-1)
    # The chain rule starts here: dloss = 1.0, and the loss divides by the batch's valid targets.
    # Frozen (LoRA), the output weight needs no gradient, so the logits, the step's largest array
    # (N, V), are never made whole: the softmax is accumulated over blocks of the vocabulary;
    # otherwise they are, for dW_out = dlogits^T xn.
    if frozen:
        block_rows = max(CLASSIFIER_MIN_BLOCK, CLASSIFIER_BLOCK_ELEMENTS // len(ids))
        loss, dxn = frozen_output_loss(xn, w_out, y, p.n_valid, block_rows)
    else:
        logits = xn @ w_out.T                                            # (N, D) -> (N, V)
        loss, dlogits = cross_entropy_in_place(logits, y, p.n_valid)
        dxn = dlogits @ w_out
        if cfg.tie_embeddings:
            dw_out = dlogits.T @ xn                                      # kept: the embedding adds into it
        else:
            p.sums.put((L, OUTPUT_SLOT), p.grads[out_name], shard, product(dlogits.T, xn))
        del logits, dlogits
    del xn
    dx, dnorm = rms_backward(dxn, x, rstd, norm_w)
    if not frozen:
        p.sums.put((L, NORM_SLOT), p.grads["norm.weight"], shard, value(dnorm))
    for i in reversed(range(L)):
        c = caches.pop()
        if p.checkpointing and i < L - 1:   # the same forward on the same input: the same cache, bit for bit
            _, c = block_forward(c, p.layers[i], rot, s, eps, block=p.block, keep_probs=p.keep_probs,
                                 lean=p.lean)
        dx = block_backward(dx, c, p.layers[i], s, rot, GradSink(p.sums, shard, i, None if frozen else p.dlayers[i]))
        del c
    if frozen:                              # the embedding is frozen too: nothing more to form
        return loss
    demb = p.grads["tok_embeddings.weight"]
    if cfg.tie_embeddings:                  # one matrix read twice: the output's term plus the embedding's
        p.sums.put((L, EMBEDDING_SLOT), demb, shard, value(add_rows(dw_out, ids, dx)))
    else:
        p.sums.put((L, EMBEDDING_SLOT), demb, shard, _embedding_term(ids, dx, cfg.vocab_size))
    return loss


def _embedding_term(ids, dx, vocab_size):
    """term(out) for dW (+)= the scatter-add of dx's rows into the rows ids (ops.embedding_backward)."""
    def term(out):
        if out is None:
            out = np.zeros((vocab_size, dx.shape[1]), dtype=dx.dtype)
        else:
            out.fill(0)
        return add_rows(out, ids, dx)
    return term


# ----------------------------------------------------------------------------- forward

class ForwardPass(NamedTuple):
    config: LlamaConfig
    params: dict
    layer: Callable          # i -> block i's StackedLayer
    rotations: Rotations
    kv_cache: object         # None, a DecodeCache or a KVCache
    start: int
    bias: np.ndarray | None  # (B, 1, T, S) additive: 0, or -inf where the mask forbids
    last_only: bool
    dtype: np.dtype


def forward(params: dict, config: LlamaConfig, rope, tokens, *, kv_cache=None, start_pos: int = 0, mask=None,
            lora=None, last_only: bool = False, workers=None) -> np.ndarray:
    """Logits of checked tokens (B, T): (B, T, V), or (B, V) of the last position when last_only.

    Arguments as npllama.model.forward; rope (cos, sin) sets the compute dtype; lora as in
    loss_and_grads. workers: threads sharing the batch rows (shards.resolve_workers); one when the
    weights must be copied per layer (a loaded or half-held model) or the cache is not a DecodeCache.
    A prefill into a DecodeCache of fewer rows than cores shares its positions between the
    cores instead (position_shards), when they are enough (POSITION_SHARD_MIN_MACS) and unless
    workers is given; a loaded model's per-layer copies are then made once for all of them
    (SharedLayers).
    """
    B, T = tokens.shape
    adapt_malloc_once()
    dtype = rope[0].dtype
    flat = stacked_views(params, config) is not None
    if lora is None:
        layer = block_layers(params, config, dtype, lazy=True)
    else:
        layers, _ = adapted_layers(block_layers(params, config, dtype), lora.params, config, lora.spec)
        layer = layers.__getitem__
    bias = None
    if mask is not None:
        bias = np.where(np.broadcast_to(mask, (B, T, start_pos + T)), 0.0, -np.inf).astype(dtype)[:, None]
    p = ForwardPass(config, params, layer,
                    rotations(rope[0][start_pos:start_pos + T], rope[1][start_pos:start_pos + T], config.head_dim),
                    kv_cache, start_pos, bias, last_only, dtype)
    shareable = (flat or lora is not None) and (kv_cache is None or isinstance(kv_cache, DecodeCache))
    small = tokens.size * config.dim < MIN_THREADED_ACTIVATIONS
    cores = available_cores()
    if isinstance(kv_cache, DecodeCache) and workers is None and B < cores and _shares_positions(config, T, cores):
        with blas_threads(1):           # a loaded model's stacked copies made once for every shard
            return _forward_by_positions(p, tokens, position_shards(config, start_pos, T, cores),
                                         share_layers=not shareable)
    workers = resolve_workers(workers if shareable else 1, B, T, config.dim)
    with blas_threads(1 if small else None):
        shards = run_sharded(lambda j, rows, x: _shard_forward(p, rows, x), workers, config.dim, tokens)
    return np.concatenate(shards)


def _shard_forward(p: ForwardPass, rows: slice, tokens, positions: slice = slice(None), written=None):
    """model.forward of one shard of rows (and of positions: all, or those of a position shard),
    keeping nothing: logits (b, T, V), or (b, V) when last_only (None for a position shard but
    the last). written(i): called once the shard has written layer i's keys and values."""
    cfg = p.config
    b, T = tokens.shape
    first, _, _ = positions.indices(p.rotations.k.shape[0])
    s = Shape(b, T, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden_dim)
    rot = Rotations(*(r[positions] for r in p.rotations))
    bias = None if p.bias is None else p.bias[rows][:, :, positions, :p.start + first + T]
    x = upcast(np.take(p.params["tok_embeddings.weight"], tokens.reshape(-1), axis=0), p.dtype)   # (N, D)
    for i in range(cfg.n_layers):
        kv = None if p.kv_cache is None else KV(p.kv_cache, i, rows, p.start + first,
                                                None if written is None else partial(written, i))
        x = block_forward(x, p.layer(i), rot, s, cfg.norm_eps, block=BLOCK, keep=False, kv=kv, bias=bias)
    if p.last_only:
        if first + T < p.rotations.k.shape[0]:
            return None                                                   # the last position is another shard's
        x = x.reshape(b, T, -1)[:, -1]                                    # (b, D): the last position's
    xn = x * rms_rstd(x, cfg.norm_eps)
    xn *= upcast(p.params["norm.weight"], p.dtype)
    logits = np.empty((xn.shape[0], cfg.vocab_size), dtype=p.dtype)
    linear_in_place(p.params[output_weight_name(cfg)], xn, logits)
    return logits if p.last_only else logits.reshape(b, T, -1)           # (b T, V) -> (b, T, V)


# ----------------------------------------------------------------------------- a prefill's positions in shards

class SharedLayers:
    """A lazy block_layers' layer(i) for the position shards of one forward: made by the first shard
    that takes it, handed to the others, dropped once all of them have it. The shards so share one
    stacked copy of a loaded model's layer, the same arrays one thread would make: the same GEMMs,
    so the same bits as an initialised model's flat stacks. The first shard waits before making
    layer i until the others have taken layer i - 2 (it never waits on their keys, so it could
    otherwise run ahead with every layer's copies alive): at most two layers' copies at a time.
    Measured at 110M, 512 positions (5 December 2026): 964-1,008 tokens/s against 822-903 for the
    whole prompt on one thread with two BLAS threads (an initialised model: 1,081)."""

    def __init__(self, layer: Callable, n_shards: int):
        self.layer = layer
        self.changed = threading.Condition()
        self.made: dict = {}                  # i -> [the layer, shards yet to take it]
        self.taken = [0] * n_shards           # per shard: how many layers it has taken
        self.running = n_shards

    def take(self, shard: int, i: int):
        """Layer i for `shard`, after layers 0 .. i - 1."""
        with self.changed:
            self.changed.wait_for(lambda: i in self.made or all(j >= i - 1 for j in self.made))
            entry = self.made.get(i)
            if entry is None:
                entry = self.made[i] = [self.layer(i), self.running]
            self.taken[shard] = i + 1
            self._hand_out(i)
            return entry[0]

    def done(self, shard: int) -> None:
        """The shard has ended, or failed: no layer waits for it any more."""
        with self.changed:
            self.running -= 1
            for i in [i for i in self.made if i >= self.taken[shard]]:
                self._hand_out(i)

    def _hand_out(self, i: int) -> None:
        self.made[i][1] -= 1
        if self.made[i][1] == 0:
            del self.made[i]
            self.changed.notify_all()


# The batched attention GEMMs (b * KVH of them, inner dimension Dh) run at about a third of the
# projections' FLOP rate (issue 18: 47 against 140 GFLOP/s a core): position_shards weighs their
# FLOPs so.
ATTENTION_FLOP_COST = 3.0


def _shares_positions(config: LlamaConfig, T: int, cores: int) -> bool:
    """Whether a prefill of T positions goes in position shards (POSITION_SHARD_MIN_MACS)."""
    return cores >= 2 and T >= cores * FEW_ROWS and T * config.n_params() >= cores * POSITION_SHARD_MIN_MACS


def position_shards(config: LlamaConfig, start: int, T: int, n: int) -> list[slice]:
    """T positions after `start` cached ones cut into up to n contiguous shards of about equal
    cost: a query at position P costs the block's projections plus attention over P + 1 keys."""
    D, H, KVH, Dh, F = config.dim, config.n_heads, config.n_kv_heads, config.head_dim, config.hidden_dim
    projections = 2 * (D * (H + 2 * KVH) * Dh + H * Dh * D + 3 * D * F)
    per_key = ATTENTION_FLOP_COST * 4 * H * Dh
    cost = np.cumsum(projections + per_key * (start + 1 + np.arange(T, dtype=np.float64)))
    bounds = np.searchsorted(cost, cost[-1] * np.arange(1, n) / n)
    edges = [0, *sorted(set(int(e) for e in bounds if 0 < e < T)), T]
    return [slice(lo, hi) for lo, hi in zip(edges[:-1], edges[1:])]


class PositionOrder:
    """The layers' keys and values of a prefill cut into position shards: the queries of shard j
    read the keys of every shard before it, so its layer i waits until those have written layer i."""

    def __init__(self, n_shards: int, n_layers: int):
        self.events = [[threading.Event() for _ in range(n_layers)] for _ in range(n_shards)]

    def written(self, shard: int, layer: int) -> None:
        """Shard `shard` has written `layer`: mark it, then wait for the earlier shards' writes of it."""
        self.events[shard][layer].set()
        for earlier in self.events[:shard]:
            earlier[layer].wait()

    def done(self, shard: int) -> None:
        """The shard has ended (or failed): nothing waits on it any more."""
        for event in self.events[shard]:
            event.set()


def _forward_by_positions(p: ForwardPass, tokens, shards: list[slice], share_layers: bool = False):
    """_shard_forward of every row, its positions cut into shards, one thread each (the first
    never waits; each later one waits in every layer for the earlier ones' keys and values).
    share_layers: p.layer makes copies, which the shards share (SharedLayers)."""
    order = PositionOrder(len(shards), p.config.n_layers)
    shared = SharedLayers(p.layer, len(shards)) if share_layers else None

    def run(j, positions):
        mine = p if shared is None else p._replace(layer=partial(shared.take, j))
        try:
            return _shard_forward(mine, slice(None), tokens[:, positions], positions, partial(order.written, j))
        finally:
            order.done(j)
            if shared is not None:
                shared.done(j)

    futures = [_executor(len(shards)).submit(run, j, positions) for j, positions in enumerate(shards)]
    logits = [f.result() for f in futures]
    return logits[-1] if p.last_only else np.concatenate(logits, axis=1)
