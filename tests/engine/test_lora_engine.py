"""LoRA on the engine (npllama.LoraLlama, npllama.engine.lora) against the reference (npllama.lora).

In float64 on hypothesis-drawn configs, ranks and target sets: logits, the loss and every
adapter's gradient within 1e-10 relative; no gradient for the frozen base; the base's
parameters keep their values.
"""

from unittest.mock import patch

import numpy as np
from hypothesis import given, settings, strategies as st

from npllama import Llama, LlamaConfig, lora, model as reference
from npllama.engine import passes
from npllama.gradcheck import rel_error
from npllama.llama import LoraLlama

from .test_engine_equals_reference import TOL, configs, random_model, tokens_and_targets

targets = st.lists(st.sampled_from(lora.LORA_TARGETS), min_size=1, max_size=7, unique=True)


def random_adapters(cfg, spec, seed):
    """Adapters far from their init (B != 0), so every adapter carries signal."""
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s) * 0.5 for n, s in lora.adapter_shapes(cfg, spec).items()}


@settings(max_examples=30)
@given(configs(), st.integers(1, 4), targets, st.integers(1, 4), st.integers(1, 12), st.sampled_from([1, 2]),
       st.integers(0, 10_000), st.sampled_from([1, 5, passes.CLASSIFIER_MIN_BLOCK]))
def test_lora_engine_equals_the_reference(cfg, rank, target_list, B, T, workers, seed, classifier_block):
    """classifier_block: the frozen classifier's softmax is accumulated over blocks of that many rows
    of its weight (the configs' vocabularies, up to 17, are one block of 256)."""
    with patch.object(passes, "CLASSIFIER_BLOCK_ELEMENTS", 0), patch.object(passes, "CLASSIFIER_MIN_BLOCK",
                                                                             classifier_block):
        check_lora_engine(cfg, rank, target_list, B, T, workers, seed)


def check_lora_engine(cfg, rank, target_list, B, T, workers, seed):
    spec = lora.LoraSpec(rank=rank, alpha=float(rank + 1), targets=tuple(target_list))
    base = random_model(cfg, seed)
    params = {n: p.copy() for n, p in base.params.items()}
    adapters = random_adapters(cfg, spec, seed + 2)
    tokens, targets_ = tokens_and_targets(cfg, B, T, seed)
    expected_logits = lora.forward(params, adapters, cfg, spec, tokens)
    expected_loss, expected_grads = lora.loss_and_grads(params, adapters, cfg, spec, tokens, targets_)

    adapted = LoraLlama(base, spec, adapters=adapters)
    assert rel_error(adapted.forward(tokens, workers=workers), expected_logits) < TOL
    loss, grads = adapted.loss_and_grads(tokens, targets_, workers=workers)
    assert abs(loss - expected_loss) <= TOL * abs(expected_loss)
    assert list(grads) == list(expected_grads) == list(adapted.params) == list(adapters)
    # As in test_engine_equals_reference: a gradient that is exactly 0 (wq's at T = 1: a softmax over
    # one key) comes out as rounding noise, so errors are relative to at least the norm of the whole
    # model's gradient (of the merged weights: the adapters' alone may all be such noise).
    full_grads = reference.loss_and_grads(lora.merge(params, adapters, spec), cfg, tokens, targets_)[1]
    floor = np.sqrt(sum(np.sum(g * g) for g in full_grads.values()))
    for name, g in grads.items():
        assert g.shape == adapters[name].shape and g.dtype == np.float64
        assert rel_error(g, expected_grads[name], floor=floor) < TOL, name
    # the base is never changed
    assert all(np.array_equal(base.params[n], params[n]) for n in params)


@settings(max_examples=10)
@given(configs(), targets, st.integers(0, 10_000))
def test_zero_b_and_rank_zero_give_the_base_logits_bit_for_bit(cfg, target_list, seed):
    base = random_model(cfg, seed).params
    tokens, _ = tokens_and_targets(cfg, 3, 7, seed)
    for dtype in (np.float32, np.float64):
        expected = _model(cfg, base, dtype).forward(tokens)
        for rank in (0, 3):                          # rank 0: no adapters; rank 3: B = 0 at init
            spec = lora.LoraSpec(rank=rank, targets=tuple(target_list))
            adapted = LoraLlama(_model(cfg, base, dtype), spec, seed=seed)
            assert np.array_equal(adapted.forward(tokens), expected)
            assert np.array_equal(adapted.merged().forward(tokens), expected)


def _model(cfg, params, dtype):
    return Llama.from_params(cfg, {n: p.astype(dtype) for n, p in params.items()}, dtype)


@settings(max_examples=10)
@given(configs(), st.integers(0, 3), targets, st.integers(1, 3), st.integers(1, 9), st.integers(0, 10_000))
def test_gradient_checkpointing_gives_the_same_bits(cfg, rank, target_list, B, T, seed):
    """Recomputing each block in backward (engine/passes.py) repeats the same arithmetic."""
    tokens, targets_ = tokens_and_targets(cfg, B, T, seed)
    spec = lora.LoraSpec(rank=rank, targets=tuple(target_list))
    adapted = LoraLlama(random_model(cfg, seed), spec, adapters=random_adapters(cfg, spec, seed))
    for model in (random_model(cfg, seed), adapted) if adapted.params else (random_model(cfg, seed),):
        expected_loss, expected_grads = model.loss_and_grads(tokens, targets_, workers=2)
        expected_logits = model.forward(tokens)
        model.gradient_checkpointing = True
        loss, grads = model.loss_and_grads(tokens, targets_, workers=2)
        assert loss == expected_loss and same_arrays(grads, expected_grads)
        assert np.array_equal(model.forward(tokens), expected_logits)


def same_arrays(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)


def test_a_flat_base_runs_as_it_is_and_a_loaded_one_as_laid_out_on_arrival():
    """A base made by Llama(config) holds its weights in one flat array, whose stacked views the LoRA
    engine runs; a base given separate arrays is laid out flat when it is made; neither changes."""
    cfg = LlamaConfig(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=11, multiple_of=8,
                      max_seq_len=16)
    spec = lora.LoraSpec(rank=2)
    flat_base = Llama(cfg, seed=0)
    before = dict(flat_base.params)
    adapted = LoraLlama(flat_base, spec, seed=0)
    separate = Llama.from_params(cfg, {n: p.copy() for n, p in before.items()})
    adapted_separate = LoraLlama(separate, spec, seed=0)
    tokens = np.arange(12).reshape(2, 6) % 11
    assert np.array_equal(adapted.forward(tokens), adapted_separate.forward(tokens))
    adapted.loss_and_grads(tokens, tokens)
    assert all(p is before[n] for n, p in flat_base.params.items())          # params untouched
