"""Where npllama may write: never over its own inputs, never over a checkpoint unasked, never nowhere.

    path = check_output_path(text, "--out", whole=True)    # '' / '  ' / '.' / '..' refused
    refuse_inputs(path, {"the model being exported (-m)": model_path}, "--out")
    check_save_target(path, "meta", overwrite_checkpoint=False)

refuse_inputs compares real paths and, for files that exist, inodes (os.path.samefile), so a
hard link or a symbolic link to an input counts as the input; a path inside an input folder
and a folder that holds an input are refused too (a folder is written whole: io/atomic.py).
check_save_target refuses to replace a training or LoRA checkpoint (a .safetensors whose
metadata holds "npllama_train_state" or "npllama_lora": the run's optimizer state, or the
adapters) unless overwrite_checkpoint is set, and a folder where a training run holds its lock.
Every refusal is an OutputPathError: one line naming the path and what to do instead.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable

from ..checks import parse_json

from .atomic import refuse_symlink
from .errors import OutputPathError
from .metadata import CONFIG_KEY, LORA_KEY, TRAIN_STATE_KEY, lora_from_metadata
from .safetensors import read_safetensors_header

RUN_LOCK_NAME = "train.lock"    # train/lock.py's LOCK_NAME (io cannot import train)


def check_output_path(path, what: str = "the output path", whole: bool = False) -> Path:
    """path as a Path, or OutputPathError when it names nothing to write: empty, only whitespace,
    or holding a NUL character; with whole=True (a file or folder replaced whole), also '.', '..',
    a root, or any path to the current folder or one above it, which would be replaced whole."""
    text = os.fsdecode(path) if isinstance(path, (bytes, os.PathLike)) else path
    if not isinstance(text, str):
        raise OutputPathError(f"{what}={path!r} must be a path")
    if not text.strip():
        raise OutputPathError(f"{what} {text!r} is empty; name the file or folder to write")
    if "\0" in text:
        raise OutputPathError(f"{what} {text!r} holds a NUL character, which no file name may; fix the path")
    p = Path(text)
    if whole and (p.name in ("", ".", "..") or _holds_cwd(p)):
        raise OutputPathError(f"{what} {text!r} names the current folder, one above it or a root, which npllama "
                              "would replace whole; name a new file or folder, e.g. ./model")
    return p


def _holds_cwd(path: Path) -> bool:
    try:
        return Path(os.getcwd()).is_relative_to(os.path.realpath(path))
    except OSError:                     # the current folder was removed: nothing to protect
        return False


def same_file(a, b) -> bool:
    """True when the paths a and b name one file or folder: the same real path, or (hard links) inode."""
    try:
        if os.path.realpath(a) == os.path.realpath(b):
            return True
        return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)
    except OSError:
        return False


def refuse_inputs(out, inputs: dict, what: str) -> None:
    """OutputPathError when writing out would overwrite one of inputs ({description: path}; paths
    that are None or do not exist are skipped): the same file (by path, link or inode), a path
    inside an input folder, or a folder that holds an input."""
    out = Path(out)
    real_out = Path(os.path.realpath(out))
    for label, p in inputs.items():
        if p is None or not os.path.lexists(p):
            continue
        p = Path(p)
        real = Path(os.path.realpath(p))
        if same_file(out, p):
            raise OutputPathError(f"{what} {out} is {label} ({p}); npllama never writes over its own input: "
                                  "write to another path")
        if real.is_dir() and real_out.is_relative_to(real):
            raise OutputPathError(f"{what} {out} lies inside {label} ({p}); npllama never writes into its own "
                                  "input: write to a path outside it")
        if real.is_relative_to(real_out):
            raise OutputPathError(f"{what} {out} holds {label} ({p}), and a folder is written whole; "
                                  "write to another path")


def checkpoint_kind(path) -> str | None:
    """'a training checkpoint' or 'a LoRA checkpoint' for a .safetensors file whose metadata says
    so, else None (also for a file that cannot be read: there is nothing of a run to keep)."""
    path = Path(path)
    if path.suffix != ".safetensors" or path.is_symlink() or not path.is_file():
        return None
    try:
        metadata = read_safetensors_header(path, verify=False)[1]
    except (ValueError, OSError):
        return None
    if LORA_KEY in metadata:
        return "a LoRA checkpoint (its adapters and their optimizer state)"
    if TRAIN_STATE_KEY in metadata:
        return "a training checkpoint (the model, its optimizer state and the run)"
    return None


def model_inputs(path, label: str) -> dict:
    """{description: path} of the files loading path reads: path itself, the config.json beside a
    .safetensors without a config of its own, and the base model of a LoRA checkpoint."""
    path = Path(path)
    inputs = {label: path}
    if path.suffix != ".safetensors" or not path.is_file():
        return inputs
    try:
        metadata = read_safetensors_header(path, verify=False)[1]
    except (ValueError, OSError):
        return inputs                   # loading it will say what is wrong
    if LORA_KEY in metadata:
        try:
            inputs[f"the base model of {label}"] = Path(lora_from_metadata(metadata, str(path))[1])
        except ValueError:
            pass
    if CONFIG_KEY not in metadata:
        inputs[f"the config.json of {label}"] = path.parent / "config.json"
    return inputs


# What saving a model into a folder supersedes: the previous model's files (a sharded one's too,
# as its index names them). Anything else there (a README, notes) is kept (io/atomic.py).
_MODEL_FILES = {"config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                "tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "added_tokens.json"}
_SHARD_NAME = re.compile(r"model-\d+-of-\d+\.safetensors")


def replaced_by_a_model(folder) -> Callable[[str], bool]:
    """A predicate on the names in folder: True for the files of the model a save there replaces."""
    shards = set()
    index = Path(folder) / "model.safetensors.index.json"
    if index.is_file():
        try:
            wmap = parse_json(index.read_bytes(), str(index)).get("weight_map", {})
            shards = {s for s in wmap.values() if isinstance(s, str) and Path(s).name == s}
        except (ValueError, OSError, AttributeError):
            pass                        # a damaged index: its shards stay (unknown names are kept)
    return lambda name: name in _MODEL_FILES or name in shards or bool(_SHARD_NAME.fullmatch(name))


def check_save_target(path, format: str, overwrite_checkpoint: bool = False,
                      flag: str | None = "overwrite_checkpoint=True") -> None:
    """OutputPathError unless saving a model at path (format "meta": one file; "hf": a folder, whose
    model files are replaced) keeps every training and LoRA checkpoint, or overwrite_checkpoint
    says to replace them (`flag` names how to say it, None: no way); never into the folder of a
    training run, never through a symbolic link."""
    path = Path(path)
    refuse_symlink(path)
    if format == "hf" and path.is_dir():
        if (path / RUN_LOCK_NAME).exists():
            raise OutputPathError(f"{path} is the folder of a training run ({RUN_LOCK_NAME} is there), which a "
                                  "Hugging Face export would replace whole; export into another folder")
        replaced = replaced_by_a_model(path)
        targets = [path / name for name in sorted(os.listdir(path)) if replaced(name)]
    else:
        targets = [path]
    for target in targets:
        kind = checkpoint_kind(target)
        if kind and not overwrite_checkpoint:
            raise OutputPathError(f"{target} is {kind}, which saving the bare model there would destroy; write to "
                                  f"another path{f', or pass {flag} to replace it' if flag else ''}")
