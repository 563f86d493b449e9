"""Weights in and out: safetensors (Meta or Hugging Face names), HF folders, llama2.c .bin files, GGUF.

    model = npllama.load(path, dtype=np.float32)
    npllama.save(model, path, format="hf")      # or format="meta", or "gguf"

What `load` accepts (the first match wins):

    a folder           Hugging Face LlamaForCausalLM: config.json plus model.safetensors, or shards
                       listed in model.safetensors.index.json; tokenizer.model or, without
                       it, tokenizer.json (what transformers 5 writes) becomes model.tokenizer
                       (a tokenizer.json npllama cannot run is a warning, not an error)
    *.safetensors      Meta or HF names; the config comes from the metadata key "npllama_config"
                       (save(format="meta") and training checkpoints write it) or from a
                       config.json beside the file (HF keys, or LlamaConfig.to_json keys);
                       a LoRA training checkpoint gives its base with the adapters merged (io/lora.py)
    *.bin              llama2.c: legacy v0 (7 int32 header) or v1 ("ak42" magic, 256-byte header),
                       float32 little-endian; layouts in io/llama2c.py
    *.gguf             llama.cpp's GGUF (v2, v3; or any file starting with b"GGUF"): LLaMA models, the
                       config from the metadata, the tokenizer from the file's vocabulary,
                       quantized tensors decoded (io/gguf_llama.py)
    pickle files       (.pt, .pth, .ckpt, .pkl, pytorch_model*.bin, or any file starting with a
                       pickle/zip magic) are refused without being unpickled (io/pickles.py)

Before any array is used, load compares the file with the config: fields the tensors
contradict (dim, vocab_size, n_layers, hidden_dim, n_kv_heads, tie_embeddings) are named first,
then every missing, unexpected and misshapen tensor at once. Hugging Face q_proj/k_proj rows are
un-permuted into Meta's RoPE layout (io/hf.py). Every tensor is held in the dtype asked for
(float32, float64, or float16 / bfloat16 for inference: npllama.storage); one already stored so
stays a view of the file, read into memory or, for a file large against the memory available or
when asked (mmap=True), mapped and then watched for changes (io/mapped.py). Tensors that are
derived data or optimizer state are skipped knowingly, never silently: HF `rotary_emb.inv_freq`
and Meta `rope.freqs` (checked against rope_theta first), and the optimizer moments of a
training checkpoint (io/metadata.py).
Every file save writes goes through io/atomic.py: replaced whole or left untouched. Every
safetensors file it writes records CRC-32s of its header and tensors, which load verifies
(io/integrity.py); memory is checked against the sizes in a header before tensors are read
(npllama.memory).
"""

from __future__ import annotations

import json
import time
import uuid
import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .. import memory
from ..checks import parse_json
from ..config import LlamaConfig
from ..engine.layout import FlatLayout
from ..errors import MissingFileError, NpllamaError
from ..backend import check_backend_name
from ..llama import Llama, LoraLlama
from ..storage import (all_finite, compute_dtype_of, conversion_scratch_bytes, is_half, nbytes_per_element,
                       storage_dtype_name, storage_name_of, to_float, to_storage)
from ..ops import rope_frequencies
from ..tokenizers import SentencePieceTokenizer, tokenizer_from_folder
from ..tokenizers.hf_export import generation_config_json, hf_tokenizer_files
from .atomic import write_bytes_atomic, write_folder_atomic
from .config_check import check_config_against
from .errors import (CheckpointError, ConfigMismatchError, PathInTheWayError, PickleRefusedError, TensorMismatchError,
                     PICKLE_HINT)
from .footprint import LoadFootprint, load_footprint
from .gguf import MAGIC as GGUF_MAGIC
from .gguf_llama import read_gguf_model, write_gguf_model
from .hf import (HF_FIELD, UnsupportedConfigError, hf_config_to_llama, hf_to_meta_name, is_hf_name, llama_to_hf_config,
                 meta_to_hf, meta_to_hf_name, permute_hf_to_meta)
from .llama2c import read_llama2c
from .lora import read_adapted
from .mapped import MappedSource, should_map
from .metadata import (CONFIG_KEY, LORA_KEY, OPTIMIZER_PREFIX, SAVE_ID_KEY, TOKENIZER_KEY, config_from_metadata,
                       is_training_checkpoint, model_metadata, tokenizer_from_metadata)
