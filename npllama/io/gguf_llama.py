"""LLaMA models in GGUF files: llama.cpp's tensor names and metadata keys, to and from npllama's.

Names (llama.cpp's llama architecture; per layer i):

    GGUF                            Meta (npllama)
    token_embd.weight               tok_embeddings.weight
    blk.{i}.attn_norm.weight        layers.{i}.attention_norm.weight
    blk.{i}.attn_q.weight           layers.{i}.attention.wq.weight
    blk.{i}.attn_k.weight           layers.{i}.attention.wk.weight
    blk.{i}.attn_v.weight           layers.{i}.attention.wv.weight
    blk.{i}.attn_output.weight      layers.{i}.attention.wo.weight
    blk.{i}.ffn_norm.weight         layers.{i}.ffn_norm.weight
    blk.{i}.ffn_gate.weight         layers.{i}.feed_forward.w1.weight
    blk.{i}.ffn_down.weight         layers.{i}.feed_forward.w2.weight
    blk.{i}.ffn_up.weight           layers.{i}.feed_forward.w3.weight
    output_norm.weight              norm.weight
    output.weight                   output.weight     (absent: tied to token_embd, as llama.cpp reads it)

Q/K rows. llama.cpp's convert_hf_to_gguf.py (LlamaModel.modify_tensors) applies `permute` to
q_proj and k_proj: W.reshape(n, 2, Dh/2, D).swapaxes(1, 2), with n = n_heads for q and
n_kv_heads for k. That is exactly io/hf.py's permute_hf_to_meta: it undoes Hugging Face's
rotate-half order, because llama.cpp's LLaMA RoPE (mode 0, "normal") rotates neighbouring
features (2j, 2j+1) as Meta's reference does. So a GGUF file holds wq and wk in Meta's order,
npllama's own: they are read and written as they are, with no permutation (a file written from
an HF folder by llama.cpp and npllama's read of that folder agree: tests/test_gguf_llama_cpp.py).

Metadata (the keys llama.cpp's loader reads for "llama"; the types its converter writes):

    general.architecture "llama"   anything else is refused, naming the architecture
    llama.embedding_length         dim            llama.block_count            n_layers
    llama.attention.head_count     n_heads        llama.attention.head_count_kv n_kv_heads (default n_heads)
    llama.feed_forward_length      hidden_dim     llama.context_length         max_seq_len
    llama.attention.layer_norm_rms_epsilon norm_eps     llama.rope.freq_base   rope_theta (default 10000)
    vocab_size: rows of token_embd (llama.vocab_size, when present, must agree)
    tie_embeddings: no output.weight
Refused with one line each, since npllama computes plain LLaMA-2 only: experts
(llama.expert_count), RoPE scaling (llama.rope.scaling.type, freq_scale, a rope_freqs tensor),
partial rotary (llama.rope.dimension_count != head_dim), a head size other than dim / n_heads,
biases. float32 values (eps, theta) are read back as the shortest decimal that rounds to them,
so 1e-5 written as float32 reads as 1e-5.

Tensor types: F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K (io/gguf_quant.py); quantized ones are
decoded a block of rows at a time into the storage dtype asked for. The memory that holding them
will take is checked (npllama.memory) from the shapes before any is decoded.
"""

from __future__ import annotations

import re
import warnings
from collections import Counter

import numpy as np

from .. import memory
from ..config import LlamaConfig
from ..errors import NpllamaError
from ..storage import BFLOAT16_BITS, all_finite, float32_to_bfloat16, is_half, storage_name_of, to_float, to_storage
from .config_check import check_config_against
from .errors import CheckpointError, ConfigMismatchError, TensorMismatchError, UnsupportedGGUFError
from .footprint import load_footprint
from .gguf import (ARRAY, FLOAT32, GGML_TYPE_IDS, STRING, UINT32, TensorToWrite, get_value, read_gguf,
                   write_gguf_atomic)
from .gguf_quant import DEQUANTIZERS, SUPPORTED, dequantize, quantize_q8_0
from .gguf_vocab import tokenizer_from_gguf, vocab_metadata
from .hf import rename_parameter
from .safetensors import release_pages

