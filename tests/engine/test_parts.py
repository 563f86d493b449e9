"""The engine's parts beyond its passes' equality with the reference: its flat arrays and
model.params' identity, the order of its sums (a step is reproducible bit for bit whatever the
threads do), its attention and its fused ops each against the op of npllama.ops they compute,
and the parameters a model starts from."""

import math
import sys

from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import npllama
from npllama import model as reference
from npllama.engine import attention, fused, passes, shards
from npllama.engine.layout import FlatLayout
from npllama.engine import projections
from npllama.engine.projections import Arena, stacked_copy
from npllama.engine.stacked import ScaledRows, adjacent_rows
from npllama.gradcheck import rel_error
from npllama.ops import (attention_backward, attention_forward, cross_entropy_backward, cross_entropy_forward,
                         embedding_backward, embedding_forward, rmsnorm_backward, rmsnorm_forward)
from npllama.ops.swiglu import sigmoid

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
    for model in (npllama.Llama(cfg, seed=1), loaded):          # made, or given arrays (laid out on arrival)
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


@pytest.mark.parametrize("backend", ["engine", "reference"])
def test_model_params_keep_their_identity_through_training_and_generation(backend):
    """Arrays a user took from model.params stay the model's: every pass and step reads and writes them."""
    model = npllama.Llama.from_params(CFG, {n: p.copy() for n, p in npllama.Llama(CFG, seed=2).params.items()},
                                      backend=backend)
    held = dict(model.params)
    opt = model.optimizer(lr=0.1)
    for _ in range(2):
        _, grads = model.loss_and_grads(*batch(CFG, 2, 5))
        opt.step(grads)
    model.generate([1, 2], max_new_tokens=3)
    model.gradient_checkpointing = True
    model.loss_and_grads(*batch(CFG, 2, 5))
    assert all(model.params[n] is held[n] for n in held)
    held["norm.weight"][...] = 0.0                         # the user's array is the model's
    assert not model.forward([[1, 2, 3]]).any()


def test_parameters_not_in_the_flat_layout_are_trained_right():
    """A replaced entry: the engine's pass stacks copies for the call, and gives the reference's gradients."""
    model = npllama.Llama(CFG, seed=3, dtype=np.float64)
    tokens, targets = batch(CFG, 3, 7, seed=3)
    model.params["layers.0.attention.wk.weight"] = model.params["layers.0.attention.wk.weight"] * 1.5
    assert FlatLayout(CFG).base_of(model.params) is None
    expected_loss, expected = reference.loss_and_grads(model.params, CFG, tokens, targets)
    for run in (lambda: passes.loss_and_grads(dict(model.params), CFG, model.rope, tokens, targets),
                lambda: model.loss_and_grads(tokens, targets)):
        loss, grads = run()
        assert loss == pytest.approx(expected_loss, rel=1e-12)
        assert all(rel_error(grads[n], expected[n]) < 1e-10 for n in expected)
    assert rel_error(model.forward(tokens), reference.forward(model.params, CFG, tokens)[0]) < 1e-10


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


