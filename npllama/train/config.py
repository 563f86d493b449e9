"""TrainConfig: every knob of a training run, its named presets, and the rule for resuming.

Each field is the `npllama train` flag of the same name (underscores become dashes), so a
preset and the flags cannot diverge; npllama.cli.train generates the flags from the fields.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..checks import check_int, check_real, dataclass_from_dict, is_real
from ..config import LlamaConfig
from ..lora import LoraSpec
from ..errors import NpllamaError
from ..io.outputs import check_output_path

def _f(help_text: str, **kw):
    return field(metadata={"help": help_text, **kw.pop("meta", {})}, **kw)


@dataclass
class TrainConfig:
    """Every knob of a training run; each field is the `npllama train` flag of the same name
    (underscores become dashes). Defaults are the shakespeare-char preset."""
    # data and tokenizer
    data: str | None = _f("UTF-8 text file to train on; default: TinyShakespeare ($NPLLAMA_DATA_DIR, "
                          "the cache, or downloaded)", default=None)
    tokenizer: str = _f("'char': one token per character; 'bpe': a sentencepiece BPE model "
                        "trained on the training split", default="char", meta={"choices": ("char", "bpe")})
    vocab_size: int = _f("BPE vocabulary size (--tokenizer bpe; at least ~330 for TinyShakespeare); "
                         "0: the character set (char) or 1024 (bpe)", default=0)
    train_fraction: float = _f("first fraction of the text for training, the rest for validation", default=0.9)
    # model
    dim: int = _f("D, width of the residual stream", default=128)
    n_layers: int = _f("L, transformer blocks", default=4)
    n_heads: int = _f("H, query heads (dim must divide by it)", default=4)
    n_kv_heads: int = _f("KVH, key/value heads for grouped-query attention; 0: same as --n-heads", default=0)
    multiple_of: int = _f("SwiGLU hidden width is rounded up to a multiple of this (Meta's rule)", default=32)
    tie_embeddings: bool = _f("share the embedding matrix with the output projection", default=False)
    seq_len: int = _f("T, tokens per training window (the context the model learns)", default=64)
    max_seq_len: int = _f("longest sequence the saved model accepts (generation); 0: same as --seq-len",
                          default=0)
    dtype: str = _f("parameter dtype", default="float32", meta={"choices": ("float32", "float64")})
    # fine-tuning: start from trained weights (train/finetune.py)
    init: str | None = _f("start from this checkpoint instead of random weights: anything npllama.load reads "
                          "(HF folder, .safetensors, llama2.c .bin, a training checkpoint); the model and its "
                          "tokenizer come from it, so leave out the model flags", default=None)
    init_tokenizer: str | None = _f("sentencepiece .model for an --init checkpoint that carries no tokenizer "
                                    "(a llama2.c .bin: stories260K.bin pairs with tok512.model)", default=None)
    lora_rank: int = _f("0: fine-tune every weight of --init; R > 0: freeze them and train rank-R LoRA "
                        "adapters, W + (alpha / R) B A (checkpoints then hold the adapters only)", default=0)
    lora_alpha: float = _f("LoRA scale: the adapters' output is multiplied by alpha / rank", default=16.0)
    lora_targets: str = _f("the projections that get LoRA adapters, comma-separated from wq,wk,wv,wo,w1,w2,w3",
                           default="wq,wk,wv,wo,w1,w2,w3")
    # optimisation
    batch_size: int = _f("B, windows per micro-batch", default=16)
    grad_accum: int = _f("micro-batches summed into one optimizer step (B*T*accum tokens per step)", default=1)
    gradient_checkpointing: bool = _f("keep only each block's input and recompute the block in backward: a "
                                      "fraction of the activation memory for one more forward per step "
                                      "(the same arithmetic, the same results)", default=False)
    reference: bool = _f("run on the readable reference (npllama/ops, model.py, lora.py, optim.py), "
                         "single-threaded, instead of the engine: the same results, slower", default=False)
    lr: float = _f("peak learning rate, reached after the warm-up", default=2e-3)
    min_lr: float = _f("learning rate at the end of the cosine decay", default=2e-4)
    warmup_steps: int = _f("linear warm-up steps", default=100)
    decay_steps: int = _f("step where the cosine reaches --min-lr; 0: --max-steps (or the steps "
                          "that fit in --time-budget)", default=0)
    weight_decay: float = _f("AdamW decoupled weight decay (matrices only, never norms)", default=0.1)
    beta1: float = _f("AdamW beta1", default=0.9)
    beta2: float = _f("AdamW beta2", default=0.99)
    eps: float = _f("AdamW epsilon (added after the square root)", default=1e-8)
    grad_clip: float = _f("clip the joint gradient norm to this; 0: no clipping", default=1.0)
    # how long
    max_steps: int = _f("optimizer steps to train; 0: as many as --time-budget allows", default=5000)
    time_budget: float = _f("stop after this many seconds of this run (suffix s, m or h: 90s, 5m, 1h); "
                            "0: no limit", default=0.0)
    # evaluation, logging, output
    eval_interval: int = _f("estimate the validation loss, print a sample and save a checkpoint "
                            "every N steps", default=500)
    eval_batches: int = _f("batches (of --batch-size windows) per validation estimate", default=40)
    sample_tokens: int = _f("tokens in the sample printed at each eval; 0: no samples", default=200)
    log_interval: int = _f("progress line every N steps when output is not a terminal "
                           "(a terminal gets a live line every step)", default=10)
    out_dir: str = _f("folder for ckpt.safetensors, metrics.jsonl and loss.png", default="runs/shakespeare-char")
    export: str | None = _f("also write the final model alone (no optimizer state; LoRA adapters merged in) "
                            "to this .safetensors file (Meta names, config and tokenizer inside), to this .gguf "
                            "file (float32, for llama.cpp), or to this folder in Hugging Face's layout (a path "
                            "without a suffix)", default=None)
    seed: int = _f("seed of the initial weights, the batch order and the samples", default=1337)
    resume: bool = _f("continue from OUT_DIR/ckpt.safetensors exactly where it stopped", default=False)

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        return dataclass_from_dict(cls, d, "TrainConfig")

    def validate(self) -> None:
        """Raise ValueError naming the flag (--name) of the first value that cannot work."""
        def flag(name):
            return f"--{name.replace('_', '-')}"

        for name in POSITIVE_INTS:
            check_int(flag(name), getattr(self, name), 1)
        for name in NON_NEGATIVE_INTS:
            check_int(flag(name), getattr(self, name), 0)
        for name in NON_NEGATIVE_FLOATS:
            check_real(flag(name), getattr(self, name), 0.0)
        check_real("--lr", self.lr, 0.0, low_open=True)
        if self.min_lr > self.lr:
            raise NpllamaError(f"--min-lr={self.min_lr!r} is above --lr={self.lr}; the cosine decays from --lr "
                             "down to --min-lr")
        for name in ("beta1", "beta2"):
            check_real(flag(name), getattr(self, name), 0.0, 1.0, high_open=True)
        check_real("--train-fraction", self.train_fraction, 0.0, 1.0, low_open=True, high_open=True)
        for name in ("tokenizer", "dtype"):
            choices = self.__dataclass_fields__[name].metadata["choices"]
            if getattr(self, name) not in choices:
                raise NpllamaError(f"{flag(name)}={getattr(self, name)!r} must be one of {list(choices)}")
        if self.max_seq_len and self.max_seq_len < self.seq_len:
            raise NpllamaError(f"--max-seq-len={self.max_seq_len} is shorter than --seq-len={self.seq_len}; "
                             "the model must fit a training window")
        if self.max_steps == 0 and self.time_budget == 0:
            raise NpllamaError("--max-steps is 0 and there is no --time-budget; give one of them so the run can end")
        if not isinstance(self.out_dir, str) or not self.out_dir:
            raise NpllamaError(f"--out-dir={self.out_dir!r} must name a folder")
        check_output_path(self.out_dir, "--out-dir")            # not only whitespace, no NUL
        if self.export is not None:
            check_output_path(self.export, "--export", whole=True)
        if self.export is not None and export_format(self.export) is None:
            raise NpllamaError(f"--export={self.export!r} must be a path ending in .safetensors (one file), "
                             ".gguf (for llama.cpp) or a folder without a suffix (Hugging Face)")
        if not isinstance(self.data, (str, type(None))):
            raise NpllamaError(f"--data={self.data!r} must be a path")
        for name in ("tie_embeddings", "resume", "gradient_checkpointing", "reference"):
            if not isinstance(getattr(self, name), bool):
                raise NpllamaError(f"{flag(name)}={getattr(self, name)!r} must be True or False")
        for name in ("init", "init_tokenizer"):
            if not isinstance(getattr(self, name), (str, type(None))):
                raise NpllamaError(f"{flag(name)}={getattr(self, name)!r} must be a path")
        check_real("--lora-alpha", self.lora_alpha, 0.0, low_open=True)
        self.lora_spec()                           # checks --lora-targets
        if self.init is None:
            for name in ("init_tokenizer", "lora_rank"):
                if getattr(self, name):
                    raise NpllamaError(f"{flag(name)} needs --init PATH: it applies to a model loaded from a checkpoint "
                                     "(LoRA adapts trained weights)")

    @property
    def backend(self) -> str:
        """The backend the run's model computes on (npllama/backend.py)."""
        return "reference" if self.reference else "engine"

    def lora_spec(self) -> LoraSpec:
        """The LoRA adapters these settings ask for (rank 0: none, full fine-tuning)."""
        try:
            return LoraSpec(rank=self.lora_rank, alpha=self.lora_alpha, targets=self.lora_targets)
        except ValueError as e:
            raise NpllamaError(f"--lora-rank / --lora-alpha / --lora-targets: {e}") from None

    def model_config(self, vocab_size: int) -> LlamaConfig:
        return LlamaConfig(dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads,
                           n_kv_heads=self.n_kv_heads or None, vocab_size=vocab_size,
                           multiple_of=self.multiple_of, max_seq_len=self.max_seq_len or self.seq_len,
                           tie_embeddings=self.tie_embeddings)


