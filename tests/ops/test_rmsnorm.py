import numpy as np
import pytest
from hypothesis import given, strategies as st

from npllama.gradcheck import gradcheck, rel_error
from npllama.ops import rmsnorm_backward, rmsnorm_forward

from ._shapes import batch, length, seed


# D >= 2: with D = 1, y = w * x / sqrt(x**2 + eps) is flat in x and its gradient is ~eps, below
# what finite differences resolve.
@given(batch, length, st.integers(2, 9), seed)
def test_rmsnorm_matches_loop_and_gradcheck(B, T, D, s):
    rng = np.random.default_rng(s)
    x, w = rng.standard_normal((B, T, D)), rng.standard_normal(D)
    y, _ = rmsnorm_forward(x, w, 1e-5)
    for b in range(B):
        for t in range(T):
            row = x[b, t]
            expected = w * row / np.sqrt(sum(v * v for v in row) / D + 1e-5)
            assert rel_error(y[b, t], expected) < 1e-12
    # dy from another seed than x: from the same one dy = x, and a near-uniform w (D = 2 drew
    # w = [0.495, 0.494] at s = 2004) then leaves dx ~ (dy - n (n . dy) / D) w / rms near 0, its
    # norm 1e-3, where the central differences' rounding (~1e-9) reads as a relative error of 1.6e-6.
    assert max(gradcheck(lambda x, w: rmsnorm_forward(x, w, 1e-5), rmsnorm_backward, x, w, seed=s + 1)) < 1e-6


def test_rmsnorm_normalises_the_last_axis_only():
    # A popular tutorial normalises over (T, D) and so leaks the future into the past: changing
    # the last position must leave every earlier row's output untouched.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 5, 8))
    y, _ = rmsnorm_forward(x, np.ones(8), 1e-5)
    x2 = x.copy()
    x2[0, -1] *= 10
    y2, _ = rmsnorm_forward(x2, np.ones(8), 1e-5)
    np.testing.assert_array_equal(y[0, :-1], y2[0, :-1])


def test_rmsnorm_keeps_dtype_and_computes_in_float32_at_least():
    x = np.full((1, 4), 3.0, np.float32)
    y, cache = rmsnorm_forward(x, np.ones(4, np.float32), 1e-5)
    assert y.dtype == np.float32 and cache.rstd.dtype == np.float32
    y64, _ = rmsnorm_forward(x.astype(np.float64), np.ones(4), 1e-5)
    assert y64.dtype == np.float64
    np.testing.assert_allclose(y, 3 / np.sqrt(9 + 1e-5), rtol=1e-6)


@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_rmsnorm_of_zero_input_is_finite(eps):
    y, cache = rmsnorm_forward(np.zeros((2, 3)), np.ones(3), eps)
    dx, dw = rmsnorm_backward(np.ones((2, 3)), cache)
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(dx)) and np.all(np.isfinite(dw))
