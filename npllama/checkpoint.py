"""Weights in and out: safetensors (Meta or Hugging Face names), HF folders, llama2.c .bin files.

    model = npllama.load(path, dtype=np.float32)
    npllama.save(model, path, format="hf")      # or format="meta"

What `load` accepts (the first match wins):

    a folder           Hugging Face LlamaForCausalLM: config.json plus model.safetensors, or shards
                       listed in model.safetensors.index.json; tokenizer.model, when present,
                       becomes model.tokenizer
    *.safetensors      Meta or HF names; the config comes from the metadata key "npllama_config"
                       (save(format="meta") and training checkpoints write it) or from a
                       config.json beside the file (HF keys, or LlamaConfig.to_json keys)
    *.bin              llama2.c: legacy v0 (7 int32 header) or v1 ("ak42" magic, 256-byte header),
                       float32 little-endian; layouts in LLAMA2C_V0 / LLAMA2C_V1 below
    pickle files       (.pt, .pth, .ckpt, .pkl, pytorch_model*.bin, or any file starting with a
                       pickle/zip magic) are refused without being unpickled

Before any array is used, load compares the file with the config: fields the tensors
contradict (dim, vocab_size, n_layers, hidden_dim, n_kv_heads, tie_embeddings) are named first,
then every missing, unexpected and misshapen tensor at once. Hugging Face q_proj/k_proj rows are
un-permuted into Meta's RoPE layout (see npllama.convert). float16 and bfloat16 are upcast;
everything is cast to the requested dtype. Tensors that are derived data or optimizer state are
skipped knowingly, never silently: HF `rotary_emb.inv_freq` and Meta `rope.freqs` (checked
against rope_theta first), and `optimizer.*` when the metadata holds "npllama_train_state".

Safetensors layout (the format is small enough to read and write here in NumPy alone):

    8 bytes   N, little-endian uint64
    N bytes   UTF-8 JSON: {"__metadata__": {str: str}, name: {"dtype": "F32", "shape": [...],
              "data_offsets": [begin, end]}, ...}, padded with spaces
    rest      the tensors' bytes, little-endian, C order; offsets count from the end of the header

Every write goes through write_safetensors_atomic / _write_bytes_atomic: a temporary file in the
same folder, fsync, then os.replace, so an existing file is either the old one or the new one,
never a torn mix.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .atomic import write_atomic as _write_atomic
from .config import LlamaConfig
from .convert import (HF_FIELD, UnsupportedConfigError, hf_config_to_llama, hf_to_meta_name, is_hf_name,
                      llama_to_hf_config, meta_to_hf, meta_to_hf_name, permute_hf_to_meta, rope_inv_freq)


# ----------------------------------------------------------------------------- errors

class CheckpointError(ValueError):
    """A checkpoint is corrupt, truncated, untrusted, or does not fit its config."""


class PickleRefusedError(CheckpointError):
    """A pickle (torch.save) file: npllama never unpickles, since unpickling runs code."""


class ConfigMismatchError(CheckpointError):
    """The config contradicts the tensors (the message names each field)."""


class TensorMismatchError(CheckpointError, KeyError):
    """Tensors missing, unexpected or of the wrong shape (the message lists every one)."""

    def __str__(self):  # KeyError would quote the message; keep it readable
        return str(self.args[0]) if self.args else ""


PICKLE_HINT = (
    "npllama never unpickles (loading a pickle runs whatever code it holds). Export the weights to "
    "safetensors instead, e.g. `python tools/export_torch.py --hf FOLDER --out OUT_FOLDER`, or in "
    "Python `model.save_pretrained(out_dir, safe_serialization=True)` for a transformers model, or "
    "`safetensors.torch.save_file(state_dict, 'model.safetensors')` with a config.json beside it")


# ----------------------------------------------------------------------------- safetensors

_ST_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # read as raw bits, upcast to float32 by _bf16_to_f32
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_NP_TO_ST = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
             np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.int16): "I16",
             np.dtype(np.int8): "I8", np.dtype(np.uint64): "U64", np.dtype(np.uint32): "U32",
             np.dtype(np.uint16): "U16", np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL"}
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit


class Bfloat16(NamedTuple):
    """A bfloat16 tensor for write_safetensors_atomic: its raw uint16 bits (NumPy has no bfloat16)."""
    bits: np.ndarray


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 is the top half of a float32: shift the 16 bits up, exact."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> Bfloat16:
    """Round float32 to bfloat16, to nearest with ties to even (as torch does); NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    rounded[np.isnan(x)] = 0x7FC0
    return Bfloat16(rounded)


