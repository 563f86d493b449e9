"""LoRA checkpoints: adapters that name the frozen base they adapt, and its fingerprint.

A LoRA training checkpoint (npllama train --lora-rank R) holds the adapters and their optimizer
state only; its metadata key "npllama_lora" (io/metadata.py) names the base checkpoint by path
and fingerprint. Reading one loads that base, checks that it is still the same bytes, and
attaches the adapters: `npllama.load` merges them (W + s B A) into an ordinary model, and the
trainer resumes the LoraLlama itself.

The fingerprint of a file is its sha256; of a folder (Hugging Face), the sha256 of the names
and sha256s of the files npllama reads there (*.json, *.safetensors, *.model), in name order.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

import numpy as np

from ..llama import Llama, LoraLlama
from ..errors import MissingFileError
from .errors import CheckpointError, ConfigMismatchError
from .integrity import sha256_file
from .metadata import OPTIMIZER_PREFIX, config_from_metadata, lora_from_metadata, tokenizer_from_metadata

FOLDER_FILES = (".json", ".safetensors", ".model")


def fingerprint(path) -> str:
    """sha256 of a checkpoint file, or of a folder's model files (see the module docstring)."""
    path = Path(path)
    if not path.is_dir():
        return sha256_file(path)
    h = hashlib.sha256()
    for f in sorted(p for p in path.iterdir() if p.is_file() and p.suffix in FOLDER_FILES):
        h.update(f"{f.name}\0{sha256_file(f)}\n".encode())
    return h.hexdigest()


def read_adapted(path, tensors: dict, metadata: dict, load_base: Callable[[str, np.dtype], Llama]) -> LoraLlama:
    """The LoraLlama a LoRA checkpoint describes: its base (loaded with load_base(path, dtype),
    checked against the recorded fingerprint) with the file's adapters and tokenizer.

    Raises FileNotFoundError when the base is gone, ValueError when it changed or does not fit.
    """
    source = str(path)
    spec, base_path, base_sha256 = lora_from_metadata(metadata, source)
    config = config_from_metadata(metadata, source)
    if not Path(base_path).exists():
        raise MissingFileError(f"{source} adapts the base model {base_path}, which is not there any more; "
                                "put it back at that path (the adapters mean nothing without it)")
    found = fingerprint(base_path)
    if found != base_sha256:
        raise CheckpointError(f"{source} adapts {base_path}, but that file changed since (sha256 {found[:12]}..., "
                              f"recorded {base_sha256[:12]}...); restore the original base, or start a new run "
                              "with --init")
    adapters = {n: t for n, t in tensors.items() if not n.startswith(OPTIMIZER_PREFIX)}
    dtype = next(iter(adapters.values())).dtype if adapters else np.dtype(np.float32)
    base = load_base(base_path, dtype)
    if base.config != config:
        raise ConfigMismatchError(f"{source}: its config {config} is not the one of its base {base_path} "
                                  f"({base.config})")
    try:
        model = LoraLlama(base, spec, adapters=adapters)
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None
    model.tokenizer = tokenizer_from_metadata(metadata, source) or base.tokenizer
    model.base_path, model.base_sha256 = base_path, base_sha256
    return model
