"""Sampling: the kept sets of top-k / top-p / min-p against naive per-token definitions, greedy,
seeded reproducibility, the drawn frequencies, the repetition penalty, and argument validation.

Hypothesis draws shapes, seeds and hyper-parameters; logit values come from rng.standard_normal,
sometimes rounded so that ties occur.
"""

import math

import numpy as np
import pytest
from hypothesis import assume, given, strategies as st

from npllama.sampling import (apply_repetition_penalty, candidate_probs, filtered_probs, min_p_mask,
                              sample_next, softmax, top_k_mask, top_p_mask)


@st.composite
def logits_batches(draw, max_v=40):
    B = draw(st.integers(1, 4))
    V = draw(st.integers(1, max_v))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    z = rng.standard_normal((B, V)) * draw(st.sampled_from([0.3, 1.0, 4.0]))
    if draw(st.booleans()):
        z = np.round(z)  # ties, including ties at the k-th value and in probability
    return z


def naive_softmax(row):
    m = max(row)
    e = [math.exp(x - m) for x in row]
    s = math.fsum(e)
    return [x / s for x in e]


def naive_top_k(row, k):
    kth = sorted(row, reverse=True)[min(k, len(row)) - 1]
    return [x >= kth for x in row]


def naive_top_p(probs, p):
    """Smallest set of most probable tokens reaching mass p, ties kept together."""
    above = [math.fsum(q for q in probs if q > pi) for pi in probs]
    assume(all(abs(a - p) > 1e-9 for a in above))  # exactly on the boundary, float order decides
    return [a < p for a in above]


def naive_min_p(row, min_p):
    m = max(row)
    ratios = [math.exp(x - m) for x in row]
    assume(all(abs(r - min_p) > 1e-12 for r in ratios))
    return [r >= min_p for r in ratios]


@given(z=logits_batches(), k=st.integers(1, 45))
def test_top_k_keeps_exactly_the_k_largest_and_their_ties(z, k):
    keep = top_k_mask(z, k)
    for row, kept in zip(z, keep):
        assert kept.tolist() == naive_top_k(row.tolist(), k)
        assert kept.sum() >= min(k, len(row))
        assert kept[np.argmax(row)]


@given(z=logits_batches(), p=st.floats(1e-6, 1.0))
def test_top_p_keeps_the_smallest_prefix_reaching_p(z, p):
    probs = softmax(z)
    keep = top_p_mask(probs, p)
    for row, kept in zip(probs, keep):
        expected = naive_top_p(row.tolist(), p)
        assert kept.tolist() == expected
        assert kept.any() and kept[np.argmax(row)]
        # reaches p (up to rounding), and dropping the least probable kept group falls short of p
        assert row[kept].sum() >= p - 1e-12
        least = row[kept].min()
        assert row[kept & (row > least)].sum() < p


@given(z=logits_batches(), min_p=st.floats(0.0, 1.0))
def test_min_p_keeps_tokens_within_a_factor_of_the_max(z, min_p):
    keep = min_p_mask(z, min_p)
    for row, kept in zip(z, keep):
        assert kept.tolist() == naive_min_p(row.tolist(), min_p)
        assert kept[np.argmax(row)]


@given(z=logits_batches(), temperature=st.sampled_from([0.5, 1.0, 1.7]),
       k=st.one_of(st.none(), st.integers(1, 45)), p=st.one_of(st.none(), st.floats(1e-3, 1.0)),
       min_p=st.one_of(st.none(), st.floats(0.0, 0.9)))
def test_filters_compose_in_order_and_renormalise(z, temperature, k, p, min_p):
    """Kept set = top-k, then top-p over the renormalised top-k survivors, then min-p."""
    probs = filtered_probs(z, temperature, top_k=k, top_p=p, min_p=min_p)
    for row, out in zip(z / temperature, probs):
        row = row.tolist()
        kept = [True] * len(row)
        if k is not None:
            kept = naive_top_k(row, k)
        if p is not None and p < 1.0:
            renorm = naive_softmax([x if kk else -math.inf for x, kk in zip(row, kept)])
            kept = [a and b for a, b in zip(kept, naive_top_p(renorm, p))]
        if min_p:
            kept = [a and b for a, b in zip(kept, naive_min_p(row, min_p))]
        assert (out > 0).tolist() == kept
        assert math.isclose(out.sum(), 1.0, rel_tol=1e-12)
        expected = naive_softmax([x if kk else -math.inf for x, kk in zip(row, kept)])
        np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-300)
    # the fast path sampling uses: the same distribution over its candidates, zero elsewhere
    cand, ids = candidate_probs(z, temperature, top_k=k, top_p=p, min_p=min_p)
    scattered = np.zeros_like(probs)
    np.put_along_axis(scattered, ids, cand, axis=-1)
    assert ((scattered > 0) == (probs > 0)).all()
    np.testing.assert_allclose(scattered, probs, rtol=1e-12, atol=1e-300)
    assert all(len(set(row)) == len(row) for row in ids.tolist())   # each candidate once


