"""llama2.c checkpoints (.bin): Karpathy's export.py layouts, read by an explicit table.

    v0 (legacy)  7 int32 header: dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size
                 (negative: a separate classifier follows), max_seq_len; then float32 weights
    v1           256-byte header: magic "ak42", int32 version 1, the same 7 int32, a uint8
                 shared_classifier flag, zero padding; then float32 weights

The order of the weights is written down as data in llama2c_layout, never left to a
pointer walk as in run.c.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy as np

from ..config import LlamaConfig
from ..errors import NpllamaError
from .errors import CheckpointError
from .mapped import file_buffer
from .pickles import refuse_pickle_magic

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
    raise NpllamaError(f"llama2.c version {version} has no float32 layout here (known: 0, 1)")


def llama2c_float_count(cfg: LlamaConfig, version: int) -> int:
    """The number of float32 values after the header: sum(prod(shape)) over llama2c_layout, in
    closed form, so a header claiming millions of layers is measured against the file at once."""
    rope = 2 * cfg.max_seq_len * (cfg.head_dim // 2) if version == 0 else 0
    return cfg.n_params() + rope


def read_llama2c(path: Path, mapped: bool = True) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """(config, {Meta name: float32 array}) of a llama2.c checkpoint; the arrays are views of the file,
    memory-mapped copy-on-write (nothing is read until used; writes never reach the file), or,
    not mapped, of the file read into memory (io/mapped.py)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(LLAMA2C_V1_HEADER_BYTES)
    refuse_pickle_magic(path, head)
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
            raise NpllamaError(f"header sizes {fields} are out of range")
        # llama2.c's run.c hard-codes RMSNorm eps 1e-5 and RoPE theta 10000.
        cfg = LlamaConfig(**fields, norm_eps=1e-5, rope_theta=10000.0, tie_embeddings=shared)
    except ValueError as e:
        raise CheckpointError(f"{path}: not a usable llama2.c v{version} checkpoint: {e}") from None
    expected = offset + 4 * llama2c_float_count(cfg, version)
    if size != expected:
        what = "truncated" if size < expected else f"{size - expected} bytes too long"
        raise CheckpointError(
            f"{path}: a llama2.c v{version} checkpoint with header {fields} (shared classifier: {shared}) "
            f"is {expected} bytes, but the file has {size}: {what}. Hint: the file is damaged, or it is "
            "not a float32 llama2.c checkpoint")
    with open(path, "rb") as f:   # mapped copy-on-write or read, as io/safetensors.py map_safetensors explains
        buffer = file_buffer(f, path, mapped)
    if len(buffer) != expected:
        raise CheckpointError(f"{path}: the file changed size while it was opened ({size:,} -> {len(buffer):,} bytes); "
                              "it is being written or truncated: wait for it, then load again")
    layout = llama2c_layout(cfg, version)
    data = np.frombuffer(buffer, dtype="<f4", offset=offset)
    if not data.dtype.isnative:
        data = data.astype("=f4")
    params, pos = {}, 0
    for name, shape in layout:
        n = math.prod(shape)
        if name is not None:
            params[name] = data[pos:pos + n].reshape(shape)
        pos += n
    assert pos == data.size, f"{pos=} {data.size=}"
    return cfg, params
