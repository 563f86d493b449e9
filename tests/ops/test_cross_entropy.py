import numpy as np
import pytest
from hypothesis import example, given, strategies as st

from npllama.gradcheck import numerical_grad, rel_error
from npllama.ops import cross_entropy_backward, cross_entropy_forward

from ._shapes import batch, length, seed


# The loss is logsumexp(logits) - logits[target] with logits up to about +-9: its rounding, ~1e-15,
# over the central difference's 2h is ~1e-9 at h = 1e-6, against a gradient as small as 1e-4 when
# the target's probability is near 1 (B = T = 1, V = 3, seed 26: 1.06e-6 relative). At h = 1e-4
# rounding gives ~1e-11 and the h^2 term less: worst 5.7e-8 over 3,000 random draws (1.9e-6 at 1e-6).
STEP = 1e-4


@given(batch, length, st.integers(1, 9), st.floats(0, 0.6), seed)
@example(1, 1, 3, 0.0, 26)
def test_cross_entropy_matches_loop_and_gradcheck(B, T, V, ignored_fraction, s):
    rng = np.random.default_rng(s)
    logits = 3 * rng.standard_normal((B, T, V))
    targets = rng.integers(0, V, (B, T))
    targets[rng.random((B, T)) < ignored_fraction] = -100
    targets[0, 0] = rng.integers(0, V)                          # at least one target counts
    loss, cache = cross_entropy_forward(logits, targets)
    terms = [np.log(np.sum(np.exp(logits[b, t]))) - logits[b, t, targets[b, t]]
             for b in range(B) for t in range(T) if targets[b, t] != -100]
    assert abs(loss - np.mean(terms)) < 1e-12 * max(1, abs(loss))
    analytic = cross_entropy_backward(1.0, cache)
    numeric = numerical_grad(lambda: cross_entropy_forward(logits, targets)[0], logits, h=STEP)
    assert rel_error(analytic, numeric) < 1e-6
    assert np.all(analytic[targets == -100] == 0)


def test_cross_entropy_is_stable_for_huge_logits_and_keeps_float32():
    logits = np.array([[1e4, -1e4, 0.0]], dtype=np.float32)
    loss, cache = cross_entropy_forward(logits, np.array([1]))
    assert loss == pytest.approx(2e4, rel=1e-6)
    d = cross_entropy_backward(1.0, cache)
    assert d.dtype == np.float32 and np.all(np.isfinite(d))
    np.testing.assert_allclose(d, [[1, -1, 0]], atol=1e-6)


def test_cross_entropy_refuses_all_ignored():
    with pytest.raises(ValueError, match="-100"):
        cross_entropy_forward(np.zeros((2, 3)), np.array([-100, -100]))