from .outputs import check_output_path, check_save_target, refuse_inputs, replaced_by_a_model
from .pickles import looks_pickled_name, refuse_pickle_magic, refuse_pickle_name
from .safetensors import Bfloat16, map_safetensors, release_pages, write_safetensors_atomic


# ----------------------------------------------------------------------------- config vs tensors

def _field(name: str, hf: bool) -> str:
    return f"{name} (config.json {HF_FIELD[name]})" if hf else name


def _check_rope_buffer(name: str, arr: np.ndarray, cfg: LlamaConfig) -> None:
    """HF rotary_emb.inv_freq (Dh/2,) and Meta rope.freqs (Dh/2,) are theta_j; check them, then skip."""
    want = rope_frequencies(cfg.head_dim, cfg.rope_theta)
    if arr.shape != want.shape or not np.allclose(arr.astype(np.float64), want, rtol=1e-3, atol=0):
        raise ConfigMismatchError(
            f"rope_theta={cfg.rope_theta} (head_dim {cfg.head_dim}) contradicts the stored RoPE frequencies "
            f"{name!r} of shape {arr.shape}; fix rope_theta in the config")


_FLOAT_CODES = ("F64", "F32", "F16", "BF16")   # safetensors dtypes that hold weights


class Loaded(NamedTuple):
    """What read_checkpoint found: a config, Meta-named arrays, a tokenizer or None, notes, and the
    memory the arrays take (worked out before they were read: io/footprint.py)."""
    config: LlamaConfig
    params: dict
    tokenizer: object
    notes: list
    footprint: LoadFootprint | None = None


def _match_tensors(tensors: dict, codes: dict, metadata: dict, cfg: LlamaConfig, storage: str, *, strict: bool,
                   source: str, hf_config: bool, mapped: bool,
                   widen_later: bool = False) -> tuple[dict, list, LoadFootprint]:
    """Rename to Meta, check config and shapes, un-permute HF q/k, hold as `storage`.

    Returns (params, notes, footprint).

    tensors: {file name: array}, views of the file mapped or read whole (map_safetensors,
    read_llama2c; `mapped` says which); codes: their safetensors dtype codes. A tensor already
    held as `storage` stays a view of the file's buffer; every other one is converted on its own
    and its pages released, so the load never holds two full copies of the weights.
    widen_later: a tensor to be widened (float16 or bfloat16 held as float32, float32 as float64)
    and not permuted is returned as stored, checked finite, for Llama.from_params to convert
    straight into the model's layout (load): then only a block of the file is held beside the
    converted weights, not a whole converted tensor. Else every array returned is held as `storage`.
    """
    notes = []
    if is_training_checkpoint(metadata):
        opt = [n for n in tensors if n.startswith(OPTIMIZER_PREFIX)]
        if opt:
            notes.append(f"skipped {len(opt)} optimizer tensors (training checkpoint)")
        for n in opt:
            release_pages(tensors[n])
        tensors = {n: t for n, t in tensors.items() if not n.startswith(OPTIMIZER_PREFIX)}
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
            _check_rope_buffer(name, to_float(t, np.float64) if codes[name] == "BF16" else t, cfg)
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
    check_config_against(cfg, shapes, lambda name: _field(name, hf_config), display)
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
    permuted = {n for n in expected if naming == "hf" and n.endswith((".attention.wq.weight", ".attention.wk.weight"))}
    # what the weights will take, from their shapes alone: compared with the memory available
    # before anything below allocates (npllama.memory). A file read into memory is there already:
    # what is still to come is the arrays converted from it.
    in_place = load_footprint({n: renamed[n] for n in expected}, storage, mapped=True, copied=permuted)
    footprint = in_place if mapped else LoadFootprint(in_place.total, 0)
    memory.require(in_place.total if mapped else in_place.allocated,
                   f"loading {source} as {storage} ({footprint.describe()})",
                   "load it on a machine with more memory" + ("" if is_half(storage) else
                                                              ", or hold it in float16 or bfloat16"))
    notes.append(f"holds {footprint.describe()}")
    params = {}
    for n in expected:
        t = renamed[n]
        if codes[file_name[n]] not in _FLOAT_CODES:
            raise CheckpointError(f"{source}: tensor {display(n)} has dtype {t.dtype}; weights must be floating point")
        widened_later = (widen_later and n not in permuted and not is_half(storage)
                         and storage_name_of(t) != storage)     # exact, so finite as stored is finite as held
        held = t if widened_later else to_storage(t, storage)
        if not all_finite(held):
            raise CheckpointError(f"{source}: tensor {display(n)} holds NaN or infinite values; the file is corrupt "
                                  "or the weights overflowed the requested dtype")
        if n in permuted:
            held = permute_hf_to_meta(held, cfg.n_heads if n.endswith("wq.weight") else cfg.n_kv_heads)
        if held is not t or (widened_later and mapped):   # a mapped file's checked pages read back when copied
            release_pages(t)
        params[n] = np.ascontiguousarray(held)
    return params, notes, footprint


