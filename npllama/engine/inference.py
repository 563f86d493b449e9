"""The forward pass when nothing will be differentiated: a prefill, or a model held in float16.

    logits = forward(params, config, rope, tokens, kv_cache=kv, start_pos=0, mask=None)  # (B, T, V)
    logits = forward(..., last_only=True)                                                # (B, V)

Equal, up to rounding, to npllama.model.forward(params, config, tokens, ...)[0] (tests/engine/
checks 1e-10 in float64), with the engine's stacked blocks (engine.block), and three savings
that a pass without backward allows:
  - each block's activations are dropped once the next block has its input (model.forward keeps
    them all for loss_and_grads: at 512 positions of a 7B model, about 5 GB);
  - each block's weights are stacked, and upcast when held in float16 / bfloat16, just before
    it runs, and dropped after: the pass holds one layer's float32 copy, never the model's;
  - last_only computes the logits of the last position only, all that generation reads (the
    classifier over all 512 positions of a 110M prefill is a fifth of its work).
"""

from __future__ import annotations

import numpy as np

from ..config import LlamaConfig
from ..kvcache import KVCache
from ..model import layer_weights, output_weight_name
from ..ops import rmsnorm_forward
from .blas import blas_threads
from .block import block_forward
from .layout import stacked_views
from .projections import ChunkedHalfLinear, linear_in_place
from .stacked import stack_layer
from .upcast import float_params, upcast

# Below this many activations (B * T * D) the GEMMs are small, and a second BLAS thread costs more
# than it saves, ruinously so on a busy machine (an 8-token prompt of an 8M model: 9 ms a GEMM on
# two threads under load, against well under 1 ms on one). Longer prompts keep the process's count.
MIN_THREADED_ACTIVATIONS = 1 << 16


def forward(params: dict, config: LlamaConfig, rope, tokens, *, kv_cache: KVCache | None = None,
            start_pos: int = 0, mask=None, last_only: bool = False) -> np.ndarray:
    """Logits of checked tokens (B, T): (B, T, V), or (B, V) of the last position when last_only.

    Arguments as npllama.model.forward; rope (cos, sin) sets the compute dtype.
    """
    small = tokens.size * config.dim < MIN_THREADED_ACTIVATIONS
    with blas_threads(1 if small else None):
        return _forward(params, config, rope, tokens, kv_cache, start_pos, mask, last_only)


def _forward(params, config, rope, tokens, kv_cache, start_pos, mask, last_only):
    dtype = rope[0].dtype
    floats = float_params(params, dtype)                   # half-held arrays upcast as they are read
    B, T = tokens.shape
    cos, sin = (table[start_pos:start_pos + T] for table in rope)             # (T, Dh/2)
    x = upcast(params["tok_embeddings.weight"].take(tokens, axis=0), dtype)   # (B, T) -> (B, T, D)
    views = stacked_views(params, config)      # npllama.Llama's flat array: its stacks are views
    for i in range(config.n_layers):
        kv = None if kv_cache is None else (kv_cache, i)
        layer = views[i] if views else stack_layer(layer_weights(floats, i))  # else one layer's copies at a time
        x, _ = block_forward(x, layer, cos, sin, eps=config.norm_eps, kv=kv, start_pos=start_pos, mask=mask)
    if last_only:
        x = x[:, -1:]
    xn, _ = rmsnorm_forward(x, floats["norm.weight"], config.norm_eps)
    rows = xn.reshape(-1, config.dim)                                          # (B, T', D) -> (B T', D)
    logits = np.empty((rows.shape[0], config.vocab_size), dtype=dtype)
    linear_in_place(params[output_weight_name(config)], rows, logits, ChunkedHalfLinear(config.dim, dtype))
    return logits.reshape(B, -1) if last_only else logits.reshape(B, T, -1)    # (B T', V) -> (B, V) | (B, T, V)