ARCH = "llama"
GLOBAL_NAMES = {"token_embd.weight": "tok_embeddings.weight", "output_norm.weight": "norm.weight",
                "output.weight": "output.weight"}
LAYER_NAMES = {
    "attn_norm.weight": "attention_norm.weight", "attn_q.weight": "attention.wq.weight",
    "attn_k.weight": "attention.wk.weight", "attn_v.weight": "attention.wv.weight",
    "attn_output.weight": "attention.wo.weight", "ffn_norm.weight": "ffn_norm.weight",
    "ffn_gate.weight": "feed_forward.w1.weight", "ffn_down.weight": "feed_forward.w2.weight",
    "ffn_up.weight": "feed_forward.w3.weight",
}
_META_LAYER = {v: k for k, v in LAYER_NAMES.items()}
_META_GLOBAL = {v: k for k, v in GLOBAL_NAMES.items()}
_GGUF_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")
_META_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")

# LlamaConfig field -> where a GGUF file says it (for errors naming both)
GGUF_FIELD = {"dim": "llama.embedding_length", "n_layers": "llama.block_count",
              "hidden_dim": "llama.feed_forward_length", "n_kv_heads": "llama.attention.head_count_kv",
              "vocab_size": "llama.vocab_size", "tie_embeddings": "output.weight present"}

# npllama export --type -> (ggml type of the 2-D weights, general.file_type: llama.cpp's LlamaFileType)
WRITE_TYPES = {"f32": ("F32", 0), "f16": ("F16", 1), "bf16": ("BF16", 32), "q8_0": ("Q8_0", 7)}
_NATIVE = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}     # held as they are stored


def gguf_to_meta_name(name: str) -> str | None:
    """Meta name of a GGUF LLaMA tensor name, or None."""
    return rename_parameter(name, GLOBAL_NAMES, _GGUF_LAYER, LAYER_NAMES, "layers.")


def meta_to_gguf_name(name: str) -> str | None:
    """GGUF name of a Meta parameter name, or None."""
    return rename_parameter(name, _META_GLOBAL, _META_LAYER_RE, _META_LAYER, "blk.")


# ----------------------------------------------------------------------------- reading

def _shortest(value: float, vtype: int) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-5, not 9.99999974e-06)."""
    return float(str(np.float32(value))) if vtype == FLOAT32 else value


def _refuse_unsupported(gf, source: str, head_dim: int) -> None:
    m = gf.metadata
    experts = get_value(m, "llama.expert_count", "int", source, 0)
    if experts:
        raise UnsupportedGGUFError(f"{source}: a mixture of {experts} experts (llama.expert_count); npllama runs "
                                   "dense LLaMA models only")
    scaling = get_value(m, "llama.rope.scaling.type", "str", source, "none")
    factor = get_value(m, "llama.rope.scaling.factor", "float", source, 1.0)
    freq_scale = get_value(m, "llama.rope.freq_scale", "float", source, 1.0)
    if scaling not in ("none", "linear") or factor not in (0.0, 1.0) or freq_scale != 1.0 or "rope_freqs.weight" in gf.tensors:
        raise UnsupportedGGUFError(f"{source}: RoPE scaling (type {scaling!r}, factor {factor}, freq_scale {freq_scale}"
                                   f"{', rope_freqs.weight' if 'rope_freqs.weight' in gf.tensors else ''}); npllama "
                                   "implements plain LLaMA-2 RoPE only")
    for key in ("llama.rope.dimension_count", "llama.attention.key_length", "llama.attention.value_length"):
        value = get_value(m, key, "int", source, head_dim)
        if value != head_dim:
            raise UnsupportedGGUFError(f"{source}: {key}={value} but head_dim = embedding_length / head_count = "
                                       f"{head_dim}; npllama needs them equal (full RoPE, head_dim = dim / n_heads)")


def check_architecture(gf, source: str) -> None:
    """Refuse, naming it, any architecture but LLaMA's."""
    arch = get_value(gf.metadata, "general.architecture", "str", source)
    if arch != ARCH:
        raise UnsupportedGGUFError(f"{source}: architecture {arch!r}; npllama runs LLaMA models "
                                   "(general.architecture 'llama') only")


