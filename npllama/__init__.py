"""npllama: LLaMA-2 in pure NumPy, with hand-written backward passes.

The public surface (see CONTRACT.md): LlamaConfig, Llama, load, save, AdamW, clip_grad_norm.
Data flows one way: config -> model (params, ops) -> optim / train / generate -> cli.
"""

from .checkpoint import load, save
from .config import LlamaConfig
from .model import Llama
from .optim import AdamW, clip_grad_norm

__all__ = ["LlamaConfig", "Llama", "load", "save", "AdamW", "clip_grad_norm"]
__version__ = "0.1.0"
