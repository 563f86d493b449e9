"""npllama: LLaMA-2 in pure NumPy, with hand-written backward passes.

The public surface (see CONTRACT.md): LlamaConfig, Llama, load, save, AdamW, clip_grad_norm.
"""

from .config import LlamaConfig
from .model import Llama
from .checkpoint import load, save

__all__ = ["LlamaConfig", "Llama"]
__version__ = "0.1.0"
