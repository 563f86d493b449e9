"""Weights in and out without torch: safetensors I/O, Meta/HF round trips, permutes, llama2.c, refusals."""

import json
import os
import pickle
import struct
import warnings
import zipfile

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import npllama
from npllama.io import checkpoint as ck, hf as cv
from npllama.io.errors import CheckpointError, ConfigMismatchError, PickleRefusedError, TensorMismatchError
from npllama.io.llama2c import LLAMA2C_MAGIC
from npllama.io.metadata import SAVE_ID_KEY
from npllama.io.safetensors import Bfloat16, read_safetensors, read_safetensors_header, write_safetensors_atomic
from npllama.storage import bfloat16_to_float32, float32_to_bfloat16
from npllama.ops import rope_frequencies
from npllama.tokenizers import CharTokenizer

from .conftest import data_file


def random_model(cfg, seed=0, dtype=np.float32):
    """A model whose every parameter (norms too) is random, so any mix-up changes the logits."""
    model = npllama.Llama(cfg, seed=seed, dtype=dtype)
    rng = np.random.default_rng(seed + 1)
    for p in model.params.values():
        p[...] = rng.standard_normal(p.shape) * (0.3 if p.ndim == 1 else 0.5) + (1.0 if p.ndim == 1 else 0.0)
    return model


def gqa_config(**kw):
    base = dict(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=11, multiple_of=8, max_seq_len=16)
    return npllama.LlamaConfig(**{**base, **kw})


TOKENS = np.array([[1, 5, 3, 9, 0, 2, 7]])


# ----------------------------------------------------------------------------- permutes and names

@given(kvh=st.integers(1, 4), rep=st.integers(1, 3), half=st.integers(1, 4), d=st.integers(1, 5),
       seed=st.integers(0, 2**16))
def test_permute_then_unpermute_is_identity(kvh, rep, half, d, seed):
    rng = np.random.default_rng(seed)
    for n in (kvh, kvh * rep):  # k uses n_kv_heads rows, q uses n_heads rows
        w = rng.standard_normal((n * 2 * half, d))
        assert np.array_equal(cv.permute_hf_to_meta(cv.permute_meta_to_hf(w, n), n), w)
        assert np.array_equal(cv.permute_meta_to_hf(cv.permute_hf_to_meta(w, n), n), w)


def test_permute_moves_rows_as_documented():
    # one head of Dh=6 over D=1: meta rows 0..5 are pairs (0,1) (2,3) (4,5); HF puts evens first
    w = np.arange(12.0).reshape(12, 1)  # two heads
    hf = cv.permute_meta_to_hf(w, 2).ravel()
    assert hf.tolist() == [0, 2, 4, 1, 3, 5, 6, 8, 10, 7, 9, 11]


def _rope_meta(x, theta):
    """Meta: rotate pairs (2j, 2j+1) of the last axis by p * theta_j."""
    T, Dh = x.shape
    ang = np.arange(T)[:, None] * rope_frequencies(Dh, theta)[None]
    a, b = x[:, 0::2], x[:, 1::2]
    out = np.empty_like(x)
    out[:, 0::2] = a * np.cos(ang) - b * np.sin(ang)
    out[:, 1::2] = a * np.sin(ang) + b * np.cos(ang)
    return out


