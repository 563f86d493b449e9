"""The reference LoRA model (npllama.lora): adapter gradients against central differences and
PyTorch autograd in float64, the merge, the spec, and the exact start at the base model."""

import numpy as np
import pytest
from hypothesis import assume, example, given, settings, strategies as st

import npllama
from npllama import lora, model as reference
from npllama.gradcheck import numerical_grad, rel_error

from .test_model_grads import perturbed_model, tokens_and_targets

targets = st.lists(st.sampled_from(lora.LORA_TARGETS), min_size=1, max_size=7, unique=True)


@st.composite
def configs(draw):
    kvh, rep = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    head_dim = 2 * draw(st.integers(1, 2))
    assume(kvh * rep * head_dim >= 4)        # as tests/test_model_grads.py: no vanishing gradients
    return npllama.LlamaConfig(
        dim=kvh * rep * head_dim, n_layers=draw(st.integers(1, 2)), n_heads=kvh * rep, n_kv_heads=kvh,
        vocab_size=draw(st.integers(3, 9)), hidden_dim=draw(st.integers(3, 8)), max_seq_len=8,
        tie_embeddings=draw(st.booleans()))


def adapted(cfg, spec, seed):
    """Perturbed base weights and adapters with B != 0 (B = 0 would hide A's gradient)."""
    params = perturbed_model(cfg, seed).params
    rng = np.random.default_rng(seed + 7)
    adapters = {n: rng.standard_normal(s) * 0.5 for n, s in lora.adapter_shapes(cfg, spec).items()}
    return params, adapters


@settings(max_examples=12)
@given(configs(), st.integers(1, 3), targets, st.integers(0, 1000))
@example(npllama.LlamaConfig(dim=4, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=8, hidden_dim=6, max_seq_len=8,
                             tie_embeddings=False), 2, list(lora.LORA_TARGETS), 564)     # truncation at 3e-5: below
def test_every_adapter_entry_against_central_differences(cfg, rank, target_list, seed):
    spec = lora.LoraSpec(rank=rank, alpha=2.0 * rank + 1, targets=tuple(target_list))
    params, adapters = adapted(cfg, spec, seed)
    tokens, targets_ = tokens_and_targets(cfg, 2, 4, seed)
    before = {n: p.copy() for n, p in params.items()}
    loss, grads = lora.loss_and_grads(params, adapters, cfg, spec, tokens, targets_)
    assert list(grads) == list(adapters)
    assert all(np.array_equal(params[n], before[n]) for n in params)     # the base is frozen
    # An adapter whose gradient is tiny (5e-5: a key projection deep in a 4-wide model) meets the
    # differences' own noise (1e-10); as in tests/test_model_grads.py, its error is relative to at
    # least the RMS size of all the adapters' gradients, scaled to its own size.
    # The five-point stencil at h = 3e-5: its truncation (~h**4) and its rounding (~1e-16 |L| / h)
    # both stay far below 1e-6. Central differences could not serve every draw: with adapters of
    # size 0.5 and s = alpha / r up to 7/3 their truncation (~h**2) failed at h = 1e-6 (1.16e-6
    # relative: dim 4, rank 3, seed 187), and at h = 1e-7 their rounding did (1.6e-5: dim 4, rank
    # 1, wq alone, seed 859, whose adapters' gradients are all ~1e-6). The stencil's truncation
    # failed at 2.5e-4 (2.6e-6: dim 4, rank 3, every target, seed 928) and at 1e-4 (4.7e-6: dim 4, 2
    # layers, 2 heads, vocab 4, hidden 6, rank 2, every target, seed 330, gradients of 12); at 3e-5
    # that draw gave 3.8e-8, and the worst of 33 other draws (every target at rank 1-3, wq alone at
    # rank 1, seeds 859 and 928 among them) 5.3e-8, the rounding then about as large as the truncation.
    # No one step serves every draw: at 3e-5 the stencil's truncation reached 4.9e-6 on dim 4, 1 layer,
    # 2 heads of 1 kv head, rank 2, every target, seed 564 (wk's B; 4.9e-10 at 3e-6, so the gradient
    # is right), where 3e-6 would bring back the rounding of the tiny gradients above. So each entry is
    # differenced at both steps, and the analytic gradient must agree with the better of the two: a
    # wrong one is off from both.
    total = np.sqrt(sum(np.sum(g * g) for g in grads.values()))
    n_total = sum(g.size for g in grads.values())
    for name, a in adapters.items():
        floor = total * np.sqrt(a.size / n_total)
        found = []                                                  # (relative error, differences) at each step
        for h in (3e-5, 3e-6):
            numeric = numerical_grad(lambda: lora.loss_and_grads(params, adapters, cfg, spec, tokens, targets_)[0], a,
                                     h=h, points=5)
            scale = max(np.linalg.norm(grads[name]), np.linalg.norm(numeric), floor)
            found.append((np.linalg.norm(grads[name] - numeric) / scale, numeric))
        err, numeric = min(found, key=lambda pair: pair[0])
        assert err < 1e-6, f"{name}: relative error {err:.2e}; analytic {grads[name].ravel()[:4]}, numeric {numeric.ravel()[:4]}"


