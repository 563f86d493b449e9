"""The engine's passes (npllama.engine, the default backend) against the reference (npllama.model).

In float64 on hypothesis-drawn configs (MHA, GQA, MQA, tied or not, odd lengths, -100 targets):
forward logits, the loss and every gradient (the training pass with attention blocks of any
size, T not a multiple of it, probabilities kept or recomputed, shards of any size), the
masked and the KV-cached forward (the prefill, also of the last position's logits only, after
cached positions), and each fused decode step in both weight layouts (stacked copies, weights
read in place; few-row GEMMs split on two threads or not) and from weights held in float16 /
bfloat16, all within 1e-10 relative of the reference. tests/test_backends.py runs the product
(training, LoRA, generation) on both backends and compares them.
"""

import contextlib
import gc
import os
import threading
import time
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import npllama
from npllama import model as reference
from npllama.engine import block, decode, passes, projections, shards
from npllama.engine import backend as engine_backend, helper as engine_helper
from npllama.engine import settings as engine_settings
from npllama.engine import cache as engine_cache
from npllama.engine.cache import DecodeCache
from npllama.engine.decode import DecodeStep
from npllama.gradcheck import rel_error
from npllama.storage import to_float, to_storage

TOL = 1e-10


@st.composite
def configs(draw):
    kvh, rep = draw(st.integers(1, 3)), draw(st.integers(1, 3))     # kvh = 1 < heads: MQA; rep = 1: MHA
    head_dim = 2 * draw(st.integers(1, 3))
    return npllama.LlamaConfig(
        dim=kvh * rep * head_dim, n_layers=draw(st.integers(1, 3)), n_heads=kvh * rep, n_kv_heads=kvh,
        vocab_size=draw(st.integers(2, 17)), hidden_dim=draw(st.integers(1, 12)), max_seq_len=12,
        tie_embeddings=draw(st.booleans()), rope_theta=draw(st.sampled_from([10000.0, 50.0])))


def random_model(cfg, seed):
    """A float64 model with weights far from the init, so every path carries signal."""
    model = npllama.Llama(cfg, seed=seed, dtype=np.float64)
    rng = np.random.default_rng(seed + 1)
    for p in model.params.values():
        p += rng.standard_normal(p.shape) * 0.3
    return model


def tokens_and_targets(cfg, B, T, seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, (B, T))
    targets = rng.integers(0, cfg.vocab_size, (B, T))
    targets[rng.random((B, T)) < 0.3] = -100
    targets[0, 0] = 1 % cfg.vocab_size
    return tokens, targets


def assert_grads_equal(grads, expected_grads, params):
    """Every gradient within TOL of the reference's, same keys in the same order, same shapes and dtype."""
    assert list(grads) == list(expected_grads) == list(params)
    # A gradient that is exactly 0 in exact arithmetic (wq's at T = 1: a softmax over one key; or a
    # window of one repeated token, whose equal value rows make the scores irrelevant) comes out as
    # rounding noise on one side or both, up to 1e-14 of the whole gradient's norm (hypothesis found
    # 1.2e-14 under NumPy 1.23), so each error is relative to at least the whole gradient's norm.
    floor = np.sqrt(sum(np.sum(g * g) for g in expected_grads.values()))
    for name, g in grads.items():
        assert g.shape == params[name].shape and g.dtype == np.float64
        assert rel_error(g, expected_grads[name], floor=floor) < TOL, name


@settings(max_examples=30)
@given(configs(), st.integers(1, 4), st.integers(1, 12), st.sampled_from([1, 2]), st.integers(0, 10_000))
def test_forward_loss_and_every_gradient_equal_the_reference(cfg, B, T, workers, seed):
    model = random_model(cfg, seed)
    tokens, targets = tokens_and_targets(cfg, B, T, seed)
    expected_logits, _ = reference.forward(model.params, cfg, tokens)
    assert rel_error(model.forward(tokens, workers=workers), expected_logits) < TOL
    expected_loss, expected_grads = reference.loss_and_grads(model.params, cfg, tokens, targets)
    loss, grads = model.loss_and_grads(tokens, targets, workers=workers)
    assert abs(loss - expected_loss) <= TOL * abs(expected_loss)
    assert_grads_equal(grads, expected_grads, model.params)


@settings(max_examples=40)
@given(configs(), st.integers(1, 4), st.integers(1, 12), st.integers(1, 5), st.booleans(), st.sampled_from([1, 2]),
       st.booleans(), st.integers(0, 10_000))
def test_training_pass_with_any_attention_block_equals_the_reference(cfg, B, T, block, keep_probs, workers,
                                                                       checkpointing, seed):
    """Query blocks of 1..5 positions (T rarely a multiple), probabilities kept or recomputed."""
    model = random_model(cfg, seed)
    tokens, targets = tokens_and_targets(cfg, B, T, seed)
    expected_loss, expected_grads = reference.loss_and_grads(model.params, cfg, tokens, targets)
    loss, grads = passes.loss_and_grads(model.params, cfg, model.rope, tokens, targets, workers=workers,
                                        block=block, keep_probs=keep_probs, checkpointing=checkpointing)
    assert abs(loss - expected_loss) <= TOL * abs(expected_loss)
    assert_grads_equal(grads, expected_grads, model.params)


def test_many_shards_on_two_threads_equal_the_reference(monkeypatch):
    """Shards smaller than the batch (several per thread), summed in order, give the reference's sums."""
    monkeypatch.setattr(shards, "MIN_SHARDED_ACTIVATIONS", 1)
    monkeypatch.setattr(shards, "SHARD_ACTIVATIONS", 64)
    cfg = npllama.LlamaConfig(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=11, multiple_of=8,
                              max_seq_len=16)
    model = random_model(cfg, 5)
    tokens, targets = tokens_and_targets(cfg, 7, 9, 6)
    expected_loss, expected_grads = reference.loss_and_grads(model.params, cfg, tokens, targets)
    loss, grads = model.loss_and_grads(tokens, targets)          # default workers: one per core
    assert abs(loss - expected_loss) <= TOL * expected_loss
    assert all(rel_error(grads[n], expected_grads[n]) < TOL for n in grads)


LAYOUTS = st.sampled_from(["stacked", "in_place"])


def key_layout(transposed: bool):
    """DecodeCache's keys stored transposed (Dh, S) or by position (S, Dh), whatever the shapes."""
    return mock.patch.object(engine_cache, "TRANSPOSED_KEYS_MAX", 1 << 62 if transposed else 0)


