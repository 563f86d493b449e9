import numpy as np
from hypothesis import given, strategies as st

from npllama.gradcheck import gradcheck, rel_error
from npllama.ops import rope_backward, rope_forward, rope_tables

from ._shapes import batch, even_head_dim, length, seed


def meta_complex_rope(x, start, theta):
    """Meta model.py's formulation: pairs (2i, 2i+1) as complex numbers times e^(i p theta_i)."""
    Dh = x.shape[-1]
    freqs = 1.0 / theta ** (np.arange(0, Dh, 2) / Dh)
    pos = np.arange(start, start + x.shape[-2])
    rot = np.exp(1j * np.outer(pos, freqs))                       # (T, Dh/2)
    xc = x[..., 0::2] + 1j * x[..., 1::2]
    yc = xc * rot
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = yc.real, yc.imag
    return out


@given(batch, st.integers(1, 3), length, even_head_dim, st.integers(0, 5), st.sampled_from([10000.0, 500000.0]), seed)
def test_rope_matches_meta_complex_form_and_gradcheck(B, H, T, Dh, start, theta, s):
    rng = np.random.default_rng(s)
    x = rng.standard_normal((B, H, T, Dh))
    cos, sin = rope_tables(Dh, start + T, theta, np.float64)
    cos, sin = cos[start:], sin[start:]
    y, _ = rope_forward(x, cos, sin)
    assert rel_error(y, meta_complex_rope(x, start, theta)) < 1e-12
    assert gradcheck(lambda x: rope_forward(x, cos, sin), rope_backward, x, seed=s)[0] < 1e-6


def test_rope_backward_inverts_forward_and_preserves_norms():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 6, 8))
    cos, sin = rope_tables(8, 6, 10000.0, np.float64)
    y, cache = rope_forward(x, cos, sin)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-12)
    np.testing.assert_allclose(rope_backward(y, cache), x, atol=1e-12)


def test_rope_position_zero_is_identity_and_float32_tables_are_rounded_once():
    cos, sin = rope_tables(4, 3, 10000.0, np.float32)
    assert cos.dtype == np.float32 and cos.shape == (3, 2)
    np.testing.assert_array_equal(cos[0], 1.0)
    np.testing.assert_array_equal(sin[0], 0.0)
    assert sin[2, 0] == np.float32(np.sin(2.0))
