"""AdamW, clip_grad_norm and lr_at: by hand, against torch.optim.AdamW / clip_grad_norm_, and state round trips."""

import math
import tracemalloc

import numpy as np
import pytest

from npllama.config import LlamaConfig
from npllama import Llama
from npllama.optim import AdamW, clip_grad_norm, lr_at

CFG = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=29, multiple_of=16, max_seq_len=16)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(a), np.linalg.norm(b), 1e-300))


def make_problem(dtype=np.float64, seed=0):
    """(params, grad_fn): a real Llama's parameters and its gradients on fresh random batches."""
    rng = np.random.default_rng(seed)
    model = Llama(CFG, seed=seed, dtype=dtype)

    def grad_fn(step):
        x = rng.integers(0, CFG.vocab_size, size=(2, 12))
        y = rng.integers(0, CFG.vocab_size, size=(2, 12))
        return model.loss_and_grads(x, y)[1]
    return model.params, grad_fn


def test_adamw_and_clipping_match_torch_over_12_steps():
    torch = pytest.importorskip("torch")
    params, grad_fn = make_problem(np.float64)
    tparams = {n: torch.nn.Parameter(torch.tensor(p.copy())) for n, p in params.items()}
    decay = [tparams[n] for n, p in params.items() if p.ndim >= 2]
    no_decay = [tparams[n] for n, p in params.items() if p.ndim < 2]
    assert decay and no_decay
    hyper = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    topt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=3e-3, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    opt = AdamW(params, **hyper)
    clipped_steps = 0
    for step in range(12):
        grads = grad_fn(step)
        for n, g in grads.items():
            tparams[n].grad = torch.tensor(g.copy())
        max_norm = 1e-2 if step % 2 else 1e6          # both branches: clipped, and left alone
        tnorm = float(torch.nn.utils.clip_grad_norm_(list(tparams.values()), max_norm=max_norm))
        norm = clip_grad_norm(grads, max_norm)
        assert isinstance(norm, float)
        assert abs(norm - tnorm) <= 1e-12 * tnorm, (step, norm, tnorm)
        clipped_steps += norm > max_norm
        for n, g in grads.items():
            assert rel_err(g, tparams[n].grad.numpy()) < 1e-12, (step, n)
        lr = lr_at(step, lr=3e-3, warmup_steps=3, decay_steps=10, min_lr=3e-4)
        for group in topt.param_groups:
            group["lr"] = lr
        topt.step()
        opt.step(grads, lr=lr)
        for n, p in params.items():
            err = rel_err(p, tparams[n].detach().numpy())
            assert err < 1e-8, f"step {step} {n}: relative error {err:.3g}"
    assert opt.step_count == 12
    assert clipped_steps == 6
    # moments agree too
    for n in params:
        state = topt.state[tparams[n]]
        assert rel_err(opt.exp_avg[n], state["exp_avg"].numpy()) < 1e-8
        assert rel_err(opt.exp_avg_sq[n], state["exp_avg_sq"].numpy()) < 1e-8


def test_first_step_by_hand():
    lr, wd, eps = 0.01, 0.5, 1e-8
    w = np.array([[1.0, -2.0], [0.5, 3.0]])
    b = np.array([1.0, 2.0])
    params = {"w": w, "b": b}
    g = {"w": np.array([[0.1, -0.2], [0.0, 4.0]]), "b": np.array([-1.0, 1e-3])}
    opt = AdamW(params, lr=lr, betas=(0.9, 0.99), eps=eps, weight_decay=wd)
    opt.step(g)
    # t = 1: m_hat = g, v_hat = g^2, so the update is lr * g / (|g| + eps); decay only on the matrix
    exp_w = np.array([[1.0, -2.0], [0.5, 3.0]]) * (1 - lr * wd) - lr * g["w"] / (np.abs(g["w"]) + eps)
    exp_b = np.array([1.0, 2.0]) - lr * g["b"] / (np.abs(g["b"]) + eps)
    np.testing.assert_allclose(w, exp_w, rtol=1e-12)
    np.testing.assert_allclose(b, exp_b, rtol=1e-12)
    assert params["w"] is w and params["b"] is b          # updated in place