@pytest.mark.parametrize("transposed", [True, False])
def test_a_position_written_through_k_at_and_v_at_is_what_the_cache_holds_there(transposed):
    """DecodeCache.k_at and v_at are views of k and v with the position first: the decode step
    writes its keys and values through them, and the attention reads them from k and v."""
    with key_layout(transposed):
        cache = DecodeCache(n_layers=2, batch_size=3, n_kv_heads=2, max_seq_len=5, head_dim=4, dtype=np.float64)
    assert cache.keys_transposed == transposed
    rng = np.random.default_rng(0)
    k_new, v_new = rng.standard_normal((3, 2, 4)), rng.standard_normal((3, 2, 4))
    cache.k_at[1, 3] = k_new
    cache.v_at[1, 3] = v_new
    keys = cache.k.swapaxes(-1, -2) if transposed else cache.k            # (L, B, KVH, S, Dh)
    assert np.array_equal(keys[1, :, :, 3], k_new) and np.array_equal(cache.v[1, :, :, 3, :4], v_new)
    keys_elsewhere = np.delete(keys, 3, axis=3)
    assert not keys_elsewhere[1].any() and not keys[0].any()               # no other position or layer
    assert not np.delete(cache.v[..., :4], 3, axis=3)[1].any() and not cache.v[0, ..., :4].any()
    assert (cache.v[..., 4] == 1.0).all()                                  # the ones column untouched


@settings(max_examples=30)
@given(configs(), st.integers(1, 4), st.integers(1, 6), LAYOUTS, st.booleans(), st.booleans(),
       st.sampled_from([None, 1, projections.CLASSIFIER_COPY_MIN_STEPS]), st.booleans(), st.booleans(),
       st.booleans(), st.integers(0, 10_000))
def test_cached_prefill_and_every_decode_step_equal_the_full_reference_forward(cfg, B, P, layout, split,
                                                                               keys_transposed, steps, small_blocks,
                                                                               shifted, helper, seed):
    """split: every few-row GEMM cut into two halves of W's rows on two threads (projections.RowHalves),
    and every one-row product run on two BLAS threads, as large models' are, whatever its size and
    the machine's cores (a few rows' GEMM there in blocks of 5 of W's rows, CORES_BLOCK_ROWS, and
    a stacked layout's classifier read in place, its gain on xn, as a large classifier is; and a
    stacked copy of one or two rows under 200 weights padded with zero columns up to 200, as dim
    288's [-w1; w3] is up to GEMV_THREADS_MIN_WEIGHTS; or, at one or two rows, for a generation of
    CLASSIFIER_COPY_MIN_STEPS `steps`, copied, as a large classifier is then).
    keys_transposed: the cache's layout of keys (engine.cache).
    small_blocks: a few rows' products on one thread go one row of W a call, as OpenBLAS's small-matrix
    blocks do at scale (SMALL_BLOCKS, SMALL_GEMM_MNK), else all of W in one call.
    shifted: no softmax denominator passes the step's check (an empty SOFTMAX_SUM_RANGE), so the
    first step runs again with each row's max subtracted, and every later step runs so at once.
    helper: one row's every product, whatever its size, split in halves with a helper process
    (engine/helper.py; HELPER_MIN_WEIGHTS 0), which then takes the place of the two-thread paths,
    and, in a cache made shared as EngineDecoder makes it, each layer's attention over half of the
    heads on either side (kv heads, or the query heads of one kv head; not for one head, nor once
    shifted: then whole); else no helper process, as on a platform without one."""
    with key_layout(keys_transposed), helper_process(helper), \
            mock.patch.object(decode, "SOFTMAX_SUM_RANGE", (np.inf, 0.0) if shifted else decode.SOFTMAX_SUM_RANGE), \
            mock.patch.object(projections, "SMALL_BLOCKS", small_blocks), \
            mock.patch.object(projections, "SMALL_GEMM_MNK", 1), \
            mock.patch.object(projections, "SPLIT_MIN_WEIGHTS", 0 if split else projections.SPLIT_MIN_WEIGHTS), \
            mock.patch.object(projections, "CORES_MIN_WEIGHTS", 0 if split else projections.CORES_MIN_WEIGHTS), \
            mock.patch.object(projections, "GEMV_THREADS_MIN_WEIGHTS",
                              200 if split else projections.GEMV_THREADS_MIN_WEIGHTS), \
            mock.patch.object(projections, "GEMV_PAD_MAX_GROWTH", 100 if split else projections.GEMV_PAD_MAX_GROWTH), \
            mock.patch.object(projections, "CORES_BLOCK_ROWS", 5 if split else projections.CORES_BLOCK_ROWS), \
            mock.patch.object(projections, "get_blas_threads", lambda: 2), \
            mock.patch.object(projections, "available_cores", lambda: 2 if split or helper else 1):
        step = _decode_equals_the_reference(cfg, B, P, layout, seed, steps, shared_cache=helper and B == 1)
    assert step.shift == shifted
    assert (step.helper is not None) == (helper and B == 1 and engine_helper.available())
    halved = [part is not None for part in step.attention_halves]
    assert halved == [step.helper is not None and cfg.n_heads >= 2] * cfg.n_layers


def _decode_equals_the_reference(cfg, B, P, layout, seed, steps=None, shared_cache=False):
    """shared_cache: the cache made shared and handed to the step, as EngineDecoder does (the step's
    helper process, if it has one, then attends with half of the heads)."""
    model = random_model(cfg, seed)
    seq = np.random.default_rng(seed).integers(0, cfg.vocab_size, (B, cfg.max_seq_len))
    kv = DecodeCache.for_config(cfg, B, np.float64, shared=True) if shared_cache else model.new_kv_cache(B)
    assert isinstance(kv, DecodeCache) and kv.keys_transposed == (engine_cache.TRANSPOSED_KEYS_MAX > 0)
    prefill = model.forward(seq[:, :P], kv_cache=kv)
    assert rel_error(prefill, reference.forward(model.params, cfg, seq[:, :P])[0]) < TOL
    halves = projections.RowHalves()
    step = DecodeStep(model.params, cfg, model.rope, B, layout=layout, halves=halves, steps=steps,
                      cache=kv if shared_cache else None)
    try:
        for pos in range(P, cfg.max_seq_len):
            logits = step(seq[:, pos], pos, kv)
            expected = reference.forward(model.params, cfg, seq[:, :pos + 1])[0][:, -1]
            assert rel_error(logits, expected) < TOL, pos
    finally:                            # a failing example (and hypothesis shrinks through many) leaves no helper
        halves.close()
        step.close()
    return step


