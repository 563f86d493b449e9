"""Token embedding: a row lookup, y[b, t] = W[ids[b, t]].

Its backward is a scatter-add: every row of dy is added into the row of dW its token chose,
so a token that appears n times receives the sum of n gradient rows. `dW[ids] += dy` would
keep only one of them; we sum exactly, by a one-hot matmul for small vocabularies and a
sort + segmented sum for large ones (both faster than np.add.at).
"""

from typing import NamedTuple

import numpy as np

# Above this many one-hot entries (V * N) the dense matmul costs more than sorting the ids.
_ONE_HOT_LIMIT = 1 << 22


class EmbeddingCache(NamedTuple):
    ids: np.ndarray          # (B, T) int
    vocab_size: int
    dtype: np.dtype


def embedding_forward(ids, weight):
    """y = weight[ids].

    Inputs:  ids (B, T) integers in [0, V); weight (V, D)
    Returns: y (B, T, D), cache (ids, V, dtype) — backward needs only which rows were read.
    """
    return weight[ids], EmbeddingCache(ids, weight.shape[0], weight.dtype)


def embedding_backward(dy, cache):
    """dW[v] = sum of dy[b, t] over every (b, t) with ids[b, t] == v; rows of unused tokens are 0.

    Inputs:  dy (B, T, D)
    Returns: dweight (V, D). (ids are integers: they have no gradient.)
    """
    ids = cache.ids.reshape(-1)                                 # (B, T) -> (N,)
    dy = dy.reshape(len(ids), -1).astype(cache.dtype, copy=False)   # (B, T, D) -> (N, D)
    V, N = cache.vocab_size, len(ids)
    if V * N <= _ONE_HOT_LIMIT:
        one_hot = np.zeros((V, N), dtype=dy.dtype)
        one_hot[ids, np.arange(N)] = 1
        return one_hot @ dy                                     # (V, N) @ (N, D) -> (V, D)
    # Sort so equal ids are adjacent, then sum each run of equal ids in one reduceat.
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    run_starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
    dweight = np.zeros((V, dy.shape[1]), dtype=dy.dtype)
    dweight[sorted_ids[run_starts]] = np.add.reduceat(dy[order], run_starts, axis=0)
    return dweight