# The ranges validate() enforces (cli_train prints them in --help).
POSITIVE_INTS = ("dim", "n_layers", "n_heads", "multiple_of", "seq_len", "batch_size", "grad_accum",
                 "eval_interval", "eval_batches", "log_interval")
NON_NEGATIVE_INTS = ("vocab_size", "n_kv_heads", "max_seq_len", "lora_rank", "warmup_steps", "decay_steps",
                     "max_steps", "sample_tokens", "seed")
NON_NEGATIVE_FLOATS = ("lr", "min_lr", "weight_decay", "eps", "grad_clip", "time_budget")

# Fields that fix the model, the tokenizer or the data; a resumed run cannot change them.
STRUCTURAL_FIELDS = ("data", "tokenizer", "vocab_size", "train_fraction", "dim", "n_layers", "n_heads",
                     "n_kv_heads", "multiple_of", "tie_embeddings", "max_seq_len", "dtype", "seed", "init",
                     "init_tokenizer", "lora_rank", "lora_alpha", "lora_targets")
# Fields that fix the architecture and the tokenizer: with --init they come from the checkpoint.
ARCHITECTURE_FIELDS = ("tokenizer", "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "multiple_of",
                       "tie_embeddings", "max_seq_len")


def export_format(path) -> str | None:
    """The format --export PATH writes: 'meta' for a .safetensors file, 'gguf' for a .gguf file, 'hf' for a
    folder, None otherwise."""
    suffix = Path(str(path)).suffix
    return {".safetensors": "meta", ".gguf": "gguf", "": "hf"}.get(suffix)