def test_shards_give_every_worker_as_many_rows_where_the_rows_allow():
    """... and a pass of SHARD_ACTIVATIONS or more two shards a worker at least, where the rows allow:
    the benchmarks' b, c and a in 4 shards on two workers, p (below the bound) in 2, k's 2 rows in 2."""
    for B, T, D, workers in ((4, 128, 768, 2), (8, 256, 288, 2), (16, 256, 256, 2), (32, 128, 128, 2), (6, 64, 64, 3),
                             (16, 64, 128, 2), (2, 512, 768, 2), (24, 128, 128, 3)):
        rows = [r.stop - r.start for r in shards.shard_rows(B, T, D, workers)]
        assert len(rows) % workers == 0 and len(set(rows)) == 1, (B, T, D, rows)
        assert len(rows) >= -(-B * T * D // shards.SHARD_ACTIVATIONS) or len(rows) == B   # no larger than asked
        large = B * T * D >= shards.SHARD_ACTIVATIONS
        assert len(rows) >= min(B, (2 if large else 1) * workers), (B, T, D, rows)
    assert [len(shards.shard_rows(B, T, D, 2)) for B, T, D in
            ((16, 256, 256), (8, 256, 288), (32, 128, 128), (16, 64, 128), (2, 512, 768))] == [4, 4, 4, 2, 2]
    assert [r.stop - r.start for r in shards.shard_rows(5, 64, 64, 2)] == [2, 3]   # 5 rows: as even as it gets


def test_every_target_ignored_is_an_error():
    model = npllama.Llama(CFG)
    with pytest.raises(ValueError, match="every target is -100"):
        model.loss_and_grads([[1, 2, 3]], [[-100, -100, -100]])


@settings(max_examples=40)
@given(st.integers(1, 2), st.integers(1, 3), st.integers(1, 3), st.integers(1, 13), st.integers(1, 3),
       st.integers(1, 6), st.booleans(), st.sampled_from([1.0, 30.0]), st.booleans(), st.integers(0, 1000))
def test_block_causal_attention_equals_the_reference_op(b, KVH, R, T, half, block, keep_probs, spread, shift_all,
                                                        seed):
    """engine.attention on its own layout against ops.attention, float64: out, dq, dk, dv. spread:
    queries that large make scores whose exp overflows or underflows, so blocks fail the check of
    their sums (attention.SOFTMAX_SUM_RANGE) and subtract their rows' max; shift_all: an empty
    range, so every block does; else at the usual scale none does."""
    rng = np.random.default_rng(seed)
    H, Dh = KVH * R, 2 * half
    q, k, v = rng.standard_normal((b, H, T, Dh)), rng.standard_normal((b, KVH, T, Dh)), rng.standard_normal((b, KVH, T, Dh))
    q *= spread
    expected, cache = attention_forward(q, k, v)
    dout = rng.standard_normal(expected.shape)
    dq_ref, dk_ref, dv_ref = attention_backward(dout, cache)
    scale = 1 / math.sqrt(Dh)
    q_rows = (q * scale).reshape(b, KVH, R, T, Dh).transpose(0, 1, 3, 2, 4).reshape(b, KVH, T * R, Dh)  # rows (t, r)
    v1 = np.concatenate([v, np.ones((b, KVH, T, 1))], axis=-1)
    out = np.empty((b, T, KVH, R, Dh))
    with mock.patch.object(attention, "SOFTMAX_SUM_RANGE", (np.inf, 0.0) if shift_all else attention.SOFTMAX_SUM_RANGE):
        c = attention.attention_forward(q_rows, k, v1, out.transpose(0, 2, 1, 3, 4), block=block,
                                        keep_probs=keep_probs)
    assert len(c.shifted) == len(attention.blocks(T, block))
    if shift_all or spread == 1.0:
        assert c.shifted == [shift_all] * len(c.shifted)
    assert rel_error(out, expected.reshape(b, KVH, R, T, Dh).transpose(0, 3, 1, 2, 4)) < 1e-12
    dv = np.empty_like(k)
    dq, dk = attention.attention_backward(dout.reshape(b, KVH, R, T, Dh).transpose(0, 3, 1, 2, 4), out, c, dv)
    dq = dq.reshape(b, KVH, T, R, Dh).transpose(0, 1, 3, 2, 4).reshape(b, H, T, Dh) * scale
    floor = 1e-4 * spread * np.linalg.norm(dv_ref)      # dq = dk = 0 exactly at T = 1: rounding noise either side
    for got, expected in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
        assert rel_error(got, expected, floor=floor) < 1e-10


def test_attention_scores_whose_exp_overflows_are_shifted_and_would_be_wrong_unchecked():
    """Scores in the thousands: exp of them overflows (inf / inf) or underflows (0 / 0). Each block
    checks its rows' sums (attention.SOFTMAX_SUM_RANGE), and those out of range are computed again
    with their rows' max subtracted: out and dv equal the reference (dq and dk, nearly zero at
    softmaxes this peaked, are rounding noise on either side; test_block_causal_attention_equals_
    the_reference_op checks them in shifted blocks, at scores of tens). With the check made to pass
    whatever the sums (a range of [0, inf]), the same blocks give NaN."""
    rng = np.random.default_rng(3)
    b, KVH, R, T, Dh = 1, 2, 2, 9, 4
    q, k, v = (rng.standard_normal((b, n, T, Dh)) for n in (KVH * R, KVH, KVH))
    q *= 3000.0
    expected, cache = attention_forward(q, k, v)
    dout = rng.standard_normal(expected.shape)
    _, _, dv_ref = attention_backward(dout, cache)
    q_rows = (q / math.sqrt(Dh)).reshape(b, KVH, R, T, Dh).transpose(0, 1, 3, 2, 4).reshape(b, KVH, T * R, Dh)
    v1 = np.concatenate([v, np.ones((b, KVH, T, 1))], axis=-1)
    for unchecked in (False, True):
        out = np.empty((b, T, KVH, R, Dh))
        checked = (0.0, np.inf) if unchecked else attention.SOFTMAX_SUM_RANGE
        with mock.patch.object(attention, "SOFTMAX_SUM_RANGE", checked), np.errstate(invalid="ignore", divide="ignore"):
            c = attention.attention_forward(q_rows, k, v1, out.transpose(0, 2, 1, 3, 4), block=4, keep_probs=False)
        if unchecked:
            assert not any(c.shifted) and np.isnan(out).any()
            continue
        assert all(c.shifted)
        assert rel_error(out, expected.reshape(b, KVH, R, T, Dh).transpose(0, 3, 1, 2, 4)) < 1e-12
        dv = np.empty_like(k)
        attention.attention_backward(dout.reshape(b, KVH, R, T, Dh).transpose(0, 3, 1, 2, 4), out, c, dv)
        assert rel_error(dv, dv_ref) < 1e-12


@settings(max_examples=20)
@given(st.integers(1, 2), st.integers(1, 7), st.integers(1, 4), st.sampled_from([np.float32, np.float64]),
       st.integers(0, 1000))
def test_a_lean_block_cache_keeps_less_and_gives_the_same_backward_bits(b, T, block_size, dtype, seed):
    """LoRA's lean cache (no attention probabilities, attention output or sigmoid; backward remakes
    them) against the full cache: the same output and the same dx, bit for bit, in either dtype."""
    from npllama.engine.block import GradSink, Shape, block_backward, block_forward, rotations
    from npllama.engine.stacked import stack_layer
    from npllama.model import layer_weights, model_rope_tables
    cfg = CFG.replace(max_seq_len=8)
    params = {n: p.astype(dtype) for n, p in npllama.Llama(cfg, seed=seed).params.items()}
    cos, sin = model_rope_tables(cfg, dtype)
    rot = rotations(cos[:T], sin[:T], cfg.head_dim)
    s = Shape(b, T, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden_dim)
    w = stack_layer(layer_weights(params, 0))
    rng = np.random.default_rng(seed)
    x, dout = (rng.standard_normal((b * T, cfg.dim)).astype(dtype) for _ in range(2))
    sink = GradSink(shards.ShardSums(1), 0, 0, None)                  # frozen weights, as in LoRA
    out, full = block_forward(x, w, rot, s, cfg.norm_eps, block=block_size)
    lean_out, lean = block_forward(x, w, rot, s, cfg.norm_eps, block=block_size, lean=True)
    assert full.att is not None and full.sig is not None and full.attention.probs is not None
    assert lean.att is None and lean.sig is None and lean.attention.probs is None
    np.testing.assert_array_equal(lean_out, out)
    np.testing.assert_array_equal(block_backward(dout, lean, w, s, rot, sink), block_backward(dout, full, w, s, rot, sink))


@settings(max_examples=25)
@given(st.integers(1, 2), st.integers(1, 3), st.integers(1, 3), st.integers(1, 9), st.integers(0, 6),
       st.integers(1, 6), st.integers(0, 1000))
def test_block_causal_attention_after_cached_positions_with_a_bias_equals_the_reference_op(b, KVH, R, T, start,
                                                                                            block, seed):
    """The prefill's forward: T queries after `start` cached keys, a -inf bias on some keys."""
    rng = np.random.default_rng(seed)
    H, Dh, S = KVH * R, 4, start + T
    q, k, v = rng.standard_normal((b, H, T, Dh)), rng.standard_normal((b, KVH, S, Dh)), rng.standard_normal((b, KVH, S, Dh))
    allowed = np.tril(np.ones((T, S), bool), k=start)[None] & (rng.random((b, 1, S)) < 0.7)
    allowed |= np.eye(T, S, k=start, dtype=bool)[None]                 # every query keeps its own key
    expected, _ = attention_forward(q, k, v, allowed)
    q_rows = (q / math.sqrt(Dh)).reshape(b, KVH, R, T, Dh).transpose(0, 1, 3, 2, 4).reshape(b, KVH, T * R, Dh)
    v1 = np.concatenate([v, np.ones((b, KVH, S, 1))], axis=-1)
    out = np.empty((b, T, KVH, R, Dh))
    bias = np.where(allowed, 0.0, -np.inf)[:, None]
    attention.attention_forward(q_rows, k, v1, out.transpose(0, 2, 1, 3, 4), block=block, start=start, bias=bias)
    assert rel_error(out, expected.reshape(b, KVH, R, T, Dh).transpose(0, 3, 1, 2, 4)) < 1e-12


def test_rmsnorm_fused_equals_the_reference_op():
    rng = np.random.default_rng(0)
    x, w, dy = rng.standard_normal((9, 16)), rng.standard_normal(16), rng.standard_normal((9, 16))
    y, cache = rmsnorm_forward(x, w, 1e-5)
    rstd = fused.rms_rstd(x, 1e-5)
    assert rel_error(x * rstd * w, y) < 1e-14
    dx, dw = rmsnorm_backward(dy, cache)
    got_dx, got_dw = fused.rms_backward(dy.copy(), x, rstd, w)
    assert rel_error(got_dx, dx) < 1e-13 and rel_error(got_dw, dw) < 1e-13


def test_sigmoid_fused_equals_the_reference_op_and_saturates_quietly():
    a = np.concatenate([np.linspace(-30, 30, 101), [-1000.0, 1000.0]])
    with np.errstate(all="raise"):
        got = fused.sigmoid(a)
    assert rel_error(got, sigmoid(a)) < 1e-14 and got[-2] == 0.0 and got[-1] == 1.0


def test_cross_entropy_in_place_equals_the_reference_op():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((7, 11)) * 5
    targets = rng.integers(0, 11, 7)
    targets[[1, 4]] = -100
    expected_loss, cache = cross_entropy_forward(logits, targets)
    expected = cross_entropy_backward(1.0, cache)
    loss, dlogits = fused.cross_entropy_in_place(logits.copy(), targets, 5)
    assert loss == pytest.approx(expected_loss, rel=1e-14)
    assert rel_error(dlogits, expected) < 1e-14 and not dlogits[[1, 4]].any()


@settings(max_examples=60)
@given(st.integers(1, 9), st.integers(1, 40), st.integers(1, 6), st.integers(1, 45), st.sampled_from([1.0, 300.0]),
       st.integers(0, 10_000))
def test_a_frozen_classifier_s_loss_by_vocabulary_blocks_equals_the_reference_ops(N, V, D, block_rows, scale, seed):
    """fused.frozen_output_loss: the loss and dxn of the output projection and the cross-entropy, the
    softmax accumulated over blocks of block_rows rows of w (any size, the last one short, or one block
    for all), equal the reference ops' in float64; ignored targets give 0 rows; logits in the hundreds
    (scale 300) exercise the running max's rescaling, which must neither overflow nor lose them."""
    from npllama.ops import linear_backward, linear_forward
    rng = np.random.default_rng(seed)
    xn, w = rng.standard_normal((N, D)), rng.standard_normal((V, D)) * scale / np.sqrt(D)
    targets = rng.integers(0, V, N)
    targets[rng.random(N) < 0.3] = -100
    targets[0] = V - 1                                               # at least one valid target
    n_valid = int((targets != -100).sum())
    logits, linear_cache = linear_forward(xn, w)
    expected_loss, ce_cache = cross_entropy_forward(logits, targets)
    expected_dxn, _ = linear_backward(cross_entropy_backward(1.0, ce_cache), linear_cache)
    loss, dxn = fused.frozen_output_loss(xn, w, targets, n_valid, block_rows)
    assert loss == pytest.approx(expected_loss, rel=1e-12) and np.isfinite(dxn).all()
    # dxn = (softmax(z) w - w_y) / n: where one logit dominates, its two terms cancel to far below
    # either, so the error is measured against the size of the terms, |w_y| / n
    terms = np.linalg.norm(w[targets[targets != -100]]) / n_valid
    assert rel_error(dxn, expected_dxn, floor=terms) < 1e-10
    assert not dxn[targets == -100].any()


@pytest.mark.parametrize("vocab", [5, 300])          # the one-hot GEMM and the sorted sums
def test_embedding_rows_add_up_with_repeated_ids_as_the_reference_op(vocab):
    rng = np.random.default_rng(vocab)
    ids = rng.integers(0, 4, 50)
    rows = rng.standard_normal((50, 3))
    _, cache = embedding_forward(ids[None], np.zeros((vocab, 3)))
    expected = embedding_backward(rows[None], cache)
    np.testing.assert_allclose(fused.add_rows(np.zeros((vocab, 3)), ids, rows), expected, rtol=1e-13)


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


@settings(max_examples=30)
@given(st.integers(1, 700), st.integers(1, 40), st.sampled_from([np.float32, np.float64]))
def test_a_transposed_copy_in_row_blocks_is_w_transposed(rows, cols, dtype):
    """projections.stacked_copy of W alone, transposed: W.T, C-contiguous, across block edges (256 rows a block)."""
    w = np.random.default_rng(rows * 41 + cols).standard_normal((rows, cols)).astype(dtype)
    t = stacked_copy([ScaledRows(w, None)], dtype, transposed=True)
    assert t.flags.c_contiguous and t.dtype == dtype and np.array_equal(t, w.T)


@settings(max_examples=30)
@given(st.lists(st.tuples(st.integers(1, 600), st.booleans()), min_size=1, max_size=3), st.integers(1, 20),
       st.sampled_from([np.float32, np.float64]), st.sampled_from([np.float32, np.float64]), st.booleans())
def test_a_stacked_copy_is_the_scaled_parts_stacked_bit_for_bit(parts, cols, held, dtype, transposed):
    """projections.stacked_copy: [w_1 * f_1; w_2 * f_2; ...] (products in the parameters' dtype, then
    rounded to dtype), or its transpose, C-contiguous, across block edges (256 rows a block)."""
    rng = np.random.default_rng(len(parts) * 1000 + cols)
    scaled = [ScaledRows(rng.standard_normal((rows, cols)).astype(held),
                         rng.standard_normal(cols).astype(held) if has_factor else None)
              for rows, has_factor in parts]
    expected = np.concatenate([(w if f is None else w * f).astype(dtype) for w, f in scaled])
    copy = stacked_copy(scaled, dtype, transposed=transposed)
    assert copy.flags.c_contiguous and copy.dtype == dtype
    assert np.array_equal(copy, expected.T if transposed else expected)


@settings(max_examples=30)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 9), st.sampled_from([np.float32, np.float64,
                                                                                 np.float16])), min_size=1, max_size=6))