def test_weight_decay_only_on_matrices_and_lr_override():
    params = {"m": np.ones((3, 4)), "v": np.ones(4), "e": np.ones((2, 2, 2))}
    zero = {n: np.zeros_like(p) for n, p in params.items()}
    opt = AdamW(params, lr=0.1, weight_decay=0.2)
    opt.step(zero)                         # zero grads: Adam's term is 0 / (0 + eps) = 0
    np.testing.assert_array_equal(params["v"], np.ones(4))
    np.testing.assert_allclose(params["m"], np.full((3, 4), 1 - 0.1 * 0.2))
    np.testing.assert_allclose(params["e"], np.full((2, 2, 2), 1 - 0.1 * 0.2))
    opt.step(zero, lr=0.5)                 # the override applies to this step only
    np.testing.assert_allclose(params["m"], np.full((3, 4), (1 - 0.02) * (1 - 0.1)))
    assert opt.lr == 0.1


def test_float32_stays_float32_and_step_allocates_nothing_large():
    params, grad_fn = make_problem(np.float32, seed=3)
    opt = AdamW(params)
    grads = grad_fn(0)
    opt.step(grads)
    assert all(p.dtype == np.float32 for p in params.values())
    assert all(m.dtype == np.float32 for m in opt.exp_avg.values())
    biggest = max(p.nbytes for p in params.values())
    tracemalloc.start()
    try:
        opt.step(grads)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < biggest / 4, f"AdamW.step allocated {peak} bytes; the largest parameter is {biggest} bytes"


def test_state_dict_round_trip_resumes_exactly():
    params, grad_fn = make_problem(np.float32, seed=1)
    copy = {n: p.copy() for n, p in params.items()}
    grads = [grad_fn(s) for s in range(8)]
    opt = AdamW(params, lr=2e-3, betas=(0.8, 0.9), eps=1e-7, weight_decay=0.05)
    for s in range(4):
        opt.step(grads[s])
    sd = opt.state_dict()
    frozen = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in sd.items()}
    assert sd["step"] == 4 and isinstance(sd["step"], int)
    assert all(isinstance(v, (np.ndarray, int, float)) for v in sd.values())
    for s in range(4, 8):
        opt.step(grads[s])
    for k, v in frozen.items():          # the dict taken earlier did not move
        np.testing.assert_array_equal(sd[k], v)

    # a fresh optimizer with default hypers over a copy of the params at step 4
    params2 = {n: p.copy() for n, p in copy.items()}
    opt_a = AdamW(params2, lr=2e-3, betas=(0.8, 0.9), eps=1e-7, weight_decay=0.05)
    for s in range(4):
        opt_a.step(grads[s])
    opt_b = AdamW(params2)
    opt_b.load_state_dict(sd)
    assert (opt_b.lr, opt_b.betas, opt_b.eps, opt_b.weight_decay) == (2e-3, (0.8, 0.9), 1e-7, 0.05)
    for s in range(4, 8):
        opt_b.step(grads[s])
    for n in params:
        np.testing.assert_array_equal(params2[n], params[n])
    assert opt_b.step_count == 8


def test_load_state_dict_refuses_mismatches_and_changes_nothing():
    params = {"w": np.zeros((2, 3)), "n": np.zeros(3)}
    opt = AdamW(params)
    opt.step({"w": np.ones((2, 3)), "n": np.ones(3)})
    good = opt.state_dict()
    before = opt.state_dict()
    cases = {
        "exp_avg.w": dict(good, **{"exp_avg.w": np.zeros((3, 2))}),
        "missing moments": {k: v for k, v in good.items() if k != "exp_avg_sq.n"},
        "unexpected keys": dict(good, **{"exp_avg.extra": np.zeros(1)}),
        "beta2": dict(good, beta2=1.0),
        "step": dict(good, step=-1),
        "'lr'": {k: v for k, v in good.items() if k != "lr"},
    }
    for needle, bad in cases.items():
        with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
            opt.load_state_dict(bad)
    after = opt.state_dict()
    for k in before:
        np.testing.assert_array_equal(after[k], before[k])


