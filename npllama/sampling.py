"""Choosing the next token from logits: greedy, temperature, top-k, top-p, min-p, repetition penalty.

One call handles a whole batch, (B, V) logits -> (B,) ids, with no Python loop over the
vocabulary. The steps, in the order Hugging Face's logits processors apply them:

  1. repetition penalty (CTRL, Keskar et al. 2019; HF RepetitionPenaltyLogitsProcessor): for each
     token already seen in the row, z = z / r if z > 0 else z * r. r > 1 discourages repeats.
  2. temperature 0: return argmax z (greedy; the filters below never drop the argmax, so they
     cannot change it). Otherwise z = z / temperature and p = softmax(z).
  3. top-k: keep tokens whose z >= the k-th largest z (ties at the k-th value all stay, as in HF).
  4. top-p (nucleus, Holtzman et al. 2019): over the top-k survivors, renormalised, keep the smallest
     set of most probable tokens whose mass reaches top_p: token i stays iff the mass of tokens
     strictly more probable than i is < top_p. The most probable token always stays; tokens tied
     in probability are kept or dropped together, so the set does not depend on sort order.
  5. min-p (Nguyen et al. 2024): keep tokens with p_i >= min_p * max_j p_j. The ratio
     p_i / p_max = exp(z_i - z_max) does not depend on renormalisation, so it is computed on z.
  6. draw one token from p restricted to the kept set (renormalised), by inverse CDF with one
     uniform number per row, over the kept tokens in descending order of probability.

filtered_probs composes the three masks as written above (the definition, and what the tests
check against per-token loops); candidate_probs computes the same distribution from one sort
of a few candidates, and is what sampling uses.

Randomness comes only from the np.random.Generator passed in (or one per row), so a seed makes
every sample reproducible.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .checks import check_int, check_real
from .errors import NpllamaError


def check_sampling_args(temperature=0.0, top_k=None, top_p=None, min_p=None, repetition_penalty=None):
    """Validate sampling hyper-parameters (ValueError naming the bad one); None means "off"."""
    check_real("temperature", temperature, 0.0, hint="; 0 means greedy (argmax)")
    if top_k is not None:
        check_int("top_k", top_k, 1, hint=", or None to keep every token")
    if top_p is not None:
        check_real("top_p", top_p, 0.0, 1.0, low_open=True, hint="; None (or 1.0) keeps every token")
    if min_p is not None:
        check_real("min_p", min_p, 0.0, 1.0, hint="; None (or 0) keeps every token")
    if repetition_penalty is not None:
        check_real("repetition_penalty", repetition_penalty, 0.0, low_open=True,
                      hint="; 1.0 (or None) is no penalty, > 1 discourages repeats")


def apply_repetition_penalty(logits: np.ndarray, seen: np.ndarray, penalty: float) -> np.ndarray:
    """CTRL's penalty on already-seen tokens: z / r where z > 0, z * r where z <= 0.

    logits (B, V) float, seen (B, V) bool -> new (B, V) array (the input is not modified).
    """
    scaled = np.where(logits > 0, logits / penalty, logits * penalty)
    return np.where(seen, scaled, logits)


def softmax(z: np.ndarray) -> np.ndarray:
    """Row softmax, max-subtracted; -inf entries get probability 0. (B, V) -> (B, V)."""
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def top_k_mask(z: np.ndarray, k: int) -> np.ndarray:
    """Keep z_i >= the k-th largest z of the row (ties at that value kept). (B, V) -> bool (B, V)."""
    V = z.shape[-1]
    if k >= V:
        return np.ones(z.shape, dtype=bool)
    kth = -np.partition(-z, k - 1, axis=-1)[:, k - 1:k]  # (B, 1): the k-th largest value
    return z >= kth


def top_p_mask(probs: np.ndarray, p: float) -> np.ndarray:
    """Nucleus: keep i iff sum of probs strictly greater than probs_i is < p. (B, V) -> bool (B, V).

    Computed from one descending sort: the exclusive cumulative sum at the first member of each
    group of equal probabilities is the mass strictly above that group.
    """
    B, V = probs.shape
    order = np.argsort(-probs, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(probs, order, axis=-1)
    mass_before = np.cumsum(sorted_p, axis=-1) - sorted_p  # exclusive prefix sums, (B, V)
    mass_before[:, 0] = 0.0
    # Index of the first member of each tie group, carried forward along the sorted row.
    starts = np.ones((B, V), dtype=bool)
    starts[:, 1:] = sorted_p[:, 1:] != sorted_p[:, :-1]
    first = np.maximum.accumulate(np.where(starts, np.arange(V), 0), axis=-1)
    keep_sorted = np.take_along_axis(mass_before, first, axis=-1) < p
    keep = np.empty_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, axis=-1)
    return keep


def min_p_mask(z: np.ndarray, min_p: float) -> np.ndarray:
    """Keep p_i >= min_p * p_max, i.e. exp(z_i - z_max) >= min_p. (B, V) -> bool (B, V)."""
    return np.exp(z - z.max(axis=-1, keepdims=True)) >= min_p


def filtered_probs(logits: np.ndarray, temperature: float, top_k=None, top_p=None, min_p=None) -> np.ndarray:
    """Steps 2-5 for temperature > 0: the renormalised distribution the sample is drawn from
    (by definition; sample_next computes it with candidate_probs).

    logits (B, V) -> probs (B, V) float64, zero outside the kept set, rows summing to 1.
    """
    z = np.asarray(logits, dtype=np.float64)
    # Shift before dividing: every step is shift-invariant, and z_max = 0 keeps a tiny
    # temperature from turning logits into inf - inf = NaN.
    z = (z - z.max(axis=-1, keepdims=True)) / temperature
    keep = np.ones(z.shape, dtype=bool)
    if top_k is not None:
        keep &= top_k_mask(z, int(top_k))
    if top_p is not None and top_p < 1.0:
        keep &= top_p_mask(softmax(np.where(keep, z, -np.inf)), top_p)
    if min_p is not None and min_p > 0.0:
        keep &= min_p_mask(z, min_p)
    return softmax(np.where(keep, z, -np.inf))


def candidate_probs(logits: np.ndarray, temperature: float, top_k=None, top_p=None, min_p=None):
    """filtered_probs computed the fast way: over a few candidate ids per row, from one sort.

    Returns probs (B, m) and ids (B, m) int64: filtered_probs(...)[b, ids[b, j]] == probs[b, j],
    and filtered_probs is 0 off ids[b]. With top_k, the candidates are each row's m highest
    logits (m = k, or the largest kept count when the k-th value is tied), found by
    np.argpartition in O(V); nothing of size V is sorted (V is 32000 for Llama 2). Only top-p
    sorts, and only the candidates. With e = exp(z - z_max) = p / p_max: top-k keeps z >= the
    k-th value, top-p keeps a token when the e-mass strictly above it (read at the first member
    of its tie group) is < top_p * sum(e over the top-k survivors), min-p keeps e >= min_p.
    """
    z = np.asarray(logits, dtype=np.float64)
    z = (z - z.max(axis=-1, keepdims=True)) / temperature             # row max 0 (see filtered_probs)
    B, V = z.shape
    rows = np.arange(B)[:, None]
    ids = np.broadcast_to(np.arange(V), (B, V))
    kth = None
    if top_k is not None and top_k < V:
        top = np.argpartition(-z, top_k - 1, axis=-1)                  # (B, V), k largest first
        kth = z[rows, top[:, top_k - 1:top_k]]                         # (B, 1) the k-th largest value
        m = int((z >= kth).sum(axis=-1).max())                         # > k only with ties at the k-th
        if m < V:
            ids = top[:, :top_k] if m == top_k else np.argpartition(-z, m - 1, axis=-1)[:, :m]
            z = z[rows, ids]                                           # (B, V) -> (B, m)
    if top_p is not None and top_p < 1.0:
        order = np.argsort(-z, axis=-1, kind="stable")                # top-p needs them sorted
        z, ids = z[rows, order], ids[rows, order]                      # descending; z[:, 0] = 0
    e = np.exp(z)                                                      # p / p_max
    keep = np.ones(z.shape, dtype=bool) if kth is None else z >= kth
    if top_p is not None and top_p < 1.0:
        e_k = np.where(keep, e, 0.0)
        mass = np.cumsum(e_k, axis=-1)
        starts = np.ones(z.shape, dtype=bool)                          # first member of a tie group
        np.not_equal(e_k[:, 1:], e_k[:, :-1], out=starts[:, 1:])
        first = np.maximum.accumulate(np.where(starts, np.arange(z.shape[1]), 0), axis=-1)
        above = np.take_along_axis(mass - e_k, first, axis=-1)        # mass strictly more probable
        keep &= above < top_p * mass[:, -1:]
    if min_p is not None and min_p > 0.0:
        keep &= e >= min_p
    probs = np.where(keep, e, 0.0)
    probs /= probs.sum(axis=-1, keepdims=True)
    return probs, ids


def sample_next(logits: np.ndarray, temperature: float = 0.0, top_k: int | None = None,
                top_p: float | None = None, min_p: float | None = None,
                repetition_penalty: float | None = None, seen: np.ndarray | None = None,
                rng: np.random.Generator | Sequence[np.random.Generator] | None = None) -> np.ndarray:
    """The next token of each row. logits (B, V) -> ids (B,) int64.

    temperature 0 is greedy (argmax, first index on ties; no randomness used). Otherwise the
    token is drawn from filtered_probs(...) (computed by candidate_probs) with one uniform
    number per row, taken from `rng`
    (a Generator shared by the rows, in row order) or from rng[b] for row b when a sequence of
    B Generators is given (so a row's samples do not depend on the other rows).
    seen: (B, V) bool, the tokens the repetition penalty applies to (prompt and output so far).
    """
    logits = np.asarray(logits)
    if logits.ndim != 2 or logits.shape[1] < 1 or not np.issubdtype(logits.dtype, np.floating):
        raise NpllamaError(f"logits must be a float array of shape (B, V), got {logits.dtype} {logits.shape}")
    if np.isnan(logits).any() or np.isposinf(logits).any():
        raise NpllamaError("logits contain NaN or +inf; the model's forward diverged (check the weights and dtype)")
    if not np.isfinite(logits).any(axis=-1).all():
        raise NpllamaError("a row of logits is all -inf: there is no token to choose")
    check_sampling_args(temperature, top_k, top_p, min_p, repetition_penalty)
    B, V = logits.shape
    if repetition_penalty is not None and repetition_penalty != 1.0:
        if seen is None:
            raise NpllamaError("repetition_penalty needs `seen`, a (B, V) bool mask of the tokens seen so far")
        seen = np.asarray(seen)
        if seen.shape != (B, V) or seen.dtype != bool:
            raise NpllamaError(f"seen must be a bool array of shape {(B, V)}, got {seen.dtype} {seen.shape}")
    if temperature != 0:
        if rng is None:
            raise NpllamaError("sampling with temperature > 0 needs rng, an np.random.Generator "
                             "(np.random.default_rng(seed)), or use temperature=0 for greedy decoding")
        if not isinstance(rng, np.random.Generator) and (
                len(rng) != B or not all(isinstance(g, np.random.Generator) for g in rng)):
            raise NpllamaError(f"rng must be an np.random.Generator or a sequence of {B} of them (one per row)")
    return choose_next(logits, temperature, top_k, top_p, min_p, repetition_penalty, seen, rng)


def choose_next(logits, temperature, top_k, top_p, min_p, repetition_penalty, seen, rng) -> np.ndarray:
    """sample_next without the argument checks, for a decoding loop that checked them once."""
    B = logits.shape[0]
    if repetition_penalty is not None and repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, seen, float(repetition_penalty))
    if temperature == 0:
        return logits.argmax(axis=-1).astype(np.int64, copy=False)   # the method: 1 us less a step than np.argmax
    if isinstance(rng, np.random.Generator):
        u = rng.random(B)
    else:
        u = np.array([g.random() for g in rng])
    probs, ids = candidate_probs(logits, temperature, top_k, top_p, min_p)
    cdf = np.cumsum(probs, axis=-1)
    # First index whose cdf exceeds u * total: never a zero-probability token, since its cdf
    # equals its predecessor's; and one exists because u < 1.
    j = np.argmax(cdf > (u * cdf[:, -1])[:, None], axis=-1)
    return ids[np.arange(B), j].astype(np.int64)