@contextlib.contextmanager
def helper_process(on: bool):
    """One-row steps with a helper process splitting every product (on; only where the platform has
    them), or none."""
    with mock.patch.object(decode, "uses_helper_process",
                           lambda params, B, steps: on and B == 1 and engine_helper.available()), \
            mock.patch.object(projections, "HELPER_MIN_WEIGHTS", 0 if on else projections.HELPER_MIN_WEIGHTS):
        yield


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("layout", ["stacked", "in_place"])
def test_scores_whose_exp_overflows_or_underflows_run_the_step_again_with_each_row_max_subtracted(sign, layout):
    """wq = +-c wk makes each query's score against its own key +-c |k|^2 / sqrt(Dh), here in the
    thousands: exp of it overflows (inf / inf) or, with every other score as far down, underflows
    (0 / 0). The step subtracts no max at first (engine.decode.SOFTMAX_SUM_RANGE); its check finds a
    denominator out of range, so it runs again with each row's max subtracted, as its later steps do
    then: every step equals the reference. Run unchecked and unshifted, the same steps do not. At the
    model's own scale, no step needs the shift."""
    cfg = npllama.LlamaConfig(dim=8, n_layers=2, n_heads=2, n_kv_heads=2, vocab_size=11, hidden_dim=12,
                              max_seq_len=8)
    model = random_model(cfg, 5)
    seq = np.random.default_rng(5).integers(0, cfg.vocab_size, (1, cfg.max_seq_len))
    seq[:] = seq[0, 0]                              # one token: each position's keys lie near the others'

    def steps_equal_the_reference(params, checked=True):
        step = DecodeStep(params, cfg, model.rope, 1, layout=layout)
        kv = model.new_kv_cache(1)
        equal = True
        for pos in range(cfg.max_seq_len):
            if checked:
                logits = step(seq[:, pos], pos, kv)
            else:
                with np.errstate(all="ignore"):
                    logits = step._step(seq[:, pos], pos, kv, None)
            expected = reference.forward(params, cfg, seq[:, :pos + 1])[0][:, -1]
            assert np.isfinite(expected).all()
            equal &= bool(rel_error(logits, expected) < TOL)
        return equal, step.shift

    assert steps_equal_the_reference(model.params) == (True, False)
    params = dict(model.params)
    for i in range(cfg.n_layers):
        params[f"layers.{i}.attention.wq.weight"] = sign * 3000.0 * params[f"layers.{i}.attention.wk.weight"]
    assert steps_equal_the_reference(params) == (True, True)
    assert steps_equal_the_reference(params, checked=False) == (False, False)


@pytest.mark.parametrize("B", [1, 2])
def test_a_copy_just_short_of_openblas_threads_is_padded_with_zeros_and_read_on_both_cores(monkeypatch, B):
    """StackedProjections pads a copy read a row at a time that falls a little short of
    GEMV_THREADS_MIN_WEIGHTS (within GEMV_PAD_MAX_GROWTH) with zero columns up to it, runs it on the
    process's BLAS threads and hands on only its own columns: the steps still equal the reference.
    The bytes a decoder copies (backend.decoder_copy_bytes, which the memory check before generation
    uses) count the padding. Neither with one BLAS thread, nor when the padding would grow the copy
    past the bound. (One row, where no helper process takes half of it: a platform without one.)"""
    cfg = npllama.LlamaConfig(dim=8, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=13, hidden_dim=20,
                              max_seq_len=10)
    model = random_model(cfg, 3)
    monkeypatch.setattr(decode, "uses_helper_process", lambda params, B, steps: False)
    monkeypatch.setattr(engine_backend, "uses_helper_process", lambda params, B, steps: False)   # decoder_copy_bytes
    monkeypatch.setattr(projections, "available_cores", lambda: 2)
    monkeypatch.setattr(projections, "GEMV_THREADS_MIN_WEIGHTS", 8 * 43)     # [-w1; w3]: 40 columns -> 43
    seq = np.random.default_rng(3).integers(0, cfg.vocab_size, (B, cfg.max_seq_len))

    def gate_up_copy(blas):
        monkeypatch.setattr(projections, "get_blas_threads", lambda: blas)
        step = DecodeStep(model.params, cfg, model.rope, B, layout="stacked")
        gate_up = step.projections.layers[0][2]
        kv = model.new_kv_cache(B)
        for pos in range(cfg.max_seq_len):
            logits = step(seq[:, pos], pos, kv)
            assert rel_error(logits, reference.forward(model.params, cfg, seq[:, :pos + 1])[0][:, -1]) < TOL, pos
        return gate_up

    def weights(product):                  # x[b] @ w: the copy, stored (in, n); a lone piece is the call itself
        piece = product.ours[0] if isinstance(product, projections.Product) else product
        return piece.args[1]

    padded = gate_up_copy(blas=2)
    assert weights(padded).shape == (8, 43) and not weights(padded)[:, 40:].any()
    assert padded.cores is not None and len(padded.ours) == B
    step = DecodeStep(model.params, cfg, model.rope, B, layout="stacked")        # the memory check's count
    assert model.backend.decoder_copy_bytes(model.params, model.dtype, B) == \
        sum(weights(p).nbytes for layer in step.projections.layers for p in layer) + \
        weights(step.projections.logits).nbytes                                 # a small classifier: copied
    assert weights(gate_up_copy(blas=1)).shape == (8, 40)
    monkeypatch.setattr(projections, "GEMV_PAD_MAX_GROWTH", 1.05)            # 43 > 40 * 1.05: no padding
    assert weights(gate_up_copy(blas=2)).shape == (8, 40)


@pytest.mark.skipif(not engine_helper.available(), reason="a helper process needs Linux on x86-64")
@pytest.mark.parametrize("layout", ["stacked", "in_place"])
def test_a_one_row_step_shares_its_large_products_with_a_helper_process(monkeypatch, layout):
    """With two cores and two BLAS threads, a one-row step forks a helper process that computes the
    second half of every product of HELPER_MIN_WEIGHTS weights or more (a stacked copy's columns, as
    two contiguous copies and never padded; or W's rows read in place), and none of the others; the
    steps equal the reference, the bytes a decoder copies are what it holds, and closing the step, or
    ending a generate call, ends the process."""
    cfg = npllama.LlamaConfig(dim=8, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=13, hidden_dim=20,
                              max_seq_len=10)
    model = random_model(cfg, 5)
    monkeypatch.setattr(projections, "available_cores", lambda: 2)
    monkeypatch.setattr(projections, "get_blas_threads", lambda: 2)
    monkeypatch.setattr(projections, "HELPER_MIN_WEIGHTS", 8 * 20)      # [-w1; w3] and w2 only
    monkeypatch.setattr(decode, "HELPER_MIN_WEIGHT_STEPS", 0)           # however short the generation
    started = []
    start = engine_helper.HelperProcess.start
    monkeypatch.setattr(engine_helper.HelperProcess, "start", lambda self: (start(self), started.append(self.pid)))
    step = DecodeStep(model.params, cfg, model.rope, 1, layout=layout)
    assert step.helper is not None and started == [step.helper.pid]
    qkv, o, gate_up, down = step.projections.layers[0]
    for product in (gate_up, down):
        assert isinstance(product, projections.Product) and product.halves is step.helper and product.cores is None
        (ours,) = product.ours
        if layout == "stacked":                                             # x @ a copy (in, n/2)
            (their_piece,) = step.helper.jobs[product.theirs]
            for piece in (ours, their_piece):
                w = piece.args[1]
                assert w.flags.c_contiguous and w.shape[1] == piece.keywords["out"].shape[0] > 0
        else:                                                               # W[:n/2] @ x, W read in place
            assert any(np.shares_memory(ours.args[0], p) for p in model.params.values())
    for product in (qkv, o):                                                # below the bound: all here
        assert not isinstance(product, projections.Product) or product.halves is None
    seq = np.random.default_rng(5).integers(0, cfg.vocab_size, cfg.max_seq_len)
    kv = model.new_kv_cache(1)
    for pos in range(cfg.max_seq_len):
        logits = step(seq[None, pos], pos, kv)
        assert rel_error(logits, reference.forward(model.params, cfg, seq[None, :pos + 1])[0][:, -1]) < TOL, pos
    if layout == "stacked":
        held = [piece.args[1] for layer in step.projections.layers for p in layer
                for piece in ([p] if not isinstance(p, projections.Product) else p.ours)]
        theirs = [piece.args[1] for job in step.helper.jobs for piece in job]
        logits = step.projections.logits
        assert model.backend.decoder_copy_bytes(model.params, model.dtype, 1) == \
            sum(w.nbytes for w in held + theirs) + logits.args[1].nbytes            # a small classifier: copied
    pid = step.helper.pid
    step.close()
    assert helper_ended(pid)
    model.generate([1, 2], max_new_tokens=5)
    assert len(started) == 2 and helper_ended(started[1])


