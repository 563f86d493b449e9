"""The engine's whole-model passes: npllama.model.forward / loss_and_grads, sharded and stacked.

    logits = forward(params, config, rope, tokens)                      # (B, T) -> (B, T, V)
    loss, grads = loss_and_grads(params, config, rope, tokens, targets)  # grads keyed like params

The batch is cut into shards run on one thread per core (engine.shards); each shard runs the
reference's model-level arithmetic (npllama.model.forward / loss_and_grads) with the engine's
stacked blocks (engine.block). Each shard's loss is divided by the whole batch's target count,
so the shards' losses and gradients add up to the full batch's exactly, up to rounding.
tests/engine/ checks both passes against the reference (1e-10, float64).
"""

from __future__ import annotations

import numpy as np

from .. import model
from ..config import LlamaConfig
from ..kvcache import KVCache
from ..ops import IGNORE_INDEX
from .block import block_backward, block_forward
from .layout import stacked_views
from .inference import forward as forward_without_grad
from .shards import resolve_workers, run_sharded
from .stacked import stack_layers
from .upcast import has_half
from ..errors import NpllamaError


def stacked_blocks(params: dict, config: LlamaConfig) -> model.Blocks:
    """The blocks as the engine runs them: weights stacked once, for every shard and layer call
    (views, when the parameters are views of one flat array as npllama.Llama keeps them)."""
    layers = stacked_views(params, config) or stack_layers(params, config)
    return model.Blocks(layers, block_forward, block_backward)


def forward(params: dict, config: LlamaConfig, rope, tokens, *, kv_cache: KVCache | None = None,
            start_pos: int = 0, mask=None, workers=None, blocks: model.Blocks | None = None) -> np.ndarray:
    """Logits (B, T, V) of checked tokens (B, T); arguments as npllama.model.forward.

    workers: threads sharing the batch rows (engine.shards.resolve_workers); used without a
    cache or mask only, since a KV cache is written by position for the whole batch. Without
    `blocks`, with a cache or mask, or weights held in float16 / bfloat16, the pass is
    engine.inference.forward.
    blocks: the blocks to run, by default stacked_blocks(params, config) (LoRA: engine/lora.py).
    """
    if blocks is None and (kv_cache is not None or mask is not None or has_half(params)):
        # nothing to differentiate here: one layer's weights and activations at a time (engine.inference)
        return forward_without_grad(params, config, rope, tokens, kv_cache=kv_cache, start_pos=start_pos,
                                    mask=mask)
    blocks = stacked_blocks(params, config) if blocks is None else blocks
    if kv_cache is not None or mask is not None:
        return model.forward(params, config, tokens, rope=rope, kv_cache=kv_cache, start_pos=start_pos,
                             mask=mask, blocks=blocks)[0]
    workers = resolve_workers(workers, *tokens.shape, config.dim)
    shards = run_sharded(lambda x: model.forward(params, config, x, rope=rope, blocks=blocks)[0],
                         workers, config.dim, tokens)
    return np.concatenate(shards)


def loss_and_grads(params: dict, config: LlamaConfig, rope, tokens, targets, *, workers=None,
                   blocks: model.Blocks | None = None, frozen: bool = False):
    """Mean cross-entropy of checked tokens and targets (B, T) and every parameter's gradient.

    workers: threads sharing contiguous shards of the batch rows (default: one per core, at
    most B; one for small steps). The result depends on `workers` only through rounding; pass
    workers=1 for sums in one order on every machine.
    blocks, frozen: as in npllama.model.loss_and_grads (LoRA: engine/lora.py passes its adapted
    blocks and frozen=True, and gets the adapters' gradients).
    """
    n_valid = int(np.count_nonzero(targets != IGNORE_INDEX))
    if n_valid == 0:
        raise NpllamaError("every target is -100 (ignored): the mean cross-entropy has no terms")
    workers = resolve_workers(workers, *tokens.shape, config.dim)
    blocks = stacked_blocks(params, config) if blocks is None else blocks
    results = run_sharded(
        lambda x, y: model.loss_and_grads(params, config, x, y, rope=rope, normalizer=n_valid, blocks=blocks,
                                          frozen=frozen),
        workers, config.dim, tokens, targets)
    loss, grads = results[0]
    for shard_loss, shard_grads in results[1:]:         # the batch's gradient is the shards' sum
        loss += shard_loss
        for name, g in shard_grads.items():
            grads[name] += g
    return loss, grads
