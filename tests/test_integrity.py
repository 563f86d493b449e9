"""Checksums: every safetensors file npllama writes records CRC-32s, and a damaged one is refused.

safetensors has none of its own, so before this a flipped bit in the data loaded silently and a
flipped AdamW moment was resumed. Files without the record (older npllama, other tools) still load.
"""

import io
import json
import struct

import numpy as np
import pytest
from safetensors.numpy import save_file

import npllama
from npllama import cli
from npllama.io import ChecksumMismatchError
from npllama.io.metadata import CHECKSUM_KEY
from npllama.io.safetensors import read_safetensors, read_safetensors_header
from npllama.tokenizers import CharTokenizer
from npllama.train import train
from npllama.train.checkpoint import load_train_checkpoint, load_train_state

from .conftest import tiny_cfg


def header_and_data(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), 8 + n, raw


def flip(path, name, element=0, bit=3):
    """Flip one bit of tensor `name`'s stored bytes."""
    header, start, raw = header_and_data(path)
    out = bytearray(raw)
    out[start + header[name]["data_offsets"][0] + 4 * element] ^= 1 << bit
    path.write_bytes(bytes(out))


def rewrite_header(path, mutate):
    header, start, raw = header_and_data(path)
    mutate(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[start:])


@pytest.fixture
def model():
    cfg = npllama.LlamaConfig(dim=16, n_layers=2, n_heads=2, vocab_size=11, multiple_of=8, max_seq_len=16)
    m = npllama.Llama(cfg, seed=3)
    m.tokenizer = CharTokenizer("abcdefghijk")
    return m


@pytest.mark.parametrize("fmt", ["meta", "hf"])
def test_every_saved_file_records_checksums_and_a_flipped_bit_is_refused(fmt, model, tmp_path):
    path = npllama.save(model, tmp_path / ("m.safetensors" if fmt == "meta" else "hf"), format=fmt)
    file = path if fmt == "meta" else path / "model.safetensors"
    header, _, _ = header_and_data(file)
    record = json.loads(header["__metadata__"][CHECKSUM_KEY])
    assert record["algorithm"] == "crc32" and set(record["tensors"]) == set(header) - {"__metadata__"}
    assert CHECKSUM_KEY not in read_safetensors(file)[1]           # verified, not handed on
    name = "layers.1.attention.wv.weight" if fmt == "meta" else "model.layers.1.self_attn.v_proj.weight"
    flip(file, name, element=5, bit=2)                             # a low mantissa bit: loads "fine" otherwise
    with pytest.raises(ChecksumMismatchError, match=f"tensor '{name}' does not match its recorded crc32"):
        npllama.load(path)
    loaded = npllama.load(path, verify=False)                      # the user's choice, stated in the hint
    assert not np.array_equal(loaded.params["layers.1.attention.wv.weight"], model.params["layers.1.attention.wv.weight"])


def test_a_flip_in_the_header_metadata_is_refused(model, tmp_path):
    path = npllama.save(model, tmp_path / "m.safetensors", format="meta")

    def tweak_eps(header):                                         # still valid JSON, still a valid config
        cfg = json.loads(header["__metadata__"]["npllama_config"])
        cfg["norm_eps"] = 1e-4
        header["__metadata__"]["npllama_config"] = json.dumps(cfg)

    rewrite_header(path, tweak_eps)
    with pytest.raises(ChecksumMismatchError, match="header"):
        npllama.load(path)
    with pytest.raises(ChecksumMismatchError, match="header"):
        read_safetensors_header(path)
    assert npllama.load(path, verify=False).config.norm_eps == 1e-4


def test_files_without_checksums_still_load(model, tmp_path):
    """Older npllama files, and files of other tools, carry no record: they load unverified."""
    path = npllama.save(model, tmp_path / "m.safetensors", format="meta")
    rewrite_header(path, lambda h: h["__metadata__"].pop(CHECKSUM_KEY))
    assert npllama.load(path).config == model.config
    other = tmp_path / "other.safetensors"
    save_file(dict(model.params), str(other), metadata={"npllama_config": model.config.to_json()})
    assert all(np.array_equal(npllama.load(other).params[n], p) for n, p in model.params.items())


def test_a_damaged_checkpoint_is_not_resumed(text_file, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    train(tiny_cfg(text_file, out, max_steps=4), out=io.StringIO())
    ckpt = out / "ckpt.safetensors"
    good = ckpt.read_bytes()
    flip(ckpt, "optimizer.exp_avg_sq.layers.0.feed_forward.w2.weight", element=7, bit=1)
    with pytest.raises(ChecksumMismatchError, match="optimizer.exp_avg_sq.layers.0.feed_forward.w2.weight"):
        load_train_checkpoint(ckpt)
    code = cli.main(["train", "--resume", "--data", str(text_file), "--out-dir", str(out), "--max-steps", "8"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "does not match its recorded crc32 checksum" in err
    ckpt.write_bytes(good)                                         # the intact file resumes as ever
    assert load_train_state(ckpt)["step"] == 4
    train(tiny_cfg(text_file, out, max_steps=8, resume=True), out=io.StringIO())
    assert load_train_state(ckpt)["step"] == 8
