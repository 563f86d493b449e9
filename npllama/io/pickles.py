"""Pickle refusal: npllama never unpickles, since unpickling runs whatever code the file holds.

PyTorch's torch.save writes pickles (inside a zip since torch 1.6); they are recognised by name
(.pt, .pth, .ckpt, .pkl, pytorch_model*.bin) or by their first bytes, and refused with a hint
on how to export safetensors instead. Nothing of such a file is parsed.
"""

from __future__ import annotations

import re
from pathlib import Path

from .errors import PICKLE_HINT, PickleRefusedError

_PICKLE_SUFFIXES = {".pt", ".pth", ".ckpt", ".pkl", ".pickle"}


def looks_pickled_name(path: Path) -> bool:
    name = path.name.lower()
    return path.suffix.lower() in _PICKLE_SUFFIXES or bool(re.fullmatch(r"pytorch_model.*\.bin", name))


def refuse_pickle_name(path: Path) -> None:
    if looks_pickled_name(path):
        raise PickleRefusedError(f"{path}: refusing a PyTorch pickle checkpoint. {PICKLE_HINT}")


def refuse_pickle_magic(path: Path, head: bytes) -> None:
    """torch.save writes a zip ("PK\\x03\\x04") or, before torch 1.6, a raw pickle
    (0x80 then protocol 2..5, then an opcode, never 0x00). A llama2.c header starting 0x80 0x02
    (dim=640) has 0x00 third, so it is not mistaken for one."""
    zipped = head[:4] == b"PK\x03\x04"
    pickled = len(head) >= 3 and head[0] == 0x80 and 2 <= head[1] <= 5 and head[2] != 0
    if zipped or pickled:
        kind = "a zip archive (torch.save)" if zipped else "a pickle"
        raise PickleRefusedError(f"{path}: the file is {kind}; refusing it without unpickling. {PICKLE_HINT}")