def _header_entries(path: Path, header: dict, data_len: int) -> list[tuple[str, str, tuple, int, int]]:
    """Validate every header entry against the file before any data is trusted."""
    entries = []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise CheckpointError(f"{path}: header entry {name!r} is not {{dtype, shape, data_offsets}}: {info!r}; "
                                  "the file is corrupt")
        st, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if st not in _ST_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {st!r}, which npllama cannot read "
                                  f"(known: {sorted(_ST_DTYPES)})")
        if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                  for s in shape):
            raise CheckpointError(f"{path}: tensor {name!r} has shape {shape!r}, not a list of sizes; corrupt header")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise CheckpointError(f"{path}: tensor {name!r} has data_offsets {offsets!r}; corrupt header")
        begin, end = offsets
        nbytes = math.prod(shape) * _ST_DTYPES[st].itemsize
        if end - begin != nbytes:
            raise CheckpointError(f"{path}: tensor {name!r} spans {end - begin} bytes but {st} {tuple(shape)} "
                                  f"needs {nbytes}; corrupt header")
        if end > data_len:
            raise CheckpointError(f"{path}: tensor {name!r} ends at data byte {end} but the file holds only "
                                  f"{data_len} data bytes; the file is truncated (re-download or re-export it)")
        entries.append((name, st, tuple(shape), begin, end))
    spans = sorted((b, e, n) for n, _, _, b, e in entries if e > b)
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CheckpointError(f"{path}: tensors {n0!r} and {n1!r} overlap; corrupt header")
    last = max((e for _, _, _, _, e in entries), default=0)
    if last != data_len:
        raise CheckpointError(f"{path}: {data_len - last} bytes follow the last tensor; the header and the "
                              "data disagree, so the file is corrupt")
    return entries


def read_safetensors_header(path) -> tuple[dict[str, tuple[str, tuple]], dict[str, str]]:
    """({name: (dtype_code, shape)}, metadata) of a safetensors file, validated, without its data."""
    path = Path(path)
    with open(path, "rb") as f:
        entries, metadata, _ = _read_header(f, path)
    return {n: (st, shape) for n, st, shape, _, _ in entries}, metadata


def _read_header(f, path: Path):
    size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    _refuse_pickle_magic(path, head)
    if len(head) < 8:
        raise CheckpointError(f"{path}: {size} bytes is too short for a safetensors file (it starts with an "
                              "8-byte header length); the file is truncated or not safetensors")
    (n,) = struct.unpack("<Q", head)
    if n > min(size - 8, _MAX_HEADER):
        raise CheckpointError(f"{path}: header length {n} does not fit in the {size}-byte file; "
                              "the file is truncated, corrupt, or not safetensors")
    raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: the safetensors header is not valid JSON ({e}); the file is corrupt") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is a JSON {type(header).__name__}, not an object; "
                              "the file is corrupt")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise CheckpointError(f"{path}: __metadata__ must map strings to strings; the file is corrupt")
    data_start = 8 + n
    return _header_entries(path, header, size - data_start), metadata, data_start


