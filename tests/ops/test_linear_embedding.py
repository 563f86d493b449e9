import numpy as np
from hypothesis import given, strategies as st

from npllama.gradcheck import gradcheck, rel_error
from npllama.ops import embedding_backward, embedding_forward, linear_backward, linear_forward

from ._shapes import batch, length, seed, width


@given(batch, length, width, width, seed)
def test_linear_matches_loop_and_gradcheck(B, T, n_in, n_out, s):
    rng = np.random.default_rng(s)
    x, w = rng.standard_normal((B, T, n_in)), rng.standard_normal((n_out, n_in))
    y, _ = linear_forward(x, w)
    naive = np.array([[[sum(x[b, t, i] * w[o, i] for i in range(n_in)) for o in range(n_out)]
                       for t in range(T)] for b in range(B)])
    assert rel_error(y, naive) < 1e-12
    assert max(gradcheck(linear_forward, linear_backward, x, w, seed=s)) < 1e-6


@given(batch, length, width, st.integers(1, 12), seed)
def test_embedding_gradcheck_with_repeated_ids(B, T, D, V, s):
    rng = np.random.default_rng(s)
    ids = rng.integers(0, V, (B, T))
    w = rng.standard_normal((V, D))
    y, _ = embedding_forward(ids, w)
    assert np.array_equal(y, np.stack([np.stack([w[i] for i in row]) for row in ids]))
    errors = gradcheck(lambda w: embedding_forward(ids, w), embedding_backward, w, seed=s)
    assert errors[0] < 1e-6


def test_embedding_backward_sums_every_repeat_on_both_paths():
    rng = np.random.default_rng(0)
    for V, N in [(5, 40), (3000, 2000)]:          # one-hot matmul path, then sort + reduceat path
        ids = np.concatenate([np.zeros(N // 2, int), rng.integers(0, V, N - N // 2)])[None]
        dy = rng.standard_normal((1, N, 3))
        expected = np.zeros((V, 3))
        np.add.at(expected, ids[0], dy[0])
        got = embedding_backward(dy, embedding_forward(ids, np.zeros((V, 3)))[1])
        assert rel_error(got, expected) < 1e-12
        assert got.dtype == np.float64


def test_embedding_backward_keeps_float32():
    ids = np.array([[0, 1, 1]])
    _, cache = embedding_forward(ids, np.zeros((4, 2), np.float32))
    assert embedding_backward(np.ones((1, 3, 2), np.float32), cache).dtype == np.float32