def test_an_arena_carves_aligned_disjoint_arrays_and_hands_its_block_to_the_next_one(shapes):
    """projections.Arena: each array C-contiguous at a multiple of ARENA_ALIGN bytes, none
    overlapping another, all within one block sized by Arena.room; no room past it; a released
    block is the next arena's that fits in it (the same memory, never a second allocation), not one
    too large for it, and release_spare_memory frees it."""
    projections.release_spare_memory()
    arena = Arena(sum(Arena.room(shape[:2], shape[2]) for shape in shapes))
    arrays = [arena.empty(shape[:2], shape[2]) for shape in shapes]
    for a, (rows, cols, dtype) in zip(arrays, shapes):
        assert a.shape == (rows, cols) and a.dtype == dtype and a.flags.c_contiguous
        if a.size:                                          # (an empty array's address is NumPy's to pick)
            assert a.__array_interface__["data"][0] % projections.ARENA_ALIGN == 0
            assert np.shares_memory(a, arena.memory)
        a[...] = 7
    for i, a in enumerate(arrays):
        for b in arrays[i + 1:]:
            assert not np.shares_memory(a, b)
    with pytest.raises(npllama.NpllamaError, match="no room"):
        arena.empty((arena.memory.size - arena.used + 1,), np.uint8)
    block = arena.memory
    arena.release()
    with pytest.raises(npllama.NpllamaError, match="no room"):            # released: carves nothing more
        arena.empty((1,), np.uint8)
    assert Arena(block.size - projections.ARENA_ALIGN).memory is block  # fits: the same block
    Arena(1).release()
    assert Arena(block.size).memory is not block                        # too large for the spare: a new one
    Arena(3).release()
    assert projections.release_spare_memory() >= 3 and projections.release_spare_memory() == 0