def read_safetensors(path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Read a .safetensors file: ({name: array}, metadata).

    The header (length, JSON, dtypes, shapes, offsets) is checked against the file size before
    any data is read. BF16 tensors come back as float32 (exact: bfloat16 is a truncated float32);
    every other dtype comes back as itself, in native byte order.
    Raises FileNotFoundError, PickleRefusedError, or CheckpointError naming the problem.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such safetensors file")
    tensors = {}
    with open(path, "rb") as f:
        entries, metadata, data_start = _read_header(f, path)
        for name, st, shape, begin, end in entries:
            dt = _ST_DTYPES[st]
            f.seek(data_start + begin)
            count = math.prod(shape)
            arr = np.fromfile(f, dtype=dt, count=count) if count else np.empty(0, dt)
            if arr.size != count:  # the file shrank under us
                raise CheckpointError(f"{path}: tensor {name!r} is cut short; the file is truncated")
            arr = arr.reshape(shape)
            arr = _bf16_to_f32(arr) if st == "BF16" else arr.astype(dt.newbyteorder("="), copy=False)
            tensors[name] = arr
    return tensors, metadata


def _write_bytes_atomic(path, data: bytes) -> None:
    _write_atomic(Path(path), lambda f: f.write(data))


def write_safetensors_atomic(path, tensors: dict, metadata: dict | None = None) -> None:
    """Write tensors ({name: np.ndarray or Bfloat16}) as one .safetensors file, atomically.

    Metadata values must be strings; "format": "pt" is always written, since transformers refuses
    safetensors files without it. Tensors are stored in the given order, little-endian, C order.
    """
    metadata = dict(metadata or {})
    metadata["format"] = "pt"
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise ValueError(f"safetensors metadata must map str to str; got {k!r}: {type(v).__name__}")
    header, arrays, offset = {}, [], 0
    for name, t in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise ValueError(f"invalid tensor name {name!r}")
        if isinstance(t, Bfloat16):
            arr, st = np.asarray(t.bits, dtype="<u2", order="C"), "BF16"
        else:
            t = np.asarray(t)
            st = _NP_TO_ST.get(t.dtype.newbyteorder("="))
            if st is None:
                raise ValueError(f"tensor {name!r}: dtype {t.dtype} cannot be stored in safetensors")
            arr = np.asarray(t, dtype=_ST_DTYPES[st], order="C")  # (ascontiguousarray would make 0-d 1-d)
        header[name] = {"dtype": st, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        arrays.append(arr)
        offset += arr.nbytes
    header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the safetensors library writes it

    def write(f):
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for arr in arrays:
            f.write(memoryview(arr.reshape(-1)).cast("B") if arr.size else b"")

    _write_atomic(Path(path), write)


# ----------------------------------------------------------------------------- pickle refusal

_PICKLE_SUFFIXES = {".pt", ".pth", ".ckpt", ".pkl", ".pickle"}


def _looks_pickled_name(path: Path) -> bool:
    name = path.name.lower()
    return path.suffix.lower() in _PICKLE_SUFFIXES or bool(re.fullmatch(r"pytorch_model.*\.bin", name))


def _refuse_pickle_name(path: Path) -> None:
    if _looks_pickled_name(path):
        raise PickleRefusedError(f"{path}: refusing a PyTorch pickle checkpoint. {PICKLE_HINT}")


def _refuse_pickle_magic(path: Path, head: bytes) -> None:
    """torch.save writes a zip ("PK\\x03\\x04") or, before torch 1.6, a raw pickle
    (0x80 then protocol 2..5, then an opcode, never 0x00). A llama2.c header starting 0x80 0x02
    (dim=640) has 0x00 third, so it is not mistaken for one."""
    zipped = head[:4] == b"PK\x03\x04"
    pickled = len(head) >= 3 and head[0] == 0x80 and 2 <= head[1] <= 5 and head[2] != 0
    if zipped or pickled:
        kind = "a zip archive (torch.save)" if zipped else "a pickle"
        raise PickleRefusedError(f"{path}: the file is {kind}; refusing it without unpickling. {PICKLE_HINT}")


# ----------------------------------------------------------------------------- llama2.c .bin

LLAMA2C_MAGIC = 0x616B3432  # "ak42" read as a little-endian uint32
LLAMA2C_V1_HEADER_BYTES = 256


def llama2c_layout(cfg: LlamaConfig, version: int) -> list[tuple[str | None, tuple[int, ...]]]:
    """The float32 data of a llama2.c .bin after its header, in file order, as (name, shape).

    name None marks data that is skipped (v0's RoPE tables, derived from rope_theta=10000).
    v0 (export.py legacy_export):  tok_embeddings, then per kind over all layers: attention_norm,
        wq, wk, wv, wo, ffn_norm, w1, w2, w3; then norm, freq_cis_real (max_seq_len, Dh/2),
        freq_cis_imag (max_seq_len, Dh/2), then output only when not shared.
    v1 (export.py version1_export): attention_norm x L, ffn_norm x L, norm, tok_embeddings, then
        wq, wk, wv, wo, w1, w2, w3 (each over all layers), then output only when not shared.
    """
    shapes = cfg.param_shapes()
    L = range(cfg.n_layers)

    def per_layer(kind):
        return [(f"layers.{i}.{kind}.weight", shapes[f"layers.{i}.{kind}.weight"]) for i in L]

    mats = ["attention.wq", "attention.wk", "attention.wv", "attention.wo",
            "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]
    emb = [("tok_embeddings.weight", shapes["tok_embeddings.weight"])]
    norm = [("norm.weight", shapes["norm.weight"])]
    out = [] if cfg.tie_embeddings else [("output.weight", shapes["output.weight"])]
    if version == 0:
        layout = emb + per_layer("attention_norm")
        for kind in mats[:4]:
            layout += per_layer(kind)
        layout += per_layer("ffn_norm")
        for kind in mats[4:]:
            layout += per_layer(kind)
        rope = (cfg.max_seq_len, cfg.head_dim // 2)
        return layout + norm + [(None, rope), (None, rope)] + out
    if version == 1:
        layout = per_layer("attention_norm") + per_layer("ffn_norm") + norm + emb
        for kind in mats:
            layout += per_layer(kind)
        return layout + out
    raise ValueError(f"llama2.c version {version} has no float32 layout here (known: 0, 1)")


def _read_llama2c(path: Path) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(LLAMA2C_V1_HEADER_BYTES)
    _refuse_pickle_magic(path, head)
    if len(head) < 28:
        raise CheckpointError(f"{path}: {size} bytes is too short for a llama2.c checkpoint "
                              "(the header alone is 28 bytes); the file is truncated")
    magic, version = struct.unpack("<Ii", head[:8])
    if magic == LLAMA2C_MAGIC:
        if version != 1:
            raise CheckpointError(
                f"{path}: llama2.c format version {version}; npllama reads v0 (legacy) and v1 (float32). "
                "Hint: re-export with llama2.c `python export.py out.bin --version 1 --checkpoint ...`")
        if len(head) < LLAMA2C_V1_HEADER_BYTES:
            raise CheckpointError(f"{path}: the llama2.c v1 header is 256 bytes but the file has {size}; truncated")
        dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = struct.unpack("<7i", head[8:36])
        shared = head[36]
        if shared not in (0, 1):
            raise CheckpointError(f"{path}: llama2.c v1 shared_classifier flag is {shared}, not 0 or 1; corrupt header")
        shared, offset = bool(shared), LLAMA2C_V1_HEADER_BYTES
    else:
        version = 0
        dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = struct.unpack("<7i", head[:28])
        shared, vocab, offset = vocab > 0, abs(vocab), 28  # legacy: negative vocab_size = separate classifier
    fields = dict(dim=dim, hidden_dim=hidden, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
                  vocab_size=vocab, max_seq_len=seq_len)
    try:
        if min(fields.values()) < 1 or max(fields.values()) > 1 << 24:
            raise ValueError(f"header sizes {fields} are out of range")
        # llama2.c's run.c hard-codes RMSNorm eps 1e-5 and RoPE theta 10000.
        cfg = LlamaConfig(**fields, norm_eps=1e-5, rope_theta=10000.0, tie_embeddings=shared)
    except ValueError as e:
        raise CheckpointError(f"{path}: not a usable llama2.c v{version} checkpoint: {e}") from None
    layout = llama2c_layout(cfg, version)
    expected = offset + 4 * sum(math.prod(s) for _, s in layout)
    if size != expected:
        what = "truncated" if size < expected else f"{size - expected} bytes too long"
        raise CheckpointError(
            f"{path}: a llama2.c v{version} checkpoint with header {fields} (shared classifier: {shared}) "
            f"is {expected} bytes, but the file has {size}: {what}. Hint: the file is damaged, or it is "
            "not a float32 llama2.c checkpoint")
    data = np.fromfile(path, dtype="<f4", offset=offset)
    params, pos = {}, 0
    for name, shape in layout:
        n = math.prod(shape)
        if name is not None:
            params[name] = data[pos:pos + n].reshape(shape)
        pos += n
    assert pos == data.size, f"{pos=} {data.size=}"
    return cfg, params


# ----------------------------------------------------------------------------- config vs tensors

def _field(name: str, hf: bool) -> str:
    return f"{name} (config.json {HF_FIELD[name]})" if hf else name


def _check_config_against(cfg: LlamaConfig, shapes: dict[str, tuple], hf: bool, display) -> None:
    """Raise ConfigMismatchError naming every config field the tensor shapes contradict."""
    problems = []
    emb = shapes.get("tok_embeddings.weight")
    if emb is not None and len(emb) == 2:
        if emb[1] != cfg.dim:
            problems.append(f"{_field('dim', hf)}={cfg.dim} but {display('tok_embeddings.weight')} is {emb}, "
                            f"i.e. dim={emb[1]}")
        if emb[0] != cfg.vocab_size:
            problems.append(f"{_field('vocab_size', hf)}={cfg.vocab_size} but {display('tok_embeddings.weight')} "
                            f"is {emb}, i.e. vocab_size={emb[0]}")
    layers = {int(m.group(1)) for n in shapes if (m := re.match(r"layers\.(\d+)\.", n))}
    if layers and max(layers) + 1 != cfg.n_layers:
        problems.append(f"{_field('n_layers', hf)}={cfg.n_layers} but the file holds layers "
                        f"{min(layers)}..{max(layers)}")
    w1 = shapes.get("layers.0.feed_forward.w1.weight")
    if w1 is not None and len(w1) == 2 and w1[0] != cfg.hidden_dim:
        problems.append(f"{_field('hidden_dim', hf)}={cfg.hidden_dim} but "
                        f"{display('layers.0.feed_forward.w1.weight')} is {w1}, i.e. hidden_dim={w1[0]}")
    wk = shapes.get("layers.0.attention.wk.weight")
    if wk is not None and len(wk) == 2 and wk[0] != cfg.n_kv_heads * cfg.head_dim and wk[0] % cfg.head_dim == 0:
        problems.append(f"{_field('n_kv_heads', hf)}={cfg.n_kv_heads} but {display('layers.0.attention.wk.weight')} "
                        f"is {wk}, i.e. n_kv_heads={wk[0] // cfg.head_dim} of head_dim {cfg.head_dim}")
    if not cfg.tie_embeddings and "output.weight" not in shapes and emb is not None:
        problems.append(f"{_field('tie_embeddings', hf)}=False but the file has no {display('output.weight')}; "
                        "if the output layer shares the embeddings, set it to true")
    if problems:
        raise ConfigMismatchError("the config contradicts the tensors:\n  " + "\n  ".join(problems))


def _check_rope_buffer(name: str, arr: np.ndarray, cfg: LlamaConfig) -> None:
    """HF rotary_emb.inv_freq (Dh/2,) and Meta rope.freqs (Dh/2,) are theta_j; check them, then skip."""
    want = rope_inv_freq(cfg.head_dim, cfg.rope_theta)
    if arr.shape != want.shape or not np.allclose(arr.astype(np.float64), want, rtol=1e-3, atol=0):
        raise ConfigMismatchError(
            f"rope_theta={cfg.rope_theta} (head_dim {cfg.head_dim}) contradicts the stored RoPE frequencies "
            f"{name!r} of shape {arr.shape}; fix rope_theta in the config")


class Loaded(NamedTuple):
    """What read_checkpoint found: a config, Meta-named arrays, a tokenizer or None, and notes."""
    config: LlamaConfig
    params: dict
    tokenizer: object
    notes: list


def _match_tensors(tensors: dict, metadata: dict, cfg: LlamaConfig, dtype, *, strict: bool,
                   source: str, hf_config: bool) -> tuple[dict, list]:
    """Rename to Meta, check config and shapes, un-permute HF q/k, cast. Returns (params, notes)."""
    notes = []
    if "npllama_train_state" in metadata:
        opt = [n for n in tensors if n.startswith("optimizer.")]
        if opt:
            notes.append(f"skipped {len(opt)} optimizer tensors (training checkpoint)")
        tensors = {n: t for n, t in tensors.items() if not n.startswith("optimizer.")}
    hf_names = [n for n in tensors if is_hf_name(n)]
    naming = "hf" if hf_names else "meta"
    if hf_names and len(hf_names) != len(tensors):
        meta_like = [n for n in tensors if not is_hf_name(n) and n in cfg.param_shapes()]
        if meta_like:
            raise CheckpointError(f"{source}: mixes Hugging Face names ({hf_names[0]!r}) and Meta names "
                                  f"({meta_like[0]!r}); a checkpoint must use one naming")
    renamed, file_name, unexpected = {}, {}, []
    for name, t in tensors.items():
        if name.endswith("rotary_emb.inv_freq") or name == "rope.freqs":
            _check_rope_buffer(name, t, cfg)
            notes.append(f"skipped derived RoPE buffer {name}")
            continue
        meta = hf_to_meta_name(name) if naming == "hf" else (name if meta_to_hf_name(name) else None)
        if meta is None or meta in renamed:
            unexpected.append(name)
            continue
        renamed[meta], file_name[meta] = t, name

    def display(meta):
        return file_name.get(meta) or (meta_to_hf_name(meta) if naming == "hf" else meta) or meta

    if cfg.tie_embeddings and "output.weight" in renamed:
        out, emb = renamed["output.weight"], renamed.get("tok_embeddings.weight")
        if emb is not None and out.shape == emb.shape and np.array_equal(out, emb):
            del renamed["output.weight"]
            notes.append(f"{display('output.weight')} equals the embeddings (tied); used once")
        else:
            raise ConfigMismatchError(
                f"{source}: {_field('tie_embeddings', hf_config)}=True but the file holds a separate "
                f"{display('output.weight')} that differs from {display('tok_embeddings.weight')}; "
                "set it to false to keep both")
    shapes = {n: tuple(t.shape) for n, t in renamed.items()}
    _check_config_against(cfg, shapes, hf_config, display)
    expected = cfg.param_shapes()
    missing = [display(n) for n in expected if n not in renamed]
    misshapen = [f"{display(n)}: {shapes[n]}, expected {expected[n]}"
                 for n in expected if n in renamed and shapes[n] != expected[n]]
    unexpected += [display(n) for n in renamed if n not in expected]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)}: {missing}")
    if misshapen:
        problems.append(f"wrong shape {len(misshapen)}: {misshapen}")
    if unexpected and strict:
        problems.append(f"unexpected {len(unexpected)}: {unexpected} (pass strict=False to load anyway "
                        "with a warning)")
    if problems:
        hint = ("expected Meta names like 'layers.0.attention.wq.weight' or Hugging Face names like "
                "'model.layers.0.self_attn.q_proj.weight'")
        raise TensorMismatchError(f"{source}: the tensors do not fit the config "
                                  f"({cfg.n_layers} layers, dim {cfg.dim}):\n  " + "\n  ".join(problems)
                                  + f"\n  hint: {hint}")
    if unexpected:
        warnings.warn(f"{source}: ignoring {len(unexpected)} unexpected tensors: {unexpected}", stacklevel=3)
        notes.append(f"ignored unexpected tensors {unexpected}")
    params = {}
    for n in expected:
        t = renamed[n]
        if t.dtype.kind != "f":
            raise CheckpointError(f"{source}: tensor {display(n)} has dtype {t.dtype}; weights must be floating point")
        t = t.astype(dtype, copy=False)
        if not np.isfinite(t).all():
            raise CheckpointError(f"{source}: tensor {display(n)} holds NaN or infinite values; the file is corrupt "
                                  "or the weights overflowed the requested dtype")
        if naming == "hf" and n.endswith((".attention.wq.weight", ".attention.wk.weight")):
            t = permute_hf_to_meta(t, cfg.n_heads if n.endswith("wq.weight") else cfg.n_kv_heads)
        params[n] = np.ascontiguousarray(t)
    return params, notes


def _config_from_json_file(path: Path, max_seq_len) -> tuple[LlamaConfig, bool]:
    """(config, is_hf) from a config.json holding either HF keys or LlamaConfig.to_json keys."""
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    try:
        if isinstance(d, dict) and "hidden_size" not in d and "dim" in d:
            cfg = LlamaConfig.from_dict(d)
            if max_seq_len is not None:
                cfg = LlamaConfig.from_dict({**cfg.to_dict(), "max_seq_len": max_seq_len})
            return cfg, False
        return hf_config_to_llama(d, max_seq_len=max_seq_len), True
    except UnsupportedConfigError as e:
        raise UnsupportedConfigError(f"{path}: {e}") from None
    except ValueError as e:
        raise ConfigMismatchError(f"{path}: {e}") from None


def _tokenizer_from_metadata(metadata: dict, source: str):
    text = metadata.get("npllama_tokenizer")
    if text is None:
        return None
    from .tokenizers import tokenizer_from_json
    try:
        return tokenizer_from_json(text)
    except ValueError as e:
        raise CheckpointError(f"{source}: metadata npllama_tokenizer is unusable: {e}") from None


def _read_hf_folder(folder: Path) -> tuple[dict, dict, str]:
    """(tensors, metadata, description) of model.safetensors or the shards of its index."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():  # transformers tries the single file first too
        tensors, metadata = read_safetensors(single)
        return tensors, metadata, str(single)
    if index.is_file():
        try:
            idx = json.loads(index.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{index}: not valid JSON ({e})") from None
        wmap = idx.get("weight_map") if isinstance(idx, dict) else None
        if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
            raise CheckpointError(f"{index}: needs a 'weight_map' object of tensor name -> shard file")
        tensors, metadata = {}, {}
        for shard in sorted(set(wmap.values())):
            if Path(shard).name != shard:
                raise CheckpointError(f"{index}: shard {shard!r} is not a file name inside the folder")
            shard_path = folder / shard
            if not shard_path.is_file():
                raise FileNotFoundError(f"{index} lists shard {shard!r}, which is not in {folder}")
            part, meta = read_safetensors(shard_path)
            metadata.update(meta)
            listed = {n for n, s in wmap.items() if s == shard}
            absent, unlisted = sorted(listed - set(part)), sorted(set(part) - listed)
            if absent or unlisted:
                raise CheckpointError(f"{shard_path}: disagrees with {index.name}: "
                                      f"listed but absent {absent}, present but not listed {unlisted}")
            tensors.update(part)
        return tensors, metadata, f"{folder} ({len(set(wmap.values()))} shards)"
    pickles = sorted(p.name for p in folder.iterdir() if _looks_pickled_name(p))
    if pickles:
        raise PickleRefusedError(f"{folder}: holds only PyTorch pickle weights {pickles}; refusing them. {PICKLE_HINT}")
    raise FileNotFoundError(f"{folder}: no model.safetensors or model.safetensors.index.json; "
                            "expected a Hugging Face LlamaForCausalLM folder")


def read_checkpoint(path, dtype=np.float32, *, strict: bool = True, max_seq_len: int | None = None) -> Loaded:
    """Read any supported checkpoint into (config, Meta-named params, tokenizer, notes); see load()."""
    path = Path(path)
    dtype = np.dtype(dtype)
    if dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(f"dtype={dtype} is not supported; use np.float32 or np.float64")
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or folder")
    if path.is_dir():
        tensors, metadata, source = _read_hf_folder(path)
        cfg_file = path / "config.json"
        if cfg_file.is_file():
            cfg, hf = _config_from_json_file(cfg_file, max_seq_len)
        elif "npllama_config" in metadata:
            cfg, hf = _config_from_metadata(metadata, source, max_seq_len), False
        else:
            raise FileNotFoundError(f"{path}: no config.json; a Hugging Face folder needs one "
                                    "(save_pretrained writes it)")
        tokenizer = _tokenizer_from_metadata(metadata, source)
        if tokenizer is None and (path / "tokenizer.model").is_file():
            from .tokenizers import SentencePieceTokenizer
            tokenizer = SentencePieceTokenizer.from_file(path / "tokenizer.model")
    else:
        _refuse_pickle_name(path)
        suffix = path.suffix.lower()
        if suffix == ".bin":
            cfg, params = _read_llama2c(path)
            if max_seq_len is not None:
                cfg = LlamaConfig.from_dict({**cfg.to_dict(), "max_seq_len": max_seq_len})
            params = {n: np.ascontiguousarray(t, dtype=dtype) for n, t in params.items()}
            return Loaded(cfg, params, None, [f"llama2.c checkpoint {path}"])
        if suffix != ".safetensors":
            with open(path, "rb") as f:
                _refuse_pickle_magic(path, f.read(4))
            raise CheckpointError(f"{path}: unknown checkpoint type {suffix!r}; npllama reads .safetensors files, "
                                  "Hugging Face folders and llama2.c .bin files")
        tensors, metadata = read_safetensors(path)
        source = str(path)
        beside = path.parent / "config.json"
        if "npllama_config" in metadata:
            cfg, hf = _config_from_metadata(metadata, source, max_seq_len), False
        elif beside.is_file():
            cfg, hf = _config_from_json_file(beside, max_seq_len)
        else:
            raise FileNotFoundError(
                f"{path}: no config found: the metadata has no 'npllama_config' and there is no config.json "
                "beside the file. Hint: put the model's config.json next to it")
        tokenizer = _tokenizer_from_metadata(metadata, source)
    params, notes = _match_tensors(tensors, metadata, cfg, dtype, strict=strict, source=source, hf_config=hf)
    return Loaded(cfg, params, tokenizer, notes)


def _config_from_metadata(metadata: dict, source: str, max_seq_len) -> LlamaConfig:
    try:
        cfg = LlamaConfig.from_json(metadata["npllama_config"])
        if max_seq_len is not None:
            cfg = LlamaConfig.from_dict({**cfg.to_dict(), "max_seq_len": max_seq_len})
        return cfg
    except ValueError as e:
        raise ConfigMismatchError(f"{source}: metadata npllama_config is unusable: {e}") from None


def load(path, dtype=np.float32, *, strict: bool = True, max_seq_len: int | None = None):
    """Load a checkpoint into an npllama.Llama (formats: see this module's docstring).

    dtype: np.float32 (default) or np.float64; every tensor is cast to it.
    strict: False turns unexpected extra tensors into a warning instead of an error.
    max_seq_len: override the config's (e.g. Llama 2's 4096 makes large RoPE tables).
    model.tokenizer is set from the metadata key "npllama_tokenizer" or a folder's tokenizer.model,
    else None.
    """
    from .model import Llama

    loaded = read_checkpoint(path, dtype, strict=strict, max_seq_len=max_seq_len)
    model = Llama.from_params(loaded.config, loaded.params, dtype=dtype)
    model.tokenizer = loaded.tokenizer
    return model


# ----------------------------------------------------------------------------- save

_SAVE_DTYPES = {"float32": "float32", "float64": "float64", "float16": "float16", "bfloat16": "bfloat16"}


def _save_dtype_name(dtype) -> str:
    if isinstance(dtype, str):
        name = dtype
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = str(dtype)
    if name not in _SAVE_DTYPES:
        raise ValueError(f"dtype={dtype!r} cannot be saved; use float32 (default), float64, float16 or 'bfloat16'")
    return name


def _cast_for_save(arr: np.ndarray, name: str):
    if name == "bfloat16":
        return f32_to_bf16(arr)
    out = np.asarray(arr, dtype=name)
    if not np.isfinite(out).all():
        raise ValueError(f"casting to {name} overflows some weights; save in float32 instead")
    return out


def save(model, path, format: str = "hf", dtype="float32") -> Path:
    """Write model to path; returns the path written.

    format="hf":   path is a folder (created if needed) holding model.safetensors (HF names,
                   q/k rows permuted to rotate-half order), config.json for LlamaForCausalLM,
                   and tokenizer.model when model.tokenizer is SentencePiece (any other tokenizer
                   goes to the metadata key "npllama_tokenizer"). It loads with
                   transformers.LlamaForCausalLM.from_pretrained(path).
    format="meta": path is one .safetensors file with Meta names and metadata
                   {"format": "pt", "npllama_config": config JSON, "npllama_tokenizer": tokenizer
                   JSON when model.tokenizer is set}.
    dtype: "float32" (default, whatever the model's dtype), "float64", "float16" or "bfloat16".
    Every file is written atomically: an existing file is replaced whole or left untouched.
    """
    path = Path(path)
    dname = _save_dtype_name(dtype)
    cfg, params = model.config, model.params
    tokenizer = getattr(model, "tokenizer", None)
    meta = {}
    if tokenizer is not None:
        meta["npllama_tokenizer"] = tokenizer.to_json()
    if format == "meta":
        if path.suffix != ".safetensors":
            raise ValueError(f"{path}: format='meta' writes one .safetensors file; give a path ending in .safetensors")
        if path.is_dir():
            raise IsADirectoryError(f"{path} is a folder; format='meta' writes one .safetensors file")
        tensors = {n: _cast_for_save(params[n], dname) for n in cfg.param_shapes()}
        write_safetensors_atomic(path, tensors, {**meta, "npllama_config": cfg.to_json()})
        return path
    if format == "hf":
        if path.exists() and not path.is_dir():
            raise FileExistsError(f"{path} is a file; format='hf' writes a folder")
        if (path / "model.safetensors.index.json").exists():
            raise FileExistsError(f"{path} holds a sharded checkpoint (model.safetensors.index.json); "
                                  "save into a new folder so the old shards cannot shadow the new weights")
        path.mkdir(parents=True, exist_ok=True)
        hf = meta_to_hf({n: params[n] for n in cfg.param_shapes()}, cfg)
        proto = getattr(tokenizer, "model_proto", None)
        if isinstance(proto, (bytes, bytearray)):  # SentencePiece: the file transformers' LlamaTokenizer reads
            _write_bytes_atomic(path / "tokenizer.model", bytes(proto))
            meta.pop("npllama_tokenizer")
        write_safetensors_atomic(path / "model.safetensors", {n: _cast_for_save(t, dname) for n, t in hf.items()},
                                 meta)
        hf_cfg = llama_to_hf_config(cfg, torch_dtype=dname,
                                    bos_id=getattr(tokenizer, "bos_id", None),
                                    eos_id=getattr(tokenizer, "eos_id", None))
        _write_bytes_atomic(path / "config.json", (json.dumps(hf_cfg, indent=2) + "\n").encode("utf-8"))
        return path
    raise ValueError(f"format={format!r}; use 'hf' (a transformers folder) or 'meta' (one .safetensors file)")
