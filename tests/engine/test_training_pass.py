"""The engine's training pass beyond equality with the reference: its flat arrays, the order of
its sums (a step is reproducible bit for bit whatever the threads do), its attention on its own,
and the parameters it starts from."""

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import npllama
from npllama import model as reference
from npllama.engine import attention, shards, training
from npllama.engine.layout import FlatLayout
from npllama.gradcheck import rel_error
from npllama.ops import attention_backward, attention_forward

CFG = npllama.LlamaConfig(dim=24, n_layers=2, n_heads=6, n_kv_heads=2, vocab_size=200, hidden_dim=20,
                          max_seq_len=16)


def batch(cfg, B, T, seed=0):
    rng = np.random.default_rng(seed)
    tokens, targets = rng.integers(0, cfg.vocab_size, (B, T)), rng.integers(0, cfg.vocab_size, (B, T))
    targets[rng.random((B, T)) < 0.2] = -100
    return tokens, targets


@pytest.mark.parametrize("tied", [False, True])
def test_parameters_are_views_of_one_flat_array_and_the_stacks_are_views_too(tied):
    cfg = CFG.replace(tie_embeddings=tied)
    loaded = npllama.Llama.from_params(cfg, {n: p.copy() for n, p in npllama.Llama(cfg, seed=1).params.items()})
    before = {n: p.copy() for n, p in loaded.params.items()}
    loaded.loss_and_grads(*batch(cfg, 2, 5))               # a loaded model's first step: moved into one array
    assert all(np.array_equal(loaded.params[n], before[n]) for n in before)
    for model in (npllama.Llama(cfg, seed=1), loaded):
        layout = FlatLayout(cfg)
        flat = layout.base_of(model.params)
        assert flat is not None and flat.size == cfg.n_params()
        assert list(model.params) == list(cfg.param_shapes())
        w = layout.stacked(flat, 1)
        p = model.params
        np.testing.assert_array_equal(w.wqkv, np.concatenate([p["layers.1.attention.wq.weight"],
                                                              p["layers.1.attention.wk.weight"],
                                                              p["layers.1.attention.wv.weight"]]))
        np.testing.assert_array_equal(w.w13, np.concatenate([p["layers.1.feed_forward.w1.weight"],
                                                             p["layers.1.feed_forward.w3.weight"]]))
        assert np.shares_memory(w.wqkv, flat) and np.shares_memory(w.w13, flat)
        # matrices first, so AdamW's decayed arrays are one run; the norms after them
        assert all(layout.slots[n][0] < layout.n_decayed for n in p if p[n].ndim == 2)
        assert all(layout.slots[n][0] >= layout.n_decayed for n in p if p[n].ndim == 1)
        _, grads = model.loss_and_grads(*batch(cfg, 2, 5))
        assert layout.base_of(grads) is not None


def test_parameters_not_in_the_flat_layout_are_trained_right():
    """A replaced entry: the engine's pass gathers a copy, the model moves them back into one array."""
    model = npllama.Llama(CFG, seed=3, dtype=np.float64)
    tokens, targets = batch(CFG, 3, 7, seed=3)
    model.params["layers.0.attention.wk.weight"] = model.params["layers.0.attention.wk.weight"] * 1.5
    assert FlatLayout(CFG).base_of(model.params) is None
    expected_loss, expected = reference.loss_and_grads(model.params, CFG, tokens, targets)
    for run in (lambda: training.loss_and_grads(dict(model.params), CFG, model.rope, tokens, targets),
                lambda: model.loss_and_grads(tokens, targets)):
        loss, grads = run()
        assert loss == pytest.approx(expected_loss, rel=1e-12)
        assert all(rel_error(grads[n], expected[n]) < 1e-10 for n in expected)
    assert FlatLayout(CFG).base_of(model.params) is not None


def test_the_sums_order_is_fixed_so_threads_never_change_a_bit(monkeypatch):
    """Many shards on two threads, again and again, and on one thread: the same bits every time
    (each slot's order starts at another shard, so this also checks that rotation)."""
    monkeypatch.setattr(shards, "MIN_SHARDED_ACTIVATIONS", 1)
    monkeypatch.setattr(shards, "SHARD_ACTIVATIONS", 1)           # one shard per row: 9 shards
    model = npllama.Llama(CFG.replace(tie_embeddings=True), seed=4)
    tokens, targets = batch(model.config, 9, 11, seed=4)
    first_loss, first = model.loss_and_grads(tokens, targets, workers=1)
    for workers in (2, 2, 2, 3):
        loss, grads = model.loss_and_grads(tokens, targets, workers=workers)
        assert loss == first_loss
        for name in first:
            np.testing.assert_array_equal(grads[name], first[name], err_msg=name)


