"""npllama: LLaMA-2 in pure NumPy, with hand-written backward passes.

The public surface (see CONTRACT.md): LlamaConfig, Llama, load, save, AdamW, clip_grad_norm, and
NpllamaError, the ValueError every error npllama raises on purpose derives from.

Layers, each importing only from those before it (tests/test_layout.py checks it):
    errors, checks, storage         the error family, argument checks, the dtypes weights are held in
    config, memory                  the blueprint, memory estimates
    tokenizers                      text <-> ids (char, sentencepiece, tokenizer.json)
    ops, kvcache, model, lora       the reference math: pure functions a reader reads
    optim, sampling, gradcheck      AdamW and clipping, choosing tokens, numerical gradients
    backend                         the seam: what a model hands its arithmetic to, and the
                                    reference's side of it (the math above, nothing else)
    engine                          the fast side of the seam, tested equal to the reference
    generate, llama                 the decoding loop; the public Llama object
    io                              file formats: load and save
    train                           the training loop and its files
    cli                             the command line
"""

from .config import LlamaConfig
from .errors import NpllamaError
from .io import load, save
from .llama import Llama
from .engine.adamw import AdamW
from .optim import clip_grad_norm

__all__ = ["LlamaConfig", "Llama", "load", "save", "AdamW", "clip_grad_norm", "NpllamaError"]
__version__ = "0.1.0"
