"""GGUF in npllama without llama.cpp: the container, LLaMA files in and out, their tokenizers, and refusals.

(llama.cpp itself judges the files in test_gguf_llama_cpp.py; the block decoders are held to the
`gguf` package bit for bit in test_gguf_quant.py.)
"""

import struct
import tracemalloc
from unittest import mock

import numpy as np
import pytest

import npllama
from npllama import cli, memory
from npllama.errors import MemoryLimitError
from npllama.io import CheckpointError, read_checkpoint
from npllama.io.errors import GGUFError, UnsupportedGGUFError
from npllama.io.gguf import (FLOAT32, GGML_TYPE_IDS, STRING, UINT32, TensorToWrite, read_gguf, tensor_nbytes,
                             write_gguf_atomic)
from npllama.io.gguf_quant import quantize_q8_0
from npllama.io.gguf_vocab import rwkv_escape, rwkv_unescape
from npllama.storage import to_float, to_storage
from npllama.tokenizers import CharTokenizer, SentencePieceTokenizer

from .conftest import data_file
from .gguf_files import TEXT, byte_level_bpe, rewrite, tiny_model


def _one_line_error(excinfo):
    message = str(excinfo.value)
    assert message and "\n" not in message, message
    return message


@pytest.mark.parametrize("tied", [False, True])
def test_f32_round_trip_is_exact(tmp_path, tied):
    model = tiny_model(tie_embeddings=tied)
    path = npllama.save(model, tmp_path / "m.gguf", format="gguf")
    back = npllama.load(path)
    assert back.config == model.config and back.tokenizer == model.tokenizer
    assert set(back.params) == set(model.params)
    for name, arr in model.params.items():
        assert np.array_equal(back.params[name], arr), name
    assert "output.weight" not in read_gguf(path).tensors if tied else "output.weight" in read_gguf(path).tensors


def test_the_layout_is_llama_cpps(tmp_path):
    """Tensor names, shapes in ggml order, types and the metadata keys llama.cpp's loader reads."""
    model = tiny_model()
    gf = read_gguf(npllama.save(model, tmp_path / "m.gguf", format="gguf", dtype="f16"))
    meta = {k: v for k, (_, v) in gf.metadata.items()}
    assert meta["general.architecture"] == "llama" and meta["general.file_type"] == 1
    cfg = model.config
    assert (meta["llama.embedding_length"], meta["llama.block_count"], meta["llama.attention.head_count"],
            meta["llama.attention.head_count_kv"], meta["llama.feed_forward_length"], meta["llama.context_length"],
            meta["llama.rope.dimension_count"]) == (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads,
                                                     cfg.hidden_dim, cfg.max_seq_len, cfg.head_dim)
    assert gf.metadata["llama.attention.layer_norm_rms_epsilon"][0] == FLOAT32
    assert gf.metadata["llama.block_count"][0] == UINT32
    t = gf.tensors
    assert t["token_embd.weight"].shape == (cfg.vocab_size, cfg.dim) and t["token_embd.weight"].type.name == "F16"
    assert t["blk.1.attn_k.weight"].shape == (cfg.n_kv_heads * cfg.head_dim, cfg.dim)
    assert t["blk.0.ffn_gate.weight"].shape == (cfg.hidden_dim, cfg.dim)
    assert t["blk.0.attn_norm.weight"].type.name == "F32" and t["output_norm.weight"].type.name == "F32"
    assert all(info.start % 32 == 0 for info in t.values())


def test_written_files_read_the_same_in_ggufs_reader(tmp_path):
    gguf = pytest.importorskip("gguf", reason="the reference GGUF package `gguf` is not installed")
    model = tiny_model()
    path = npllama.save(model, tmp_path / "m.gguf", format="gguf")
    reader = gguf.GGUFReader(path)
    ours = read_gguf(path)
    assert [t.name for t in reader.tensors] == list(ours.tensors)
    for t in reader.tensors:
        assert np.array_equal(np.asarray(t.data).reshape(ours.tensors[t.name].shape),
                              ours.tensor_bytes(ours.tensors[t.name]).view(np.float32).reshape(t.data.shape))
    assert reader.fields["tokenizer.ggml.model"].contents() == "rwkv"
    assert reader.fields["llama.attention.head_count_kv"].contents() == model.config.n_kv_heads