@settings(max_examples=40)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.integers(2, 4), st.sampled_from(["none", "gap", "order",
       "dtype", "columns", "apart", "strided"]), st.booleans())
def test_adjacent_rows_is_one_view_of_parts_lying_in_order_in_one_buffer_and_none_otherwise(rows, cols, flaw, mapped):
    """engine.stacked.adjacent_rows: parts cut one after another out of one buffer (an array, or a
    bytes object read through one memoryview per part, as np.frombuffer reads a mapped file) come back
    as one view, [p_1; p_2; ...]; a gap between two, parts out of order, another dtype or width, a part
    of another buffer, or a strided part give None (the caller copies)."""
    n = sum(rows) * cols
    values = np.arange(n + cols, dtype=np.float32)
    raw = values.tobytes()
    ends = np.cumsum([0] + rows) * cols

    def part(r0, r1, shift=0):
        if mapped:
            return np.frombuffer(memoryview(raw), np.float32, (r1 - r0), (r0 + shift) * 4).reshape(-1, cols)
        return values[r0 + shift:r1 + shift].reshape(-1, cols)
    parts = [part(a, b) for a, b in zip(ends[:-1], ends[1:])]
    if flaw != "none" and len(parts) > 1:
        if flaw == "gap":
            parts[-1] = part(ends[-2], ends[-1], shift=cols)
        elif flaw == "order":
            parts = parts[::-1]
        elif flaw == "dtype":
            parts[-1] = parts[-1].view(np.int32)
        elif flaw == "columns":
            parts[-1] = parts[-1].reshape(-1, 1)
        elif flaw == "apart":
            parts[-1] = parts[-1].copy()
        else:
            parts[-1] = values[:2 * parts[-1].size].reshape(-1, cols)[::2]
        assert adjacent_rows(parts) is None
        return
    view = adjacent_rows(parts)
    assert view is not None and np.shares_memory(view, parts[0])
    assert np.array_equal(view, np.concatenate(parts)) and view.flags.c_contiguous