@pytest.mark.parametrize("kwargs, needle", [
    (dict(lr=-1e-3), "lr"), (dict(lr=float("nan")), "lr"), (dict(betas=(1.0, 0.9)), "beta1"),
    (dict(betas=(0.9, -0.1)), "beta2"), (dict(betas=0.9), "betas"), (dict(eps=-1.0), "eps"),
    (dict(weight_decay=-0.1), "weight_decay"),
])
def test_bad_hyperparameters_are_refused(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        AdamW({"w": np.zeros((2, 2))}, **kwargs)


def test_bad_params_and_grads_are_refused():
    with pytest.raises(ValueError, match="non-empty dict"):
        AdamW({})
    with pytest.raises(ValueError, match="floating-point"):
        AdamW({"w": np.zeros((2, 2), dtype=np.int64)})
    opt = AdamW({"w": np.zeros((2, 2)), "n": np.zeros(2)})
    with pytest.raises(ValueError, match=r"missing \['n'\]"):
        opt.step({"w": np.zeros((2, 2))})
    with pytest.raises(ValueError, match="grad"):
        opt.step({"w": np.zeros((2, 3)), "n": np.zeros(2)})
    with pytest.raises(ValueError, match="lr"):
        opt.step({"w": np.zeros((2, 2)), "n": np.zeros(2)}, lr=-1.0)
    assert opt.step_count == 0


def test_clip_grad_norm_scales_in_place_only_above_max():
    g = {"a": np.array([3.0, 0.0]), "b": np.array([[0.0, 4.0]])}
    a = g["a"]
    total = clip_grad_norm(g, 10.0)
    assert total == 5.0 and isinstance(total, float)
    np.testing.assert_array_equal(g["a"], [3.0, 0.0])      # under the max: untouched
    total = clip_grad_norm(g, 1.0)
    assert total == 5.0
    assert g["a"] is a                                     # in place
    np.testing.assert_allclose(g["a"], [3.0 / (5 + 1e-6), 0.0])
    np.testing.assert_allclose(math.sqrt(sum(float((x ** 2).sum()) for x in g.values())), 5 / (5 + 1e-6))
    assert clip_grad_norm({"z": np.zeros(3)}, 1.0) == 0.0
    big = {"x": np.full(4, 1e30, dtype=np.float32)}         # squares overflow float32; the norm does not
    assert math.isclose(clip_grad_norm(big, math.inf), 2e30, rel_tol=1e-6)


def test_clip_grad_norm_non_finite_leaves_grads_untouched():
    for bad in (np.nan, np.inf):
        g = {"a": np.array([1.0, bad]), "b": np.ones(3)}
        total = clip_grad_norm(g, 1.0)
        assert not math.isfinite(total)
        np.testing.assert_array_equal(g["b"], np.ones(3))
    for max_norm in (0.0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="max_norm"):
            clip_grad_norm({"a": np.ones(2)}, max_norm)
    with pytest.raises(ValueError, match="np.ndarray"):
        clip_grad_norm({"a": [1.0, 2.0]}, 1.0)


def test_schedule_values_at_known_steps():
    kw = dict(lr=1e-3, warmup_steps=100, decay_steps=1100, min_lr=1e-4)
    assert lr_at(0, **kw) == pytest.approx(1e-5)
    assert lr_at(49, **kw) == pytest.approx(5e-4)
    assert lr_at(99, **kw) == pytest.approx(1e-3)
    assert lr_at(100, **kw) == pytest.approx(1e-3)
    assert lr_at(600, **kw) == pytest.approx(5.5e-4)          # half-way down the cosine: (lr + min_lr) / 2
    assert lr_at(350, **kw) == pytest.approx(1e-4 + 0.5 * (1 + math.cos(math.pi / 4)) * 9e-4)
    assert lr_at(1100, **kw) == pytest.approx(1e-4)
    assert lr_at(10 ** 6, **kw) == 1e-4
    after = [lr_at(s, **kw) for s in range(100, 1101)]
    assert all(x >= y for x, y in zip(after, after[1:]))
    warm = [lr_at(s, **kw) for s in range(100)]
    assert all(x < y for x, y in zip(warm, warm[1:]))
    assert lr_at(0, lr=1e-3, warmup_steps=0, decay_steps=10, min_lr=0.0) == pytest.approx(1e-3)
    assert lr_at(500, lr=1e-3, warmup_steps=10, decay_steps=0, min_lr=0.0) == 1e-3    # no decay: flat


@pytest.mark.parametrize("kwargs, needle", [
    (dict(step=-1), "step"), (dict(step=1.5), "step"), (dict(warmup_steps=-1), "warmup_steps"),
    (dict(min_lr=2e-3), "min_lr"), (dict(lr=-1.0, min_lr=0.0), "lr"),
])
def test_schedule_refuses_bad_arguments(kwargs, needle):
    kw = dict(step=0, lr=1e-3, warmup_steps=10, decay_steps=100, min_lr=1e-4)
    kw.update(kwargs)
    with pytest.raises(ValueError, match=needle):
        lr_at(**kw)
