"""Properties the architecture guarantees: causality, cache equivalence, batch independence, seeds."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import npllama


@settings(max_examples=20)
@given(st.integers(2, 12), st.data())
def test_changing_a_token_never_changes_earlier_logits(T, data):
    cfg = npllama.LlamaConfig(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=13, multiple_of=8, max_seq_len=16)
    model = npllama.Llama(cfg, seed=data.draw(st.integers(0, 99)), dtype=np.float64)
    tokens = np.array(data.draw(st.lists(st.integers(0, 12), min_size=T, max_size=T)))[None]
    t = data.draw(st.integers(0, T - 1))
    changed = tokens.copy()
    changed[0, t] = (tokens[0, t] + data.draw(st.integers(1, 12))) % 13
    before, after = model.forward(tokens), model.forward(changed)
    np.testing.assert_allclose(after[0, :t], before[0, :t], rtol=1e-13, atol=1e-15)
    assert not np.allclose(after[0, t], before[0, t])          # and position t itself does see it


def test_kv_cache_prefill_then_steps_equals_full_forward(tiny_config):
    model = npllama.Llama(tiny_config, seed=0, dtype=np.float64)
    tokens = np.random.default_rng(0).integers(0, tiny_config.vocab_size, (2, 12))
    full = model.forward(tokens)
    cache = model.new_kv_cache(batch_size=2)
    pieces = [model.forward(tokens[:, :5], kv_cache=cache, start_pos=0)]
    for p in range(5, 12):
        pieces.append(model.forward(tokens[:, p:p + 1], kv_cache=cache, start_pos=p))
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, rtol=1e-10, atol=1e-12)
    assert cache.length == 12


def test_batch_rows_are_independent(tiny_config):
    model = npllama.Llama(tiny_config, seed=1)
    tokens = np.random.default_rng(1).integers(0, tiny_config.vocab_size, (3, 9))
    together = model.forward(tokens)
    for b in range(3):
        np.testing.assert_allclose(together[b], model.forward(tokens[b:b + 1])[0], rtol=1e-5, atol=1e-6)


def test_same_seed_same_weights_and_float32_is_float64_rounded():
    cfg = npllama.LlamaConfig(dim=16, n_layers=2, n_heads=2, vocab_size=9, multiple_of=8)
    a, b = npllama.Llama(cfg, seed=7), npllama.Llama(cfg, seed=7)
    c, d = npllama.Llama(cfg, seed=8), npllama.Llama(cfg, seed=7, dtype=np.float64)
    for name in a.params:
        np.testing.assert_array_equal(a.params[name], b.params[name])
        np.testing.assert_array_equal(a.params[name], d.params[name].astype(np.float32))
        assert a.params[name].dtype == np.float32 and d.params[name].dtype == np.float64
    assert not np.array_equal(a.params["layers.0.attention.wq.weight"], c.params["layers.0.attention.wq.weight"])


def test_init_statistics_follow_the_recipe():
    cfg = npllama.LlamaConfig(dim=128, n_layers=8, n_heads=4, vocab_size=300)
    p = npllama.Llama(cfg, seed=0, dtype=np.float64).params
    assert abs(p["layers.3.attention.wq.weight"].std() - 0.02) < 0.001
    assert abs(p["layers.3.feed_forward.w2.weight"].std() - 0.02 / 4) < 0.0003     # 0.02 / sqrt(2 * 8)
    assert abs(p["layers.3.attention.wo.weight"].std() - 0.02 / 4) < 0.0003
    np.testing.assert_array_equal(p["norm.weight"], 1.0)


def test_tied_model_has_no_output_weight_and_uses_the_embedding():
    cfg = npllama.LlamaConfig(dim=8, n_layers=1, n_heads=2, vocab_size=5, multiple_of=8, tie_embeddings=True)
    model = npllama.Llama(cfg, dtype=np.float64)
    assert "output.weight" not in model.params
    before = model.forward([[1, 2]])
    model.params["tok_embeddings.weight"][3] += 1.0             # changes the logit of token 3 too
    assert not np.allclose(model.forward([[1, 2]])[0, :, 3], before[0, :, 3])


def test_one_dimensional_tokens_mean_batch_of_one(tiny_config):
    model = npllama.Llama(tiny_config)
    np.testing.assert_array_equal(model.forward([1, 2, 3]), model.forward([[1, 2, 3]])[0])


def test_hidden_dim_rule_matches_meta():
    assert npllama.LlamaConfig(dim=4096, n_heads=32, multiple_of=256).hidden_dim == 11008       # Llama 2 7B
    assert npllama.LlamaConfig(dim=8192, n_heads=64, n_kv_heads=8, multiple_of=4096,
                               ffn_dim_multiplier=1.3).hidden_dim == 28672                     # Llama 2 70B
    assert npllama.LlamaConfig(dim=288, n_heads=6, multiple_of=32).hidden_dim == 768           # llama2.c 15M
    assert npllama.LlamaConfig(dim=64, n_heads=4, hidden_dim=100).hidden_dim == 100


@pytest.mark.parametrize("workers", [2, 3, 5])
def test_sharded_loss_and_grads_equal_one_pass(tiny_config, workers):
    model = npllama.Llama(tiny_config, seed=2, dtype=np.float64)
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, tiny_config.vocab_size, (5, 7))
    targets = rng.integers(0, tiny_config.vocab_size, (5, 7))
    targets[0] = -100                                  # a shard with nothing to predict still adds up
    targets[3, :4] = -100
    loss1, grads1 = model.loss_and_grads(tokens, targets, workers=1)
    loss, grads = model.loss_and_grads(tokens, targets, workers=workers)
    assert loss == pytest.approx(loss1, rel=1e-13)
    for name in grads1:
        np.testing.assert_allclose(grads[name], grads1[name], rtol=1e-10, atol=1e-14, err_msg=name)


def test_workers_must_be_positive(tiny_config):
    model = npllama.Llama(tiny_config)
    with pytest.raises(ValueError, match="workers=0"):
        model.loss_and_grads([[1, 2]], [[2, 3]], workers=0)


def test_sharded_forward_equals_one_pass(tiny_config):
    model = npllama.Llama(tiny_config, seed=4, dtype=np.float64)
    tokens = np.random.default_rng(4).integers(0, tiny_config.vocab_size, (5, 9))
    one = model.forward(tokens, workers=1)
    for workers in (2, 3, 7):
        np.testing.assert_allclose(model.forward(tokens, workers=workers), one, rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="workers=-1"):
        model.forward(tokens, workers=-1)
