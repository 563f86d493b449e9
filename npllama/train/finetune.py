"""Fine-tuning: a run that starts from trained weights (`npllama train --init PATH`).

    npllama train --init stories260K.bin --init-tokenizer tok512.model --data tinyshakespeare.txt
    npllama train --init stories260K.bin --init-tokenizer tok512.model --lora-rank 8 ...

The model, its config and its tokenizer come from the checkpoint (anything npllama.load reads),
and the text is tokenized with that tokenizer; the run's architecture settings are set from it,
so a resumed run checks them as any other. Flags given on the command line that would change
the architecture are refused when they differ from the checkpoint's.

  --lora-rank 0  full fine-tuning: every weight trains, with the loop's AdamW, schedule and
                 checkpoints exactly as for training from scratch.
  --lora-rank R  LoRA (npllama.lora): the checkpoint's weights are frozen and a LoraLlama trains
                 its adapters only; AdamW holds their moments only, and the training checkpoint
                 holds the adapters, their moments, and the base's path and fingerprint
                 (io/lora.py), so resuming (or generating from it) refuses a base that changed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..io import load
from ..io.lora import fingerprint
from ..llama import Llama, LoraLlama
from ..tokenizers import CharTokenizer, SentencePieceTokenizer
from .config import ARCHITECTURE_FIELDS, TrainConfig
from ..errors import NpllamaError


def architecture_of(model: Llama) -> dict:
    """The TrainConfig architecture fields that describe a loaded model and its tokenizer."""
    c = model.config
    return dict(tokenizer="char" if isinstance(model.tokenizer, CharTokenizer) else "bpe", vocab_size=c.vocab_size,
                dim=c.dim, n_layers=c.n_layers, n_heads=c.n_heads, n_kv_heads=c.n_kv_heads,
                multiple_of=c.multiple_of, tie_embeddings=c.tie_embeddings, max_seq_len=c.max_seq_len)


def _load_init(cfg: TrainConfig) -> Llama:
    """The --init model in the run's dtype, with its tokenizer (or --init-tokenizer's)."""
    model = load(cfg.init, dtype=np.dtype(cfg.dtype), backend=cfg.backend)
    if cfg.init_tokenizer:
        model.tokenizer = SentencePieceTokenizer.from_file(cfg.init_tokenizer)
    if model.tokenizer is None:
        raise NpllamaError(f"--init {cfg.init} carries no tokenizer (a llama2.c .bin has none); give its "
                         "sentencepiece model with --init-tokenizer PATH (stories260K.bin pairs with tok512.model)")
    if model.tokenizer.vocab_size > model.config.vocab_size:
        raise NpllamaError(f"the tokenizer has {model.tokenizer.vocab_size} tokens but {cfg.init} only "
                         f"{model.config.vocab_size}: they do not belong together; pass the model's own "
                         "tokenizer with --init-tokenizer")
    return model


def init_model(cfg: TrainConfig, explicit=()) -> tuple[Llama | LoraLlama, TrainConfig]:
    """The model a fine-tuning run starts from, and cfg with the architecture fields set from it.

    explicit: the fields the user set (the command line's flags); those that fix the architecture
    must equal the checkpoint's, else ValueError names each one.
    """
    base = _load_init(cfg)
    architecture = architecture_of(base)
    differ = [f"--{n.replace('_', '-')} {getattr(cfg, n)!r} (the checkpoint has {architecture[n]!r})"
              for n in ARCHITECTURE_FIELDS if n in explicit and getattr(cfg, n) != architecture[n]]
    if differ:
        raise NpllamaError(f"--init {cfg.init} fixes the model and its tokenizer, which these flags would change: "
                         f"{'; '.join(differ)}; leave them out to fine-tune the model as it is")
    cfg = cfg.replace(**architecture)
    if cfg.seq_len > cfg.max_seq_len:
        raise NpllamaError(f"--seq-len {cfg.seq_len} is longer than the context of {cfg.init} "
                         f"(max_seq_len {cfg.max_seq_len}); use --seq-len {cfg.max_seq_len} or less")
    spec = cfg.lora_spec()
    if spec.rank == 0:
        return base, cfg
    model = LoraLlama(base, spec, seed=cfg.seed)
    model.base_path, model.base_sha256 = str(Path(cfg.init).absolute()), fingerprint(cfg.init)
    return model, cfg


def init_architecture(saved: TrainConfig, cfg: TrainConfig, explicit=()) -> TrainConfig:
    """cfg for resuming the run saved with `saved`: for an --init run, the architecture fields not set
    explicitly are the saved ones (they came from the checkpoint), so only explicit changes are refused."""
    if not saved.init:
        return cfg
    return cfg.replace(**{n: getattr(saved, n) for n in ARCHITECTURE_FIELDS if n not in explicit})


def describe_init(model, cfg: TrainConfig) -> str:
    """One header line: where the weights come from, and what trains."""
    if isinstance(model, LoraLlama):
        s = model.spec
        return (f"{cfg.init}: frozen; LoRA rank {s.rank}, alpha {s.alpha:g} (scale {s.scale:g}) on "
                f"{','.join(s.targets)}: {model.n_params():,} trainable")
    return f"{cfg.init}: every weight trains"