@pytest.mark.skipif(not engine_helper.available(), reason="a helper process needs Linux on x86-64")
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (3, 1), (6, 3)])
def test_a_one_row_decoder_s_helper_process_attends_with_half_of_the_heads_the_same_bits(monkeypatch, heads,
                                                                                        kv_heads):
    """A one-row EngineDecoder whose step forks a helper process makes its cache in shared memory,
    and each layer's attention runs over half of the kv heads in either process (over half of the
    query heads of MQA's one kv head; 3 of 6 kv heads, or 1 of 3 query heads, and the rest): every
    step equals the reference, and the same decoder's steps in a cache not shared, where the step
    attends with every head here: bit for bit when split by kv heads (the same BLAS call a kv head),
    to rounding when by query heads (one query head's product a gemv where all three's is a GEMM).
    A sliding-window generation, whose full cache starts a new decoder, gives the reference
    backend's tokens."""
    cfg = npllama.LlamaConfig(dim=4 * heads, n_layers=2, n_heads=heads, n_kv_heads=kv_heads, vocab_size=13,
                              hidden_dim=20, max_seq_len=12)
    model = random_model(cfg, 7)
    monkeypatch.setattr(projections, "available_cores", lambda: 2)
    monkeypatch.setattr(projections, "get_blas_threads", lambda: 2)
    monkeypatch.setattr(projections, "HELPER_MIN_WEIGHTS", 0)
    monkeypatch.setattr(decode, "HELPER_MIN_WEIGHT_STEPS", 0)
    seq = np.random.default_rng(7).integers(0, cfg.vocab_size, cfg.max_seq_len)
    P = 3

    def steps(shared: bool):
        decoder = decode.EngineDecoder(model.params, cfg, model.rope, 1)
        assert decoder.cache.shared
        if not shared:
            decoder.cache = DecodeCache.for_config(cfg, 1, np.float64)
        decoder.prefill(seq[None, :P], None)
        try:
            logits = [decoder.step(seq[pos:pos + 1], pos, None).copy() for pos in range(P, cfg.max_seq_len)]
            step = decoder.step_fn
            assert step.helper is not None
            assert [half is not None for half in step.attention_halves] == [shared] * cfg.n_layers
            return np.array(logits)
        finally:
            decoder.close()

    halved = steps(shared=True)
    for i, pos in enumerate(range(P, cfg.max_seq_len)):
        expected = reference.forward(model.params, cfg, seq[None, :pos + 1])[0][:, -1]
        assert rel_error(halved[i], expected) < TOL, pos
    whole = steps(shared=False)
    assert np.array_equal(halved, whole) if kv_heads >= 2 else rel_error(halved, whole) < TOL
    on_reference = npllama.Llama.from_params(cfg, model.params, backend="reference")
    ids = model.generate(seq[:P], max_new_tokens=25, sliding_window=True)
    assert np.array_equal(ids, on_reference.generate(seq[:P], max_new_tokens=25, sliding_window=True))
    # a cache long enough for a half's products to reach OpenBLAS's threads: the attention whole, here
    per_call = heads // kv_heads if kv_heads >= 2 else heads - heads // 2
    largest = per_call * cfg.max_seq_len * (cfg.head_dim + 1)
    bound = "GEMV_THREADS_MIN_WEIGHTS" if per_call == 1 else "GEMM_THREADS_MIN_MNK"
    monkeypatch.setattr(decode, bound, largest)
    decoder = decode.EngineDecoder(model.params, cfg, model.rope, 1)
    decoder.prefill(seq[None, :P], None)
    try:
        decoder.step(seq[P:P + 1], P, None)
        assert decoder.step_fn.helper is not None and decoder.step_fn.attention_halves == [None] * cfg.n_layers
    finally:
        decoder.close()
    monkeypatch.setattr(decode, bound, largest + 1)
    assert steps(shared=True).shape == halved.shape      # a bound one above: shared again (steps checks)


@pytest.mark.skipif(not engine_helper.available(), reason="a helper process needs Linux on x86-64")
@pytest.mark.parametrize("layout", ["stacked", "in_place"])
def test_a_step_whose_fork_is_refused_runs_in_one_process(monkeypatch, layout):
    """A fork refused (a process limit, no memory): the step is made again without a helper process
    and still equals the reference."""
    cfg = npllama.LlamaConfig(dim=8, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=13, hidden_dim=20,
                              max_seq_len=6)
    model = random_model(cfg, 6)
    monkeypatch.setattr(projections, "available_cores", lambda: 2)
    monkeypatch.setattr(projections, "get_blas_threads", lambda: 2)
    monkeypatch.setattr(projections, "HELPER_MIN_WEIGHTS", 0)
    monkeypatch.setattr(decode, "HELPER_MIN_WEIGHT_STEPS", 0)

    def refused():
        raise BlockingIOError(11, "Resource temporarily unavailable")
    monkeypatch.setattr(os, "fork", refused)
    step = DecodeStep(model.params, cfg, model.rope, 1, layout=layout)
    assert step.helper is None
    assert not any(isinstance(p, projections.Product) and p.halves is not None
                   for layer in step.projections.layers for p in layer)
    seq = np.random.default_rng(6).integers(0, cfg.vocab_size, cfg.max_seq_len)
    kv = model.new_kv_cache(1)
    for pos in range(cfg.max_seq_len):
        logits = step(seq[None, pos], pos, kv)
        assert rel_error(logits, reference.forward(model.params, cfg, seq[None, :pos + 1])[0][:, -1]) < TOL, pos