def test_every_target_ignored_is_an_error():
    model = npllama.Llama(CFG)
    with pytest.raises(ValueError, match="every target is -100"):
        model.loss_and_grads([[1, 2, 3]], [[-100, -100, -100]])


@settings(max_examples=40)
@given(st.integers(1, 2), st.integers(1, 3), st.integers(1, 3), st.integers(1, 13), st.integers(1, 3),
       st.integers(1, 6), st.booleans(), st.integers(0, 1000))
def test_block_causal_attention_equals_the_reference_op(b, KVH, R, T, half, block, keep_probs, seed):
    """engine.attention on its own layout against ops.attention, float64: out, dq, dk, dv."""
    rng = np.random.default_rng(seed)
    H, Dh = KVH * R, 2 * half
    q, k, v = rng.standard_normal((b, H, T, Dh)), rng.standard_normal((b, KVH, T, Dh)), rng.standard_normal((b, KVH, T, Dh))
    expected, cache = attention_forward(q, k, v)
    dout = rng.standard_normal(expected.shape)
    dq_ref, dk_ref, dv_ref = attention_backward(dout, cache)
    scale = 1 / math.sqrt(Dh)
    q_rows = (q * scale).reshape(b, KVH, R, T, Dh).transpose(0, 1, 3, 2, 4).reshape(b, KVH, T * R, Dh)  # rows (t, r)
    v1 = np.concatenate([v, np.ones((b, KVH, T, 1))], axis=-1)
    out = np.empty((b, T, KVH, R, Dh))
    c = attention.attention_forward(q_rows, k, v1, out.transpose(0, 2, 1, 3, 4), block=block, keep_probs=keep_probs)
    assert rel_error(out, expected.reshape(b, KVH, R, T, Dh).transpose(0, 3, 1, 2, 4)) < 1e-12
    dv = np.empty_like(k)
    dq, dk = attention.attention_backward(dout.reshape(b, KVH, R, T, Dh).transpose(0, 3, 1, 2, 4), out, c, dv)
    dq = dq.reshape(b, KVH, T, R, Dh).transpose(0, 1, 3, 2, 4).reshape(b, H, T, Dh) * scale
    floor = 1e-4 * np.linalg.norm(dv_ref)        # dq = dk = 0 exactly at T = 1: rounding noise either side
    for got, expected in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
        assert rel_error(got, expected, floor=floor) < 1e-10


def test_cross_entropy_in_place_equals_the_reference_op():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((7, 11)) * 5
    targets = rng.integers(0, 11, 7)
    targets[[1, 4]] = -100
    expected_loss, cache = npllama.ops.cross_entropy_forward(logits, targets, normalizer=9)
    expected = npllama.ops.cross_entropy_backward(1.0, cache)
    loss, dlogits = training.cross_entropy_in_place(logits.copy(), targets, 9)
    assert loss == pytest.approx(expected_loss, rel=1e-14)
    assert rel_error(dlogits, expected) < 1e-14 and not dlogits[[1, 4]].any()


@pytest.mark.parametrize("vocab", [5, 300])          # the one-hot GEMM and the sorted sums
def test_embedding_rows_add_up_with_repeated_ids(vocab):
    rng = np.random.default_rng(vocab)
    ids = rng.integers(0, 4, 50)
    rows = rng.standard_normal((50, 3))
    expected = np.zeros((vocab, 3))
    np.add.at(expected, ids, rows)
    np.testing.assert_allclose(training.add_rows(np.zeros((vocab, 3)), ids, rows), expected, rtol=1e-13)


def test_init_draws_in_chunks_give_the_one_shot_values(monkeypatch):
    """The documented init: float64 N(0, std) in param_shapes order, rounded; chunking changes nothing."""
    cfg = npllama.LlamaConfig(dim=16, n_layers=2, n_heads=2, vocab_size=37, multiple_of=8)
    monkeypatch.setattr(reference, "INIT_CHUNK", 100)             # many chunks, a partial last one
    rng = np.random.default_rng(11)
    residual = 0.02 / math.sqrt(2 * cfg.n_layers)
    for dtype in (np.float32, np.float64):
        model = npllama.Llama(cfg, seed=11, dtype=dtype)
        rng = np.random.default_rng(11)
        for name, shape in cfg.param_shapes().items():
            if name.endswith("norm.weight"):
                np.testing.assert_array_equal(model.params[name], 1.0)
                continue
            std = residual if name.endswith(("wo.weight", "w2.weight")) else 0.02
            np.testing.assert_array_equal(model.params[name], (rng.standard_normal(shape) * std).astype(dtype))
