"""DecodeCache: the engine's KV cache, a KVCache stored as its decode step reads it fastest.

    k  (L, B, KVH, max_seq_len, Dh)       keys by position: a step's scores = q @ k.T
       (L, B, KVH, Dh, max_seq_len)       or transposed (keys_transposed): scores = q @ k, for tiny heads
    v  (L, B, KVH, max_seq_len, Dh + 1)   values and a column of ones, so e @ v gives both
                                           sum_s e_s v_s and the softmax denominator sum_s e_s
    k_at, v_at  (L, max_seq_len, B, KVH, Dh)   views of k and of v without its ones, position first:
                                           where a decode step writes its position

The keys' layout is chosen by the size of a step's q, B KVH Dh (TRANSPOSED_KEYS_MAX). The ones
column saved 1.1 us a layer per decode step at dim 64. The prefill's blocks
(engine/block.py) write it by batch rows through `write`, which hands back k and [v | 1] as
block-causal attention reads them; `append` keeps the KVCache interface, so anything written
for a KVCache reads and writes it too (tests/test_backends.py checks the two equal).
"""

from __future__ import annotations

import numpy as np

from ..errors import NpllamaError
from ..kvcache import KVCache
from .helper import shared_zeros


# Keys are stored transposed when a step's q has at most this many numbers (B KVH Dh). NumPy's
# batched matmul runs q @ k over keys by position as one BLAS call a head that reads k's rows
# whole; over transposed keys each call reads Dh strided pieces of S numbers. Measured a layer's
# scores (5 December 2026, Xeon, one thread): stories260K's 4 x 2 heads of 8 (batch 1) 1.4 us
# transposed against 2.7 by position; 110M's 12 heads of 64 at 130 positions, batch 1 21 us
# against 7.5, batch 8 202 against 107; 8M's 6 heads of 48, batch 1 level (2.6 against 2.8),
# batch 4 18 against 7, batch 8 63 against 17.
TRANSPOSED_KEYS_MAX = 256


class DecodeCache(KVCache):
    """Keys and values of every layer, in the decode step's layout (module docstring)."""

    def __init__(self, n_layers, batch_size, n_kv_heads, max_seq_len, head_dim, dtype=np.float32,
                 shared: bool = False):
        """shared: keys and values in memory a process forked later sees (helper.shared_zeros), for a
        decode step whose helper process attends with half of the heads (engine/decode.py)."""
        if batch_size < 1:
            raise NpllamaError(f"batch_size={batch_size} must be >= 1")
        self.keys_transposed = batch_size * n_kv_heads * head_dim <= TRANSPOSED_KEYS_MAX
        self.shared = shared
        zeros = shared_zeros if shared else np.zeros
        shape = (head_dim, max_seq_len) if self.keys_transposed else (max_seq_len, head_dim)
        self.k = zeros((n_layers, batch_size, n_kv_heads, *shape), dtype=dtype)
        self.v = zeros((n_layers, batch_size, n_kv_heads, max_seq_len, head_dim + 1), dtype=dtype)
        self.v[..., head_dim] = 1.0
        # The same keys and values (without the ones) with the position first, (L, max_seq_len, B,
        # KVH, Dh): a decode step writes its position with one integer index, 0.3 us against 0.55
        # for the 4-D slice (k[layer][:, :, :, pos]), twice a layer.
        self.k_at = np.moveaxis(self.k, 4 if self.keys_transposed else 3, 1)
        self.v_at = np.moveaxis(self.v[..., :head_dim], 3, 1)
        self.length = 0

    @classmethod
    def for_config(cls, config, batch_size: int, dtype, positions: int | None = None,
                   shared: bool = False) -> DecodeCache:
        """A cache for config's model: batch_size rows of `positions` (default max_seq_len)."""
        return cls(config.n_layers, batch_size, config.n_kv_heads, config.cache_positions(positions), config.head_dim,
                   dtype, shared)

    def write(self, layer: int, rows: slice, start: int, k, v):
        """Store k, v (b, KVH, T, Dh) of batch rows `rows` at positions start .. start + T - 1.

        Returns every position so far of those rows: k (b, KVH, S, Dh) and v1 = [v | 1]
        (b, KVH, S, Dh + 1), views of the cache, S = start + T.
        """
        end = start + k.shape[2]
        Dh = k.shape[3]
        self.v[layer, rows, :, start:end, :Dh] = v
        if self.keys_transposed:
            self.k[layer, rows, :, :, start:end] = k.swapaxes(-1, -2)
            return self.k[layer, rows, :, :, :end].swapaxes(-1, -2), self.v[layer, rows, :, :end]
        self.k[layer, rows, :, start:end] = k
        return self.k[layer, rows, :, :end], self.v[layer, rows, :, :end]

    def append(self, layer: int, k, v, start_pos: int):
        """KVCache.append: write every row's k, v (B, KVH, T, Dh); return k, v (B, KVH, S, Dh) views."""
        k_all, v1 = self.write(layer, slice(None), start_pos, k, v)
        return k_all, v1[..., :k.shape[3]]
