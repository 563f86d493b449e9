"""KVCache: the keys and values of past positions, kept so decoding computes one token a step.

The one intentional piece of model state in npllama, owned by whoever generates. Preallocated
once for max_seq_len, so a step writes into it rather than growing (and copying) arrays.
"""

import numpy as np
from .errors import NpllamaError


class KVCache:
    """Keys and values of every layer: k, v (L, B, KVH, max_seq_len, Dh).

    Positions [0, length) hold valid entries. A forward with start_pos = p appends positions
    p .. p + T - 1 to every layer (append) and attends to 0 .. p + T - 1. The engine keeps a
    subclass with another storage layout (npllama.engine.cache.DecodeCache); append hides it.
    """

    def __init__(self, n_layers, batch_size, n_kv_heads, max_seq_len, head_dim, dtype=np.float32):
        if batch_size < 1:
            raise NpllamaError(f"batch_size={batch_size} must be >= 1")
        shape = (n_layers, batch_size, n_kv_heads, max_seq_len, head_dim)
        self.k = np.zeros(shape, dtype=dtype)
        self.v = np.zeros(shape, dtype=dtype)
        self.length = 0

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def positions(self) -> int:
        """The positions it holds (max_seq_len, or fewer for a generation's cache)."""
        return self.v.shape[3]

    def append(self, layer: int, k, v, start_pos: int):
        """Write one layer's new keys and values at start_pos and return every position so far.

        k, v: (B, KVH, T, Dh). Returns k, v (B, KVH, S, Dh) with S = start_pos + T, views of the cache.
        """
        end = start_pos + k.shape[2]
        self.k[layer, :, :, start_pos:end] = k
        self.v[layer, :, :, start_pos:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]
