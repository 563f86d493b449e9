"""Token embedding: a row lookup, y[b, t] = W[ids[b, t]].

Its backward is a scatter-add: every row of dy is added into the row of dW its token chose,
so a token that appears n times receives the sum of n gradient rows. `dW[ids] += dy` would
keep only one of them (NumPy's fancy-index assignment writes each repeated index once);
np.add.at accumulates every occurrence.
"""

from typing import NamedTuple

import numpy as np


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
    dy = dy.reshape(len(ids), -1)                               # (B, T, D) -> (N, D)
    dweight = np.zeros((cache.vocab_size, dy.shape[1]), dtype=cache.dtype)
    np.add.at(dweight, ids, dy)                                 # repeated ids: every row summed
    return dweight