@settings(max_examples=10)
@given(configs(), st.integers(1, 4), targets, st.integers(0, 1000))
def test_logits_loss_and_adapter_grads_match_torch_autograd(cfg, rank, target_list, seed):
    torch = pytest.importorskip("torch", reason="torch not installed: pip install -e '.[torch]'")
    from tools.torch_llama import TorchLlama, cross_entropy
    spec = lora.LoraSpec(rank=rank, alpha=float(rank + 2), targets=tuple(target_list))
    params, adapters = adapted(cfg, spec, seed)
    tokens, targets_ = tokens_and_targets(cfg, 2, 5, seed)
    # torch: the frozen weights as constants, each adapted one as W + s B A in the autograd graph
    P = {n: torch.tensor(p) for n, p in params.items()}
    A = {n: torch.tensor(t, requires_grad=True) for n, t in adapters.items()}
    for name in adapters:
        if name.endswith(".lora_a"):
            stem = name.removesuffix(".lora_a")
            P[stem + ".weight"] = P[stem + ".weight"] + spec.scale * A[stem + ".lora_b"] @ A[name]
    logits = torch.func.functional_call(TorchLlama(cfg, torch.float64), P, (torch.tensor(tokens),))
    loss = cross_entropy(logits, torch.tensor(targets_))
    loss.backward()
    assert rel_error(lora.forward(params, adapters, cfg, spec, tokens), logits.detach().numpy()) < 1e-10
    ours_loss, grads = lora.loss_and_grads(params, adapters, cfg, spec, tokens, targets_)
    assert abs(ours_loss - loss.item()) < 1e-10 * abs(loss.item())
    for name, g in grads.items():
        assert rel_error(g, A[name].grad.numpy()) < 1e-10, name


@given(configs(), st.integers(1, 3), targets, st.integers(0, 1000))
def test_merged_weights_give_the_adapted_logits(cfg, rank, target_list, seed):
    spec = lora.LoraSpec(rank=rank, alpha=3.0, targets=tuple(target_list))
    params, adapters = adapted(cfg, spec, seed)
    tokens, _ = tokens_and_targets(cfg, 2, 6, seed)
    merged = lora.merge(params, adapters, spec)
    expected = lora.forward(params, adapters, cfg, spec, tokens)
    assert rel_error(reference.forward(merged, cfg, tokens)[0], expected) < 1e-12
    changed = {n for n in params if merged[n] is not params[n]}
    assert changed == {lora.weight_name(i, t) for i in range(cfg.n_layers) for t in spec.targets}


def test_init_starts_at_the_base_exactly_and_follows_peft():
    cfg = npllama.LlamaConfig(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=11, multiple_of=8,
                              max_seq_len=16)
    params = reference.init_params(cfg, seed=0)
    spec = lora.LoraSpec(rank=4, alpha=8)
    adapters = lora.init_adapters(cfg, spec, seed=1)
    assert len(adapters) == 2 * 7 * cfg.n_layers and spec.scale == 2.0
    assert adapters["layers.1.feed_forward.w2.lora_a"].shape == (4, cfg.hidden_dim)
    assert adapters["layers.1.feed_forward.w2.lora_b"].shape == (16, 4)
    for name, t in adapters.items():
        assert t.dtype == np.float32
        if name.endswith("lora_b"):
            assert not t.any()
        else:                                        # kaiming_uniform_(a=sqrt(5)): U(+-1/sqrt(in))
            assert 0.5 / np.sqrt(t.shape[1]) < np.abs(t).max() <= 1 / np.sqrt(t.shape[1])
    assert np.array_equal(lora.init_adapters(cfg, spec, seed=1)["layers.0.attention.wq.lora_a"],
                          adapters["layers.0.attention.wq.lora_a"])
    tokens = np.arange(12).reshape(2, 6) % 11
    expected = reference.forward(params, cfg, tokens)[0]
    got = lora.forward(params, adapters, cfg, spec, tokens)
    assert np.array_equal(got, expected)
    assert all(np.array_equal(lora.merge(params, adapters, spec)[n], params[n]) for n in params)


def test_spec_checks_and_orders_its_targets():
    spec = lora.LoraSpec(rank=2, alpha=4, targets="w2, wq")
    assert spec.targets == ("wq", "w2") and spec.scale == 2.0
    assert lora.LoraSpec.from_json(spec.to_json()) == spec
    assert lora.LoraSpec(rank=0).scale == 0.0
    for bad in (dict(targets="wq,bogus"), dict(targets=""), dict(targets="wq,wq"), dict(rank=-1), dict(alpha=0.0)):
        with pytest.raises(ValueError) as e:
            lora.LoraSpec(**bad)
        assert "lora" in str(e.value).lower() or "targets" in str(e.value)
    with pytest.raises(ValueError, match="unusable"):
        lora.LoraSpec.from_json('{"rank": 2}')


def test_adapters_that_do_not_fit_are_named():
    cfg = npllama.LlamaConfig(dim=8, n_layers=1, n_heads=2, vocab_size=5, multiple_of=8)
    spec = lora.LoraSpec(rank=2, targets="wq,wv")
    adapters = lora.init_adapters(cfg, spec)
    adapters["layers.0.attention.wq.lora_a"] = np.zeros((3, 8))
    del adapters["layers.0.attention.wv.lora_b"]
    adapters["layers.0.attention.wk.lora_a"] = np.zeros((2, 8))
    with pytest.raises(ValueError) as e:
        lora.check_adapters(adapters, cfg, spec)
    msg = str(e.value)
    assert "wv.lora_b" in msg and "wk.lora_a" in msg and "(3, 8), expected (2, 8)" in msg
