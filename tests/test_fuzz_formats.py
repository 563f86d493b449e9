"""Fuzzing every format npllama reads: a damaged file loads cleanly or raises npllama's error, fast and small.

Hypothesis mutates small valid files of each format: safetensors with Meta names and the config
in the metadata, a Hugging Face folder (model.safetensors and config.json), llama2.c v0 and v1
.bin files, training checkpoints (read as --resume reads them), and GGUF files (float32 with a
character vocabulary, Q8_0 with a sentencepiece one). The mutations: truncation, bit flips in
the header and in the data, appended bytes, and header or config fields replaced by a value of
the wrong type or size (for GGUF: any 4 or 8 header bytes overwritten by a count, length or
type of any size, or a metadata entry rewritten with a value of another type or an absurd one). Every outcome must be either a model whose logits are
finite or an NpllamaError, within a time bound (SIGALRM) and a memory bound (tracemalloc) per
case, so a hang or a runaway allocation fails the test instead of stalling the suite. The
memory npllama believes is available is set to MEMORY_AVAILABLE for the fuzzing: whatever a
header makes it allocate beyond that must be refused by npllama.memory's check, not attempted.
"""

import functools
import json
import math
import signal
import struct
import tempfile
import tracemalloc
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import npllama
from npllama import memory
from npllama.io.llama2c import LLAMA2C_MAGIC
from npllama.io.metadata import CHECKSUM_KEY
from npllama.io.gguf import ARRAY, BOOL, FLOAT32, INT32, STRING, UINT32, UINT64, read_gguf
from npllama.tokenizers import CharTokenizer, train_sentencepiece
from npllama.train import TrainConfig
from npllama.train.checkpoint import load_train_checkpoint, rng_from_state, save_train_checkpoint

from .gguf_files import rewrite
from .test_checkpoint import _write_llama2c

SECONDS_PER_CASE = 5          # generous: a clean refusal takes milliseconds
MEMORY_AVAILABLE = memory.CHECK_FLOOR + (16 << 20)
BYTES_PER_CASE = 2 * MEMORY_AVAILABLE     # the files are a few kB: more than this was allocated unchecked
CASES = 250                   # per format: about 2 s each

BAD_VALUES = [[1], {}, None, "x", "16", -1, 0, True, 1e308, 2 ** 70, [[]], {"a": 1}]


class CaseTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise CaseTimeout(f"a case took over {SECONDS_PER_CASE} s")


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    """{format: {relative path: bytes}} of small valid files, written once."""
    root = tmp_path_factory.mktemp("fuzz-originals")
    cfg = npllama.LlamaConfig(dim=8, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=7, multiple_of=8, max_seq_len=8)
    model = npllama.Llama(cfg, seed=0)
    model.tokenizer = CharTokenizer("abcdefg")
    npllama.save(model, root / "meta.safetensors", format="meta")
    npllama.save(model, root / "hf", format="hf")
    opt = npllama.AdamW(model.params)
    x = np.array([[1, 2, 3, 4]])
    opt.step(model.loss_and_grads(x, x)[1])
    save_train_checkpoint(root / "ckpt.safetensors", model, model.tokenizer, opt,
                          {"step": 1, "rng": np.random.default_rng(0).bit_generator.state,
                           "train_config": TrainConfig(dim=8, n_layers=2, n_heads=2).to_dict(), "elapsed": 1.0,
                           "tokens": 4, "val_loss": 1.9, "history": [[0, 1.9]], "text_sha256": "ab"})
    for version in (0, 1):
        _write_llama2c(root / f"v{version}.bin", model, version)
    npllama.save(model, root / "char.gguf", format="gguf")
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\nAll:\nSpeak, speak.\n" * 3
    spm = npllama.Llama(npllama.LlamaConfig(dim=32, n_layers=1, n_heads=2, vocab_size=300, hidden_dim=32,
                                            max_seq_len=8), seed=1)
    spm.tokenizer = train_sentencepiece(text, 300)
    npllama.save(spm, root / "spm.gguf", format="gguf", dtype="q8_0")

    def read(*names):
        return {name: (root / name).read_bytes() for name in names}

    return {"meta": read("meta.safetensors"), "hf": read("hf/model.safetensors", "hf/config.json"),
            "ckpt": read("ckpt.safetensors"), "v0": read("v0.bin"), "v1": read("v1.bin"),
            "gguf": read("char.gguf"), "gguf-spm": read("spm.gguf")}


def _json_paths(obj, prefix=()):
    """Every (path, value) inside a JSON value, leaves and containers."""
    yield prefix, obj
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else []
    for key, value in items:
        yield from _json_paths(value, prefix + (key,))


def _set(obj, path, value):
    if not path:
        return value
    obj[path[0]] = _set(obj[path[0]], path[1:], value)
    return obj