@settings(max_examples=40)
@given(st.integers(2, 32), st.integers(1, 3000), st.integers(1, 700), st.sampled_from([np.float32, np.float64]),
       st.booleans(), st.integers(0, 2**16))
def test_a_few_rows_product_by_small_blocks_is_x_times_w_transposed(rows, n, n_in, dtype, small_blocks, seed):
    """projections.few_rows_product: x @ w.T as W @ x.T a block of W's rows at a time, every block
    within OpenBLAS's small-matrix bound where it has small-matrix kernels (SMALL_BLOCKS), else all of
    W in one call; contiguous, as x @ w.T is."""
    from unittest import mock
    from npllama.engine import projections
    rng = np.random.default_rng(seed)
    x, w = rng.standard_normal((rows, n_in)).astype(dtype), rng.standard_normal((n, n_in)).astype(dtype)
    calls = []
    real_matmul = np.matmul
    with mock.patch.object(projections, "SMALL_BLOCKS", small_blocks), \
            mock.patch.object(projections.np, "matmul", lambda a, *r, **k: calls.append(a.shape[0]) or real_matmul(a, *r, **k)):
        got = projections.few_rows_product(x, w)
    assert got.dtype == dtype and got.shape == (rows, n) and got.flags.c_contiguous
    want = x.astype(np.float64) @ w.astype(np.float64).T
    scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T
    assert np.all(np.abs(got - want) <= (1e-5 if dtype == np.float32 else 1e-13) * scale)
    assert sum(calls) == n
    if small_blocks:
        assert all(c * n_in * rows <= max(projections.SMALL_GEMM_MNK, n_in * rows) for c in calls)
        assert len(calls) == -(-n // max(1, projections.SMALL_GEMM_MNK // (n_in * rows)))
    else:
        assert calls == [n]


def test_small_blocks_only_where_openblas_has_small_matrix_kernels():
    """projections.SMALL_BLOCKS is whether the core OpenBLAS picked its kernels for (settings.blas_core)
    is one with small-matrix kernels of its own; NumPy's wheels bundle OpenBLAS, which names its core."""
    from npllama.engine import projections, settings
    core = settings.blas_core()
    if settings.get_blas_threads() is not None:
        assert isinstance(core, str) and core and core == core.lower()
    assert projections.SMALL_BLOCKS == (core in projections.SMALL_KERNEL_CORES)
    assert projections.small_block_rows(288, 8) == (projections.SMALL_GEMM_MNK // (288 * 8) if projections.SMALL_BLOCKS
                                                    else sys.maxsize)


def test_a_short_prompt_s_prefill_goes_by_small_blocks_and_equals_the_reference(monkeypatch):
    """A prefill of 2 to 32 positions on one BLAS thread runs its projections by few_rows_product
    (projections.linear_rows; counted), and its logits equal the reference backend's (float64, 1e-10)."""
    from npllama.engine import projections
    calls = []
    real = projections.few_rows_product
    monkeypatch.setattr(projections, "few_rows_product", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    engine = npllama.Llama(CFG, seed=3, dtype=np.float64)
    ref = npllama.Llama.from_params(CFG, engine.params, backend="reference")
    tokens = np.random.default_rng(4).integers(0, CFG.vocab_size, (1, 12))
    logits = {name: model.forward(tokens, kv_cache=model.new_kv_cache(1))
              for name, model in (("engine", engine), ("reference", ref))}
    assert calls == [12] * (4 * CFG.n_layers)          # 4 projections a block, each of the prompt's 12 rows
    assert rel_error(logits["engine"], logits["reference"]) < 1e-10


def test_a_decoder_makes_its_step_at_the_first_step_and_refuses_a_bad_layout_at_once(monkeypatch):
    """EngineDecoder: the first token comes from the prefill before any step (a small model's
    copies) is made; a one-token generation makes none, a longer one exactly one; a layout that
    is no layout is refused when the decoder is made, not after its prefill."""
    from npllama.engine import decode
    from npllama.errors import NpllamaError
    made = []
    real = decode.DecodeStep
    monkeypatch.setattr(decode, "DecodeStep", lambda *args, **kw: made.append(args[3]) or real(*args, **kw))
    model = npllama.Llama(CFG, seed=5)
    prompt = [3, 1, 4, 1, 5]
    one = list(model.generate(prompt, 1, temperature=0))
    assert made == []
    four = list(model.generate(prompt, 4, temperature=0))
    assert made == [1] and four[:1] == one
    reference = npllama.Llama.from_params(CFG, model.params, backend="reference")
    assert four == list(reference.generate(prompt, 4, temperature=0))
    with pytest.raises(NpllamaError, match="layout='rows'"):
        decode.EngineDecoder(model.params, CFG, model.rope, 1, layout="rows")
