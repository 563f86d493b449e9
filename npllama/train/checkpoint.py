"""Training checkpoints: everything `npllama train --resume` needs, in ONE .safetensors file.

Layout (written atomically by io.safetensors.write_safetensors_atomic: temp file beside the
target, fsync, os.replace -- a kill mid-write leaves the previous checkpoint as it was; the
metadata keys are io.metadata's):

  tensors   <Meta name>                       the model's parameters, in the model's dtype
            optimizer.exp_avg.<Meta name>     AdamW first moment m
            optimizer.exp_avg_sq.<Meta name>  AdamW second moment v
  metadata  "format": "pt"
            "npllama_config":      LlamaConfig.to_json()
            "npllama_tokenizer":   tokenizer.to_json()   (so generation needs nothing else)
            "npllama_train_state": JSON {
                "version": 1,
                "step": optimizer steps completed,
                "rng": the training-batch np.random.Generator's bit_generator.state,
                "optimizer": {"step", "lr", "beta1", "beta2", "eps", "weight_decay"},
                "train_config": the TrainConfig as a dict,
                plus run bookkeeping (elapsed seconds, tokens seen, last val loss, text sha256)}

Because the model part is a plain "meta" checkpoint, `npllama.load(path)` and
`npllama generate --model path` read it directly (they skip the optimizer.* tensors only
because "npllama_train_state" is present).

A LoRA run (a LoraLlama) writes its adapters in place of the parameters, their moments, and
metadata "npllama_lora" naming the frozen base file and its fingerprint (io/lora.py); loading
reads that base again and refuses it if it changed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..checks import check_int, check_real, is_integer, is_real, parse_json
from ..errors import MissingFileError, NpllamaError
from ..io import load
from ..io.errors import CheckpointError
from ..io.lora import read_adapted
from ..io.metadata import (LORA_KEY, OPTIMIZER_PREFIX, TRAIN_STATE_KEY, config_from_metadata, lora_metadata,
                           model_metadata, tokenizer_from_metadata)
from ..io.safetensors import read_safetensors, read_safetensors_header, write_safetensors_atomic
from ..llama import Llama, LoraLlama
from ..optim import AdamW
from .config import TrainConfig

CHECKPOINT_NAME = "ckpt.safetensors"
FORMAT_VERSION = 1
_MOMENTS = ("exp_avg", "exp_avg_sq")
_HYPERS = ("step", "lr", "beta1", "beta2", "eps", "weight_decay")


class TrainCheckpoint(NamedTuple):
    """What load_train_checkpoint returns."""
    model: Llama                 # parameters exactly as saved (same dtype), tokenizer attached
    tokenizer: object
    optimizer_state: dict        # AdamW.state_dict() form: load it with opt.load_state_dict
    state: dict                  # the "npllama_train_state" JSON (step, rng, train_config, ...)


def save_train_checkpoint(path, model: Llama, tokenizer, optimizer: AdamW, state: dict) -> Path:
    """Write model + optimizer + state to path (atomically). state must be JSON-serialisable.

    The optimizer's step count and hyper-parameters are stored under state["optimizer"];
    its moments as tensors. Returns the path written.
    """
    path = Path(path)
    if path.suffix != ".safetensors":
        raise NpllamaError(f"training checkpoint {path} must end in .safetensors")
    if optimizer.params is not model.params:
        raise NpllamaError("the optimizer does not update this model's parameters; "
                           "build it as AdamW(model.params, ...)")
    sd = optimizer.state_dict()
    tensors = dict(model.params)
    for kind in _MOMENTS:
        for name in model.params:
            tensors[f"{OPTIMIZER_PREFIX}{kind}.{name}"] = sd[f"{kind}.{name}"]
    full_state = {"version": FORMAT_VERSION, **state, "optimizer": {k: sd[k] for k in _HYPERS}}
    metadata = {**model_metadata(model.config, tokenizer), TRAIN_STATE_KEY: json.dumps(full_state, sort_keys=True)}
    if isinstance(model, LoraLlama):      # adapters only: name the base they adapt
        if model.base_path is None:
            raise NpllamaError("a LoRA checkpoint must name its base file; set model.base_path and model.base_sha256")
        metadata.update(lora_metadata(model.spec, model.base_path, model.base_sha256))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_safetensors_atomic(path, tensors, metadata)
    return path


def _parse_state(path: Path, metadata: dict) -> dict:
    if TRAIN_STATE_KEY not in metadata:
        raise NpllamaError(f"{path} holds model weights but no training state ({TRAIN_STATE_KEY!r}); "
                           "it cannot be resumed (it can still be loaded with npllama.load)")
    state = parse_json(metadata[TRAIN_STATE_KEY], f"{path}: the training state (the file is damaged)")
    if not isinstance(state, dict) or state.get("version") != FORMAT_VERSION:
        version = state.get("version") if isinstance(state, dict) else None
        raise NpllamaError(f"{path}: training state version {version!r} is not {FORMAT_VERSION}; "
                           "this npllama cannot resume it")
    missing = [k for k in ("step", "rng", "optimizer", "train_config") if k not in state]
    if missing:
        raise NpllamaError(f"{path}: the training state lacks {missing}")
    try:
        _check_state_fields(state)
    except ValueError as e:
        raise CheckpointError(f"{path}: the training state is unusable: {e}; the file is damaged "
                              "or was not written by npllama train") from None
    return state


def _check_state_fields(state: dict) -> None:
    """Every field a resume reads, of the type it needs (JSON may hold anything): NpllamaError
    naming the first one that is not."""
    check_int("step", state["step"], 0)
    for key in ("rng", "optimizer", "train_config"):
        if not isinstance(state[key], dict):
            raise NpllamaError(f"{key}={state[key]!r} must be a JSON object")
    rng_from_state(state["rng"])
    try:
        TrainConfig.from_dict(state["train_config"]).validate()
    except ValueError as e:
        raise NpllamaError(f"train_config: {e}") from None
    check_real("elapsed", state.get("elapsed", 0.0), 0.0)
    check_int("tokens", state.get("tokens", 0), 0)
    for key in ("val_loss", "best_loss"):
        if state.get(key) is not None:
            check_real(key, state[key])
    history = state.get("history", [])
    if not isinstance(history, list) or not all(isinstance(h, list) and len(h) == 2 and is_integer(h[0])
                                                and is_real(h[1]) for h in history):
        raise NpllamaError(f"history={str(history)[:80]} must be a list of [step, val_loss] pairs")
    if not isinstance(state.get("text_sha256", ""), str):
        raise NpllamaError(f"text_sha256={state['text_sha256']!r} must be a string")


def _require_file(path: Path) -> None:
    if not path.is_file():
        raise MissingFileError(f"no training checkpoint at {path}; start without --resume, "
                                "or pass the --out-dir of an earlier run")


def load_train_state(path) -> dict:
    """Only the "npllama_train_state" JSON of a training checkpoint (reads the header, not the tensors)."""
    path = Path(path)
    _require_file(path)
    return _parse_state(path, read_safetensors_header(path)[1])


def load_model_config(path):
    """The LlamaConfig of a training checkpoint, from its header alone (for the memory check of a resume)."""
    path = Path(path)
    _require_file(path)
    return config_from_metadata(read_safetensors_header(path)[1], str(path))


def load_train_checkpoint(path, backend: str = "engine") -> TrainCheckpoint:
    """Read a file save_train_checkpoint wrote; every missing or damaged piece is an NpllamaError
    that names it (the CRC-32s of io/integrity.py are verified, NaN and infinity refused).

    The model keeps the saved dtype (no cast), so a resumed run continues bit for bit; it runs on
    `backend` ("engine" or "reference").
    """
    path = Path(path)
    _require_file(path)
    tensors, metadata = read_safetensors(path)
    state = _parse_state(path, metadata)
    config = config_from_metadata(metadata, str(path))
    tokenizer = tokenizer_from_metadata(metadata, str(path))
    for name, t in tensors.items():       # a run is never saved diverged (train/loop.py)
        if t.dtype.kind == "f" and not np.isfinite(t).all():
            raise CheckpointError(f"{path}: tensor {name!r} holds NaN or infinite values; the file is damaged")
    if LORA_KEY in metadata:                       # the base it names, checked, with these adapters
        model = read_adapted(path, tensors, metadata, lambda base, dtype: load(base, dtype, backend=backend))
    else:
        params = {n: tensors.pop(n) for n in list(tensors) if not n.startswith(OPTIMIZER_PREFIX)}
        model = Llama.from_params(config, params, backend=backend, adopt=True)  # checks names and shapes, keeps the dtype
    model.tokenizer = tokenizer
    optimizer_state = dict(state["optimizer"])
    for kind in _MOMENTS:
        prefix = f"{OPTIMIZER_PREFIX}{kind}."
        for name, t in tensors.items():
            if name.startswith(prefix):
                optimizer_state[f"{kind}.{name[len(prefix):]}"] = t
    return TrainCheckpoint(model, tokenizer, optimizer_state, state)


def rng_state(rng: np.random.Generator) -> dict:
    """The generator's full state as JSON-ready data (PCG64: two big ints and a flag)."""
    return rng.bit_generator.state


def rng_from_state(state: dict) -> np.random.Generator:
    """A Generator that continues exactly where the one rng_state(...) was taken from."""
    name = state.get("bit_generator") if isinstance(state, dict) else None
    bit_generator_cls = getattr(np.random, str(name), None)
    if bit_generator_cls is None or not isinstance(bit_generator_cls, type) \
            or not issubclass(bit_generator_cls, np.random.BitGenerator):
        raise NpllamaError(f"the training state's rng names an unknown random bit generator {name!r}")
    bit_generator = bit_generator_cls()
    try:
        bit_generator.state = state
    except (TypeError, ValueError, KeyError) as e:
        raise NpllamaError(f"the training state's rng (random generator state) is unusable ({e})") from None
    return np.random.Generator(bit_generator)
