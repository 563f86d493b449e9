import warnings

import numpy as np
from hypothesis import given

from npllama.gradcheck import gradcheck, rel_error
from npllama.ops import swiglu_backward, swiglu_forward

from ._shapes import batch, length, seed, width


@given(batch, length, width, seed)
def test_swiglu_matches_formula_and_gradcheck(B, T, F, s):
    rng = np.random.default_rng(s)
    a, b = 2 * rng.standard_normal((B, T, F)), rng.standard_normal((B, T, F))
    y, _ = swiglu_forward(a, b)
    expected = np.vectorize(lambda a, b: a / (1 + np.exp(-a)) * b)(a, b)
    assert rel_error(y, expected) < 1e-12
    assert max(gradcheck(swiglu_forward, swiglu_backward, a, b, seed=s)) < 1e-6


def test_swiglu_backward_by_hand():
    a, b = np.array([[0.5, -1.0]]), np.array([[2.0, 3.0]])
    _, cache = swiglu_forward(a, b)
    da, db = swiglu_backward(np.ones((1, 2)), cache)
    s = 1 / (1 + np.exp(-a))
    np.testing.assert_allclose(db, a * s)                                  # db = silu(a)
    np.testing.assert_allclose(da, b * (s + a * s * (1 - s)))              # da = b * silu'(a)


def test_swiglu_saturates_without_nan_or_warning():
    a = np.array([-1000.0, -100.0, 0.0, 100.0, 1000.0], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y, cache = swiglu_forward(a, np.ones_like(a))
        da, db = swiglu_backward(np.ones_like(a), cache)
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(da)) and np.all(np.isfinite(db))
    assert y[0] == 0 and y[-1] == 1000 and y.dtype == np.float32 and da.dtype == db.dtype == np.float32