@pytest.mark.parametrize("B, helper", [(1, False), (1, True), (3, False)])
def test_a_stacked_step_s_copies_lie_in_one_arena_the_next_step_reuses_once_it_is_closed(monkeypatch, B, helper):
    """Every copy a stacked step reads (its own pieces' and a helper process's) lies in the step's one
    projections.Arena; closed, the step refuses to run, and the next step's copies are made into the
    same memory; its steps still equal the reference at every position."""
    cfg = npllama.LlamaConfig(dim=8, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=13, hidden_dim=20,
                              max_seq_len=6)
    model = random_model(cfg, 8)
    seq = np.random.default_rng(8).integers(0, cfg.vocab_size, (B, cfg.max_seq_len))
    projections.release_spare_memory()
    copies = []
    stacked_copy = projections.stacked_copy

    def recorded(*args, **kwargs):
        copy = stacked_copy(*args, **kwargs)
        copies.extend(copy if isinstance(copy, list) else [copy])
        return copy
    with helper_process(helper), mock.patch.object(projections, "stacked_copy", recorded):
        first = DecodeStep(model.params, cfg, model.rope, B, layout="stacked")
        assert (first.helper is not None) == (helper and engine_helper.available())
        block = first.projections.arena.memory
        first.close()
        copies.clear()
        step = DecodeStep(model.params, cfg, model.rope, B, layout="stacked")
    assert first.projections.arena.memory is None and step.projections.arena.memory is block
    assert len(copies) >= 2 * cfg.n_layers and all(np.shares_memory(c, block) for c in copies)
    try:
        kv = model.new_kv_cache(B)
        for pos in range(cfg.max_seq_len):
            logits = step(seq[:, pos], pos, kv)
            assert rel_error(logits, reference.forward(model.params, cfg, seq[:, :pos + 1])[0][:, -1]) < TOL, pos
    finally:
        memory = step.projections.arena.memory
        step.close()
    with pytest.raises(npllama.NpllamaError, match="closed"):
        step(seq[:, 0], 0, model.new_kv_cache(B))
    assert DecodeStep(model.params, cfg, model.rope, B, layout="stacked").projections.arena.memory is memory


@pytest.mark.skipif(not engine_helper.available(), reason="a helper process needs Linux on x86-64")
def test_a_helper_process_is_forked_only_for_a_generation_long_enough_to_pay_for_it(monkeypatch):
    """uses_helper_process: one row, two BLAS threads on two cores, and the steps times the weights a
    step shares (products of HELPER_MIN_WEIGHTS or more) at least HELPER_MIN_WEIGHT_STEPS."""
    cfg = npllama.LlamaConfig(dim=8, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=13, hidden_dim=20,
                              max_seq_len=6)
    params = random_model(cfg, 7).params
    monkeypatch.setattr(projections, "available_cores", lambda: 2)
    monkeypatch.setattr(projections, "get_blas_threads", lambda: 2)
    monkeypatch.setattr(projections, "HELPER_MIN_WEIGHTS", 8 * 20)      # [-w1; w3] (320) and w2 (160)
    shared = projections.helper_weights(params)
    assert shared == cfg.n_layers * (320 + 160)
    monkeypatch.setattr(decode, "HELPER_MIN_WEIGHT_STEPS", 10 * shared)
    assert decode.uses_helper_process(params, 1, 10) and not decode.uses_helper_process(params, 1, 9)
    assert not decode.uses_helper_process(params, 2, 100)                   # one row only
    monkeypatch.setattr(projections, "get_blas_threads", lambda: 1)
    assert not decode.uses_helper_process(params, 1, 100)                   # blas_threads(1): none
    monkeypatch.setattr(projections, "get_blas_threads", lambda: 2)
    monkeypatch.setattr(projections, "HELPER_MIN_WEIGHTS", 10 ** 6)         # no product large enough
    assert projections.helper_weights(params) == 0 and not decode.uses_helper_process(params, 1, 10 ** 9)


@pytest.mark.skipif(not engine_helper.available(), reason="a helper process needs Linux on x86-64")
def test_a_step_dropped_unclosed_ends_its_helper_process_at_once():
    """A DecodeStep holds no reference cycle: dropped without close(), it goes at once, and its
    helper process with it, with the garbage collector off."""
    cfg = npllama.LlamaConfig(dim=8, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=13, hidden_dim=20,
                              max_seq_len=6)
    model = random_model(cfg, 9)
    with helper_process(True):
        step = DecodeStep(model.params, cfg, model.rope, 1, layout="stacked")
    step(np.array([1]), 0, model.new_kv_cache(1))
    pid = step.helper.pid
    gc.disable()
    try:
        del step
        assert helper_ended(pid)
    finally:
        gc.enable()


