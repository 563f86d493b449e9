"""loss_and_grads reuses a gradient array that nothing holds any more (engine/layout.py
gradient_array): the same values as a new array, never an array a caller still reads, and the
kept arrays go with the model."""

import gc
import weakref

import numpy as np

import npllama
from npllama.engine import layout as layout_module

CONFIG = npllama.LlamaConfig(dim=16, n_layers=2, n_heads=2, vocab_size=11, max_seq_len=8)


def batch(seed):
    tokens = np.random.default_rng(seed).integers(0, CONFIG.vocab_size, (2, 9))
    return tokens[:, :-1], tokens[:, 1:]


def base(grads):
    return next(iter(grads.values())).base


def test_a_dropped_gradient_array_is_reused_with_a_new_step_s_values():
    model = npllama.Llama(CONFIG, seed=0)
    _, grads = model.loss_and_grads(*batch(0))
    first = weakref.ref(base(grads))
    del grads
    _, grads = model.loss_and_grads(*batch(1))
    assert base(grads) is first()                                   # reused, not a new mapping
    expected = npllama.Llama(CONFIG, seed=0).loss_and_grads(*batch(1))[1]   # a model whose arrays are new
    for name, g in grads.items():
        np.testing.assert_array_equal(g, expected[name], err_msg=name)


def test_an_array_a_caller_still_reads_is_never_reused():
    model = npllama.Llama(CONFIG, seed=0)
    _, grads = model.loss_and_grads(*batch(0))
    held = grads["layers.0.attention.wq.weight"]                 # one view held, the dict dropped
    kept = held.copy()
    del grads
    arrays = [model.loss_and_grads(*batch(seed))[1] for seed in (1, 2, 3)]   # every one held
    bases = [base(g) for g in arrays]
    assert all(b is not held.base for b in bases) and len({id(b) for b in bases}) == 3
    np.testing.assert_array_equal(held, kept)                    # untouched by the later steps


def test_a_loop_holding_the_last_step_s_gradients_alternates_two_arrays():
    model = npllama.Llama(CONFIG, seed=0)
    grads, seen = None, []
    for seed in range(5):
        loss, grads = model.loss_and_grads(*batch(seed))          # the last grads alive during the call
        seen.append(id(base(grads)))
    assert len(set(seen)) == layout_module.KEPT_GRADIENT_ARRAYS == 2
    assert seen[0] == seen[2] == seen[4] and seen[1] == seen[3]


def test_the_kept_arrays_go_with_the_model():
    model = npllama.Llama(CONFIG, seed=0)
    _, grads = model.loss_and_grads(*batch(0))
    array = weakref.ref(base(grads))
    owner = id(model.params["tok_embeddings.weight"].base)
    assert owner in layout_module._kept
    del grads, model
    gc.collect()
    assert array() is None and owner not in layout_module._kept


def test_parameters_not_in_one_flat_array_get_a_new_array_every_call():
    model = npllama.Llama(CONFIG, seed=0)
    model.params["layers.0.attention.wk.weight"] = model.params["layers.0.attention.wk.weight"] * 1.5
    assert layout_module.FlatLayout(CONFIG).base_of(model.params) is None
    _, grads = model.loss_and_grads(*batch(0))
    first = weakref.ref(base(grads))
    del grads
    assert first() is None                                        # nothing kept it


def test_a_run_s_step_keeps_no_gradient_array_for_its_evaluations():
    from npllama.train.loop import train_step
    model = npllama.Llama(CONFIG, seed=0)
    owner = id(model.params["tok_embeddings.weight"].base)
    train_step(model, model.optimizer(), [batch(0), batch(1)], 1e-3, 1.0)     # two micro-batches: two arrays
    assert owner not in layout_module._kept
    model.loss_and_grads(*batch(2))                                 # a library call keeps them again
    assert owner in layout_module._kept
