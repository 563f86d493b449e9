"""The reference-logits file: what tools/export_torch.py writes and tools/crosscheck.py reads.

A safetensors file, reference_logits.safetensors in or beside the weights:
    prompt.{i}.ids             (T,) int64, the fixed_prompts
    prompt.{i}.logits.float32  (T, V), and/or
    prompt.{i}.logits.float64  (T, V): the logits PyTorch computed for prompt i
with a metadata entry npllama_reference saying how they were made.
"""

from __future__ import annotations

import json

import numpy as np

from npllama.io import CheckpointError
from npllama.io.safetensors import read_safetensors, write_safetensors_atomic

REFERENCE_NAME = "reference_logits.safetensors"


def fixed_prompts(vocab_size: int, max_seq_len: int, seed: int = 0) -> list[np.ndarray]:
    """Three prompts of lengths 1, 8 and 16 (capped at max_seq_len); the first is BOS (id 1)."""
    rng = np.random.default_rng(seed)
    prompts = [np.array([1 % vocab_size], dtype=np.int64)]
    for T in (8, 16):
        T = min(T, max_seq_len)
        ids = rng.integers(0, vocab_size, size=T, dtype=np.int64)
        ids[0] = 1 % vocab_size
        prompts.append(ids)
    return prompts


def read_reference(path) -> tuple[list[np.ndarray], dict[str, list[np.ndarray]]]:
    """(prompts, {dtype: [logits per prompt]}) from a reference file (the module docstring's layout)."""
    tensors, _ = read_safetensors(path)
    n = 0
    while f"prompt.{n}.ids" in tensors:
        n += 1
    if n == 0:
        raise CheckpointError(f"{path}: no prompt.0.ids; not a reference file written by tools/export_torch.py")
    prompts = [tensors[f"prompt.{i}.ids"] for i in range(n)]
    logits = {}
    for dt in ("float32", "float64"):
        if all(f"prompt.{i}.logits.{dt}" in tensors for i in range(n)):
            logits[dt] = [tensors[f"prompt.{i}.logits.{dt}"] for i in range(n)]
    if not logits:
        raise CheckpointError(f"{path}: no prompt.*.logits.float32/float64 tensors")
    return prompts, logits


def write_reference(path, prompts, logits: dict[str, list[np.ndarray]], note: dict) -> None:
    """Write prompts and {dtype: [logits per prompt]} as a reference file, with `note` (JSON) as its metadata."""
    tensors = {}
    for i, ids in enumerate(prompts):
        tensors[f"prompt.{i}.ids"] = np.asarray(ids, dtype=np.int64)
        for dt, per_prompt in logits.items():
            tensors[f"prompt.{i}.logits.{dt}"] = np.asarray(per_prompt[i], dtype=dt)
    write_safetensors_atomic(path, tensors, {"npllama_reference": json.dumps(note, sort_keys=True)})