def helper_ended(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True                     # reaped by close()
    return False


@pytest.mark.parametrize("B", [1, 2, 3])
def test_a_long_generation_of_one_or_two_rows_copies_a_large_classifier(monkeypatch, B):
    """A stacked step reads a large classifier (CORES_MIN_WEIGHTS and more) in place, unless it has one
    or two rows and is made for CLASSIFIER_COPY_MIN_STEPS steps or more: then it reads a copy stored
    (in, n), folded with the final norm's gain. Either way the steps equal the reference, and the
    bytes a decoder copies (backend.decoder_copy_bytes) count the copy. EngineDecoder makes its step
    for the positions left in its cache, which generate sizes to the new tokens."""
    cfg = npllama.LlamaConfig(dim=8, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=13, hidden_dim=20,
                              max_seq_len=12)
    model = random_model(cfg, 4)
    classifier = model.params[reference.output_weight_name(cfg)]
    monkeypatch.setattr(projections, "CORES_MIN_WEIGHTS", classifier.size)          # 13 x 8: large
    monkeypatch.setattr(projections, "CLASSIFIER_COPY_MIN_STEPS", 6)
    seq = np.random.default_rng(4).integers(0, cfg.vocab_size, (B, cfg.max_seq_len))

    def classifier_read(steps):
        step = DecodeStep(model.params, cfg, model.rope, B, layout="stacked", steps=steps)
        kv = model.new_kv_cache(B)
        for pos in range(cfg.max_seq_len):
            logits = step(seq[:, pos], pos, kv)
            assert rel_error(logits, reference.forward(model.params, cfg, seq[:, :pos + 1])[0][:, -1]) < TOL, pos
        logits = step.projections.logits
        pieces = logits.ours if isinstance(logits, projections.Product) else [logits]
        w = pieces[0].args[1] if pieces[0].func is np.dot else pieces[0].args[0]  # x[b] @ copy, or W @ x[b]
        in_place = np.shares_memory(w, classifier)
        assert model.backend.decoder_copy_bytes(model.params, model.dtype, B, steps) == \
            model.backend.decoder_copy_bytes(model.params, model.dtype, B) + (0 if in_place else w.nbytes)
        return w, in_place

    for steps in (None, 5):
        assert classifier_read(steps)[1]
    copy, in_place = classifier_read(6)
    assert in_place == (B > projections.ROW_BY_ROW)
    if not in_place:
        np.testing.assert_array_equal(copy, (classifier * projections.norm_gain(model.params["norm.weight"])).T)

    made = []
    real_step = decode.DecodeStep
    monkeypatch.setattr(decode, "DecodeStep", lambda *a, **kw: made.append(kw["steps"]) or real_step(*a, **kw))
    prompts = [seq[b, :3] for b in range(B)]
    for new_tokens in (6, 7):                       # 3 + 6 - 1 positions, 5 of them stepped; then 6
        assert np.array_equal(model.generate_batch(prompts, new_tokens),
                              npllama.Llama.from_params(cfg, model.params, backend="reference").generate_batch(
                                  prompts, new_tokens))
    assert made == [5, 6]


@settings(max_examples=15)
@given(configs(), st.integers(1, 3), st.integers(1, 5), st.integers(1, 5), st.sampled_from([1, 2]),
       st.booleans(), st.integers(0, 10_000))
def test_forward_after_cached_positions_equals_the_reference(cfg, B, P, T, workers, keys_transposed, seed):
    """A KV-cached forward of T positions after P cached ones (prefill in two chunks), by shards of rows."""
    with key_layout(keys_transposed):
        _forward_after_cached_positions(cfg, B, P, T, workers, seed)


def _forward_after_cached_positions(cfg, B, P, T, workers, seed):
    model = random_model(cfg, seed)
    seq = np.random.default_rng(seed).integers(0, cfg.vocab_size, (B, P + T))
    kv = model.new_kv_cache(B)
    model.forward(seq[:, :P], kv_cache=kv, workers=workers)
    got = model.forward(seq[:, P:], kv_cache=kv, start_pos=P, workers=workers)
    assert rel_error(got, reference.forward(model.params, cfg, seq)[0][:, P:]) < TOL
    plain = npllama.kvcache.KVCache(cfg.n_layers, B, cfg.n_kv_heads, cfg.max_seq_len, cfg.head_dim, np.float64)
    model.forward(seq[:, :P], kv_cache=plain)                   # the reference's cache layout works too
    assert rel_error(model.forward(seq[:, P:], kv_cache=plain, start_pos=P), got) < TOL


@settings(max_examples=15)
@given(configs(), LAYOUTS, st.booleans(), st.integers(0, 10_000))
def test_masked_forward_and_decode_with_key_bias_equal_the_reference(cfg, layout, keys_transposed, seed):
    """Left padding: a mask in the prefill, a -inf key bias in the decode steps."""
    with key_layout(keys_transposed):
        _masked_forward_and_decode(cfg, layout, seed)


def _masked_forward_and_decode(cfg, layout, seed):
    model = random_model(cfg, seed)
    rng = np.random.default_rng(seed)
    B, P = 3, 5
    pads = np.array([0, 2, 4])
    tokens = rng.integers(0, cfg.vocab_size, (B, cfg.max_seq_len))
    s = np.arange(P)
    mask = (s[None, None, :] <= s[None, :, None]) & ((s[None, None, :] >= pads[:, None, None])
                                                     | (s[None, None, :] == s[None, :, None]))
    kv = model.new_kv_cache(B)
    got = model.forward(tokens[:, :P], kv_cache=kv, mask=mask)
    assert rel_error(got, reference.forward(model.params, cfg, tokens[:, :P], mask=mask)[0]) < TOL
    step = DecodeStep(model.params, cfg, model.rope, B, layout=layout)
    for pos in range(P, P + 3):
        keys = np.arange(pos + 1)
        allowed = keys[None, :] >= pads[:, None]                                # (B, S)
        key_bias = np.where(allowed, 0.0, -np.inf)[:, None, None, :]
        logits = step(tokens[:, pos], pos, kv, key_bias)
        full_mask = np.tril(np.ones((pos + 1, pos + 1), bool))[None] & (allowed[:, None, :] | np.eye(pos + 1, dtype=bool))
        expected = reference.forward(model.params, cfg, tokens[:, :pos + 1], mask=full_mask)[0][:, -1]
        assert rel_error(logits, expected) < TOL


@settings(max_examples=15)
@given(configs(), st.integers(1, 3), st.integers(1, 8), st.integers(0, 10_000))
def test_prefill_of_the_last_position_only_equals_the_reference(cfg, B, T, seed):
    model = random_model(cfg, seed)
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (B, T))
    kv = model.new_kv_cache(B)
    last = passes.forward(model.params, cfg, model.rope, tokens, kv_cache=kv, last_only=True)
    assert last.shape == (B, cfg.vocab_size)
    assert rel_error(last, reference.forward(model.params, cfg, tokens)[0][:, -1]) < TOL


@settings(max_examples=20)
@given(configs(), st.integers(1, 2), st.integers(0, 3), st.integers(1, 8), st.integers(2, 4), st.booleans(),
       st.booleans(), st.booleans(), st.integers(0, 10_000))
def test_a_prefill_cut_into_position_shards_on_threads_equals_the_reference(cfg, B, P, T, cores, last_only, masked,
                                                                              loaded, seed):
    """Fewer rows than cores: the prefill's positions in shards on threads, each later shard waiting in
    every layer for the earlier ones' keys (forced on these tiny shapes; the first shard's writes
    delayed, so a later shard that did not wait would read keys not yet written), after P cached
    positions, with a mask or not, every position's logits or the last one's. loaded: parameters
    that are separate arrays, as a loaded file's, whose stacked copies the shards share
    (passes.SharedLayers): the same bits as the model's own flat parameters give."""
    B = min(B, cores - 1)
    model = random_model(cfg, seed)
    seq = np.random.default_rng(seed).integers(0, cfg.vocab_size, (B, P + T))
    s = np.arange(P + T)
    mask = (s[None, :] <= s[:, None]) & ((s[None, :] != 1) | (s[:, None] == 1))   # key 1 hidden from the others
    expected = reference.forward(model.params, cfg, seq, mask=mask if masked else None)[0][:, P:]

    def prefill(params):
        kv = model.new_kv_cache(B)
        if P:
            model.forward(seq[:, :P], kv_cache=kv, mask=mask[:P, :P] if masked else None)
        with mock.patch.object(passes, "_shares_positions", lambda *args: True), \
                mock.patch.object(passes, "available_cores", lambda: cores), \
                mock.patch.object(passes, "_forward_by_positions", side_effect=passes._forward_by_positions) as split, \
                mock.patch.object(block, "kv_append", side_effect=late_first_writes(block.kv_append, P)), \
                shared_layers_kept() as shared:
            got = passes.forward(params, cfg, model.rope, seq[:, P:], kv_cache=kv, start_pos=P,
                                 mask=mask[P:] if masked else None, last_only=last_only)
            calls = split.call_args_list
        assert len(calls) == 1 and (T == 1 or len(calls[0].args[2]) >= 2)
        return got, shared

    got, shared = prefill(model.params)
    assert rel_error(got, expected[:, -1] if last_only else expected) < TOL
    assert shared == []                                                     # flat parameters: views, no copies
    if loaded:
        got_loaded, shared = prefill({name: a.copy() for name, a in model.params.items()})
        assert len(shared) == 1 and shared[0].made == {}                    # every layer handed to every shard
        assert np.array_equal(got_loaded, got)


@contextlib.contextmanager
def shared_layers_kept():
    """The passes.SharedLayers made inside the block, in a list."""
    made = []

    def make(*args):
        made.append(real(*args))
        return made[-1]
    real = passes.SharedLayers
    with mock.patch.object(passes, "SharedLayers", side_effect=make):
        yield made


