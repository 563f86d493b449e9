import numpy as np
from hypothesis import given

from npllama.gradcheck import gradcheck, rel_error
from npllama.ops import swiglu_backward, swiglu_forward

from ._shapes import batch, length, seed, width


@given(batch, length, width, seed)
def test_swiglu_matches_formula_and_gradcheck(B, T, F, s):
    rng = np.random.default_rng(s)
    a, b = 2 * rng.standard_normal((B, T, F)), rng.standard_normal((B, T, F))
    ab = np.concatenate((a, b), axis=-1)
    y, _ = swiglu_forward(ab)
    expected = np.vectorize(lambda a, b: a / (1 + np.exp(-a)) * b)(a, b)
    assert rel_error(y, expected) < 1e-12
    assert gradcheck(swiglu_forward, swiglu_backward, ab, seed=s)[0] < 1e-6


def test_swiglu_backward_layout_is_gate_then_up():
    a, b = np.array([[0.5, -1.0]]), np.array([[2.0, 3.0]])
    _, cache = swiglu_forward(np.concatenate((a, b), -1))
    dab = swiglu_backward(np.ones((1, 2)), cache)
    s = 1 / (1 + np.exp(-a))
    np.testing.assert_allclose(dab[:, 2:], a * s)                          # db = silu(a)
    np.testing.assert_allclose(dab[:, :2], b * (s + a * s * (1 - s)))      # da


def test_swiglu_saturates_without_nan_or_warning():
    import warnings
    a = np.array([-1000.0, -100.0, 0.0, 100.0, 1000.0], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y, cache = swiglu_forward(np.concatenate((a, np.ones_like(a))))
        dab = swiglu_backward(np.ones_like(a), cache)
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(dab))
    assert y[0] == 0 and y[-1] == 1000 and y.dtype == np.float32 and dab.dtype == np.float32