# ---- presets: named functions, each a TrainConfig -------------------------------------------------

def shakespeare_char() -> TrainConfig:
    """The default: characters of TinyShakespeare on 2 CPU cores, about 5 minutes (the TrainConfig defaults).

    dim 128, 4 layers, 4 heads (0.8M parameters), windows of T = 64 characters, B = 16 windows
    (1,024 tokens a step), 5,000 steps. Chosen by measurement on 2 cores (docs/speed.md):
    for the same number of tokens, val loss after 1.2M tokens was 1.78 with (B 32, T 64),
    1.79 with (B 16, T 128), 1.74 with (B 16, T 64) and 1.72 with (B 8, T 64), while tokens
    per second rise with the batch; B = 16 gave the lowest loss per minute. A small model
    takes a high lr (2e-3; 3e-3 was worse) and beta2 = 0.99 because its batches are small
    (nanoGPT's shakespeare-char); clip 1.0 and weight decay 0.1 as nanoGPT.
    """
    return TrainConfig()


def shakespeare_bpe() -> TrainConfig:
    """TinyShakespeare through a 1024-token sentencepiece BPE trained on the training split.

    256 of the ids are byte-fallback pieces, so 1024 leaves ~700 merges: a token carries 2.1
    characters of the validation text (1.8 with --vocab-size 512), and T = 64 tokens sees ~137
    characters. Losses are per token, not per character: compare runs of one tokenizer only.
    """
    return TrainConfig(tokenizer="bpe", vocab_size=1024, out_dir="runs/shakespeare-bpe")


