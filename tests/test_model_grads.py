"""Whole-model gradient checks of the reference (npllama.model) in float64 against central
differences of the loss. (tests/engine/ checks that npllama.Llama's engine equals the reference.)"""

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

import npllama
from npllama import model as reference
from npllama.gradcheck import assert_grad_close, numerical_grad, rel_error


class ReferenceModel:
    """The reference functions over one params dict, with Llama's method names."""

    def __init__(self, cfg, params):
        self.config, self.params = cfg, params

    def loss_and_grads(self, tokens, targets):
        return reference.loss_and_grads(self.params, self.config, tokens, targets)


def perturbed_model(cfg, seed):
    params = reference.init_params(cfg, seed=seed, dtype=np.float64)
    rng = np.random.default_rng(seed + 1)
    # Larger weights than the 0.02 init, so deep gradients are not vanishingly small.
    for p in params.values():
        p += rng.standard_normal(p.shape) * 0.3
    return ReferenceModel(cfg, params)


def tokens_and_targets(cfg, B, T, seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, (B, T))
    targets = rng.integers(0, cfg.vocab_size, (B, T))
    targets[rng.random((B, T)) < 0.3] = -100
    targets[0, -1] = 0
    return tokens, targets


@pytest.mark.parametrize("variant", ["mha", "gqa", "tied"])
def test_every_entry_of_every_parameter(variant):
    kw = dict(dim=8, n_layers=2, n_heads=2, vocab_size=7, multiple_of=8, max_seq_len=8)
    kw.update({"mha": {}, "gqa": dict(dim=16, n_heads=4, n_kv_heads=2), "tied": dict(n_kv_heads=1, tie_embeddings=True)}[variant])
    cfg = npllama.LlamaConfig(**kw)
    model = perturbed_model(cfg, seed=3)
    tokens, targets = tokens_and_targets(cfg, 2, 5, seed=4)
    _, grads = model.loss_and_grads(tokens, targets)
    assert set(grads) == set(model.params)
    for name, p in model.params.items():
        assert grads[name].shape == p.shape and grads[name].dtype == np.float64
        numeric = numerical_grad(lambda: model.loss_and_grads(tokens, targets)[0], p)
        assert_grad_close(grads[name], numeric, tol=1e-6, name=name)


@st.composite
def configs(draw):
    kvh, rep = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    head_dim = 2 * draw(st.integers(1, 3))
    # dim >= 4 and hidden_dim >= 3: narrower models have gradients near 1e-5, where central
    # differences (noise about 1e-10) cannot certify a relative error of 1e-6.
    assume(kvh * rep * head_dim >= 4)
    return npllama.LlamaConfig(
        dim=kvh * rep * head_dim, n_layers=draw(st.integers(1, 2)), n_heads=kvh * rep, n_kv_heads=kvh,
        vocab_size=draw(st.integers(2, 13)), hidden_dim=draw(st.integers(3, 12)), max_seq_len=8,
        tie_embeddings=draw(st.booleans()), rope_theta=draw(st.sampled_from([10000.0, 100.0])))


@settings(max_examples=15)
@given(configs(), st.integers(1, 3), st.integers(1, 6), st.integers(0, 1000))
def test_directional_derivative_and_sampled_entries(cfg, B, T, seed):
    model = perturbed_model(cfg, seed)
    tokens, targets = tokens_and_targets(cfg, B, T, seed)
    _, grads = model.loss_and_grads(tokens, targets)
    # (L(theta + h v) - L(theta - h v)) / 2h == <grad, v> for a random direction v over all parameters.
    rng = np.random.default_rng(seed)
    direction = {n: rng.standard_normal(p.shape) for n, p in model.params.items()}
    # A unit direction: central differences err by h**2 |v|**3 L'''/6, so |v| must not grow with the model.
    norm = np.sqrt(sum(np.sum(d * d) for d in direction.values()))
    direction = {n: d / norm for n, d in direction.items()}
    original = {n: p.copy() for n, p in model.params.items()}

    def loss_at(step):
        for n, p in model.params.items():
            p[...] = original[n] + step * direction[n]
        return model.loss_and_grads(tokens, targets)[0]

    # The five-point stencil (error ~ h**4) lets h be 2.5e-4, where the rounding of L, divided by h,
    # stays near 4e-13: a central difference at h = 1e-5 carries ~1e-11 of noise, 1e-6 of a
    # directional derivative as small as 1e-5. (At h = 1e-3 a dim-4 model's higher derivatives
    # left 1.07e-6 of truncation error; at 2.5e-4, 4e-9.)
    h = 2.5e-4
    numeric = (8 * (loss_at(h) - loss_at(-h)) - (loss_at(2 * h) - loss_at(-2 * h))) / (12 * h)
    loss_at(0.0)
    analytic = sum(float(np.sum(grads[n] * direction[n])) for n in grads)
    assert rel_error(analytic, numeric) < 1e-6
    # A few entries of each parameter, so a gradient routed to the wrong array cannot hide. Picked
    # entries can be ~1e-6: the five-point stencil at h keeps their noise near 1e-12, where central
    # differences at h = 1e-6 carried ~1e-9 (seed 528's w1 entries of ~1e-3 then missed 1e-6 by
    # rounding alone; a stencil at h = 1e-3 confirmed the analytic ones to 1e-9). The error is
    # taken relative to at least the RMS size of the whole parameter's gradient. A gradient sent
    # to the wrong array still shows an error of order 1.
    for name, p in model.params.items():
        picks = rng.choice(p.size, size=min(3, p.size), replace=False)
        numeric = numerical_grad(lambda: model.loss_and_grads(tokens, targets)[0], p, h=h, indices=picks, points=5)
        a, n = grads[name].reshape(-1)[picks], numeric.reshape(-1)[picks]
        floor = np.linalg.norm(grads[name]) * np.sqrt(len(picks) / p.size)
        # Gradients that are exactly 0 (with equal tokens every value row is equal, and the queries
        # get no gradient at all) pass when the differences show only their own noise, < 1e-9.
        diff = np.linalg.norm(a - n)
        err = diff / max(np.linalg.norm(a), np.linalg.norm(n), floor, 1e-300)
        assert err < 1e-6 or diff < 1e-9, f"{name}: relative error {err:.2e}; analytic {a}, numeric {n}"


def test_numerical_grad_stencils_reach_their_orders():
    """points=5 (the five-point stencil) errs by ~h**4, points=3 by ~h**2: at h = 1e-2 on sin,
    ~1e-10 against ~1e-5; any other count of points is refused."""
    x = np.linspace(-2.0, 2.0, 7)
    exact = np.cos(x)
    three = numerical_grad(lambda: float(np.sum(np.sin(x))), x, h=1e-2)
    five = numerical_grad(lambda: float(np.sum(np.sin(x))), x, h=1e-2, points=5)
    assert 1e-7 < np.abs(three - exact).max() < 1e-4
    assert np.abs(five - exact).max() < 1e-9
    assert np.array_equal(x, np.linspace(-2.0, 2.0, 7))          # every entry put back
    with pytest.raises(ValueError, match="points=4"):
        numerical_grad(lambda: 0.0, x, points=4)
