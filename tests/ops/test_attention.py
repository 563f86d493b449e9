import numpy as np
import pytest
from hypothesis import given, strategies as st

from npllama.gradcheck import gradcheck, rel_error
from npllama.ops import attention_backward, attention_forward, causal_mask

from ._shapes import batch, even_head_dim, length, seed


def naive_attention(q, k, v):
    """Loops over batch, heads and positions; query head h reads kv head h // R (Meta's repeat_kv)."""
    B, H, T, Dh = q.shape
    KVH, S = k.shape[1], k.shape[2]
    R = H // KVH
    out = np.zeros_like(q)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                visible = S - T + t + 1
                scores = np.array([q[b, h, t] @ k[b, h // R, s] for s in range(visible)]) / np.sqrt(Dh)
                p = np.exp(scores - scores.max())
                p /= p.sum()
                out[b, h, t] = sum(p[s] * v[b, h // R, s] for s in range(visible))
    return out


@given(batch, st.integers(1, 3), st.integers(1, 3), length, st.integers(0, 4), even_head_dim, seed)
def test_attention_matches_loop_and_gradcheck(B, KVH, R, T, past, Dh, s):
    rng = np.random.default_rng(s)
    H, S = KVH * R, T + past
    q = rng.standard_normal((B, H, T, Dh))
    k, v = rng.standard_normal((B, KVH, S, Dh)), rng.standard_normal((B, KVH, S, Dh))
    y, _ = attention_forward(q, k, v)
    assert rel_error(y, naive_attention(q, k, v)) < 1e-12
    errors = gradcheck(attention_forward, attention_backward, q, k, v, seed=s)
    assert max(errors) < 1e-6, errors


def test_attention_with_explicit_mask_equals_causal_and_padding_ignores_keys():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((2, 4, 5, 4)), rng.standard_normal((2, 2, 5, 4)), rng.standard_normal((2, 2, 5, 4))
    causal, _ = attention_forward(q, k, v)
    explicit, _ = attention_forward(q, k, v, np.broadcast_to(causal_mask(5, 5), (2, 5, 5)))
    np.testing.assert_array_equal(causal, explicit)
    # Row 1 left-padded by two positions: its keys 0 and 1 are masked, so their values don't matter.
    mask = np.broadcast_to(causal_mask(5, 5), (2, 5, 5)).copy()
    mask[1, :, :2] = False
    mask[1, :2, :2] = np.eye(2, dtype=bool)                     # padded queries see themselves only
    y1, _ = attention_forward(q, k, v, mask)
    v2 = v.copy()
    v2[1, :, :2] = 1e6
    y2, _ = attention_forward(q, k, v2, mask)
    np.testing.assert_allclose(y1[1, :, 2:], y2[1, :, 2:], rtol=1e-12)


def test_attention_is_causal_and_stable_for_large_scores():
    rng = np.random.default_rng(1)
    q, k, v = (1e4 * rng.standard_normal((1, 2, 6, 4)), 1e4 * rng.standard_normal((1, 2, 6, 4)),
               rng.standard_normal((1, 2, 6, 4)))
    y, cache = attention_forward(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32))
    assert np.all(np.isfinite(y)) and y.dtype == np.float32
    assert np.all(np.triu(cache.att[0, 0, :6], 1) == 0)        # no weight on the future
    np.testing.assert_allclose(cache.att.sum(-1), 1, rtol=1e-6)


@pytest.mark.parametrize("T,S", [(1, 1), (1, 7), (3, 7), (7, 7)])
def test_causal_mask_offset(T, S):
    m = causal_mask(T, S)
    for t in range(T):
        assert m[t].tolist() == [s <= S - T + t for s in range(S)]