def _config_from_json_file(path: Path) -> tuple[LlamaConfig, bool]:
    """(config, is_hf) from a config.json holding either HF keys or LlamaConfig.to_json keys."""
    d = parse_json(path.read_bytes(), str(path), CheckpointError)
    try:
        if isinstance(d, dict) and "hidden_size" not in d and "dim" in d:
            return LlamaConfig.from_dict(d), False
        return hf_config_to_llama(d), True
    except UnsupportedConfigError as e:
        raise UnsupportedConfigError(f"{path}: {e}") from None
    except ValueError as e:
        raise ConfigMismatchError(f"{path}: {e}") from None


def _read_hf_folder(folder: Path, verify: bool, mapped: bool | None) -> tuple[dict, dict, dict, str, bool]:
    """(tensors, metadata, dtype codes, description, mapped) of model.safetensors or the shards of its
    index, mapped or read (map_safetensors; mapped None: as should_map decides for their total size)."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():  # transformers tries the single file first too
        mapped = _decide(mapped, single.stat().st_size)
        tensors, metadata, codes = map_safetensors(single, verify, mapped)
        return tensors, metadata, codes, str(single), mapped
    if index.is_file():
        idx = parse_json(index.read_bytes(), str(index), CheckpointError)
        wmap = idx.get("weight_map") if isinstance(idx, dict) else None
        if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
            raise CheckpointError(f"{index}: needs a 'weight_map' object of tensor name -> shard file")
        tensors, metadata, codes = {}, {}, {}
        shards = sorted(set(wmap.values()))
        for shard in shards:
            if Path(shard).name != shard:
                raise CheckpointError(f"{index}: shard {shard!r} is not a file name inside the folder")
            if not (folder / shard).is_file():
                raise MissingFileError(f"{index} lists shard {shard!r}, which is not in {folder}")
        mapped = _decide(mapped, sum((folder / shard).stat().st_size for shard in shards))
        for shard in shards:
            shard_path = folder / shard
            part, meta, part_codes = map_safetensors(shard_path, verify, mapped)
            if meta.get(SAVE_ID_KEY) != metadata.get(SAVE_ID_KEY, meta.get(SAVE_ID_KEY)):
                raise CheckpointError(f"{shard_path}: written by another save than the shards before it; "
                                      "save or export the folder again")
            metadata.update(meta)
            listed = {n for n, s in wmap.items() if s == shard}
            absent, unlisted = sorted(listed - set(part)), sorted(set(part) - listed)
            if absent or unlisted:
                raise CheckpointError(f"{shard_path}: disagrees with {index.name}: "
                                      f"listed but absent {absent}, present but not listed {unlisted}")
            tensors.update(part)
            codes.update(part_codes)
        return tensors, metadata, codes, f"{folder} ({len(shards)} shards)", mapped
    pickles = sorted(p.name for p in folder.iterdir() if looks_pickled_name(p))
    if pickles:
        raise PickleRefusedError(f"{folder}: holds only PyTorch pickle weights {pickles}; refusing them. {PICKLE_HINT}")
    raise MissingFileError(f"{folder}: no model.safetensors or model.safetensors.index.json; "
                            "expected a Hugging Face LlamaForCausalLM folder")


def _read_folder_once(path: Path, verify: bool, mmap: bool | None):
    """(tensors, metadata, codes, source, config, is_hf, tokenizer, mapped) of a Hugging Face folder, read once."""
    tensors, metadata, codes, source, mapped = _read_hf_folder(path, verify, mmap)
    cfg_file = path / "config.json"
    if cfg_file.is_file():
        cfg, hf = _config_from_json_file(cfg_file)
    elif CONFIG_KEY in metadata:
        cfg, hf = config_from_metadata(metadata, source), False
    else:
        raise MissingFileError(f"{path}: no config.json; a Hugging Face folder needs one "
                                "(save_pretrained writes it)")
    tokenizer = tokenizer_from_metadata(metadata, source)
    if tokenizer is None and (path / "tokenizer.model").is_file():
        tokenizer = SentencePieceTokenizer.from_file(path / "tokenizer.model")
    elif tokenizer is None:
        # transformers 5's save_pretrained writes tokenizer.json only
        tokenizer, problem = tokenizer_from_folder(path)
        if problem:
            warnings.warn(f"{problem}; the model loads without a tokenizer", stacklevel=5)
    return tensors, metadata, codes, source, cfg, hf, tokenizer, mapped


def _save_id(folder: Path) -> str | None:
    """The SAVE_ID_KEY of folder/config.json, or None (no such file, no id, or unreadable: the read says why)."""
    try:
        d = parse_json((folder / "config.json").read_bytes(), "config.json")
    except (OSError, ValueError):
        return None
    value = d.get(SAVE_ID_KEY) if isinstance(d, dict) else None
    return value if isinstance(value, str) else None


_SWAP_RETRIES = 20      # a writer swaps a folder in one rename: a reader that straddles one reads again


def _read_folder(path: Path, verify: bool, mmap: bool | None):
    """_read_folder_once, of one save only. A folder npllama saved carries one save id in config.json
    and model.safetensors (save()); a read that saw the id change under it (another process saved
    into the folder meanwhile: io/atomic.py write_folder_atomic) is read again, so the config,
    weights and tokenizer returned are one save's. Ids that disagree in a folder nobody is writing
    mean its files come from two saves: CheckpointError."""
    for attempt in range(_SWAP_RETRIES):
        before = _save_id(path)
        try:
            parts = _read_folder_once(path, verify, mmap)
        except (CheckpointError, MissingFileError):
            if _save_id(path) == before:
                raise
        else:
            weights = parts[1].get(SAVE_ID_KEY)
            if before is None or (weights == before and _save_id(path) == before):
                return parts
            if _save_id(path) == before:
                raise CheckpointError(
                    f"{path}: config.json (save {before}) and the weights (save {weights}) were not written by one "
                    "save, so the config may not be the weights'; save or export the folder again (or, if you put "
                    f"these files together on purpose, delete the {SAVE_ID_KEY!r} line of config.json)")
        time.sleep(0.01 * (attempt + 1))
    raise CheckpointError(f"{path}: changed while it was being read, {_SWAP_RETRIES} times (another process keeps "
                          "saving into it); retry when that process is done")


def _decide(mapped: bool | None, nbytes: int) -> bool:
    """mmap=True / False as given; None: map a file of nbytes when it is large (io/mapped.py should_map)."""
    return should_map(nbytes) if mapped is None else bool(mapped)


def read_checkpoint(path, dtype=np.float32, *, strict: bool = True, max_seq_len: int | None = None,
                    verify: bool = True, mmap: bool | None = None) -> Loaded:
    """Read any supported checkpoint into (config, Meta-named params, tokenizer, notes); see load()."""
    return _with_max_seq_len(_read(Path(path), storage_dtype_name(dtype), strict, verify, mmap, widen_later=False),
                             max_seq_len)


def _with_max_seq_len(loaded: Loaded, max_seq_len: int | None) -> Loaded:
    if max_seq_len is not None:     # the one place a file's context length is overridden
        loaded = loaded._replace(config=loaded.config.replace(max_seq_len=max_seq_len))
    return loaded


def _read(path: Path, storage: str, strict: bool, verify: bool, mmap: bool | None, widen_later: bool) -> Loaded:
    """read_checkpoint's Loaded; widen_later as in _match_tensors (load's: from_params converts afterwards)."""
    if not path.exists():
        raise MissingFileError(f"{path}: no such file or folder")
    if path.is_dir():
        tensors, metadata, codes, source, cfg, hf, tokenizer, mapped = _read_folder(path, verify, mmap)
    else:
        refuse_pickle_name(path)
        suffix = path.suffix.lower()
        if suffix == ".gguf":
            return Loaded(*read_gguf_model(path, storage, strict=strict, mapped=_decide(mmap, path.stat().st_size),
                                           widen_later=widen_later))
        if suffix == ".bin":
            mapped = _decide(mmap, path.stat().st_size)
            cfg, tensors = read_llama2c(path, mapped)
            params, notes, footprint = _match_tensors(tensors, dict.fromkeys(tensors, "F32"), {}, cfg, storage,
                                                      strict=True, source=str(path), hf_config=False, mapped=mapped,
                                                      widen_later=widen_later)
            return Loaded(cfg, params, None, [f"llama2.c checkpoint {path}"] + notes, footprint)
        if suffix != ".safetensors":
            with open(path, "rb") as f:
                head = f.read(4)
            if head == GGUF_MAGIC:
                return Loaded(*read_gguf_model(path, storage, strict=strict,
                                               mapped=_decide(mmap, path.stat().st_size), widen_later=widen_later))
            refuse_pickle_magic(path, head)
            raise CheckpointError(f"{path}: unknown checkpoint type {suffix!r}; npllama reads .safetensors files, "
                                  "Hugging Face folders, llama2.c .bin files and GGUF files")
        mapped = _decide(mmap, path.stat().st_size)
        tensors, metadata, codes = map_safetensors(path, verify, mapped)
        source = str(path)
        if LORA_KEY in metadata:    # LoRA adapters: the base they name, with them merged in (io/lora.py)
            # the base in the dtype the adapters are merged in; held as `storage` by load() afterwards
            base_dtype = compute_dtype_of(storage)
            adapted = read_adapted(path, tensors, metadata,
                                   lambda base, _: load(base, base_dtype, strict=strict, verify=verify, mmap=mmap))
            return Loaded(adapted.config, adapted.merged().params, adapted.tokenizer,
                          [f"LoRA adapters of {path} (rank {adapted.spec.rank}) merged into {adapted.base_path}"])
        beside = path.parent / "config.json"
        if CONFIG_KEY in metadata:
            cfg, hf = config_from_metadata(metadata, source), False
        elif beside.is_file():
            cfg, hf = _config_from_json_file(beside)
        else:
            raise MissingFileError(
                f"{path}: no config found: the metadata has no 'npllama_config' and there is no config.json "
                "beside the file. Hint: put the model's config.json next to it")
        tokenizer = tokenizer_from_metadata(metadata, source)
    params, notes, footprint = _match_tensors(tensors, codes, metadata, cfg, storage, strict=strict, source=source,
                                              hf_config=hf, mapped=mapped, widen_later=widen_later)
    return Loaded(cfg, params, tokenizer, notes, footprint)


def load(path, dtype=np.float32, *, strict: bool = True, max_seq_len: int | None = None, verify: bool = True,
         mmap: bool | None = None, backend: str = "engine"):
    """Load a checkpoint into an npllama.Llama (formats: see this module's docstring).

    dtype: what the weights are held in: np.float32 (default) or np.float64, which the model
        also computes in; or np.float16 / "bfloat16", half the memory, for inference (forward and
        generate compute in float32, one layer at a time; loss_and_grads refuses). Each tensor
        is converted on its own, so a load never holds two full copies of the weights.
    mmap: None (default) reads the file into memory, unless it holds more than half the memory
        available, which it maps (io/mapped.py should_map). True maps it: a tensor stored in the
        dtype asked for (float32 safetensors and llama2.c .bin for float32; float16 / bfloat16
        files for those) is then not copied but read in place (the checksum and finiteness checks
        read each page once; when such tensors are not most of the weights, as a float16 GGUF
        file's float32 norms, they are copied with the converted rest into the model's one array),
        its pages shared with the OS page cache, and writing to a
        parameter (training) changes the process's copy only, never the file. A mapped model
        checks that the file is unchanged before every forward, training pass and generate call,
        and every 8th decode step (WeightsFileChangedError tells to reload it; a truncation
        mid-step ends the process with one line and exit code 135, io/sigbus.py): replacing the
        file atomically, as npllama does, is safe; copying over it or truncating it is not.
        False reads it.
    strict: False turns unexpected extra tensors into a warning instead of an error.
    max_seq_len: override the config's (e.g. Llama 2's 4096 makes large RoPE tables).
    verify: check the CRC-32s npllama records in the files it writes (io/integrity.py); a damaged
        file raises ChecksumMismatchError naming the tensor. Files without them load unverified.
    backend: "engine" (default) or "reference" (npllama/backend.py): what the model runs on.
    model.tokenizer is set from the metadata key "npllama_tokenizer", or a folder's tokenizer.model
    or tokenizer.json, else None.
    """
    check_backend_name(backend)
    # tensors to widen come back as stored (_match_tensors), converted by from_params straight into
    # the model's layout, each block's file pages handed back once copied: the peak is the weights
    # held and one block of the file
    loaded = _with_max_seq_len(_read(Path(path), storage_dtype_name(dtype), strict, verify, mmap, widen_later=True),
                               max_seq_len)
    model = Llama.from_params(loaded.config, loaded.params, dtype=dtype, backend=backend, adopt=True,
                              release=release_pages)
    model.tokenizer = loaded.tokenizer
    source = MappedSource.of(model.params)
    if source is not None:                   # weights read in place from a mapped file: watch it
        model._source_check = source.check
    return model


# ----------------------------------------------------------------------------- save

def _save_dtype_name(dtype) -> str:
    """The storage dtype name to write (npllama.storage), or an error worded for save."""
    try:
        return storage_dtype_name(dtype)
    except NpllamaError:
        raise NpllamaError(f"dtype={dtype!r} cannot be saved; use float32 (default), float64, float16 or "
                           "'bfloat16'") from None


def _cast_for_save(arr: np.ndarray, name: str):
    """A held parameter (any storage dtype) as the array to write: Bfloat16 bits for "bfloat16"."""
    out = to_storage(arr, name)
    if not all_finite(out):
        raise NpllamaError(f"casting to {name} overflows some weights; save in float32 instead")
    return Bfloat16(out) if name == "bfloat16" else out


def _require_save(params: dict, path: Path, format: str, dname: str) -> None:
    """Refuse, before converting anything, a save whose copies cannot fit (npllama.memory): every
    parameter not held as dname is converted (with the temporaries of one conversion), and format
    "hf" permutes the q and k rows, and all are kept until the file is written."""
    changing = [p for p in params.values() if storage_name_of(p) != dname]
    converted = sum(memory.array_bytes(p.size, nbytes_per_element(dname)) for p in changing)
    scratch = max((conversion_scratch_bytes(p.size) for p in changing), default=0)
    permuted = sum(p.nbytes for n, p in params.items() if format == "hf" and n.endswith(("wq.weight", "wk.weight")))
    memory.require(converted + scratch + permuted, f"writing {path} as {dname}", "save on a machine with more memory")


def save(model, path, format: str = "hf", dtype="float32", *, overwrite_checkpoint: bool = False) -> Path:
    """Write model to path; returns the path written.

    format="hf":   path is a folder (created if needed) holding model.safetensors (HF names,
                   q/k rows permuted to rotate-half order), config.json for LlamaForCausalLM,
                   generation_config.json (BOS / EOS ids), and the tokenizer's files
                   (tokenizers/hf_export.py): tokenizer.json and tokenizer_config.json, which
                   transformers reads with no extra package, and tokenizer.model for a
                   sentencepiece model (a CharTokenizer also goes to the metadata key
                   "npllama_tokenizer", so load gives it back as it was). It loads with
                   transformers.LlamaForCausalLM.from_pretrained(path) and AutoTokenizer.
    format="meta": path is one .safetensors file with Meta names and metadata
                   {"format": "pt", "npllama_config": config JSON, "npllama_tokenizer": tokenizer
                   JSON when model.tokenizer is set}.
    format="gguf": path is one .gguf file that llama.cpp (and so ollama) runs: llama.cpp's tensor
                   names and metadata, the tokenizer as a GGUF vocabulary (io/gguf_llama.py,
                   io/gguf_vocab.py).
    dtype: "float32" (default, whatever the model's dtype or storage dtype), "float64", "float16" or
                   "bfloat16"; for "gguf": "f32" (= "float32"), "f16", "bf16" or "q8_0" (2-D weights;
                   norms stay float32).
    A LoraLlama is saved merged: each adapted weight as W + s B A; never onto its base model.
    Every file is written atomically: an existing file is replaced whole or left untouched. A
    folder is written whole (io/atomic.py write_folder_atomic): a reader sees the old folder or
    the new one; the old model's files go, anything else in the folder is kept. config.json and
    model.safetensors carry the same fresh SAVE_ID_KEY, which load compares.
    overwrite_checkpoint: replace a training or LoRA checkpoint at path (refused otherwise:
    io/outputs.py); a symbolic link at path is always refused.
    """
    path = check_output_path(path, "the path to save to", whole=True)
    if isinstance(model, LoraLlama):
        refuse_inputs(path, {"the base model of these LoRA adapters": getattr(model, "base_path", None)},
                      "the path to save to")
        model = model.merged()
    if format == "gguf":
        if path.suffix.lower() != ".gguf" or path.is_dir():
            raise NpllamaError(f"{path}: format='gguf' writes one .gguf file; give a path ending in .gguf")
        check_save_target(path, format, overwrite_checkpoint)
        write_gguf_model(path, model.config, model.params, getattr(model, "tokenizer", None), dtype, name=path.stem)
        return path
    dname = _save_dtype_name(dtype)
    cfg, params = model.config, model.params
    _require_save(params, path, format, dname)
    tokenizer = getattr(model, "tokenizer", None)
    meta = model_metadata(cfg, tokenizer)
    if format == "meta":
        if path.suffix != ".safetensors":
            raise NpllamaError(f"{path}: format='meta' writes one .safetensors file; "
                               "give a path ending in .safetensors")
        if path.is_dir():
            raise PathInTheWayError(f"{path} is a folder; format='meta' writes one .safetensors file")
        check_save_target(path, format, overwrite_checkpoint)
        # stored in the engine's flat order, each stack's members adjacent ([wq; wk; wv], [w1; w3]), so a
        # mapped file's stacks are views for the engine's passes, not copies (engine.stacked.adjacent_rows)
        tensors = {n: _cast_for_save(params[n], dname) for n in FlatLayout(cfg).slots}
        write_safetensors_atomic(path, tensors, meta)
        return path
    if format == "hf":
        if path.exists() and not path.is_dir():
            raise PathInTheWayError(f"{path} is a file; format='hf' writes a folder")
        check_save_target(path, format, overwrite_checkpoint)
        hf = meta_to_hf({n: params[n] for n in cfg.param_shapes()}, cfg)
        del meta[CONFIG_KEY]                 # config.json carries it, in transformers' terms
        meta[SAVE_ID_KEY] = uuid.uuid4().hex
        tokenizer_files = hf_tokenizer_files(tokenizer, cfg.max_seq_len)   # tokenizers/hf_export.py
        if tokenizer_files.restores:         # loading the folder gives it back from these files
            del meta[TOKENIZER_KEY]
        if tokenizer is not None and tokenizer_files.note:
            warnings.warn(f"{path}: {tokenizer_files.note}", stacklevel=2)

        def write_contents(path):            # a new temporary folder, which then replaces the old one whole
            for name, data in tokenizer_files.files.items():
                write_bytes_atomic(path / name, data)
            write_safetensors_atomic(path / "model.safetensors",
                                     {n: _cast_for_save(t, dname) for n, t in hf.items()}, meta)
            hf_cfg = llama_to_hf_config(cfg, torch_dtype=dname,
                                        bos_id=getattr(tokenizer, "bos_id", None),
                                        eos_id=getattr(tokenizer, "eos_id", None))
            hf_cfg[SAVE_ID_KEY] = meta[SAVE_ID_KEY]
            write_bytes_atomic(path / "config.json", (json.dumps(hf_cfg, indent=2) + "\n").encode("utf-8"))
            write_bytes_atomic(path / "generation_config.json",
                               (json.dumps(generation_config_json(tokenizer), indent=2) + "\n").encode("utf-8"))

        return write_folder_atomic(path, write_contents, replaced_by_a_model(path))
    raise NpllamaError(f"format={format!r}; use 'hf' (a transformers folder), 'meta' (one .safetensors file) "
                       "or 'gguf' (one .gguf file for llama.cpp)")
