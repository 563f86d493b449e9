"""The LoRA op: forward against its definition, backward against central differences and torch autograd."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from npllama.gradcheck import gradcheck, rel_error
from npllama.ops import linear_forward, lora_backward, lora_forward

from ._shapes import batch, length, seed, width

rank = st.integers(1, 4)


def random_lora(rng, n_in, n_out, r):
    return (rng.standard_normal((n_out, n_in)), rng.standard_normal((r, n_in)), rng.standard_normal((n_out, r)),
            float(rng.uniform(0.1, 4.0)))


@given(batch, length, width, width, rank, seed)
def test_lora_equals_the_merged_weight_and_gradcheck(B, T, n_in, n_out, r, s):
    rng = np.random.default_rng(s)
    x = rng.standard_normal((B, T, n_in))
    w, a, b, scale = random_lora(rng, n_in, n_out, r)
    y, _ = lora_forward(x, w, a, b, scale=scale)
    assert y.shape == (B, T, n_out)
    assert rel_error(y, x @ (w + scale * b @ a).T) < 1e-12                  # it acts as W' = W + s B A
    errors = gradcheck(lambda x, a, b: lora_forward(x, w, a, b, scale=scale), lora_backward, x, a, b, seed=s)
    assert max(errors) < 1e-6, errors


@given(batch, length, width, width, st.integers(0, 4), seed)
def test_zero_b_or_rank_zero_is_exactly_the_frozen_linear(B, T, n_in, n_out, r, s):
    rng = np.random.default_rng(s)
    x = rng.standard_normal((B, T, n_in)).astype(np.float32)
    w, a, _, scale = random_lora(rng, n_in, n_out, r)
    w, a = w.astype(np.float32), a.astype(np.float32)
    y, cache = lora_forward(x, w, a, np.zeros((n_out, r), np.float32), scale=scale)
    assert y.dtype == np.float32 and np.array_equal(y, linear_forward(x, w)[0])
    dx, da, db = lora_backward(np.ones_like(y), cache)
    assert dx.dtype == da.dtype == db.dtype == np.float32
    assert da.shape == (r, n_in) and db.shape == (n_out, r) and not da.any()   # dA = s (dy B)^T x = 0 while B = 0


def test_lora_backward_by_hand():
    """One position, rank 1: every formula of the docstring written out."""
    x, w = np.array([[1.0, 2.0]]), np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    a, b, s = np.array([[3.0, -1.0]]), np.array([[1.0], [2.0], [0.5]]), 2.0
    dy = np.array([[1.0, -1.0, 2.0]])
    y, cache = lora_forward(x, w, a, b, scale=s)
    xa = 3.0 * 1 - 1.0 * 2                                                   # x A^T = 1
    np.testing.assert_allclose(y, x @ w.T + s * xa * b.T)
    dx, da, db = lora_backward(dy, cache)
    dyb = 1.0 * 1 - 1.0 * 2 + 2.0 * 0.5                                      # dy B = 0
    np.testing.assert_allclose(dx, dy @ w + s * dyb * a)
    np.testing.assert_allclose(da, s * dyb * x)
    np.testing.assert_allclose(db, s * dy.T * xa)


@settings(max_examples=15)
@given(batch, length, width, width, st.integers(1, 4), seed)
def test_lora_matches_torch_autograd(B, T, n_in, n_out, r, s):
    torch = pytest.importorskip("torch", reason="torch not installed: pip install -e '.[torch]'")
    rng = np.random.default_rng(s)
    x = rng.standard_normal((B, T, n_in))
    w, a, b, scale = random_lora(rng, n_in, n_out, r)
    dy = rng.standard_normal((B, T, n_out))
    xt, at, bt = (torch.tensor(t, requires_grad=True) for t in (x, a, b))
    wt = torch.tensor(w)                                                     # frozen: no requires_grad
    yt = xt @ wt.T + scale * (xt @ at.T) @ bt.T                              # PEFT: base(x) + lora_B(lora_A(x)) * s
    yt.backward(torch.tensor(dy))
    y, cache = lora_forward(x, w, a, b, scale=scale)
    assert rel_error(y, yt.detach().numpy()) < 1e-10
    for ours, theirs in zip(lora_backward(dy, cache), (xt, at, bt)):
        assert rel_error(ours, theirs.grad.numpy()) < 1e-10
    assert wt.grad is None
