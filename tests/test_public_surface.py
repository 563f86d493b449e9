"""The contract's public surface answers as CONTRACT.md writes it."""

import numpy as np

import npllama


def test_contract_names_are_exported():
    for name in ("LlamaConfig", "Llama", "load", "save", "AdamW", "clip_grad_norm"):
        assert hasattr(npllama, name), name
        assert name in npllama.__all__


def test_contract_walkthrough(tmp_path):
    cfg = npllama.LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=37, multiple_of=16, max_seq_len=64)
    model = npllama.Llama(cfg, seed=0, dtype=np.float64)
    x = np.random.default_rng(0).integers(0, 37, (2, 9))
    y = np.roll(x, -1, 1)
    y[:, -1] = -100
    assert model.forward(x).shape == (2, 9, 37)
    loss, grads = model.loss_and_grads(x, y)
    assert isinstance(loss, float) and set(grads) == set(model.params)
    opt = npllama.AdamW(model.params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    total = npllama.clip_grad_norm(grads, 1.0)
    assert isinstance(total, float)
    opt.step(grads)
    new_ids = model.generate([1, 2, 3], max_new_tokens=4, temperature=0.0)
    assert isinstance(new_ids, np.ndarray) and new_ids.ndim == 1 and len(new_ids) == 4
    npllama.save(model, tmp_path / "m.safetensors", format="meta", dtype="float64")   # float32 unless asked
    loaded = npllama.load(tmp_path / "m.safetensors", dtype=np.float64)
    assert loaded.config == model.config
    np.testing.assert_array_equal(loaded.forward(x), model.forward(x))


def test_model_generate_methods_agree():
    cfg = npllama.LlamaConfig(dim=16, n_layers=1, n_heads=2, vocab_size=11, multiple_of=8, max_seq_len=32)
    model = npllama.Llama(cfg, seed=3)
    ids = model.generate([1, 2, 3], max_new_tokens=6, temperature=0.7, top_k=5, min_p=0.01,
                         repetition_penalty=1.1, seed=4)
    assert list(model.generate_stream([1, 2, 3], max_new_tokens=6, temperature=0.7, top_k=5, min_p=0.01,
                                      repetition_penalty=1.1, seed=4)) == ids.tolist()
    batch = model.generate_batch([[1, 2, 3], [4]], max_new_tokens=6, temperature=0.0)
    assert batch[0].tolist() == model.generate([1, 2, 3], max_new_tokens=6).tolist()
    assert batch[1].tolist() == model.generate([4], max_new_tokens=6).tolist()