def test_shared_layers_make_each_layer_once_wait_two_layers_ahead_and_forget_a_failed_shard():
    """passes.SharedLayers alone: one copy a layer for every shard; the first shard waits to make
    layer 2 until the other has taken layer 0; a shard's end hands out what it never took."""
    calls = []
    shared = passes.SharedLayers(lambda i: calls.append(i) or f"layer {i}", 2)
    assert shared.take(0, 0) == "layer 0" and shared.take(0, 1) == "layer 1"
    ahead = []
    first = threading.Thread(target=lambda: ahead.append(shared.take(0, 2)))
    first.start()
    first.join(0.2)
    assert first.is_alive() and ahead == []                     # layer 0 not yet taken by shard 1
    assert shared.take(1, 0) == "layer 0"
    first.join(5)
    assert ahead == ["layer 2"] and calls == [0, 1, 2] and sorted(shared.made) == [1, 2]
    shared.done(1)                                              # shard 1 failed before layers 1 and 2
    assert shared.made == {} and shared.running == 1
    assert shared.take(0, 3) == "layer 3" and shared.made == {}  # made for shard 0 alone
    shared.done(0)
    assert shared.running == 0


def test_shared_layers_hold_two_layers_at_most_and_free_the_others_when_a_shard_fails():
    """passes.SharedLayers with a later shard slowed down: the first waits to make layer i until
    layer i - 2 is taken; when a shard fails, the forward raises and a next one runs (no thread
    left waiting for it)."""
    cfg = npllama.LlamaConfig(dim=8, n_layers=6, n_heads=2, vocab_size=11, hidden_dim=8, max_seq_len=32)
    model = random_model(cfg, 3)
    loaded = {name: a.copy() for name, a in model.params.items()}
    tokens = np.random.default_rng(3).integers(0, 11, (1, 24))
    alive, made, real, kv_append = [], [], passes.SharedLayers, block.kv_append

    def counting(layer, n_shards):              # each copy made: how many are alive with it
        shared = real(lambda i: alive.append(len(shared.made) + 1) or layer(i), n_shards)
        made.append(shared)
        return shared

    def slow_later_shards(kv, k, v):
        if kv.start > 0:
            time.sleep(0.01)
        return kv_append(kv, k, v)

    def failing_later_shard(kv, k, v):
        if kv.start > 0 and kv.layer == 2:
            raise RuntimeError("shard failed")
        return kv_append(kv, k, v)

    with mock.patch.object(passes, "_shares_positions", lambda *args: True), \
            mock.patch.object(passes, "available_cores", lambda: 2), \
            mock.patch.object(passes, "SharedLayers", side_effect=counting):
        with mock.patch.object(block, "kv_append", side_effect=slow_later_shards):
            got = passes.forward(loaded, cfg, model.rope, tokens, kv_cache=model.new_kv_cache(1))
        assert rel_error(got, reference.forward(model.params, cfg, tokens)[0]) < TOL
        assert len(alive) == cfg.n_layers and max(alive) == 2 and made[-1].made == {}
        with mock.patch.object(block, "kv_append", side_effect=failing_later_shard), \
                pytest.raises(RuntimeError, match="shard failed"):
            passes.forward(loaded, cfg, model.rope, tokens, kv_cache=model.new_kv_cache(1))
        assert made[-1].made == {} and made[-1].running == 0
        again = passes.forward(loaded, cfg, model.rope, tokens, kv_cache=model.new_kv_cache(1))
    assert np.array_equal(again, got)                                        # the threads are free


def late_first_writes(kv_append, first_start):
    """kv_append, slowed down for the shard whose positions start at first_start."""
    def append(kv, k, v):
        if kv.start == first_start:
            time.sleep(0.01)
        return kv_append(kv, k, v)
    return append


def test_a_prefill_shares_its_positions_when_each_core_gets_enough_rows_and_work():
    """passes._shares_positions on the shapes it was measured on (two cores): each core at least
    FEW_ROWS positions and n_params * T / cores at least POSITION_SHARD_MIN_MACS multiply-adds."""
    shapes = {"260K": npllama.LlamaConfig(dim=64, n_layers=5, n_heads=8, n_kv_heads=4, vocab_size=512),
              "8M": npllama.LlamaConfig(dim=288, n_layers=6, n_heads=6, vocab_size=4096, tie_embeddings=True),
              "15M": npllama.LlamaConfig(dim=288, n_layers=6, n_heads=6, vocab_size=32000, tie_embeddings=True),
              "110M": npllama.LlamaConfig(dim=768, n_layers=12, n_heads=12, vocab_size=32000, tie_embeddings=True)}
    shared = {(name, T): passes._shares_positions(cfg, T, 2) for name, cfg in shapes.items()
              for T in (16, 32, 64, 128, 256)}
    assert {key for key, yes in shared.items() if yes} == {
        ("8M", 128), ("8M", 256), ("15M", 64), ("15M", 128), ("15M", 256),
        ("110M", 64), ("110M", 128), ("110M", 256)}
    assert not passes._shares_positions(shapes["110M"], 512, 1)        # one core: nothing to share


def test_position_shards_cover_the_positions_in_order_at_about_equal_cost():
    cfg = npllama.LlamaConfig(dim=768, n_layers=12, n_heads=12, vocab_size=32000, max_seq_len=1024)
    for start, T, n in ((0, 512, 2), (100, 300, 3), (0, 3, 4), (0, 1, 2)):
        shards = passes.position_shards(cfg, start, T, n)
        assert shards[0].start == 0 and shards[-1].stop == T and len(shards) == min(n, T)
        assert all(a.stop == b.start for a, b in zip(shards, shards[1:]))
    first, second = passes.position_shards(cfg, 0, 512, 2)
    assert 256 < first.stop < 300                  # the later positions attend to more keys: fewer of them


@settings(max_examples=15)
@given(configs(), st.integers(1, 3), st.sampled_from(["float16", "bfloat16"]), st.integers(0, 10_000))
def test_half_held_weights_decode_as_the_reference_on_the_same_values(cfg, B, storage, seed):
    """Weights held in float16 / bfloat16 (as uint16 bits), computed here in float64 so the
    comparison is exact to 1e-10: the prefill and every decode step read them a layer or a block of
    rows at a time (here a few rows, so every matrix takes several blocks), and must give the
    reference's logits for the very same (upcast) values."""
    with mock.patch.object(projections, "HALF_BLOCK_ELEMENTS", 2 * cfg.dim + 1):
        check_half_held_weights(cfg, B, storage, seed)


def check_half_held_weights(cfg, B, storage, seed):
    model = random_model(cfg, seed)
    held = {n: to_storage(p, storage) for n, p in model.params.items()}
    values = {n: to_float(h, np.float64) for n, h in held.items()}        # exactly the held numbers
    seq = np.random.default_rng(seed).integers(0, cfg.vocab_size, (B, cfg.max_seq_len))
    kv = model.new_kv_cache(B)
    P = 3
    prefill = passes.forward(held, cfg, model.rope, seq[:, :P], kv_cache=kv)
    assert rel_error(prefill, reference.forward(values, cfg, seq[:, :P])[0]) < TOL
    step = DecodeStep(held, cfg, model.rope, B)
    assert step.layout == "in_place"
    for pos in range(P, cfg.max_seq_len):
        expected = reference.forward(values, cfg, seq[:, :pos + 1])[0][:, -1]
        assert rel_error(step(seq[:, pos], pos, kv), expected) < TOL, pos