@given(z=logits_batches(), seed=st.integers(0, 2**32 - 1))
def test_temperature_zero_is_argmax_and_uses_no_randomness(z, seed):
    rng = np.random.default_rng(seed)
    ids = sample_next(z, temperature=0.0, top_k=3, top_p=0.5, min_p=0.2, rng=rng)
    assert ids.dtype == np.int64 and ids.tolist() == np.argmax(z, axis=-1).tolist()
    assert rng.random() == np.random.default_rng(seed).random()  # the generator was not advanced
    assert sample_next(z).tolist() == ids.tolist()                # and none is needed


@given(z=logits_batches(), seed=st.integers(0, 2**32 - 1), temperature=st.floats(0.05, 5.0))
def test_top_k_one_is_greedy(z, seed, temperature):
    assume(all((row == row.max()).sum() == 1 for row in z))  # a unique maximum per row
    ids = sample_next(z, temperature=temperature, top_k=1, rng=np.random.default_rng(seed))
    assert ids.tolist() == np.argmax(z, axis=-1).tolist()


@given(z=logits_batches(), seed=st.integers(0, 2**32 - 1))
def test_seeded_sampling_is_reproducible_and_stays_in_the_kept_set(z, seed):
    kw = dict(temperature=0.9, top_k=5, top_p=0.9, min_p=0.05)
    a = [sample_next(z, rng=g, **kw) for g in [np.random.default_rng(seed)] * 5]
    b = [sample_next(z, rng=g, **kw) for g in [np.random.default_rng(seed)] * 5]
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    allowed = filtered_probs(z, 0.9, top_k=5, top_p=0.9, min_p=0.05) > 0
    for ids in a:
        assert allowed[np.arange(len(ids)), ids].all()


def test_per_row_generators_make_rows_independent(rng):
    z = rng.standard_normal((3, 50))
    rows = [sample_next(z[b:b + 1], temperature=1.0, rng=np.random.default_rng(7))[0] for b in range(3)]
    batched = sample_next(z, temperature=1.0, rng=[np.random.default_rng(7) for _ in range(3)])
    assert batched.tolist() == rows


def test_sampled_frequencies_match_the_distribution():
    z = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    n = 40_000
    ids = sample_next(np.tile(z, (n, 1)), temperature=1.0, rng=np.random.default_rng(0))
    freq = np.bincount(ids, minlength=4) / n
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.01)
    # temperature 2 flattens: p ~ sqrt(p0); top_p 0.7 at temperature 1 keeps {0, 1}
    ids = sample_next(np.tile(z, (n, 1)), temperature=1.0, top_p=0.7, rng=np.random.default_rng(1))
    np.testing.assert_allclose(np.bincount(ids, minlength=4) / n, [0.625, 0.375, 0, 0], atol=0.01)
    ids = sample_next(np.tile(z, (n, 1)), temperature=2.0, rng=np.random.default_rng(2))
    flat = np.sqrt([0.5, 0.3, 0.15, 0.05])
    np.testing.assert_allclose(np.bincount(ids, minlength=4) / n, flat / flat.sum(), atol=0.01)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    z = np.array([[2.0, -1.0, 0.5, -3.0, 0.0]])
    seen = np.array([[True, True, False, False, True]])
    out = apply_repetition_penalty(z, seen, 2.0)
    np.testing.assert_array_equal(out, [[1.0, -2.0, 0.5, -3.0, 0.0]])
    np.testing.assert_array_equal(z, [[2.0, -1.0, 0.5, -3.0, 0.0]])  # input untouched
    # greedy with the penalty: token 0 (2.0 -> 0.8 at r=2.5) loses to the unseen 1.5
    z = np.array([[2.0, 1.5, -1.0]])
    assert sample_next(z, temperature=0, repetition_penalty=2.5, seen=np.array([[True, False, False]]))[0] == 1
    assert sample_next(z, temperature=0, repetition_penalty=1.0)[0] == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=1.0, top_k=0), "top_k"),
    (dict(temperature=1.0, top_k=2.5), "top_k"),
    (dict(temperature=1.0, top_p=0.0), "top_p"),
    (dict(temperature=1.0, top_p=1.5), "top_p"),
    (dict(temperature=1.0, min_p=-0.1), "min_p"),
    (dict(temperature=1.0, min_p=2.0), "min_p"),
    (dict(temperature=1.0, repetition_penalty=0.0), "repetition_penalty"),
    (dict(temperature=1.0, repetition_penalty=1.3), "seen"),
    (dict(temperature=1.0, repetition_penalty=1.3, seen=np.zeros((2, 5), dtype=bool)), "seen"),
    (dict(temperature=1.0), "rng"),
    (dict(temperature=1.0, rng=[np.random.default_rng(0)]), "rng"),
])
def test_bad_arguments_raise_value_errors_naming_them(kwargs, message):
    z = np.zeros((2, 4))
    with pytest.raises(ValueError, match=message):
        sample_next(z, **kwargs)


@pytest.mark.parametrize("logits, message", [
    (np.zeros(4), "shape"),
    (np.zeros((2, 4), dtype=np.int64), "float"),
    (np.array([[0.0, np.nan]]), "NaN"),
    (np.array([[-np.inf, -np.inf]]), "all -inf"),
])
def test_bad_logits_raise(logits, message):
    with pytest.raises(ValueError, match=message):
        sample_next(logits)