def config_from_gguf(gf, shapes: dict, source: str) -> LlamaConfig:
    """The LlamaConfig a LLaMA GGUF file's metadata describes (module docstring); shapes: {Meta name:
    shape} of its tensors, which give vocab_size, tie_embeddings and a missing feed_forward_length."""
    m = gf.metadata
    if m.get("llama.attention.head_count_kv", (None,))[0] == ARRAY:
        raise UnsupportedGGUFError(f"{source}: llama.attention.head_count_kv differs between layers; npllama "
                                   "needs one number of key/value heads for every layer")
    n_heads = get_value(m, "llama.attention.head_count", "int", source)
    emb = shapes.get("tok_embeddings.weight")
    if emb is None or len(emb) != 2:
        raise TensorMismatchError(f"{source}: no 2-D token_embd.weight; not a LLaMA model")
    fields = dict(
        dim=get_value(m, "llama.embedding_length", "int", source),
        n_layers=get_value(m, "llama.block_count", "int", source),
        n_heads=n_heads,
        n_kv_heads=get_value(m, "llama.attention.head_count_kv", "int", source, n_heads),
        vocab_size=emb[0],
        hidden_dim=get_value(m, "llama.feed_forward_length", "int", source,
                             shapes.get("layers.0.feed_forward.w1.weight", (None,))[0]),
        max_seq_len=get_value(m, "llama.context_length", "int", source),
        norm_eps=_shortest(get_value(m, "llama.attention.layer_norm_rms_epsilon", "float", source),
                           m.get("llama.attention.layer_norm_rms_epsilon", (None,))[0]),
        rope_theta=_shortest(get_value(m, "llama.rope.freq_base", "float", source, 10000.0),
                             m.get("llama.rope.freq_base", (None,))[0]),
        tie_embeddings="output.weight" not in shapes,
    )
    try:
        cfg = LlamaConfig(**fields)
    except NpllamaError as e:
        raise ConfigMismatchError(f"{source}: the metadata describes no usable LLaMA model: {e}") from None
    vocab = get_value(m, "llama.vocab_size", "int", source, cfg.vocab_size)
    if vocab != cfg.vocab_size:
        raise ConfigMismatchError(f"{source}: llama.vocab_size={vocab} but token_embd.weight has {cfg.vocab_size} rows")
    _refuse_unsupported(gf, source, cfg.head_dim)
    return cfg


