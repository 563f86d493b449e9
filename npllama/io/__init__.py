"""Files in and out: every format npllama reads or writes, and nothing else.

    checkpoint.py   load / save: HF folders, Meta or HF safetensors, llama2.c .bin (the entry points)
    safetensors.py  the safetensors format, read and written in NumPy alone
    llama2c.py      llama2.c .bin layouts (v0, v1), as an explicit (name, shape) table
    hf.py           Meta <-> Hugging Face names, the q/k RoPE permutation, config.json
    metadata.py     the keys npllama writes into safetensors metadata (the one owner)
    footprint.py    the memory a load will take, from the tensors' shapes and dtypes
    pickles.py      pickle refusal: never unpickled
    atomic.py       atomic writes: a temp file, fsync, one rename
    errors.py       the exceptions, all ValueErrors with hints
"""

from .checkpoint import Loaded, load, read_checkpoint, save
from .errors import CheckpointError, ConfigMismatchError, PickleRefusedError, TensorMismatchError

__all__ = ["load", "save", "read_checkpoint", "Loaded", "CheckpointError", "ConfigMismatchError",
           "PickleRefusedError", "TensorMismatchError"]