def _mutate_json(text: str, data) -> str:
    """Replace one field anywhere in a JSON document (nested JSON strings included) by a bad value."""
    doc = json.loads(text)
    path, _ = data.draw(st.sampled_from(list(_json_paths(doc))[1:] or [((), doc)]))
    value = data.draw(st.sampled_from(BAD_VALUES))
    inner = doc
    for key in path[:-1]:
        inner = inner[key]
    if path and isinstance(inner[path[-1]], str) and inner[path[-1]][:1] in "{[" and data.draw(st.booleans()):
        inner[path[-1]] = _mutate_json(inner[path[-1]], data)      # JSON inside a metadata string
    else:
        doc = _set(doc, path, value)
    return json.dumps(doc)


def _mutate_safetensors_header(raw: bytes, data) -> bytes:
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    metadata = header.get("__metadata__", {})
    if data.draw(st.booleans()):          # an older file, or a writer that recomputed nothing: no checksum
        metadata.pop(CHECKSUM_KEY, None)
    text = _mutate_json(json.dumps(header), data)
    body = text.encode() + b" " * (-len(text) % 8)
    return struct.pack("<Q", len(body)) + body + raw[8 + n:]


GGUF_BAD_VALUES = [(UINT32, 0), (UINT32, 2 ** 32 - 1), (UINT64, 2 ** 63), (INT32, -1), (FLOAT32, float("nan")),
                   (FLOAT32, float("inf")), (FLOAT32, 0.0), (STRING, ""), (STRING, "x"), (BOOL, True),
                   (ARRAY, (UINT32, [])), (ARRAY, (STRING, ["", ""])), (ARRAY, (INT32, [-5, 99]))]


def _mutate_gguf_metadata(raw: bytes, data) -> bytes:
    """Rewrite the file with one metadata entry given another type or an absurd value (or removed)."""
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "in.gguf", Path(tmp) / "out.gguf"
        src.write_bytes(raw)
        key = data.draw(st.sampled_from(sorted(read_gguf(src).metadata)))
        bad = data.draw(st.sampled_from(GGUF_BAD_VALUES + [None]))

        def edit(meta):
            if bad is None:
                del meta[key]
            else:
                vtype, value = bad
                meta[key] = (vtype, np.asarray(value[1], dtype={UINT32: "<u4", INT32: "<i4"}[value[0]])
                             if vtype == ARRAY and value[0] != STRING else value[1] if vtype == ARRAY else value)
            return meta
        rewrite(src, dst, metadata=edit)
        return dst.read_bytes()


@functools.lru_cache(maxsize=4)      # called with the same original file every case
def _gguf_header_end(raw: bytes) -> int:
    """Where the tensor data starts: the smallest tensor offset, found by the reader itself."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "f.gguf").write_bytes(raw)
        return min(t.start for t in read_gguf(Path(tmp) / "f.gguf").tensors.values())


def _mutate(raw: bytes, kind: str, data) -> bytes:
    """One mutation of a file's bytes (kind: 'safetensors', 'bin', 'json' or 'gguf')."""
    if kind == "gguf":
        return _mutate_gguf(raw, data)
    if kind == "safetensors":
        header_end = 8 + struct.unpack("<Q", raw[:8])[0]
    else:
        header_end = 256 if struct.unpack("<I", raw[:4])[0] == LLAMA2C_MAGIC else 28
    what = data.draw(st.sampled_from(["truncate", "flip_header", "flip_data", "append", "field"]))
    if what != "field":
        return _mutate_bytes(raw, "flip_header" if kind == "json" and what == "flip_data" else what, header_end, data)
    if kind == "json":
        return _mutate_json(raw.decode(), data).encode()
    if kind == "safetensors":
        return _mutate_safetensors_header(raw, data)
    offset = 0 if header_end == 28 else 8                  # llama2.c: one header int, of any value
    head = bytearray(raw[:header_end])
    struct.pack_into("<i", head, offset + 4 * data.draw(st.integers(0, 6)), data.draw(st.integers(-2 ** 31, 2 ** 31 - 1)))
    return bytes(head) + raw[header_end:]


def _mutate_gguf(raw: bytes, data) -> bytes:
    header_end = _gguf_header_end(raw)
    what = data.draw(st.sampled_from(["truncate", "flip_header", "flip_data", "append", "field", "metadata"]))
    if what == "metadata":
        return _mutate_gguf_metadata(raw, data)
    if what != "field":
        return _mutate_bytes(raw, what, header_end, data)
    size = data.draw(st.sampled_from([4, 8]))
    at = data.draw(st.integers(0, header_end - size))
    value = data.draw(st.one_of(st.sampled_from([0, 1, 2, 3, 31, 2 ** 31, 2 ** 32 - 1, 2 ** 62, 2 ** 64 - 1]),
                                st.integers(0, 2 ** 64 - 1)))
    return raw[:at] + (value % 2 ** (8 * size)).to_bytes(size, "little") + raw[at + size:]