def tiny() -> TrainConfig:
    """A smoke test that finishes in seconds: 2 small layers, 60 steps."""
    return TrainConfig(dim=32, n_layers=2, n_heads=4, seq_len=32, batch_size=8, lr=3e-3, min_lr=3e-4,
                       warmup_steps=10, max_steps=60, eval_interval=30, eval_batches=4, sample_tokens=60,
                       out_dir="runs/tiny")


PRESETS: dict[str, Callable[[], TrainConfig]] = {
    "shakespeare-char": shakespeare_char,
    "shakespeare-bpe": shakespeare_bpe,
    "tiny": tiny,
}


def preset(name: str) -> TrainConfig:
    if name not in PRESETS:
        raise NpllamaError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()


def check_resume(saved: TrainConfig, cfg: TrainConfig, source) -> None:
    """Refuse a resumed run whose config changes what defines the model, the tokenizer or the data.

    saved: the config in the checkpoint `source`; cfg: the one the run was asked to use. Every
    other field (lr, max_steps, eval_interval, ...) may change between runs.
    """
    changed = [f"--{n.replace('_', '-')} {getattr(saved, n)!r} -> {getattr(cfg, n)!r}"
               for n in STRUCTURAL_FIELDS if getattr(cfg, n) != getattr(saved, n)]
    if changed:
        raise NpllamaError(f"--resume cannot change what defines the model and data of {source} "
                         f"({'; '.join(changed)}); drop those flags, or train a new model in another --out-dir")


def parse_duration(text) -> float:
    """'90' / '90s' -> 90.0, '5m' -> 300.0, '1.5h' -> 5400.0 (seconds)."""
    if is_real(text):
        value = float(text)
    else:
        s = str(text).strip().lower()
        scale = {"s": 1.0, "m": 60.0, "h": 3600.0}.get(s[-1:], None)
        try:
            value = float(s[:-1] if scale else s) * (scale or 1.0)
        except ValueError:
            raise NpllamaError(f"time {text!r} is not a duration; write seconds or a number with s, m or h "
                             "(90, 90s, 5m, 1.5h)") from None
    if not math.isfinite(value) or value < 0:
        raise NpllamaError(f"time {text!r} must be a finite duration >= 0")
    return value