def test_half_held_weights_in_float32_decode_as_their_float32_values():
    """The production path (float32 compute, fast upcast a block of rows at a time) against the
    same float32 values read in place: the same dot products, so the same logits to rounding."""
    cfg = npllama.LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300, multiple_of=32,
                              max_seq_len=24)
    model = npllama.Llama(cfg, seed=3)
    for storage in ("float16", "bfloat16"):
        half = npllama.Llama.from_params(cfg, model.params, dtype=storage)
        values = npllama.Llama.from_params(cfg, {n: to_float(p) for n, p in half.params.items()})
        for B in (1, 4):
            seq = np.random.default_rng(B).integers(0, cfg.vocab_size, (B, cfg.max_seq_len))
            kv_half, kv_values = half.new_kv_cache(B), values.new_kv_cache(B)
            half.forward(seq[:, :4], kv_cache=kv_half)
            values.forward(seq[:, :4], kv_cache=kv_values)
            steps = DecodeStep(half.params, cfg, half.rope, B), DecodeStep(values.params, cfg, values.rope, B, "in_place")
            for pos in range(4, cfg.max_seq_len):
                got, want = steps[0](seq[:, pos], pos, kv_half), steps[1](seq[:, pos], pos, kv_values)
                assert got.dtype == np.float32
                assert rel_error(got, want) < 1e-6, (storage, B, pos)


@pytest.mark.skipif(engine_settings.get_blas_threads() is None,
                    reason="NumPy's BLAS is not OpenBLAS: no thread count to restore")
@pytest.mark.parametrize("stacked_max_bytes", [decode.STACKED_MAX_BYTES, 0])     # 0: weights read in place
def test_process_wide_blas_threads_are_restored_even_while_a_generator_is_paused(monkeypatch, stacked_max_bytes):
    monkeypatch.setattr(decode, "STACKED_MAX_BYTES", stacked_max_bytes)
    cfg = npllama.LlamaConfig(dim=32, n_layers=1, n_heads=4, vocab_size=13, multiple_of=8, max_seq_len=64)
    model = npllama.Llama(cfg, seed=0)
    tokens = np.random.default_rng(0).integers(0, 13, (8, 64))
    before = engine_settings.get_blas_threads()
    for threads in sorted({1, 2, before}):
        engine_settings.set_blas_threads(threads)
        model.loss_and_grads(tokens, tokens, workers=2)
        model.forward(tokens, workers=1)
        stream = model.generate_stream([1, 2, 3], max_new_tokens=5)
        next(stream)
        next(stream)                  # paused between two decode steps
        assert engine_settings.get_blas_threads() == threads
        stream.close()
    engine_settings.set_blas_threads(before)


@pytest.mark.parametrize("block_rows", [1024, 64])
@pytest.mark.parametrize("rows, held, blas", [(1, "float64", 2), (1, "float64", 1), (1, "float32", 2),
                                              (2, "float64", 2), (2, "float64", 1), (5, "float64", 2),
                                              (5, "float64", 1), (5, "float32", 2), (40, "float64", 2),
                                              (40, "float64", 1)])
def test_products_split_on_two_threads_equal_one_gemm_pass_errors_on_and_end_their_thread(monkeypatch, rows, held,
                                                                                          blas, block_rows):
    """On two BLAS threads: a gemv a row (up to ROW_BY_ROW rows), or a GEMM per block_rows rows of each
    matrix (W @ x.T up to FEW_ROWS rows). When the process runs one BLAS thread or the weights are
    held in another dtype (upcast a block at a time): up to FEW_ROWS rows in halves on two threads
    (small GEMMs, or a gemv for one row); one GEMM above."""
    monkeypatch.setattr(projections, "SPLIT_MIN_WEIGHTS", 0)
    monkeypatch.setattr(projections, "CORES_MIN_WEIGHTS", 0)
    monkeypatch.setattr(projections, "CORES_BLOCK_ROWS", block_rows)
    monkeypatch.setattr(projections, "available_cores", lambda: 2)
    monkeypatch.setattr(projections, "get_blas_threads", lambda: blas)
    rng = np.random.default_rng(0)
    ws, x = [rng.standard_normal((301, 40)).astype(held), rng.standard_normal((6, 40)).astype(held)], \
        rng.standard_normal((rows, 40))
    halves = projections.RowHalves()
    out = np.empty((rows, 307))
    buffers = (None, None) if held == "float64" else projections.half_buffers({"w": ws[0]}, x.dtype, 40)
    product = projections.Product(ws, x, out, halves, buffers=buffers)
    on_blas_threads = held == "float64" and blas == 2
    assert (product.cores is not None) == on_blas_threads
    assert (product.halves is halves) == (rows <= projections.FEW_ROWS and not on_blas_threads)
    assert product.row_by_row == (on_blas_threads and rows <= projections.ROW_BY_ROW)
    # up to FEW_ROWS rows (more than ROW_BY_ROW on BLAS threads): W @ x.T through transposed copies
    assert product.transposed == (1 < rows <= projections.FEW_ROWS and not product.row_by_row)
    if on_blas_threads:               # a gemv a row of each matrix, or a GEMM per block of rows (up to FEW_ROWS rows)
        blocks = sum(-(-len(w) // block_rows) for w in ws) if product.transposed else len(ws)
        assert len(product.ours) == (len(ws) * rows if rows <= projections.ROW_BY_ROW else blocks)
    product()
    assert rel_error(out, x @ np.concatenate(ws).astype(np.float64).T) < TOL
    first = out.copy()
    product()
    assert np.array_equal(out, first)                        # the same bits every call
    with pytest.raises(ValueError):                          # a piece fails on the helper: the caller raises
        halves.run([lambda: np.ones(3) @ np.ones(4)], [])
    product()
    assert np.array_equal(out, first)                        # and the helper is free again
    thread = halves._thread
    halves.close()
    assert thread is None or not thread.is_alive()


def test_a_generate_call_leaves_no_helper_thread_behind(monkeypatch):
    monkeypatch.setattr(projections, "SPLIT_MIN_WEIGHTS", 0)
    monkeypatch.setattr(projections, "available_cores", lambda: 2)
    monkeypatch.setattr(decode, "STACKED_MAX_BYTES", 0)
    import threading
    cfg = npllama.LlamaConfig(dim=32, n_layers=1, n_heads=4, vocab_size=13, multiple_of=8, max_seq_len=64)
    model = npllama.Llama(cfg, seed=0)
    model.generate_batch([[1, 2], [3]], max_new_tokens=4)
    assert not [t for t in threading.enumerate() if t.name == "npllama-row-halves"]