@pytest.mark.parametrize("storage", ["float32", "float16", "bfloat16"])
def test_files_written_by_ggufs_writer_with_every_type_decode_as_ggufs_reference(tmp_path, storage):
    """A model written by llama.cpp's own GGUFWriter, each weight in another type, loads as the
    `gguf` package decodes it (then held in the storage dtype asked for)."""
    gguf = pytest.importorskip("gguf", reason="the reference GGUF package `gguf` is not installed")
    cfg = npllama.LlamaConfig(dim=256, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=8, hidden_dim=256,
                              max_seq_len=32, tie_embeddings=True)
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(tmp_path / "m.gguf", "llama")
    w.add_block_count(1), w.add_context_length(32), w.add_embedding_length(256), w.add_feed_forward_length(256)
    w.add_head_count(4), w.add_head_count_kv(2), w.add_layer_norm_rms_eps(1e-5), w.add_rope_freq_base(10000.0)
    types = {"token_embd.weight": "Q8_0", "blk.0.attn_q.weight": "Q4_0", "blk.0.attn_k.weight": "Q4_K",
             "blk.0.attn_v.weight": "Q6_K", "blk.0.attn_output.weight": "F16", "blk.0.ffn_gate.weight": "BF16",
             "blk.0.ffn_up.weight": "Q4_K", "blk.0.ffn_down.weight": "Q6_K", "blk.0.attn_norm.weight": "F32",
             "blk.0.ffn_norm.weight": "F32", "output_norm.weight": "F32"}
    shapes = {"token_embd.weight": (8, 256), "blk.0.attn_k.weight": (128, 256), "blk.0.attn_v.weight": (128, 256)}
    expected = {}
    for name, type_name in types.items():
        shape = shapes.get(name, (256,) if "norm" in name else (256, 256))
        qtype = gguf.GGMLQuantizationType[type_name]
        if type_name in ("F32", "F16", "BF16", "Q8_0", "Q4_0"):
            raw = gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32) * 0.1, qtype)
        else:   # no encoder for k-quants in gguf-py: random blocks with tame fp16 scales
            raw = rng.integers(0, 256, size=tensor_nbytes(shape, GGML_TYPE_IDS[type_name]), dtype=np.uint8)
            block = gguf.constants.GGML_QUANT_SIZES[qtype][1]
            blocks = raw.reshape(-1, block)
            scale_at = [0, 2] if type_name == "Q4_K" else [block - 2]
            for at in scale_at:
                blocks[:, at:at + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
            raw = raw.reshape(shape[0], -1)
        w.add_tensor(name, np.asarray(raw), raw_dtype=qtype)
        expected[name] = np.asarray(gguf.quants.dequantize(np.asarray(raw), qtype), np.float32).reshape(shape)
    w.add_tokenizer_model("none")
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()

    loaded = read_checkpoint(tmp_path / "m.gguf", "bfloat16" if storage == "bfloat16" else np.dtype(storage))
    assert loaded.config == cfg and loaded.tokenizer is None
    from npllama.io.gguf_llama import gguf_to_meta_name
    for name, ref in expected.items():
        held = loaded.params[gguf_to_meta_name(name)]
        assert np.array_equal(held, to_storage(ref, storage)), name
    assert any("Q4_K x 2" in n and "Q6_K x 2" in n for n in loaded.notes)


def test_half_files_are_held_as_views_of_the_file(tmp_path):
    path = npllama.save(tiny_model(), tmp_path / "m.gguf", format="gguf", dtype="f16")
    loaded = read_checkpoint(path, np.float16, mmap=True)
    assert loaded.params["layers.0.attention.wq.weight"].dtype == np.float16
    assert not loaded.params["layers.0.attention.wq.weight"].flags.owndata      # views of the mapping, not copied
    assert loaded.footprint.mapped > 0
    as32 = read_checkpoint(path, np.float32)
    assert np.array_equal(as32.params["layers.0.attention.wq.weight"],
                          to_float(loaded.params["layers.0.attention.wq.weight"]))


def test_the_memory_check_counts_the_decoded_size_before_decoding(tmp_path):
    """A Q8_0 file is ~4x smaller than its float32 weights: the check must use the latter."""
    model = tiny_model(dim=64, n_heads=4, n_kv_heads=4, hidden_dim=256)
    path = npllama.save(model, tmp_path / "m.gguf", format="gguf", dtype="q8_0")
    decoded = sum(a.size * 4 for a in model.params.values())
    assert path.stat().st_size < decoded / 2
    with mock.patch.object(memory, "CHECK_FLOOR", 0), \
            mock.patch.object(memory, "available_bytes", lambda: decoded - 1):
        tracemalloc.start()
        with pytest.raises(MemoryLimitError, match="loading .*m.gguf as float32"):
            npllama.load(path)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < decoded / 2
    with mock.patch.object(memory, "CHECK_FLOOR", 0), mock.patch.object(memory, "available_bytes", lambda: decoded):
        npllama.load(path)


def test_q8_0_export_falls_back_to_f16_for_short_rows_and_loads_close(tmp_path):
    model = tiny_model(dim=32, n_heads=4, n_kv_heads=2, hidden_dim=48)
    path = npllama.save(model, tmp_path / "m.gguf", format="gguf", dtype="q8_0")
    types = {n: t.type.name for n, t in read_gguf(path).tensors.items()}
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["blk.0.ffn_down.weight"] == "F16"   # 48 columns
    assert types["blk.0.attn_norm.weight"] == "F32"
    back = npllama.load(path)
    w = model.params["layers.0.attention.wq.weight"]
    expected = np.frombuffer(quantize_q8_0(w).tobytes(), np.uint8)
    raw = read_gguf(path).tensor_bytes(read_gguf(path).tensors["blk.0.attn_q.weight"])
    assert np.array_equal(raw, expected)
    assert np.abs(back.params["layers.0.attention.wq.weight"] - w).max() <= np.abs(w).max() / 127


def test_sentencepiece_vocabulary_round_trips_and_encodes_as_the_model_file(tmp_path):
    spm_path = data_file("tok512.model")
    tok = SentencePieceTokenizer.from_file(spm_path)
    model = tiny_model(vocab_size=520)              # larger than the tokenizer: padding tokens
    model.tokenizer = tok
    path = npllama.save(model, tmp_path / "m.gguf", format="gguf")
    gf = read_gguf(path)
    tokens = gf.metadata["tokenizer.ggml.tokens"][1]
    assert len(tokens) == 520 and tokens[512] == "[PAD512]" and tokens[1] == "<s>"
    assert list(gf.metadata["tokenizer.ggml.token_type"][1][:4]) == [2, 3, 3, 6]    # unk, bos, eos, <0x00>
    back = npllama.load(path).tokenizer
    assert isinstance(back, SentencePieceTokenizer) and (back.bos_id, back.eos_id, back.unk_id) == (1, 2, 0)
    lines = data_file("tinyshakespeare.txt").read_text().split("\n")[:3000]
    assert [back.encode(s) for s in lines] == [tok.encode(s) for s in lines]
    assert back.decode(tok.encode(TEXT)) == tok.decode(tok.encode(TEXT))


def test_char_vocabulary_is_rwkv_escaped_and_reads_back(tmp_path):
    chars = "\n \\abc\u00e9\u4e2d\U0001F600"
    tok = CharTokenizer(chars)
    assert [rwkv_unescape(rwkv_escape(c)).decode() for c in chars] == list(chars)
    assert rwkv_unescape("\\x41\\n\\t\\q") == b"A\n\tq"
    from npllama.io.gguf_vocab import tokenizer_from_gguf, vocab_metadata
    path = tmp_path / "vocab.gguf"
    write_gguf_atomic(path, vocab_metadata(tok, 12), [])        # 12 rows: 4 padding tokens
    gf = read_gguf(path)
    assert len(gf.metadata["tokenizer.ggml.tokens"][1]) == 12
    assert tokenizer_from_gguf(gf.metadata, path) == (tok, None)


def test_byte_level_bpe_vocabulary_runs_through_tokenizers():
    """A gpt2-style GGUF vocabulary (Llama 3 and SmolLM files) encodes as the tokenizer it came from."""
    pytest.importorskip("tokenizers", reason="Hugging Face's `tokenizers` package is not installed")
    from npllama.io.gguf_vocab import tokenizer_from_gguf
    text = data_file("tinyshakespeare.txt").read_text()
    bpe, meta = byte_level_bpe(text[:200_000])
    tok, problem = tokenizer_from_gguf(meta, "x")
    assert problem is None and tok.eos_id == 0
    lines = text.split("\n")[:500]
    assert [tok.encode(s) for s in lines] == [bpe.encode(s).ids for s in lines]
    assert tok.decode(bpe.encode(TEXT).ids) == TEXT


# ----------------------------------------------------------------------------- refusals, one line each

@pytest.fixture
def good(tmp_path):
    return npllama.save(tiny_model(), tmp_path / "good.gguf", format="gguf")


def _patch(path, offset, fmt, value):
    raw = bytearray(path.read_bytes())
    struct.pack_into(fmt, raw, offset, value)
    path.write_bytes(bytes(raw))
    return path


def _cut(path, end):
    path.write_bytes(path.read_bytes()[:end])
    return path


def test_not_gguf_truncated_and_versions_are_refused(good, tmp_path):
    cases = {
        "magic": (lambda p: _patch(p, 0, "4s", b"GGUX"), "not the GGUF magic"),
        "version 1": (lambda p: _patch(p, 4, "<I", 1), "version 1"),
        "big-endian": (lambda p: _patch(p, 4, ">I", 3), "big-endian"),
        "tensor count": (lambda p: _patch(p, 8, "<Q", 2 ** 60), "truncated"),
        "kv count": (lambda p: _patch(p, 16, "<Q", 2 ** 40), "truncated"),
        "key length": (lambda p: _patch(p, 24, "<Q", 2 ** 62), "truncated"),
        "cut in the header": (lambda p: _cut(p, 300), "truncated"),
        "cut in the data": (lambda p: _cut(p, -40), "past the end"),
        "empty": (lambda p: _cut(p, 0), "too short"),
    }
    for name, (damage, match) in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(good.read_bytes())
        with pytest.raises(GGUFError) as e:
            npllama.load(damage(path))
        assert match in _one_line_error(e), (name, str(e.value))


def _edit_meta(key, vtype=None, value=None):
    def edit(meta):
        if vtype is None:
            meta.pop(key)
        else:
            meta[key] = (vtype, value)
        return meta
    return edit


def _edit_tensor(name, fn):
    return lambda items: [fn(t) if t.name == name else t for t in items]


@pytest.mark.parametrize("case", [
    "architecture", "experts", "rope scaling", "partial rotary", "unknown type id", "unsupported type",
    "tensor past the end", "misaligned", "missing tensor", "wrong shape", "bias", "nan", "string length",
    "missing key", "wrong key type"])
def test_what_npllama_cannot_run_is_refused_in_one_line(good, tmp_path, case):
    out = tmp_path / "bad.gguf"
    q = "blk.0.attn_q.weight"
    edits = {
        "architecture": (dict(metadata=_edit_meta("general.architecture", STRING, "gemma2")), UnsupportedGGUFError,
                         "architecture 'gemma2'"),
        "experts": (dict(metadata=_edit_meta("llama.expert_count", UINT32, 8)), UnsupportedGGUFError, "experts"),
        "rope scaling": (dict(metadata=_edit_meta("llama.rope.scaling.type", STRING, "yarn")), UnsupportedGGUFError,
                         "RoPE scaling"),
        "partial rotary": (dict(metadata=_edit_meta("llama.rope.dimension_count", UINT32, 2)), UnsupportedGGUFError,
                           "dimension_count=2"),
        "missing tensor": (dict(tensors=lambda items: [t for t in items if t.name != q]), CheckpointError, q),
        "wrong shape": (dict(tensors=_edit_tensor(q, lambda t: t._replace(shape=(8, 32), data=t.data[:256 * 4]))),
                        CheckpointError, "wrong shape"),
        "bias": (dict(tensors=lambda items: items + [TensorToWrite("blk.0.attn_q.bias", (16,), 0,
                                                                   np.zeros(16, np.float32))]),
                 UnsupportedGGUFError, "bias"),
        "nan": (dict(tensors=_edit_tensor(q, lambda t: t._replace(data=np.full(t.data.size // 4, np.nan, np.float32)))),
                CheckpointError, "NaN"),
        "missing key": (dict(metadata=_edit_meta("llama.block_count")), GGUFError, "llama.block_count"),
        "wrong key type": (dict(metadata=_edit_meta("llama.block_count", STRING, "2")), GGUFError, "type string where int belongs"),
    }
    if case in edits:
        kw, error, match = edits[case]
        rewrite(good, out, **kw)
    else:
        raw = bytearray(good.read_bytes())
        # the tensor info of q: name, n_dims, ne[2], type, offset, found by its name in the header
        at = raw.index(struct.pack("<Q", len(q)) + q.encode()) + 8 + len(q) + 4 + 16
        if case == "unknown type id":
            struct.pack_into("<I", raw, at, 99)
            error, match = GGUFError, "ggml type 99"
        elif case == "unsupported type":     # rows of 16 values cannot even hold a Q5_K block of 256
            struct.pack_into("<I", raw, at, GGML_TYPE_IDS["Q5_K"])
            error, match = GGUFError, "not a whole number of Q5_K blocks"
        elif case == "tensor past the end":
            struct.pack_into("<Q", raw, at + 4, 1 << 20)
            error, match = GGUFError, "past the end"
        elif case == "misaligned":
            struct.pack_into("<Q", raw, at + 4, 4)
            error, match = GGUFError, "alignment"
        else:   # string length: the architecture's value claims more bytes than the file has
            key = b"general.architecture"
            struct.pack_into("<Q", raw, raw.index(key) + len(key) + 4, 1 << 40)
            error, match = GGUFError, "truncated"
        out.write_bytes(bytes(raw))
    with pytest.raises(error) as e:
        npllama.load(out)
    assert match in _one_line_error(e)


def test_a_type_npllama_cannot_decode_is_named(tmp_path):
    good = npllama.save(tiny_model(dim=256, hidden_dim=256), tmp_path / "good.gguf", format="gguf")
    q5 = GGML_TYPE_IDS["Q5_K"]

    def to_q5_k(t):
        return t._replace(type_id=q5, data=np.zeros(tensor_nbytes(t.shape, q5), np.uint8))
    rewrite(good, tmp_path / "q5.gguf", tensors=_edit_tensor("blk.1.ffn_up.weight", to_q5_k))
    with pytest.raises(UnsupportedGGUFError) as e:
        npllama.load(tmp_path / "q5.gguf")
    assert "blk.1.ffn_up.weight is Q5_K" in _one_line_error(e) and "Q4_K" in str(e.value)


def test_version_2_files_load_as_version_3(good, tmp_path):
    """v2 and v3 share the layout (v3 only allows big-endian files, which are refused)."""
    v2 = tmp_path / "v2.gguf"
    v2.write_bytes(good.read_bytes())
    _patch(v2, 4, "<I", 2)
    assert read_gguf(v2).version == 2
    a, b = npllama.load(v2), npllama.load(good)
    assert all(np.array_equal(a.params[n], b.params[n]) for n in b.params) and a.tokenizer == b.tokenizer


def test_loading_by_magic_without_the_suffix(good, tmp_path):
    plain = tmp_path / "model.bin.weights"
    plain.write_bytes(good.read_bytes())
    assert npllama.load(plain).config == npllama.load(good).config


# ----------------------------------------------------------------------------- the command line

def test_export_then_generate_from_the_gguf(tmp_path, capsys):
    model = tiny_model(n_kv_heads=4, dim=32, hidden_dim=64)
    src = npllama.save(model, tmp_path / "m.safetensors", format="meta")
    out = tmp_path / "m.gguf"
    assert cli.main(["export", "-m", str(src), "-o", str(out), "--type", "q8_0"]) == 0
    assert read_gguf(out).tensors["blk.0.attn_q.weight"].type.name == "Q8_0"
    capsys.readouterr()
    assert cli.main(["generate", "-m", str(out), "-p", "All:", "-n", "20", "--temp", "0"]) == 0
    text = capsys.readouterr().out
    back = npllama.load(out)
    tok = back.tokenizer
    assert text == "All:" + tok.decode(back.generate(tok.encode("All:"), 20, temperature=0.0)) + "\n"
    assert cli.main(["export", "-m", str(src), "-o", str(tmp_path / "x.safetensors"), "--type", "q8_0"]) == 1
    assert "--type q8_0 is for --format gguf" in capsys.readouterr().err
    with pytest.raises(npllama.NpllamaError, match="ending in .gguf"):
        npllama.save(model, tmp_path / "x.bin", format="gguf")


def test_a_training_run_exports_a_gguf(text_file, tmp_path):
    """`npllama train --export run.gguf`: the trained model, float32, with its character vocabulary."""
    import io
    from npllama.train import train
    from npllama.train.checkpoint import load_train_checkpoint
    from .conftest import tiny_cfg
    export = tmp_path / "run.gguf"
    res = train(tiny_cfg(text_file, tmp_path / "run", max_steps=3, export=str(export)), out=io.StringIO())
    exported, trained = npllama.load(export), load_train_checkpoint(res.checkpoint).model
    assert exported.tokenizer == trained.tokenizer
    assert all(np.array_equal(exported.params[n], trained.params[n]) for n in trained.params)


@pytest.mark.slow
def test_the_docs_gguf_section_runs_as_written(tmp_path):
    """docs/weights.md, section GGUF: its bash lines, then its python block, in a folder holding
    stories260K.bin and tok512.model (the text block is for tools outside npllama)."""
    import os
    import re
    import shlex
    import subprocess
    import sys
    from pathlib import Path
    for name in ("stories260K.bin", "tok512.model"):
        (tmp_path / name).symlink_to(data_file(name))
    docs = (Path(__file__).resolve().parents[1] / "docs" / "weights.md").read_text(encoding="utf-8")
    section = docs.split("\n## GGUF\n")[1].split("\n## ")[0]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, re.S)
    bash = [line for lang, body in blocks if lang == "bash" for line in body.splitlines() if line.strip()]
    python = [body for lang, body in blocks if lang == "python"]
    assert len(bash) == 2 and len(python) == 1
    env = dict(os.environ, PYTHONPATH=str(Path(npllama.__file__).resolve().parents[1]))
    for line in bash:
        argv = shlex.split(line)
        proc = subprocess.run([sys.executable, "-m", "npllama", *argv[1:]], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Once upon a time")
    proc = subprocess.run([sys.executable, "-c", python[0]], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "stories260K-f32.gguf").is_file()
