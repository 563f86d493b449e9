"""npllama against PyTorch autograd: same weights, same tokens, same logits, loss and gradients."""

import numpy as np
import pytest

import npllama
from npllama.gradcheck import rel_error

torch = pytest.importorskip("torch")
from tools.torch_llama import TorchLlama, cross_entropy  # noqa: E402

CONFIGS = {
    "mha": dict(dim=32, n_layers=2, n_heads=4, vocab_size=50),
    "gqa": dict(dim=48, n_layers=3, n_heads=6, n_kv_heads=2, vocab_size=61, rope_theta=500000.0),
    "mqa-tied": dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=1, vocab_size=40, tie_embeddings=True),
}


def make_case(kw, dtype, seed=0):
    cfg = npllama.LlamaConfig(multiple_of=16, max_seq_len=32, **kw)
    model = npllama.Llama(cfg, seed=seed, dtype=dtype)
    rng = np.random.default_rng(seed)
    # Norm weights away from 1 and larger matrices, so every gradient is far from zero.
    for name, p in model.params.items():
        p += (rng.standard_normal(p.shape) * (0.3 if p.ndim == 1 else 0.05)).astype(dtype)
    tokens = rng.integers(0, cfg.vocab_size, (3, 13))
    targets = rng.integers(0, cfg.vocab_size, (3, 13))
    targets[rng.random(targets.shape) < 0.25] = -100
    return model, tokens, targets


def torch_logits_loss_grads(params, cfg, tokens, targets):
    """(logits, loss, grads) as numpy, by torch autograd on tools/torch_llama.py in the params' dtype."""
    tmodel = TorchLlama.from_params(cfg, params)
    logits = tmodel(torch.from_numpy(tokens))
    loss = cross_entropy(logits, torch.from_numpy(targets))
    loss.backward()
    grads = {name: p.grad.numpy() for name, p in tmodel.named_parameters()}
    return logits.detach().numpy(), loss.item(), grads


def compare(model, tokens, targets, tol):
    logits = model.forward(tokens)
    loss, grads = model.loss_and_grads(tokens, targets)
    ref_logits, ref_loss, ref_grads = torch_logits_loss_grads(model.params, model.config, tokens, targets)
    failures = []
    if rel_error(logits, ref_logits) > tol:
        failures.append(f"logits {rel_error(logits, ref_logits):.2e}")
    if abs(loss - ref_loss) > tol * abs(ref_loss):
        failures.append(f"loss {loss!r} vs {ref_loss!r}")
    assert set(grads) == set(ref_grads)
    for name in grads:
        err = rel_error(grads[name], ref_grads[name])
        if err > tol:
            failures.append(f"{name} {err:.2e}")
    assert not failures, f"disagreement with torch autograd above {tol:.0e}: " + ", ".join(failures)


@pytest.mark.parametrize("variant", CONFIGS)
def test_float64_agrees_with_torch_autograd_to_1e10(variant):
    compare(*make_case(CONFIGS[variant], np.float64), tol=1e-10)


@pytest.mark.parametrize("variant", CONFIGS)
def test_float32_agrees_with_torch_autograd_to_1e4(variant):
    model, tokens, targets = make_case(CONFIGS[variant], np.float32, seed=1)
    compare(model, tokens, targets, tol=1e-4)


def test_comparison_fails_when_one_weight_is_off():
    # The check itself must be able to fail: nudge one weight of npllama's copy only.
    model, tokens, targets = make_case(CONFIGS["gqa"], np.float64)
    ref = torch_logits_loss_grads(model.params, model.config, tokens, targets)
    model.params["layers.1.attention.wk.weight"][3, 5] += 1e-6
    assert rel_error(model.forward(tokens), ref[0]) > 1e-10
