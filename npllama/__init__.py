"""npllama: LLaMA-2 in pure NumPy, with hand-written backward passes.

The public surface (see CONTRACT.md): LlamaConfig, Llama, load, save, AdamW, clip_grad_norm, and
NpllamaError, the ValueError every error npllama raises on purpose derives from.

Layers, each importing only from those before it (tests/test_layout.py checks it):
    errors, interrupts, checks,     the error family, stop signals, argument checks,
    storage, config, memory, work   the dtypes weights are held in, the blueprint, memory and time estimates
    tokenizers                      text <-> ids (char, sentencepiece, tokenizer.json)
    ops, kvcache, model, lora       the reference math: pure functions a reader reads
    optim, sampling, gradcheck      AdamW and clipping, choosing tokens, numerical gradients
    backend                         the seam: what a model hands its arithmetic to, and the
                                    reference's side of it (the math above, nothing else)
    engine                          the fast side of the seam, tested equal to the reference
    generate, llama                 the decoding loop; the public Llama object
    io                              file formats: load and save
    train                           the training loop and its files
    cli                             the command line (started by __main__.py, the launcher)

The names are imported when first used (`npllama.Llama`, `from npllama import load`, or any
submodule as an attribute, `npllama.io`), not by `import npllama` itself: so the launcher of the
command line runs before NumPy is imported and a Ctrl-C during start-up ends in one line.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it
_PUBLIC = {"LlamaConfig": "config", "Llama": "llama", "load": "io", "save": "io", "AdamW": "engine.adamw",
           "clip_grad_norm": "optim", "NpllamaError": "errors"}
__all__ = ["LlamaConfig", "Llama", "load", "save", "AdamW", "clip_grad_norm", "NpllamaError"]


def __getattr__(name: str):
    """A public name, or a submodule (npllama.io, npllama.memory, ...), imported on first use."""
    if name in _PUBLIC:
        value = getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
    else:
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":      # the submodule exists but an import inside it failed
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
