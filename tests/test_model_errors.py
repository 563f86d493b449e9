"""Bad input gets a clear error of the ValueError family naming the problem."""

import numpy as np
import pytest

import npllama


@pytest.fixture
def model():
    cfg = npllama.LlamaConfig(dim=16, n_layers=1, n_heads=2, vocab_size=10, multiple_of=8, max_seq_len=8)
    return npllama.Llama(cfg)


@pytest.mark.parametrize("tokens,match", [
    ([[1, 10]], r"id 10 at index \(0, 1\), outside \[0, 10\)"),
    ([[-1, 2]], r"id -1"),
    ([[-100, 2]], r"id -100"),                           # -100 is for targets only
    ([[0.0, 1.0]], r"integer array"),
    ([[True, False]], r"integer array"),
    (np.zeros((1, 9), int), r"max_seq_len=8"),
    (np.zeros((1, 2, 3), int), r"shape \(B, T\)"),
    (np.zeros((1, 0), int), r"empty"),
    ([["a", "b"]], r"integer array"),
])
def test_bad_tokens(model, tokens, match):
    with pytest.raises(ValueError, match=match):
        model.forward(tokens)
    with pytest.raises(ValueError, match=match):
        model.loss_and_grads(tokens, np.zeros(np.shape(tokens), int) if np.ndim(tokens) == 2 else tokens)


def test_bad_targets(model):
    with pytest.raises(ValueError, match=r"targets holds id 10"):
        model.loss_and_grads([[1, 2]], [[1, 10]])
    with pytest.raises(ValueError, match=r"targets holds id -5"):
        model.loss_and_grads([[1, 2]], [[1, -5]])
    with pytest.raises(ValueError, match=r"targets shape"):
        model.loss_and_grads([[1, 2]], [[1, 2, 3]])
    with pytest.raises(ValueError, match=r"-100"):
        model.loss_and_grads([[1, 2]], [[-100, -100]])
    loss, _ = model.loss_and_grads([[1, 2]], [[-100, 3]])          # -100 is fine as a target
    assert np.isfinite(loss)


@pytest.mark.parametrize("kw,match", [
    (dict(n_heads=6, n_kv_heads=4, dim=24), r"n_heads=6 is not divisible by n_kv_heads=4"),
    (dict(dim=21, n_heads=3), r"head_dim = dim // n_heads = 7 is odd"),
    (dict(dim=30, n_heads=2), r"head_dim = dim // n_heads = 15 is odd"),
    (dict(dim=10, n_heads=4), r"dim=10 is not divisible by n_heads=4"),
    (dict(vocab_size=0), r"vocab_size=0 must be >= 1"),
    (dict(n_layers=2.0), r"n_layers=2.0 must be an integer"),
    (dict(norm_eps=0.0), r"norm_eps"),
    (dict(rope_theta=float("nan")), r"rope_theta"),
    (dict(ffn_dim_multiplier=-1.0), r"ffn_dim_multiplier"),
    (dict(tie_embeddings="yes"), r"tie_embeddings"),
])
def test_bad_config(kw, match):
    base = dict(dim=16, n_layers=1, n_heads=2, vocab_size=10)
    base.update(kw)
    with pytest.raises(ValueError, match=match):
        npllama.LlamaConfig(**base)


def test_config_json_round_trip_and_unknown_fields():
    cfg = npllama.LlamaConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=10, tie_embeddings=True)
    assert npllama.LlamaConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match=r"unknown LlamaConfig fields \['n_embd'\]"):
        npllama.LlamaConfig.from_dict({"n_embd": 3})


def test_bad_dtype_and_from_params(model):
    with pytest.raises(ValueError, match="float16"):
        npllama.Llama(model.config, dtype=np.float16)
    params = dict(model.params)
    params.pop("norm.weight")
    params["extra.weight"] = np.zeros(3)
    params["output.weight"] = np.zeros((3, 3))
    with pytest.raises(ValueError) as e:
        npllama.Llama.from_params(model.config, params)
    assert "norm.weight" in str(e.value) and "extra.weight" in str(e.value) and "output.weight: (3, 3)" in str(e.value)


@pytest.mark.parametrize("dtype", [np.complex64, object, np.str_, np.bool_])
def test_from_params_refuses_weights_that_are_not_real_numbers_naming_them(model, dtype):
    """(A complex array used to lose its imaginary part with only a NumPy warning.)"""
    params = dict(model.params)
    params["norm.weight"] = params["norm.weight"].astype(dtype)
    with pytest.raises(ValueError, match=r"not real numbers \['norm.weight: "):
        npllama.Llama.from_params(model.config, params)


def test_start_pos_checks(model):
    with pytest.raises(ValueError, match="needs a kv_cache"):
        model.forward([[1]], start_pos=2)
    cache = model.new_kv_cache(1)
    with pytest.raises(ValueError, match="skips positions"):
        model.forward([[1]], kv_cache=cache, start_pos=3)
    model.forward([[1, 2, 3]], kv_cache=cache)
    with pytest.raises(ValueError, match="max_seq_len=8"):
        model.forward(np.zeros((1, 6), int), kv_cache=cache, start_pos=3)
