"""Files in and out: every format npllama reads or writes, and nothing else.

    checkpoint.py   load / save: HF folders, Meta or HF safetensors, llama2.c .bin, GGUF (the entry points)
    safetensors.py  the safetensors format, read and written in NumPy alone
    llama2c.py      llama2.c .bin layouts (v0, v1), as an explicit (name, shape) table
    hf.py           Meta <-> Hugging Face names, the q/k RoPE permutation, config.json
    gguf.py         the GGUF container (llama.cpp's format), read and written in NumPy alone
    gguf_quant.py   ggml's tensor encodings (F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K) decoded, Q8_0 encoded
    gguf_llama.py   LLaMA in GGUF: llama.cpp's tensor names and metadata keys <-> npllama's
    gguf_vocab.py   tokenizers <-> GGUF vocabularies (tokenizer.ggml.*)
    config_check.py a config read from a file checked against the file's tensor shapes
    metadata.py     the keys npllama writes into safetensors metadata (the one owner)
    lora.py         LoRA checkpoints: the adapters, the base they name and its fingerprint
    footprint.py    the memory a load will take, from the tensors' shapes and dtypes
    mapped.py       a file read into memory or mapped (the rule), and a mapped file watched for changes
    sigbus.py       SIGBUS while a file is mapped: one line naming it, exit 135
    pickles.py      pickle refusal: never unpickled
    atomic.py       atomic writes: a temp file (or folder), fsync, one rename; never through a link
    outputs.py      where npllama may write: never over an input or, unasked, a checkpoint
    integrity.py    CRC-32s of the header and every tensor: recorded on writing, verified on reading
    errors.py       the exceptions, all NpllamaErrors (ValueErrors) with hints
"""

from .checkpoint import Loaded, load, read_checkpoint, save
from .errors import CheckpointError, ConfigMismatchError, PickleRefusedError, TensorMismatchError
from .integrity import ChecksumMismatchError

__all__ = ["load", "save", "read_checkpoint", "Loaded", "CheckpointError", "ConfigMismatchError",
           "PickleRefusedError", "TensorMismatchError", "ChecksumMismatchError"]