def _mutate_bytes(raw: bytes, what: str, header_end: int, data) -> bytes:
    """The format-blind mutations: truncation, bit flips in the header or the data, appended bytes."""
    if what == "truncate":
        return raw[:data.draw(st.integers(0, len(raw) - 1))]
    if what in ("flip_header", "flip_data"):
        lo, hi = (0, header_end) if what == "flip_header" else (header_end, len(raw))
        out = bytearray(raw)
        for _ in range(data.draw(st.integers(1, 3))):
            out[data.draw(st.integers(lo, hi - 1))] ^= 1 << data.draw(st.integers(0, 7))
        return bytes(out)
    return raw + data.draw(st.binary(min_size=1, max_size=64))


def _resume_parts(path):
    """What `npllama train --resume` does with a checkpoint before it needs the training text."""
    ck = load_train_checkpoint(path)
    opt = npllama.AdamW(ck.model.params)
    opt.load_state_dict(ck.optimizer_state)
    rng_from_state(ck.state["rng"])
    TrainConfig.from_dict(ck.state["train_config"]).validate()
    return ck.model


def _outcome(load, target):
    """Load under the time and memory bounds; return (model or None, error or None, peak bytes)."""
    old = signal.signal(signal.SIGALRM, _alarm)
    tracemalloc.start()
    signal.setitimer(signal.ITIMER_REAL, SECONDS_PER_CASE)
    try:
        with np.errstate(all="ignore"), mock.patch.object(memory, "available_bytes", lambda: MEMORY_AVAILABLE):       # e.g. rms_norm_eps=1e308 overflows float32, harmlessly
            model = load(target)
            logits = model.forward(np.array([[1, 2, 3]]))
        return logits, None, tracemalloc.get_traced_memory()[1]
    except npllama.NpllamaError as e:
        return None, e, tracemalloc.get_traced_memory()[1]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        tracemalloc.stop()
        signal.signal(signal.SIGALRM, old)


FORMATS = {  # case: (the originals, the file to mutate, its kind, how to load, what to load)
    "meta": ("meta", "meta.safetensors", "safetensors", npllama.load, "meta.safetensors"),
    "hf-weights": ("hf", "hf/model.safetensors", "safetensors", npllama.load, "hf"),
    "hf-config": ("hf", "hf/config.json", "json", npllama.load, "hf"),
    "llama2c-v0": ("v0", "v0.bin", "bin", npllama.load, "v0.bin"),
    "llama2c-v1": ("v1", "v1.bin", "bin", npllama.load, "v1.bin"),
    "checkpoint-load": ("ckpt", "ckpt.safetensors", "safetensors", npllama.load, "ckpt.safetensors"),
    "checkpoint-resume": ("ckpt", "ckpt.safetensors", "safetensors", _resume_parts, "ckpt.safetensors"),
    "gguf-char-f32": ("gguf", "char.gguf", "gguf", npllama.load, "char.gguf"),
    "gguf-spm-q8_0": ("gguf-spm", "spm.gguf", "gguf", npllama.load, "spm.gguf"),
}


@pytest.mark.parametrize("case_name", list(FORMATS))
def test_damaged_files_load_cleanly_or_raise_npllamas_error(case_name, originals, tmp_path_factory):
    group, name, kind, load, target = FORMATS[case_name]
    files = originals[group]
    folder = tmp_path_factory.mktemp(case_name)

    @settings(max_examples=CASES, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(data=st.data())
    def case(data):
        for rel, raw in files.items():
            path = folder / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(_mutate(raw, kind, data) if rel == name else raw)
        logits, error, peak = _outcome(load, folder / target)
        assert peak < BYTES_PER_CASE, f"a case allocated {peak / 2**20:.0f} MiB ({error!r})"
        if error is None:
            assert np.isfinite(logits).all(), "a damaged file loaded and gave non-finite logits"
        else:
            assert str(error), f"{error!r} has no message"

    case()


def test_the_mutations_reach_every_kind_of_refusal(originals, tmp_path):
    """The fuzzer is not vacuous: flips in the data are caught by the checksum, in a header by its
    checks, and a llama2.c header claiming more than the file holds by the size check."""
    path = tmp_path / "m.safetensors"
    raw = originals["meta"]["meta.safetensors"]
    flipped = bytearray(raw)
    flipped[-3] ^= 0x10
    path.write_bytes(bytes(flipped))
    with pytest.raises(npllama.NpllamaError, match="checksum"):
        npllama.load(path)
    v1 = bytearray(originals["v1"]["v1.bin"])
    struct.pack_into("<i", v1, 8 + 4 * 2, 2_097_157)        # n_layers, the one-bit flip of the issue
    path = tmp_path / "v1.bin"
    path.write_bytes(bytes(v1))
    tracemalloc.start()
    with pytest.raises(npllama.NpllamaError, match="truncated"):
        npllama.load(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20 and math.isfinite(peak)             # no per-layer table was built
