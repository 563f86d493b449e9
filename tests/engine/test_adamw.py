"""FusedAdamW (what `npllama train` steps with) against the reference npllama.optim.AdamW: the same
bits after many steps, in float32 and float64, chunked, on threads, resumed from a state dict."""

import numpy as np
import pytest

import npllama
from npllama.engine import adamw
from npllama.engine.adamw import FusedAdamW
from npllama.optim import AdamW

SHAPES = {"emb": (37, 24), "w": (24, 40), "norm": (24,), "big": (3, 5000), "tiny": (1, 1)}
HYPER = dict(lr=3e-3, betas=(0.8, 0.97), eps=1e-7, weight_decay=0.1)


def assert_same_state(a, b):
    for name in a.params:
        np.testing.assert_array_equal(a.params[name], b.params[name], err_msg=name)
        np.testing.assert_array_equal(a.exp_avg[name], b.exp_avg[name], err_msg=name)
        np.testing.assert_array_equal(a.exp_avg_sq[name], b.exp_avg_sq[name], err_msg=name)
    assert a.step_count == b.step_count


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_fused_adamw_equals_adamw_to_the_last_bit(monkeypatch, dtype, workers):
    monkeypatch.setattr(adamw, "CHUNK", 64)              # many chunks, partial last ones
    monkeypatch.setattr(adamw, "MIN_THREADED", 1)        # threads even for these small arrays
    rng = np.random.default_rng(0)
    p_ref = {n: rng.standard_normal(s).astype(dtype) for n, s in SHAPES.items()}
    reference = AdamW(p_ref, **HYPER)
    fused = FusedAdamW({n: p.copy() for n, p in p_ref.items()}, **HYPER, workers=workers)
    for step in range(25):
        grads = {n: (rng.standard_normal(s) * 10.0 ** rng.integers(-3, 3)).astype(dtype) for n, s in SHAPES.items()}
        lr = None if step % 3 else 1e-3 * (step + 1)       # the stored lr, or this step's
        reference.step(grads, lr=lr)
        fused.step(grads, lr=lr)
        if step == 12:                                     # resume in a new optimizer from the state dict
            resumed = FusedAdamW(fused.params, workers=workers)
            resumed.load_state_dict(fused.state_dict())
            fused = resumed
    assert_same_state(reference, fused)


def test_fused_adamw_trains_a_model_as_adamw_does():
    """A real model, its flat parameters and gradients, clipping: the same bits as the reference optimizer."""
    cfg = npllama.LlamaConfig(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=11, multiple_of=8)
    a, b = npllama.Llama(cfg, seed=0), npllama.Llama(cfg, seed=0)
    opt_a, opt_b = AdamW(a.params, **HYPER), FusedAdamW(b.params, **HYPER)
    tokens = np.random.default_rng(0).integers(0, 11, (4, 9))
    for _ in range(5):
        for model, opt in ((a, opt_a), (b, opt_b)):
            _, grads = model.loss_and_grads(tokens[:, :-1], tokens[:, 1:], workers=1)
            npllama.clip_grad_norm(grads, 0.5)
            opt.step(grads)
    assert_same_state(opt_a, opt_b)


def test_a_strided_parameter_is_updated_in_place():
    base = np.random.default_rng(1).standard_normal((6, 8))
    params = {"strided": base[:, ::2], "plain": np.ones((3, 3))}
    ref = {n: p.copy() for n, p in params.items()}
    fused, reference = FusedAdamW(params, **HYPER), AdamW(ref, **HYPER)
    grads = {"strided": np.full((6, 4), 0.5), "plain": np.full((3, 3), -1.0)}
    fused.step(grads)
    reference.step(grads)
    np.testing.assert_array_equal(base[:, ::2], ref["strided"])
    np.testing.assert_array_equal(params["plain"], ref["plain"])


def test_fused_adamw_checks_its_gradients_as_adamw_does():
    opt = FusedAdamW({"w": np.zeros((2, 2))})
    with pytest.raises(ValueError, match="missing"):
        opt.step({})
    with pytest.raises(ValueError, match="shapes"):
        opt.step({"w": np.zeros(3)})


def test_the_public_adamw_steps_fused_on_engine_models_and_as_the_reference_elsewhere():
    """npllama.AdamW: FusedAdamW's step on an engine model's flat parameters, optim.AdamW's on a
    reference model's; the same bits either way, and no whole-size scratch array when fused."""
    cfg = npllama.LlamaConfig(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=11, multiple_of=8)
    engine, reference = npllama.Llama(cfg, seed=0), npllama.Llama(cfg, seed=0, backend="reference")
    opt_e, opt_r = npllama.AdamW(engine.params, **HYPER), npllama.AdamW(reference.params, **HYPER)
    assert opt_e.fused and opt_e._scratch is None
    assert not opt_r.fused
    tokens = np.random.default_rng(0).integers(0, 11, (4, 9))
    for _ in range(4):
        for model, opt in ((engine, opt_e), (reference, opt_r)):
            _, grads = model.loss_and_grads(tokens[:, :-1], tokens[:, 1:], workers=1)
            npllama.clip_grad_norm(grads, 0.5)
            opt.step(grads)
    for name in engine.params:              # the two backends' gradients agree to rounding, not bits
        np.testing.assert_allclose(engine.params[name], reference.params[name], rtol=1e-4, atol=1e-6)
    fused, plain = npllama.AdamW(engine.params, **HYPER), AdamW({n: p.copy() for n, p in engine.params.items()}, **HYPER)
    grads = {n: np.full_like(p, 0.01) for n, p in engine.params.items()}
    fused.step(grads)
    plain.step(grads)
    assert_same_state(plain, fused)