def _rope_hf(x, theta):
    """transformers: x * cos + rotate_half(x) * sin with angles cat(ang, ang)."""
    T, Dh = x.shape
    ang = np.arange(T)[:, None] * rope_frequencies(Dh, theta)[None]
    cos, sin = np.cos(np.concatenate([ang, ang], 1)), np.sin(np.concatenate([ang, ang], 1))
    rot = np.concatenate([-x[:, Dh // 2:], x[:, :Dh // 2]], 1)
    return x * cos + rot * sin


def test_permuted_projection_under_hf_rope_gives_the_same_attention_scores(rng):
    n, Dh, D, T = 3, 8, 5, 7
    x = rng.standard_normal((T, D))
    wq, wk = rng.standard_normal((n * Dh, D)), rng.standard_normal((n * Dh, D))
    for h in range(n):
        rows = slice(h * Dh, (h + 1) * Dh)
        qm, km = _rope_meta(x @ wq[rows].T, 500.0), _rope_meta(x @ wk[rows].T, 500.0)
        qh = _rope_hf(x @ cv.permute_meta_to_hf(wq, n)[rows].T, 500.0)
        kh = _rope_hf(x @ cv.permute_meta_to_hf(wk, n)[rows].T, 500.0)
        np.testing.assert_allclose(qh @ kh.T, qm @ km.T, rtol=1e-12, atol=1e-12)


def test_name_maps_cover_every_parameter_both_ways():
    cfg = gqa_config(n_layers=3)
    for name in cfg.param_shapes():
        hf = cv.meta_to_hf_name(name)
        assert hf is not None and cv.is_hf_name(hf)
        assert cv.hf_to_meta_name(hf) == name
    assert cv.meta_to_hf_name("layers.2.feed_forward.w1.weight") == "model.layers.2.mlp.gate_proj.weight"
    assert cv.meta_to_hf_name("output.weight") == "lm_head.weight"
    assert cv.hf_to_meta_name("model.layers.0.self_attn.rotary_emb.inv_freq") is None


# ----------------------------------------------------------------------------- safetensors I/O

def test_safetensors_write_read_all_dtypes(tmp_path):
    t = {"f32": np.arange(6, dtype=np.float32).reshape(2, 3), "f64": np.array(2.5),
         "f16": np.ones((3,), np.float16), "i64": np.array([1, -2], np.int64), "empty": np.zeros((0, 4), np.float32),
         "bf16": Bfloat16(float32_to_bfloat16(np.array([1.0, -2.5, 3.140625], np.float32)))}
    write_safetensors_atomic(tmp_path / "x.safetensors", t, {"note": "hi"})
    got, meta = read_safetensors(tmp_path / "x.safetensors")
    assert meta == {"note": "hi", "format": "pt"}
    assert list(got) == list(t)
    for k in ("f32", "f64", "f16", "i64", "empty"):
        assert got[k].dtype == t[k].dtype and np.array_equal(got[k], t[k])
    assert got["bf16"].dtype == np.float32 and got["bf16"].tolist() == [1.0, -2.5, 3.140625]
    with open(tmp_path / "x.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    assert n % 8 == 0


def test_bf16_rounds_to_nearest_even():
    x = np.array([1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-7 + 2**-9], np.float32)
    back = bfloat16_to_float32(float32_to_bfloat16(x))
    assert back.tolist() == [1.0, 1.0 + 2**-6, 1.0 + 2**-7 + 0]


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "m.safetensors"
    write_safetensors_atomic(path, {"a": np.ones(3, np.float32)})
    before = path.read_bytes()

    def boom(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        write_safetensors_atomic(path, {"a": np.zeros(1000, np.float32)})
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]  # no temp file left


# ----------------------------------------------------------------------------- round trips

def test_meta_round_trip_is_exact_with_tokenizer(tiny_config, tmp_path):
    model = random_model(tiny_config)
    model.tokenizer = CharTokenizer("abcdefghij ")
    path = npllama.save(model, tmp_path / "m.safetensors", format="meta")
    _, meta = read_safetensors(path)
    assert meta["format"] == "pt" and npllama.LlamaConfig.from_json(meta["npllama_config"]) == tiny_config
    back = npllama.load(path)
    assert back.config == tiny_config
    assert back.params.keys() == model.params.keys()
    for n, p in model.params.items():
        assert back.params[n].dtype == np.float32 and np.array_equal(back.params[n], p), n
    assert back.tokenizer == model.tokenizer
    np.testing.assert_array_equal(back.forward(TOKENS % 11), model.forward(TOKENS % 11))


def test_sentencepiece_tokenizer_travels_with_both_formats(tmp_path):
    from npllama.tokenizers import SentencePieceTokenizer
    tok = SentencePieceTokenizer.from_file(data_file("llama2-tokenizer.model"))
    model = random_model(gqa_config())
    model.tokenizer = tok
    folder = npllama.save(model, tmp_path / "hf", format="hf")
    assert (folder / "tokenizer.model").read_bytes() == data_file("llama2-tokenizer.model").read_bytes()
    hf = json.loads((folder / "config.json").read_text())
    assert (hf["bos_token_id"], hf["eos_token_id"]) == (tok.bos_id, tok.eos_id) == (1, 2)
    metadata = read_safetensors_header(folder / "model.safetensors")[1]
    assert metadata.pop(SAVE_ID_KEY) == hf[SAVE_ID_KEY] and metadata == {"format": "pt"}    # no tokenizer inside
    assert npllama.load(folder).tokenizer == tok
    assert npllama.load(npllama.save(model, tmp_path / "m.safetensors", format="meta")).tokenizer == tok
    (folder / "tokenizer.model").unlink()     # tokenizer.json, written beside it, then gives the same ids
    from_json = npllama.load(folder).tokenizer
    assert type(from_json).__name__ == "HFTokenizer" and (from_json.bos_id, from_json.eos_id) == (1, 2)
    text = "Hello  world, good night sweet prince\n"
    assert from_json.encode(text) == tok.encode(text) and from_json.decode(tok.encode(text)) == text


def test_hf_round_trip_without_torch(tiny_config, tmp_path):
    model = random_model(tiny_config)
    folder = npllama.save(model, tmp_path / "hf", format="hf")
    assert {p.name for p in folder.iterdir()} == {"model.safetensors", "config.json", "generation_config.json"}
    assert json.loads((folder / "generation_config.json").read_text()) == {}     # no tokenizer: no BOS / EOS
    hf = json.loads((folder / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["model_type"] == "llama"
    assert hf["num_key_value_heads"] == tiny_config.n_kv_heads and hf["torch_dtype"] == "float32"
    tensors, meta = read_safetensors(folder / "model.safetensors")
    assert meta == {"format": "pt", SAVE_ID_KEY: hf[SAVE_ID_KEY]}        # one save: config.json says the same
    assert ("lm_head.weight" in tensors) == (not tiny_config.tie_embeddings)
    wq = model.params["layers.1.attention.wq.weight"]
    assert not np.array_equal(tensors["model.layers.1.self_attn.q_proj.weight"], wq)  # permuted on save
    back = npllama.load(folder)
    assert back.tokenizer is None
    for n, p in model.params.items():
        assert np.array_equal(back.params[n], p), n


def test_float64_model_saves_float32_unless_asked(tmp_path):
    model = random_model(gqa_config(), dtype=np.float64)
    ck.save(model, tmp_path / "a.safetensors", format="meta")
    ck.save(model, tmp_path / "b.safetensors", format="meta", dtype=np.float64)
    a, _ = read_safetensors(tmp_path / "a.safetensors")
    b, _ = read_safetensors(tmp_path / "b.safetensors")
    assert a["norm.weight"].dtype == np.float32 and b["norm.weight"].dtype == np.float64
    back = npllama.load(tmp_path / "b.safetensors", dtype=np.float64)
    assert all(np.array_equal(back.params[n], p) for n, p in model.params.items())


@pytest.mark.parametrize("dtype,tol", [("float16", 1e-3), ("bfloat16", 8e-3)])
def test_half_precision_is_upcast_on_load(tmp_path, dtype, tol):
    model = random_model(gqa_config())
    folder = ck.save(model, tmp_path / "hf", format="hf", dtype=dtype)
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == dtype
    header, _ = read_safetensors_header(folder / "model.safetensors")
    assert {d for d, _ in header.values()} == {"F16" if dtype == "float16" else "BF16"}
    back = npllama.load(folder, dtype=np.float64)
    for n, p in model.params.items():
        assert back.params[n].dtype == np.float64
        np.testing.assert_allclose(back.params[n], p, rtol=tol, atol=tol * 1e-2)


def _write_sharded(folder, model):
    hf = cv.meta_to_hf(model.params, model.config)
    names = list(hf)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    folder.mkdir()
    for shard, part in shards.items():
        write_safetensors_atomic(folder / shard, {n: hf[n] for n in part})
    index = {"metadata": {"total_size": 0}, "weight_map": {n: s for s, part in shards.items() for n in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps(cv.llama_to_hf_config(model.config)))
    return shards


def test_a_saved_model_s_stacks_are_views_of_its_file_and_give_the_same_bits(tmp_path):
    """format="meta" stores each block's [wq; wk; wv] and [w1; w3] next to each other (the engine's
    flat order), so the loaded model's passes read them as views of the file, not copies, and compute
    the same bits as the model that was saved. A transformers folder's q and k (un-permuted on loading)
    are copied."""
    from npllama.engine.passes import block_layers
    from npllama.model import layer_weights
    model = random_model(gqa_config())
    back = npllama.load(npllama.save(model, tmp_path / "m.safetensors", format="meta"))
    for i, layer in enumerate(block_layers(back.params, back.config, np.float32)):
        w = layer_weights(back.params, i)
        assert np.shares_memory(layer.wqkv, w.wv) and np.shares_memory(layer.w13, w.w3), i
        assert np.array_equal(layer.wqkv, np.concatenate((w.wq, w.wk, w.wv)))
        assert np.array_equal(layer.w13, np.concatenate((w.w1, w.w3)))
    np.testing.assert_array_equal(back.forward(TOKENS), model.forward(TOKENS))
    from_hf = npllama.load(npllama.save(model, tmp_path / "hf", format="hf"))
    layer = block_layers(from_hf.params, from_hf.config, np.float32)[0]
    assert not np.shares_memory(layer.wqkv, from_hf.params["layers.0.attention.wv.weight"])
    assert np.array_equal(layer.wqkv, np.concatenate([from_hf.params[f"layers.0.attention.{n}.weight"]
                                                      for n in ("wq", "wk", "wv")]))


def test_sharded_hf_folder_loads(tmp_path):
    model = random_model(gqa_config())
    _write_sharded(tmp_path / "sharded", model)
    back = npllama.load(tmp_path / "sharded")
    np.testing.assert_array_equal(back.forward(TOKENS), model.forward(TOKENS))
    # a save there replaces the sharded model whole (io/atomic.py): no old shard can shadow the new
    # weights, and a file that is not part of a model stays
    (tmp_path / "sharded" / "README.md").write_text("notes")
    other = random_model(gqa_config(), seed=1)
    npllama.save(other, tmp_path / "sharded", format="hf")
    assert {p.name for p in (tmp_path / "sharded").iterdir()} == {"README.md", "config.json", "model.safetensors",
                                                                 "generation_config.json"}
    np.testing.assert_array_equal(npllama.load(tmp_path / "sharded").forward(TOKENS), other.forward(TOKENS))


def test_sharded_folder_with_a_missing_or_inconsistent_shard_is_refused(tmp_path):
    model = random_model(gqa_config())
    shards = _write_sharded(tmp_path / "s", model)
    first = next(iter(shards))
    index = json.loads((tmp_path / "s" / "model.safetensors.index.json").read_text())
    moved = shards[first][0]
    index["weight_map"][moved] = "model-00002-of-00002.safetensors"
    (tmp_path / "s" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="disagrees with model.safetensors.index.json"):
        npllama.load(tmp_path / "s")
    (tmp_path / "s" / first).unlink()
    index["weight_map"][moved] = first
    (tmp_path / "s" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match=first):
        npllama.load(tmp_path / "s")


def test_safetensors_with_config_json_beside_it(tmp_path):
    model = random_model(gqa_config())
    hf = cv.meta_to_hf(model.params, model.config)
    write_safetensors_atomic(tmp_path / "weights.safetensors", hf)
    (tmp_path / "config.json").write_text(json.dumps(cv.llama_to_hf_config(model.config)))
    back = npllama.load(tmp_path / "weights.safetensors")
    np.testing.assert_array_equal(back.forward(TOKENS), model.forward(TOKENS))
    # an npllama-style config.json (LlamaConfig.to_json) works too, with Meta names
    write_safetensors_atomic(tmp_path / "weights.safetensors", model.params)
    (tmp_path / "config.json").write_text(model.config.to_json())
    assert npllama.load(tmp_path / "weights.safetensors").config == model.config


def test_training_checkpoint_skips_optimizer_state_knowingly(tmp_path):
    model = random_model(gqa_config())
    tensors = dict(model.params)
    for n, p in model.params.items():
        tensors[f"optimizer.exp_avg.{n}"] = np.zeros_like(p)
        tensors[f"optimizer.exp_avg_sq.{n}"] = np.zeros_like(p)
    meta = {"npllama_config": model.config.to_json(), "npllama_train_state": json.dumps({"step": 3})}
    write_safetensors_atomic(tmp_path / "ckpt.safetensors", tensors, meta)
    back = npllama.load(tmp_path / "ckpt.safetensors")
    assert back.params.keys() == model.params.keys()
    del meta["npllama_train_state"]  # without it, optimizer tensors are unexpected
    write_safetensors_atomic(tmp_path / "ckpt.safetensors", tensors, meta)
    with pytest.raises(TensorMismatchError, match="optimizer.exp_avg.norm.weight"):
        npllama.load(tmp_path / "ckpt.safetensors")


def test_rope_buffers_are_checked_then_skipped(tmp_path):
    model = random_model(gqa_config(rope_theta=500.0))
    hf = cv.meta_to_hf(model.params, model.config)
    hf["model.layers.0.self_attn.rotary_emb.inv_freq"] = rope_frequencies(4, 500.0).astype(np.float32)
    write_safetensors_atomic(tmp_path / "w.safetensors", hf)
    (tmp_path / "config.json").write_text(json.dumps(cv.llama_to_hf_config(model.config)))
    npllama.load(tmp_path / "w.safetensors")
    cfg = cv.llama_to_hf_config(model.config)
    cfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"] = 10000.0
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigMismatchError, match="rope_theta=10000.0"):
        npllama.load(tmp_path / "w.safetensors")


# ----------------------------------------------------------------------------- config.json

def test_hf_config_both_rope_layouts():
    base = dict(model_type="llama", hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=50, max_position_embeddings=64,
                rms_norm_eps=1e-5, tie_word_embeddings=True)
    v4 = hf = cv.hf_config_to_llama({**base, "rope_theta": 5e5, "rope_scaling": None})
    v5 = cv.hf_config_to_llama({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    assert v4 == v5 and hf.rope_theta == 5e5 and hf.hidden_dim == 40 and hf.n_kv_heads == 2 and hf.tie_embeddings
    minimal = cv.hf_config_to_llama({k: base[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                          "num_attention_heads", "vocab_size")})
    assert (minimal.norm_eps, minimal.rope_theta, minimal.n_kv_heads, minimal.max_seq_len) == (1e-6, 1e4, 4, 2048)
    cfg = gqa_config(rope_theta=123.0, norm_eps=1e-6, tie_embeddings=True)
    assert cv.hf_config_to_llama(cv.llama_to_hf_config(cfg)).to_dict() == {**cfg.to_dict(), "multiple_of": 32}


@pytest.mark.parametrize("change,field", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "rope_parameters"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"head_dim": 16}, "head_dim"),
    ({"model_type": "mistral"}, "model_type"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
])
def test_hf_config_refuses_what_npllama_cannot_represent(change, field):
    d = cv.llama_to_hf_config(gqa_config())
    d.update(change)
    with pytest.raises(cv.UnsupportedConfigError, match=field):
        cv.hf_config_to_llama(d)


# ----------------------------------------------------------------------------- llama2.c

def _write_llama2c(path, model, version):
    """Written in the order of llama2.c export.py, spelled out here apart from checkpoint.py."""
    c, p = model.config, model.params
    L = range(c.n_layers)
    shared = c.tie_embeddings
    if version == 0:
        head = struct.pack("<7i", c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads,
                           c.vocab_size if shared else -c.vocab_size, c.max_seq_len)
        parts = [p["tok_embeddings.weight"]]
        for kind in ("attention_norm", "attention.wq", "attention.wk", "attention.wv", "attention.wo", "ffn_norm",
                     "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"):
            parts += [p[f"layers.{i}.{kind}.weight"] for i in L]
        parts += [p["norm.weight"], np.full((c.max_seq_len, c.head_dim // 2), 7.0),
                  np.full((c.max_seq_len, c.head_dim // 2), 7.0)]
    else:
        head = struct.pack("<Ii7iB", LLAMA2C_MAGIC, version, c.dim, c.hidden_dim, c.n_layers, c.n_heads,
                           c.n_kv_heads, c.vocab_size, c.max_seq_len, int(shared))
        head += b"\0" * (256 - len(head))
        parts = [p[f"layers.{i}.attention_norm.weight"] for i in L] + [p[f"layers.{i}.ffn_norm.weight"] for i in L]
        parts += [p["norm.weight"], p["tok_embeddings.weight"]]
        for kind in ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                     "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"):
            parts += [p[f"layers.{i}.{kind}.weight"] for i in L]
    if not shared:
        parts.append(p["output.weight"])
    path.write_bytes(head + b"".join(np.asarray(a, "<f4").tobytes() for a in parts))


@pytest.mark.parametrize("version", [0, 1])
@pytest.mark.parametrize("tied", [False, True])
def test_llama2c_versions_and_classifiers(tmp_path, version, tied):
    model = random_model(gqa_config(tie_embeddings=tied, hidden_dim=24))
    _write_llama2c(tmp_path / "m.bin", model, version)
    back = npllama.load(tmp_path / "m.bin")
    assert back.config.tie_embeddings == tied and back.config.hidden_dim == 24
    for n, p in model.params.items():
        assert np.array_equal(back.params[n], p), n


def test_llama2c_wrong_size_and_version_are_refused(tmp_path):
    model = random_model(gqa_config())
    _write_llama2c(tmp_path / "m.bin", model, 0)
    data = (tmp_path / "m.bin").read_bytes()
    (tmp_path / "m.bin").write_bytes(data[:-4])
    with pytest.raises(CheckpointError, match="truncated"):
        npllama.load(tmp_path / "m.bin")
    (tmp_path / "m.bin").write_bytes(data + b"\0" * 8)
    with pytest.raises(CheckpointError, match="8 bytes too long"):
        npllama.load(tmp_path / "m.bin")
    (tmp_path / "m.bin").write_bytes(struct.pack("<Ii", LLAMA2C_MAGIC, 2) + b"\0" * 300)
    with pytest.raises(CheckpointError, match="version 2"):
        npllama.load(tmp_path / "m.bin")
    (tmp_path / "m.bin").write_bytes(struct.pack("<7i", 64, 172, 5, 8, 3, 512, 512) + b"\0" * 64)
    with pytest.raises(CheckpointError, match="n_kv_heads"):
        npllama.load(tmp_path / "m.bin")


def test_stories260k_loads():
    model = npllama.load(data_file("stories260K.bin"))
    c = model.config
    assert (c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads, c.vocab_size, c.max_seq_len) == \
        (64, 172, 5, 8, 4, 512, 512)
    assert c.tie_embeddings and "output.weight" not in model.params
    assert model.tokenizer is None
    logits = model.forward(np.array([[1, 2, 3]]))
    assert logits.shape == (1, 3, 512) and np.isfinite(logits).all()


# ----------------------------------------------------------------------------- refusals

def _meta_file(tmp_path, model=None):
    model = model or random_model(gqa_config())
    path = npllama.save(model, tmp_path / "m.safetensors", format="meta")
    return path, model


def test_missing_file_and_folder_without_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        npllama.load(tmp_path / "nope.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        npllama.load(tmp_path / "empty")
    # a bare .safetensors without npllama_config or config.json: which config? say so
    write_safetensors_atomic(tmp_path / "bare.safetensors", random_model(gqa_config()).params)
    with pytest.raises(FileNotFoundError, match="config.json"):
        npllama.load(tmp_path / "bare.safetensors")


@pytest.mark.parametrize("cut", [4, 20, -1])
def test_truncated_safetensors_is_refused(tmp_path, cut):
    path, _ = _meta_file(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:cut] if cut > 0 else data[:cut])
    with pytest.raises(CheckpointError, match="truncated"):
        npllama.load(path)


def _rewrite_header(path, mutate):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    raw = mutate(header)
    raw = raw if isinstance(raw, bytes) else json.dumps(raw).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


@pytest.mark.parametrize("mutate,match", [
    (lambda h: b"{not json" + b" " * 20, "not valid JSON"),
    (lambda h: b"[1, 2, 3]", "not an object"),
    (lambda h: {**h, "norm.weight": {**h["norm.weight"], "dtype": "F8_E9M9"}}, "F8_E9M9"),
    (lambda h: {**h, "norm.weight": {**h["norm.weight"], "shape": [3, 5]}}, "norm.weight"),
    (lambda h: {**h, "norm.weight": {**h["norm.weight"],
                                     "data_offsets": [0, h["norm.weight"]["data_offsets"][1]
                                                      - h["norm.weight"]["data_offsets"][0]]}}, "overlap"),
    (lambda h: {**h, "__metadata__": {"format": 3}}, "__metadata__"),
])
def test_corrupt_header_is_refused(tmp_path, mutate, match):
    path, _ = _meta_file(tmp_path)
    _rewrite_header(path, mutate)
    with pytest.raises(CheckpointError, match=match):
        npllama.load(path)


def test_header_length_beyond_file_and_trailing_bytes_are_refused(tmp_path):
    path, _ = _meta_file(tmp_path)
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 10**12) + data[8:])
    with pytest.raises(CheckpointError, match="header length"):
        npllama.load(path)
    path.write_bytes(data + b"\0" * 16)
    with pytest.raises(CheckpointError, match="16 bytes follow the last tensor"):
        npllama.load(path)


def test_missing_misshapen_and_unexpected_tensors_are_reported_at_once(tmp_path):
    model = random_model(gqa_config())
    t = dict(model.params)
    del t["layers.1.ffn_norm.weight"], t["norm.weight"]
    t["layers.0.attention.wv.weight"] = np.zeros((9, 16), np.float32)
    t["lora.A"] = np.zeros(2, np.float32)
    write_safetensors_atomic(tmp_path / "m.safetensors", t, {"npllama_config": model.config.to_json()})
    with pytest.raises(TensorMismatchError) as e:
        npllama.load(tmp_path / "m.safetensors")
    msg = str(e.value)
    for part in ("layers.1.ffn_norm.weight", "'norm.weight'", "layers.0.attention.wv.weight: (9, 16), expected (8, 16)",
                 "lora.A"):
        assert part in msg
    assert isinstance(e.value, KeyError) and isinstance(e.value, ValueError)


def test_unexpected_tensor_is_an_error_or_with_strict_false_a_warning(tmp_path):
    model = random_model(gqa_config())
    hf = cv.meta_to_hf(model.params, model.config)
    hf["model.layers.0.self_attn.q_norm.weight"] = np.ones(4, np.float32)
    folder = tmp_path / "hf"
    folder.mkdir()
    write_safetensors_atomic(folder / "model.safetensors", hf)
    (folder / "config.json").write_text(json.dumps(cv.llama_to_hf_config(model.config)))
    with pytest.raises(TensorMismatchError, match="q_norm"):
        npllama.load(folder)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        back = npllama.load(folder, strict=False)
    assert any("q_norm" in str(w.message) for w in caught)
    np.testing.assert_array_equal(back.forward(TOKENS), model.forward(TOKENS))


@pytest.mark.parametrize("change,match", [
    ({"hidden_size": 32, "head_dim": 8}, r"dim \(config.json hidden_size\)=32"),
    ({"vocab_size": 12}, r"vocab_size \(config.json vocab_size\)=12"),
    ({"num_hidden_layers": 3}, r"n_layers \(config.json num_hidden_layers\)=3 but the file holds layers 0..1"),
    ({"intermediate_size": 40}, r"hidden_dim \(config.json intermediate_size\)=40 .* i.e. hidden_dim=48"),
    ({"num_key_value_heads": 1}, r"n_kv_heads \(config.json num_key_value_heads\)=1 .* i.e. n_kv_heads=2"),
    ({"tie_word_embeddings": True}, r"tie_embeddings \(config.json tie_word_embeddings\)=True"),
])
def test_config_contradicting_tensors_names_the_field(tmp_path, change, match):
    model = random_model(gqa_config())
    folder = npllama.save(model, tmp_path / "hf", format="hf")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(change)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigMismatchError, match=match):
        npllama.load(folder)


def test_untied_config_without_output_weight_names_the_field(tmp_path):
    model = random_model(gqa_config(tie_embeddings=True))
    untied = gqa_config(tie_embeddings=False)
    write_safetensors_atomic(tmp_path / "m.safetensors", model.params, {"npllama_config": untied.to_json()})
    with pytest.raises(ConfigMismatchError, match="tie_embeddings=False but the file has no output.weight"):
        npllama.load(tmp_path / "m.safetensors")


def test_non_float_and_non_finite_weights_are_refused(tmp_path):
    model = random_model(gqa_config())
    meta = {"npllama_config": model.config.to_json()}
    t = dict(model.params)
    t["norm.weight"] = np.ones(16, np.int32)
    write_safetensors_atomic(tmp_path / "m.safetensors", t, meta)
    with pytest.raises(CheckpointError, match="norm.weight has dtype int32"):
        npllama.load(tmp_path / "m.safetensors")
    t["norm.weight"] = np.full(16, np.nan, np.float32)
    write_safetensors_atomic(tmp_path / "m.safetensors", t, meta)
    with pytest.raises(CheckpointError, match="norm.weight holds NaN"):
        npllama.load(tmp_path / "m.safetensors")


class _Payload:
    """Unpickling this creates the marker file: proof that something was executed."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _pickle_variants(tmp_path, marker):
    evil = pickle.dumps({"model": _Payload(marker)}, protocol=2)
    (tmp_path / "model.pt").write_bytes(evil)
    (tmp_path / "raw.bin").write_bytes(pickle.dumps(_Payload(marker), protocol=4))
    with zipfile.ZipFile(tmp_path / "zipped.bin", "w") as z:  # torch.save's zip layout
        z.writestr("archive/data.pkl", evil)
    (tmp_path / "renamed.safetensors").write_bytes(evil)
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "pytorch_model.bin").write_bytes(evil)
    (tmp_path / "folder" / "config.json").write_text(json.dumps(cv.llama_to_hf_config(gqa_config())))
    return ["model.pt", "raw.bin", "zipped.bin", "renamed.safetensors", "folder", "folder/pytorch_model.bin"]


def test_pickles_are_refused_without_being_executed(tmp_path):
    marker = tmp_path / "EXECUTED"
    for name in _pickle_variants(tmp_path, marker):
        with pytest.raises(PickleRefusedError, match="never unpickles") as e:
            npllama.load(tmp_path / name)
        assert "safe_serialization=True" in str(e.value) and "export_torch.py" in str(e.value)
        assert not marker.exists(), f"{name}: the pickle was executed"
    # the payload is live: unpickling it (here, on purpose) does create the marker
    pickle.loads((tmp_path / "model.pt").read_bytes())
    assert marker.exists()


def test_save_argument_errors(tmp_path):
    model = random_model(gqa_config())
    with pytest.raises(ValueError, match=".safetensors"):
        npllama.save(model, tmp_path / "m.bin", format="meta")
    with pytest.raises(ValueError, match="format="):
        npllama.save(model, tmp_path / "x", format="gguf")
    with pytest.raises(ValueError, match="dtype="):
        npllama.save(model, tmp_path / "x", format="hf", dtype="int8")
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="is a file"):
        npllama.save(model, tmp_path / "file", format="hf")
    assert (tmp_path / "file").read_text() == "x"