class _Planned:
    """What footprint.load_footprint needs of a tensor before it exists: its shape and the dtype it is stored in."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, np.dtype(dtype)


def _stored_dtype(type_name: str):
    return {"F32": np.float32, "F16": np.float16, "BF16": BFLOAT16_BITS}.get(type_name, np.uint8)


def _hold(gf, info, storage: str, mapped: bool, widen_later: bool = False) -> np.ndarray:
    """A tensor as an array of `storage` (uint16 bits for bfloat16): a view of the file when it is
    stored so and mapped, else decoded a block of rows at a time (each block's pages then released).
    widen_later: a mapped F32, F16 or BF16 tensor to be widened (to float32 or float64) stays a view
    of the file too, for Llama.from_params to convert straight into the model's layout (load)."""
    raw = gf.tensor_bytes(info)
    native = _NATIVE.get(info.type.name)
    if native is not None and (native == storage or (widen_later and not is_half(storage))):
        arr = raw.view(_stored_dtype(info.type.name)).reshape(info.shape)
        if native == storage:
            return arr if mapped and arr.flags.aligned else arr.copy()
        if arr.flags.aligned:                            # widened later, from the file's buffer
            return arr
    out = np.empty(info.shape, dtype=BFLOAT16_BITS if storage == "bfloat16" else storage)
    rows = out.reshape(-1, info.shape[-1])
    row_bytes = info.nbytes // rows.shape[0]
    step = max(1, (1 << 20) // info.shape[-1])
    for r in range(0, rows.shape[0], step):
        chunk = raw[r * row_bytes:(r + step) * row_bytes]
        values = dequantize(chunk, info.type_id).reshape(-1, info.shape[-1])
        rows[r:r + step] = to_storage(values, storage)
        release_pages(chunk)
    return out


def _tensor_names(gf, source: str, strict: bool) -> tuple[dict, list]:
    """({Meta name: TensorInfo}, notes); refuses biases and RoPE factor tensors, and unknown
    tensors when strict."""
    found, unexpected = {}, []
    for name, info in gf.tensors.items():
        meta = gguf_to_meta_name(name)
        if name == "rope_freqs.weight":       # RoPE scaling factors: config_from_gguf refuses them by name
            continue
        if meta is None:
            if name.endswith(".bias"):
                raise UnsupportedGGUFError(f"{source}: tensor {name!r} is a bias; LLaMA's linear layers have none, "
                                           "and npllama's neither")
            unexpected.append(name)
            continue
        found[meta] = info
    notes = []
    if unexpected and strict:
        raise TensorMismatchError(f"{source}: unexpected tensors {unexpected} (pass strict=False to load anyway "
                                  "with a warning)")
    if unexpected:
        warnings.warn(f"{source}: ignoring {len(unexpected)} unexpected tensors: {unexpected}", stacklevel=4)
        notes.append(f"ignored unexpected tensors {unexpected}")
    return found, notes


def read_gguf_model(path, storage: str, *, strict: bool = True, mapped: bool = True, widen_later: bool = False):
    """(config, Meta-named params held as `storage`, tokenizer or None, notes, footprint) of a LLaMA GGUF file.
    widen_later: mapped tensors to be widened come back as stored, checked finite (_hold)."""
    gf = read_gguf(path, mapped)
    source = str(path)
    check_architecture(gf, source)
    found, notes = _tensor_names(gf, source, strict)
    shapes = {n: info.shape for n, info in found.items()}
    cfg = config_from_gguf(gf, shapes, source)

    def display(meta):
        return found[meta].name if meta in found else meta_to_gguf_name(meta)

    check_config_against(cfg, shapes, lambda f: f"{f} ({GGUF_FIELD.get(f, f)})", display)
    expected = cfg.param_shapes()
    missing = [display(n) for n in expected if n not in found]
    misshapen = [f"{display(n)}: {shapes[n]}, expected {expected[n]}" for n in expected
                 if n in found and shapes[n] != expected[n]]
    if missing or misshapen:
        raise TensorMismatchError(f"{source}: the tensors do not fit the metadata ({cfg.n_layers} layers, dim "
                                  f"{cfg.dim}): missing {missing}, wrong shape {misshapen}")
    for n in expected:
        if found[n].type_id not in DEQUANTIZERS:
            raise UnsupportedGGUFError(f"{source}: tensor {display(n)} is {found[n].type.name}, which npllama cannot "
                                       f"decode (it reads {', '.join(SUPPORTED)}); convert the model again with one "
                                       "of those, e.g. llama-quantize ... Q8_0 or Q4_K_M")
    planned = {n: _Planned(found[n].shape, _stored_dtype(found[n].type.name)) for n in expected}
    footprint = load_footprint(planned, storage, mapped=mapped)
    memory.require(footprint.total, f"loading {source} as {storage} ({footprint.describe()})",
                   "load it on a machine with more memory" + ("" if is_half(storage) else
                                                              ", or hold it in float16 or bfloat16"))
    params = {}
    for n in expected:
        held = _hold(gf, found[n], storage, mapped, widen_later)
        if not all_finite(held):
            raise CheckpointError(f"{source}: tensor {display(n)} holds NaN or infinite values; the file is corrupt "
                                  "or the weights overflowed the requested dtype")
        if mapped and storage_name_of(held) != storage:     # widened later: the checked pages read back when copied
            release_pages(held)
        params[n] = held
    types = Counter(found[n].type.name for n in expected)
    notes = [f"GGUF v{gf.version} {source}: " + ", ".join(f"{k} x {v}" for k, v in sorted(types.items()))] + notes
    notes.append(f"holds {footprint.describe()}")
    tokenizer, problem = tokenizer_from_gguf(gf.metadata, source)
    if problem:
        warnings.warn(f"{problem}; the model loads without a tokenizer (pass --tokenizer PATH)", stacklevel=4)
        notes.append(problem)
    return cfg, params, tokenizer, notes, footprint


# ----------------------------------------------------------------------------- writing

def write_type_name(name) -> str:
    """The --type of a GGUF export from what a user may pass: f32 / f16 / bf16 / q8_0, or the
    storage dtype names float32 / float16 / bfloat16."""
    aliases = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "bf16": "bf16"}
    key = str(name).lower()
    key = aliases.get(key, key)
    if key not in WRITE_TYPES:
        raise NpllamaError(f"GGUF type {name!r}; use one of {sorted(WRITE_TYPES)} (q8_0: 8-bit blocks, a quarter "
                           "of float32's size)")
    return key


def _encoder(arr: np.ndarray, type_name: str, name: str):
    """A function giving the bytes of `arr` (a held parameter) as ggml type type_name, made when written."""
    def encode():
        x = to_float(arr, np.float32)
        if type_name == "F32":
            return np.ascontiguousarray(x)
        if type_name == "BF16":
            return float32_to_bfloat16(x)
        if type_name == "Q8_0":
            return quantize_q8_0(x)
        with np.errstate(over="ignore"):
            out = x.astype(np.float16)
        if not all_finite(out):
            raise NpllamaError(f"{name}: values beyond float16's range; export with --type f32 or bf16")
        return out
    return encode


def write_gguf_model(path, cfg: LlamaConfig, params: dict, tokenizer, type_name: str = "f32",
                     name: str = "npllama") -> list[str]:
    """Write a LLaMA GGUF file as llama.cpp's converter lays it out; returns notes (fallbacks).

    type_name (write_type_name): the ggml type of every 2-D weight; 1-D norms are always F32,
    as llama.cpp's converter keeps them. Q8_0 needs rows of a multiple of 32 values: other
    weights are written F16, as the converter falls back.
    """
    type_name = write_type_name(type_name)
    weight_type, file_type = WRITE_TYPES[type_name]
    order = ["tok_embeddings.weight"]
    for i in range(cfg.n_layers):
        order += [f"layers.{i}.{k}" for k in ("attention_norm.weight", "attention.wq.weight", "attention.wk.weight",
                                              "attention.wv.weight", "attention.wo.weight", "ffn_norm.weight",
                                              "feed_forward.w1.weight", "feed_forward.w3.weight",
                                              "feed_forward.w2.weight")]
    order += ["norm.weight"] + ([] if cfg.tie_embeddings else ["output.weight"])
    tensors, fallbacks = [], []
    for meta in order:
        arr = params[meta]
        ttype = "F32" if arr.ndim == 1 else weight_type
        if ttype == "Q8_0" and arr.shape[-1] % 32:
            ttype = "F16"
            fallbacks.append(meta_to_gguf_name(meta))
        tensors.append(TensorToWrite(meta_to_gguf_name(meta), tuple(arr.shape), GGML_TYPE_IDS[ttype],
                                     _encoder(arr, ttype, meta_to_gguf_name(meta))))
    u32 = [("llama.block_count", cfg.n_layers), ("llama.context_length", cfg.max_seq_len),
           ("llama.embedding_length", cfg.dim), ("llama.feed_forward_length", cfg.hidden_dim),
           ("llama.attention.head_count", cfg.n_heads), ("llama.attention.head_count_kv", cfg.n_kv_heads)]
    metadata = ([("general.architecture", STRING, ARCH), ("general.type", STRING, "model"),
                 ("general.name", STRING, name)]
                + [(k, UINT32, v) for k, v in u32]
                + [("llama.rope.freq_base", FLOAT32, cfg.rope_theta),
                   ("llama.attention.layer_norm_rms_epsilon", FLOAT32, cfg.norm_eps),
                   ("general.file_type", UINT32, file_type), ("llama.vocab_size", UINT32, cfg.vocab_size),
                   ("llama.rope.dimension_count", UINT32, cfg.head_dim)]
                + vocab_metadata(tokenizer, cfg.vocab_size)
                + [("general.quantization_version", UINT32, 2)])
    write_gguf_atomic(path, metadata, tensors)
    return [f"rows not a multiple of 32 written as F16: {fallbacks}"] if fallbacks else []
