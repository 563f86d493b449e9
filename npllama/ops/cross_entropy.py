"""Softmax cross-entropy over the vocabulary, fused and stable, with ignored targets.

    loss = (1 / n) * sum over valid (b, t) of [ logsumexp(z[b, t]) - z[b, t, y[b, t]] ]

where z are the logits, y the targets, and n the number of targets that are not -100
(PyTorch's ignore_index). logsumexp is shifted by the row max, so no exp overflows and no
log(probability) ever underflows to log(0).
"""

from typing import NamedTuple

import numpy as np
from ..errors import NpllamaError

IGNORE_INDEX = -100


class NoTargetsError(NpllamaError):
    """Every target of a batch is IGNORE_INDEX: a mean over no terms."""


class CrossEntropyCache(NamedTuple):
    logits: np.ndarray       # (N, V), a reference to the forward's input (no copy)
    lse: np.ndarray          # (N, 1) logsumexp of each row, in the compute dtype
    targets: np.ndarray      # (N,) with ignored rows set to 0 (a valid index for the gather)
    valid: np.ndarray        # (N,) bool
    n_valid: int             # n, the count the summed loss is divided by
    shape: tuple             # the logits' original shape, (B, T, V)


def count_valid(targets) -> int:
    """n, the number of targets that are not IGNORE_INDEX; NoTargetsError when there is none."""
    n_valid = int(np.count_nonzero(np.asarray(targets) != IGNORE_INDEX))
    if n_valid == 0:
        raise NoTargetsError("every target is -100 (ignored): the mean cross-entropy has no terms")
    return n_valid


def cross_entropy_forward(logits, targets):
    """Mean cross-entropy of the targets that are not IGNORE_INDEX.

    Inputs:  logits (B, T, V) or (N, V); targets (B, T) or (N,) integers in [0, V) or -100
    Returns: loss, a python float; cache (logits, logsumexp, targets, valid mask, n).
             The softmax is recomputed from the cached logsumexp in backward rather than cached:
             an (N, V) array saved for one exp.
    """
    shape = logits.shape
    V = shape[-1]
    z = logits.reshape(-1, V)                                    # (B, T, V) -> (N, V)
    targets = targets.reshape(-1)
    valid = targets != IGNORE_INDEX
    n_valid = count_valid(targets)
    safe_targets = np.where(valid, targets, 0)
    zc = z.astype(np.result_type(z.dtype, np.float32), copy=False)
    row_max = zc.max(axis=-1, keepdims=True)
    shifted = zc - row_max
    np.exp(shifted, out=shifted)                                 # in place: one (N, V) temporary, not two
    lse = row_max + np.log(shifted.sum(axis=-1, keepdims=True))
    picked = zc[np.arange(len(zc)), safe_targets]
    losses = (lse[:, 0] - picked)[valid]
    loss = float(losses.sum(dtype=np.float64) / n_valid)
    return loss, CrossEntropyCache(z, lse, safe_targets, valid, n_valid, shape)


def cross_entropy_backward(dloss, cache):
    """dz = dloss * (softmax(z) - onehot(y)) / n on valid rows, 0 on ignored rows.

    Inputs:  dloss, a scalar (1.0 when the loss is the objective)
    Returns: dlogits with the logits' shape, (B, T, V) or (N, V)
    """
    z, lse, targets, valid, n_valid, shape = cache
    dz = z - lse.astype(z.dtype, copy=False)
    np.exp(dz, out=dz)                                           # softmax, (N, V), computed in place
    dz[np.arange(len(dz)), targets] -= 1.0
    dz *= (valid * (dloss / n_valid)).astype(dz.dtype)[:, None]   # ignored rows -> 0
    return dz.reshape(shape)
