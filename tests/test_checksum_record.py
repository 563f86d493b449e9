"""The checksum record checks itself, and a file another tool re-saved intact is verified, not damaged.

io/integrity.py: a flipped bit anywhere in a file npllama wrote is refused, the record's own key
name included (before, a flip there loaded the file unverified: 112 of 112 flips); a file that
safetensors.numpy.save_file wrote again with npllama's metadata and the same tensors (in its own
order and alignment) is verified by its content, where it used to be called damaged.
"""

import io
import json
import struct

import numpy as np
import pytest
from safetensors.numpy import save_file

import npllama
from npllama.io import ChecksumMismatchError
from npllama.io.errors import CheckpointError
from npllama.io.integrity import checksum_metadata
from npllama.io.metadata import CHECKSUM_KEY
from npllama.io.safetensors import read_safetensors
from npllama.tokenizers import CharTokenizer
from npllama.train import train
from npllama.train.checkpoint import load_train_checkpoint

from .conftest import tiny_cfg


@pytest.fixture
def model():
    m = npllama.Llama(npllama.LlamaConfig(dim=16, n_layers=2, n_heads=2, vocab_size=11, multiple_of=8,
                                          max_seq_len=16), seed=3)
    m.tokenizer = CharTokenizer("abcdefghijk")
    return m


def outcome(path) -> str:
    try:
        npllama.load(path)
    except (ChecksumMismatchError, CheckpointError):
        return "refused"
    return "loaded"


def test_no_flip_in_the_records_key_name_loads_unverified(model, tmp_path):
    path = npllama.save(model, tmp_path / "m.safetensors", format="meta")
    raw = path.read_bytes()
    key = raw.index(json.dumps(CHECKSUM_KEY).encode(), 8) + 1
    flipped = tmp_path / "flipped.safetensors"
    results = {}
    for offset in range(len(CHECKSUM_KEY)):
        for bit in range(8):                                       # every bit of every byte of the key name
            damaged = bytearray(raw)
            damaged[key + offset] ^= 1 << bit
            flipped.write_bytes(bytes(damaged))
            results[offset, bit] = outcome(flipped)
    assert len(results) == 128 and set(results.values()) == {"refused"}, \
        [k for k, v in results.items() if v != "refused"]


def test_flips_in_the_records_value_are_refused(model, tmp_path):
    path = npllama.save(model, tmp_path / "m.safetensors", format="meta")
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    value = json.dumps(header["__metadata__"][CHECKSUM_KEY])[1:-1].encode()
    start = raw.index(value, 8)
    flipped = tmp_path / "flipped.safetensors"
    for offset in range(len(value)):                               # one bit of every byte
        damaged = bytearray(raw)
        damaged[start + offset] ^= 1 << (offset % 7)
        flipped.write_bytes(bytes(damaged))
        assert outcome(flipped) == "refused", offset


def _resave(src, dst):
    """What another tool does: read every tensor and the metadata, write them again its own way."""
    from safetensors import safe_open
    with safe_open(str(src), "np") as f:
        metadata, tensors = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}
    save_file(tensors, str(dst), metadata=metadata)


def test_a_file_another_tool_re_saved_intact_is_verified(model, tmp_path):
    meta = npllama.save(model, tmp_path / "m.safetensors", format="meta")
    folder = npllama.save(model, tmp_path / "hf", format="hf")
    for src in (meta, folder / "model.safetensors"):
        src_bytes = src.read_bytes()
        _resave(src, src)
        assert src.read_bytes() != src_bytes                       # laid out differently...
    for path in (meta, folder):
        back = npllama.load(path)                                   # ...and verified, not "damaged"
        assert all(np.array_equal(back.params[n], p) for n, p in model.params.items())
    # still a checksum: a flipped bit in a re-saved tensor is refused
    raw = bytearray(meta.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    begin = json.loads(raw[8:8 + n])["norm.weight"]["data_offsets"][0]
    raw[8 + n + begin] ^= 4
    meta.write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatchError, match="norm.weight"):
        npllama.load(meta)


def test_a_re_saved_training_checkpoint_resumes(text_file, tmp_path):
    out = tmp_path / "run"
    train(tiny_cfg(text_file, out, max_steps=2, eval_interval=2), out=io.StringIO())
    ckpt = out / "ckpt.safetensors"
    before = load_train_checkpoint(ckpt)
    _resave(ckpt, ckpt)
    after = load_train_checkpoint(ckpt)
    assert after.state == before.state
    assert all(np.array_equal(after.optimizer_state[k], v) for k, v in before.optimizer_state.items()
               if isinstance(v, np.ndarray))


def test_an_older_record_without_content_is_still_checked(model, tmp_path):
    """Files npllama wrote before "content" and "record" existed carry "header" alone: verified as before."""
    path = npllama.save(model, tmp_path / "m.safetensors", format="meta")
    tensors, metadata = read_safetensors(path)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    record = json.loads(header["__metadata__"][CHECKSUM_KEY])
    del record["content"], record["record"]
    header["__metadata__"][CHECKSUM_KEY] = json.dumps(record)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    assert all(np.array_equal(npllama.load(path).params[k], v) for k, v in model.params.items())
    header["__metadata__"]["npllama_config"] = header["__metadata__"]["npllama_config"].replace("1e-05", "1e-04")
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    with pytest.raises(ChecksumMismatchError, match="header"):
        npllama.load(path)
    assert "content" in json.loads(checksum_metadata({}, {}, {}))   # what npllama writes now
