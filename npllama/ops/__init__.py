"""The ops of a LLaMA-2 block, each a pure forward/backward pair.

Every op has the signature

    y, cache = op_forward(x, *params, *, hyper)      dx, *dparams = op_backward(dy, cache)

Backward returns fresh arrays in the order of the forward's array arguments and never writes
into its inputs; where one value feeds several places (residual stream, GQA groups, tied
embeddings) the model sums the gradients explicitly. Each cache is a small NamedTuple holding
only what backward needs.

Shape notation, used in every docstring and comment:

    B   batch                       H    n_heads (query heads)
    T   query positions             KVH  n_kv_heads (key/value heads)
    S   key positions (cache + T)   R    n_rep = H // KVH (query heads per key/value head)
    D   dim (residual width)        Dh   head_dim = D // H
    F   hidden_dim (SwiGLU width)   V    vocab_size
    L   n_layers                    N    B * T (flattened positions)
"""

from .attention import attention_backward, attention_forward, causal_mask
from .cross_entropy import IGNORE_INDEX, NoTargetsError, count_valid, cross_entropy_backward, cross_entropy_forward
from .embedding import embedding_backward, embedding_forward
from .linear import linear_backward, linear_forward
from .lora import LoraCache, lora_backward, lora_forward
from .rmsnorm import rmsnorm_backward, rmsnorm_forward
from .rope import rope_backward, rope_forward, rope_frequencies, rope_tables
from .swiglu import swiglu_backward, swiglu_forward

__all__ = [
    "attention_forward", "attention_backward", "causal_mask",
    "cross_entropy_forward", "cross_entropy_backward", "IGNORE_INDEX", "NoTargetsError", "count_valid",
    "embedding_forward", "embedding_backward",
    "linear_forward", "linear_backward",
    "lora_forward", "lora_backward", "LoraCache",
    "rmsnorm_forward", "rmsnorm_backward",
    "rope_frequencies", "rope_tables", "rope_forward", "rope_backward",
    "swiglu_forward", "swiglu_backward",
]
