"""What holding a checkpoint's weights will take in memory, worked out before any tensor is read.

    footprint = load_footprint(tensors, storage, mapped=True, copied={"layers.0.attention.wq.weight", ...})
    footprint.allocated    bytes of new arrays: tensors converted to the storage dtype, HF q/k rows
                           permuted into Meta's order, or (mapped=False) every tensor copied
    footprint.mapped       bytes of the file read in place: page cache, shared and reclaimable, but
                           resident while the model runs at speed
    footprint.total        what the weights need in RAM, whichever way they are held

Only shapes and dtypes are read (the tensors may be memory-mapped views of the file), so the
answer costs nothing; npllama.memory compares it with the memory available.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ..storage import nbytes_per_element, storage_name_of


class LoadFootprint(NamedTuple):
    allocated: int
    mapped: int

    @property
    def total(self) -> int:
        return self.allocated + self.mapped

    def describe(self) -> str:
        return (f"{self.total / 2**20:,.0f} MB of weights: {self.allocated / 2**20:,.0f} MB allocated, "
                f"{self.mapped / 2**20:,.0f} MB mapped from the file")


def load_footprint(tensors: dict, storage: str, *, mapped: bool, copied=()) -> LoadFootprint:
    """tensors: {name: array as read from the file (uint16 = bfloat16 bits)}, the ones to be held;
    storage: the dtype they will be held in; copied: names that are rewritten whatever their dtype."""
    allocated = kept = 0
    for name, t in tensors.items():
        held = math.prod(t.shape) * nbytes_per_element(storage)
        if mapped and storage_name_of(t) == storage and name not in copied:
            kept += held
        else:
            allocated += held
    return LoadFootprint(allocated, kept)
