"""Training on a CPU: TrainConfig, presets, and the loop behind `npllama train`.

One optimizer step (`train_step`), with A = grad_accum micro-batches of B windows of T tokens:

    grads = (1/A) * sum over micro-batches of d(mean cross-entropy)/d(params)
    total = clip_grad_norm(grads, grad_clip)              # joint L2 norm, torch semantics
    lr    = lr_at(step, lr, warmup_steps, decay_steps, min_lr)
    AdamW step with that lr                               # decoupled decay on matrices only

Every eval_interval steps the loop estimates the validation loss on eval_batches fixed
windows (the same windows every time, so the curve is comparable), prints a short sample,
and writes the training checkpoint (train_checkpoint.py) atomically. A metrics log
(metrics.jsonl) gets one line per step and per eval; at the end a loss curve (loss.png)
is drawn when matplotlib is installed.

Randomness: the model's init uses `seed`; the training batches come from one
np.random.Generator seeded from (seed, 1) whose state is saved in the checkpoint, so
`--resume` draws exactly the batches the uninterrupted run would have drawn; evals and
samples use their own generators and never disturb it. N steps + resume + N steps gives
the same parameters, bit for bit, as 2N steps straight.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TextIO

import numpy as np

from . import data as data_mod
from .config import LlamaConfig
from .model import Llama
from .ops import cross_entropy_forward
from .optim import AdamW, clip_grad_norm, lr_at
from .tokenizers import CharTokenizer, train_sentencepiece
from .train_checkpoint import load_train_checkpoint, rng_from_state, rng_state, save_train_checkpoint

CHECKPOINT_NAME = "ckpt.safetensors"
METRICS_NAME = "metrics.jsonl"
PLOT_NAME = "loss.png"


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
    # optimisation
    batch_size: int = _f("B, windows per micro-batch", default=16)
    grad_accum: int = _f("micro-batches summed into one optimizer step (B*T*accum tokens per step)", default=1)
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
    export: str | None = _f("also write the final model alone (no optimizer state: a few MB) to this "
                            ".safetensors file, with its config and tokenizer", default=None)
    seed: int = _f("seed of the initial weights, the batch order and the samples", default=1337)
    resume: bool = _f("continue from OUT_DIR/ckpt.safetensors exactly where it stopped", default=False)

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown TrainConfig fields {unknown}")
        return cls(**d)

    def validate(self) -> None:
        """Raise ValueError naming the flag (--name) of the first value that cannot work."""
        def bad(name, why):
            raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)!r} {why}")

        def is_int(v):
            return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

        def is_num(v):
            return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) \
                and math.isfinite(v)

        for name in POSITIVE_INTS:
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                bad(name, "must be a positive integer")
        for name in NON_NEGATIVE_INTS:
            if not is_int(getattr(self, name)) or getattr(self, name) < 0:
                bad(name, "must be a non-negative integer")
        for name in NON_NEGATIVE_FLOATS:
            if not is_num(getattr(self, name)) or getattr(self, name) < 0:
                bad(name, "must be a finite number >= 0")
        if self.lr <= 0:
            bad("lr", "must be > 0")
        if self.min_lr > self.lr:
            bad("min_lr", f"is above --lr={self.lr}; the cosine decays from --lr down to --min-lr")
        for name in ("beta1", "beta2"):
            if not is_num(getattr(self, name)) or not 0 <= getattr(self, name) < 1:
                bad(name, "must lie in [0, 1)")
        if not is_num(self.train_fraction) or not 0 < self.train_fraction < 1:
            bad("train_fraction", "must lie strictly between 0 and 1")
        if self.tokenizer not in ("char", "bpe"):
            bad("tokenizer", "must be 'char' or 'bpe'")
        if self.dtype not in ("float32", "float64"):
            bad("dtype", "must be float32 or float64")
        if self.max_seq_len and self.max_seq_len < self.seq_len:
            bad("max_seq_len", f"is shorter than --seq-len={self.seq_len}; the model must fit a training window")
        if self.max_steps == 0 and self.time_budget == 0:
            bad("max_steps", "is 0 and there is no --time-budget; give one of them so the run can end")
        if not isinstance(self.out_dir, str) or not self.out_dir:
            bad("out_dir", "must name a folder")
        if self.export is not None and not str(self.export).endswith(".safetensors"):
            bad("export", "must be a path ending in .safetensors")
        if not isinstance(self.tie_embeddings, bool) or not isinstance(self.resume, bool):
            raise ValueError("tie_embeddings and resume must be True or False")

    def model_config(self, vocab_size: int) -> LlamaConfig:
        return LlamaConfig(dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads,
                           n_kv_heads=self.n_kv_heads or None, vocab_size=vocab_size,
                           multiple_of=self.multiple_of, max_seq_len=self.max_seq_len or self.seq_len,
                           tie_embeddings=self.tie_embeddings)


# The ranges validate() enforces (cli_train prints them in --help).
POSITIVE_INTS = ("dim", "n_layers", "n_heads", "multiple_of", "seq_len", "batch_size", "grad_accum",
                 "eval_interval", "eval_batches", "log_interval")
NON_NEGATIVE_INTS = ("vocab_size", "n_kv_heads", "max_seq_len", "warmup_steps", "decay_steps", "max_steps",
                     "sample_tokens", "seed")
NON_NEGATIVE_FLOATS = ("lr", "min_lr", "weight_decay", "eps", "grad_clip", "time_budget")

# Fields that fix the model, the tokenizer or the data; a resumed run cannot change them.
STRUCTURAL_FIELDS = ("data", "tokenizer", "vocab_size", "train_fraction", "dim", "n_layers", "n_heads",
                     "n_kv_heads", "multiple_of", "tie_embeddings", "max_seq_len", "dtype", "seed")


# ---- presets: named functions, each a TrainConfig -------------------------------------------------

def shakespeare_char() -> TrainConfig:
    """The default: characters of TinyShakespeare on 2 CPU cores, about 5 minutes (the TrainConfig defaults).

    dim 128, 4 layers, 4 heads (0.8M parameters), windows of T = 64 characters, B = 16 windows
    (1,024 tokens a step), 5,000 steps. Chosen by measurement on 2 cores (README "Training"):
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
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()


# ---- data ------------------------------------------------------------------------------------------

@dataclass
class Corpus:
    """The text, its tokenizer and the two token streams."""
    text_path: Path
    text_sha256: str
    tokenizer: object
    train_ids: np.ndarray        # (N_train,) int32
    val_ids: np.ndarray          # (N_val,) int32


def prepare_data(cfg: TrainConfig, tokenizer=None, log: Callable[[str], None] = print) -> Corpus:
    """Load the text, split it, build (or reuse) the tokenizer on the training part, encode both parts.

    The BPE model is trained on the training split only, so validation text is never seen.
    A char tokenizer takes the characters of the whole text (the validation part may hold
    a character the training part lacks; nanoGPT does the same).
    """
    path = data_mod.find_text(cfg.data)
    text = data_mod.load_text(path)
    sha = hashlib.sha256(text.encode("utf-8")).hexdigest()
    train_text, val_text = data_mod.split_text(text, cfg.train_fraction)
    if tokenizer is None:
        if cfg.tokenizer == "char":
            tokenizer = CharTokenizer.from_text(text)
            if cfg.vocab_size and cfg.vocab_size != tokenizer.vocab_size:
                raise ValueError(f"--vocab-size={cfg.vocab_size} but the text has {tokenizer.vocab_size} distinct "
                                 "characters; --vocab-size applies to --tokenizer bpe only (leave it at 0)")
        else:
            vocab_size = cfg.vocab_size or 1024
            log(f"training a {vocab_size}-token sentencepiece BPE model on the training split ...")
            t0 = time.perf_counter()
            tokenizer = train_sentencepiece(train_text, vocab_size, seed=cfg.seed)
            log(f"  done in {time.perf_counter() - t0:.1f}s")
    train_ids = np.asarray(tokenizer.encode(train_text), dtype=np.int32)
    val_ids = np.asarray(tokenizer.encode(val_text), dtype=np.int32)
    for name, ids in (("training", train_ids), ("validation", val_ids)):
        if len(ids) <= cfg.seq_len:
            raise ValueError(f"the {name} split has {len(ids)} tokens, not enough for one window of --seq-len="
                             f"{cfg.seq_len}; use more text, a shorter --seq-len or another --train-fraction")
    return Corpus(path, sha, tokenizer, train_ids, val_ids)


# ---- the pieces of the loop ------------------------------------------------------------------------

def train_step(model: Llama, optimizer: AdamW, batches, lr: float, grad_clip: float) -> tuple[float, float]:
    """One optimizer step over len(batches) micro-batches [(x, y), ...]; returns (loss, grad_norm).

    The gradients of the micro-batches are averaged (each is already a mean over its B*T
    targets, so the average is the mean over all of them), clipped, and applied. When the
    loss or the gradient norm is not finite, nothing is updated and that value is returned:
    the caller decides to stop.
    """
    total_loss, grads = 0.0, None
    for x, y in batches:
        loss, g = model.loss_and_grads(x, y)
        total_loss += loss
        if grads is None:
            grads = g
        else:
            for name, gi in g.items():
                grads[name] += gi
    n = len(batches)
    if n > 1:
        for gi in grads.values():
            gi *= 1.0 / n
    loss = total_loss / n
    if not math.isfinite(loss):
        return loss, math.nan
    norm = clip_grad_norm(grads, grad_clip if grad_clip > 0 else math.inf)
    if not math.isfinite(norm):
        return loss, norm
    optimizer.step(grads, lr=lr)
    return loss, norm


def estimate_loss(model: Llama, ids: np.ndarray, batch_size: int, seq_len: int, n_batches: int,
                  seed: int) -> float:
    """Mean cross-entropy over n_batches random windows drawn with a fresh Generator(seed).

    The same seed gives the same windows, so successive estimates differ only by the model.
    """
    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(n_batches):
        x, y = data_mod.get_batch(ids, batch_size, seq_len, rng)
        logits = model.forward(x)
        losses.append(cross_entropy_forward(logits, y)[0])
    return float(np.mean(losses))


def full_val_loss(model: Llama, ids: np.ndarray, seq_len: int, batch_size: int) -> float:
    """Mean cross-entropy over the whole of ids, cut into consecutive windows of seq_len.

    Window j predicts ids[j*T + 1 : (j + 1)*T + 1] from ids[j*T : (j + 1)*T]; a last window
    too short for T tokens and its target is left out. Deterministic: the figure the README
    and weights/README quote.
    """
    n_windows = (len(ids) - 1) // seq_len
    if n_windows < 1:
        raise ValueError(f"{len(ids)} tokens hold no full window of seq_len={seq_len}")
    x_all = ids[:n_windows * seq_len].reshape(n_windows, seq_len)
    y_all = ids[1:n_windows * seq_len + 1].reshape(n_windows, seq_len)
    total = 0.0
    for start in range(0, n_windows, batch_size):
        x, y = x_all[start:start + batch_size], y_all[start:start + batch_size]
        total += cross_entropy_forward(model.forward(x), y)[0] * len(x)
    return total / n_windows


def sample_text(model: Llama, tokenizer, n_tokens: int, seed: int, prompt: str = "\n",
                temperature: float = 0.8, top_k: int | None = None) -> str:
    """A short continuation of prompt, for watching the model learn (KV-cache generation)."""
    prompt_ids = tokenizer.encode(prompt) or [0]
    n = min(n_tokens, model.config.max_seq_len - len(prompt_ids))
    if n <= 0:
        return ""
    ids = model.generate(prompt_ids, max_new_tokens=n, temperature=temperature, top_k=top_k, seed=seed)
    return tokenizer.decode([int(i) for i in ids])


def parse_duration(text) -> float:
    """'90' / '90s' -> 90.0, '5m' -> 300.0, '1.5h' -> 5400.0 (seconds)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        s = str(text).strip().lower()
        scale = {"s": 1.0, "m": 60.0, "h": 3600.0}.get(s[-1:], None)
        try:
            value = float(s[:-1] if scale else s) * (scale or 1.0)
        except ValueError:
            raise ValueError(f"time {text!r} is not a duration; write seconds or a number with s, m or h "
                             "(90, 90s, 5m, 1.5h)") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"time {text!r} must be a finite duration >= 0")
    return value


def _fmt_time(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class MetricsLog:
    """metrics.jsonl: one JSON object per line, flushed as written (a killed run keeps its log).

    {"kind": "train", "step", "loss", "lr", "grad_norm", "tok_per_s", "elapsed"} per step and
    {"kind": "eval", "step", "val_loss", "train_loss"} per evaluation, and at the end of a run
    {"kind": "final", "step", "full_val_loss"}; "step" counts optimizer steps completed. On
    resume, lines past the resumed step (written after that checkpoint by the interrupted run)
    and the earlier run's "final" line are dropped, so the log reads as one run.
    """

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        if resume_step is not None and path.is_file():
            records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            kept = [json.dumps(r) for r in records if r.get("kind") != "final" and r.get("step", 0) <= resume_step]
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, path)
        elif path.exists():
            path.unlink()
        self._f = open(path, "a", encoding="utf-8")

    def write(self, **record) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_metrics(path) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) of a metrics.jsonl file."""
    train, evals = [], []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            if rec.get("kind") == "eval":
                evals.append(rec)
            elif rec.get("kind") == "train":
                train.append(rec)
    return train, evals


def plot_metrics(metrics_path, png_path) -> Path | None:
    """Draw the training loss (raw and smoothed) and the validation loss against the step.

    Returns the PNG's path, or None when matplotlib is not installed.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    train, evals = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    if train:
        steps = np.array([r["step"] for r in train])
        loss = np.array([r["loss"] for r in train])
        ax.plot(steps, loss, color="tab:blue", alpha=0.25, lw=0.8, label="train (per step)")
        w = max(1, len(loss) // 50)
        if w > 1:
            smooth = np.convolve(loss, np.ones(w) / w, mode="valid")
            ax.plot(steps[w - 1:], smooth, color="tab:blue", lw=1.5, label=f"train ({w}-step mean)")
    if evals:
        ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", color="tab:orange",
                lw=1.5, ms=3, label="validation")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"npllama train: {Path(metrics_path).parent.name}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return Path(png_path)


# ---- the run ---------------------------------------------------------------------------------------

class TrainingDiverged(ValueError):
    """The loss or the gradient norm became NaN or infinite."""


@dataclass
class TrainResult:
    steps: int                      # optimizer steps completed in total
    val_loss: float | None          # last validation estimate
    checkpoint: Path | None         # the last checkpoint written
    metrics: Path
    plot: Path | None
    stopped: str                    # "max_steps", "time_budget", "interrupted"
    elapsed: float                  # seconds of this run
    full_val_loss: float            # over every validation token (full_val_loss)
    history: list = field(default_factory=list)   # (step, val_loss) of every eval


class _StopFlag:
    """Ctrl-C asks the loop to stop at the next step boundary (then save); a second one aborts."""

    def __init__(self):
        self.requested = False
        self._old = None

    def __enter__(self):
        try:
            self._old = signal.signal(signal.SIGINT, self._handler)
        except ValueError:          # not the main thread: no handler, Ctrl-C behaves as usual
            self._old = None
        return self

    def _handler(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


def _calibrate_steps(model, corpus, cfg, budget_left, log) -> int:
    """How many steps fit in budget_left seconds, eval and sample time included.

    Times two gradient computations (after one warm-up) and one forward without touching
    the parameters, so the run itself is unaffected.
    """
    rng = np.random.default_rng([cfg.seed, 9])
    batches = [data_mod.get_batch(corpus.train_ids, cfg.batch_size, cfg.seq_len, rng) for _ in range(cfg.grad_accum)]
    model.loss_and_grads(*batches[0])
    t0 = time.perf_counter()
    for _ in range(2):
        for x, y in batches:
            model.loss_and_grads(x, y)
    step_time = (time.perf_counter() - t0) / 2 * 1.03        # + clipping and the AdamW update
    t0 = time.perf_counter()
    model.forward(batches[0][0])
    eval_time = (time.perf_counter() - t0) * cfg.eval_batches + (0.002 * cfg.sample_tokens)
    per_step = step_time + eval_time / cfg.eval_interval
    steps = max(1, int(budget_left / per_step))
    log(f"time budget {_fmt_time(budget_left)}: {step_time:.3f}s a step, so about {steps} steps; "
        "the cosine decays over them")
    return steps


def train(cfg: TrainConfig, out: TextIO | None = None, preset_name: str | None = None) -> TrainResult:
    """Run (or resume) training as cfg says; returns what happened. See the module docstring.

    Raises ValueError for unusable settings, FileNotFoundError for missing data or checkpoint,
    and TrainingDiverged when the loss stops being finite (the last checkpoint is kept).
    """
    out = out or sys.stdout
    is_tty = hasattr(out, "isatty") and out.isatty()
    live = {"pending": False}

    def log(msg: str = "") -> None:
        if live["pending"]:
            out.write("\n")
            live["pending"] = False
        out.write(msg + "\n")
        out.flush()

    cfg.validate()
    run_start = time.perf_counter()
    out_dir = Path(cfg.out_dir)
    ckpt_path = out_dir / CHECKPOINT_NAME
    dtype = np.dtype(cfg.dtype)

    if cfg.resume:
        ck = load_train_checkpoint(ckpt_path)
        saved = TrainConfig.from_dict(ck.state["train_config"])
        changed = [f"--{n.replace('_', '-')} {getattr(saved, n)!r} -> {getattr(cfg, n)!r}"
                   for n in STRUCTURAL_FIELDS if getattr(saved, n) != getattr(cfg, n)]
        if changed:
            raise ValueError(f"--resume cannot change what defines the model and data ({'; '.join(changed)}); "
                             f"drop those flags, or start a new run in another --out-dir")
        model, tokenizer = ck.model, ck.tokenizer
        if model.dtype != dtype:
            raise ValueError(f"{ckpt_path} holds {model.dtype} parameters but --dtype is {cfg.dtype}")
        corpus = prepare_data(cfg, tokenizer=tokenizer, log=log)
        if corpus.text_sha256 != ck.state.get("text_sha256"):
            raise ValueError(f"the training text {corpus.text_path} is not the one {ckpt_path} was trained on "
                             "(sha256 differs); resume with the same --data")
        start_step = int(ck.state["step"])
        data_rng = rng_from_state(ck.state["rng"])
        optimizer = AdamW(model.params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                          weight_decay=cfg.weight_decay)
        optimizer.load_state_dict(ck.optimizer_state)
        # hyper-parameters given now win over the saved ones (same values when nothing changed)
        optimizer.lr, optimizer.beta1, optimizer.beta2 = cfg.lr, cfg.beta1, cfg.beta2
        optimizer.eps, optimizer.weight_decay = cfg.eps, cfg.weight_decay
        elapsed_before = float(ck.state.get("elapsed", 0.0))
        tokens_before = int(ck.state.get("tokens", 0))
        last_val = ck.state.get("val_loss")
        history = [tuple(h) for h in ck.state.get("history", [])]
        if start_step >= (cfg.max_steps or math.inf):
            log(f"{ckpt_path} is already at step {start_step} >= --max-steps {cfg.max_steps}; "
                "raise --max-steps to train further")
    else:
        if ckpt_path.exists():
            raise ValueError(f"{ckpt_path} already exists; add --resume to continue that run, or choose another "
                             "--out-dir (or delete the folder) to start a new one")
        corpus = prepare_data(cfg, log=log)
        tokenizer = corpus.tokenizer
        model = Llama(cfg.model_config(tokenizer.vocab_size), seed=cfg.seed, dtype=dtype)
        model.tokenizer = tokenizer
        optimizer = AdamW(model.params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                          weight_decay=cfg.weight_decay)
        start_step, elapsed_before, tokens_before, last_val, history = 0, 0.0, 0, None, []
        data_rng = np.random.default_rng([cfg.seed, 1])

    out_dir.mkdir(parents=True, exist_ok=True)
    mcfg = model.config
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum
    if cfg.max_steps == 0:
        budget_left = cfg.time_budget - (time.perf_counter() - run_start)
        cfg = cfg.replace(max_steps=start_step + _calibrate_steps(model, corpus, cfg, budget_left, log))
    if cfg.decay_steps == 0:
        cfg = cfg.replace(decay_steps=cfg.max_steps)
    n_kv = mcfg.n_kv_heads
    log(f"npllama train{f' --preset {preset_name}' if preset_name else ''}"
        f"{f' --resume from step {start_step}' if cfg.resume else ''}")
    log(f"  data       {corpus.text_path}: train {len(corpus.train_ids):,} / val {len(corpus.val_ids):,} tokens")
    log(f"  tokenizer  {cfg.tokenizer}, vocab {mcfg.vocab_size}")
    log(f"  model      dim {mcfg.dim}, {mcfg.n_layers} layers, {mcfg.n_heads} heads ({n_kv} kv), hidden "
        f"{mcfg.hidden_dim}, seq {cfg.seq_len} (max {mcfg.max_seq_len}): {model.n_params():,} params, {cfg.dtype}")
    log(f"  optimizer  AdamW lr {cfg.lr:g} -> {cfg.min_lr:g} (warm-up {cfg.warmup_steps}, cosine to step "
        f"{cfg.decay_steps}), betas ({cfg.beta1}, {cfg.beta2}), weight decay {cfg.weight_decay}, clip {cfg.grad_clip}")
    log(f"  batch      {cfg.batch_size} x {cfg.seq_len} tokens x {cfg.grad_accum} accum = "
        f"{tokens_per_step:,} tokens a step")
    log(f"  run        steps {start_step} -> {cfg.max_steps}"
        f"{f', time budget {_fmt_time(cfg.time_budget)}' if cfg.time_budget else ''}, eval every "
        f"{cfg.eval_interval} ({cfg.eval_batches} batches), seed {cfg.seed}, out {out_dir}/")

    if cfg.warmup_steps >= cfg.decay_steps:
        log(f"  note: --warmup-steps {cfg.warmup_steps} >= the {cfg.decay_steps}-step schedule; the lr never "
            "reaches its peak or decays (lower --warmup-steps for short runs)")
    metrics = MetricsLog(out_dir / METRICS_NAME, start_step if cfg.resume else None)
    saved_step = start_step if cfg.resume else None
    eval_seed = [cfg.seed, 2]

    def checkpoint(step: int) -> None:
        nonlocal saved_step
        state = {"step": step, "rng": rng_state(data_rng), "train_config": cfg.to_dict(),
                 "elapsed": elapsed_before + (time.perf_counter() - run_start), "tokens": tokens,
                 "val_loss": last_val, "history": history, "text_sha256": corpus.text_sha256}
        save_train_checkpoint(ckpt_path, model, tokenizer, optimizer, state)
        saved_step = step

    def evaluate(step: int) -> None:
        nonlocal last_val
        t0 = time.perf_counter()
        last_val = estimate_loss(model, corpus.val_ids, cfg.batch_size, cfg.seq_len, cfg.eval_batches, eval_seed)
        recent = [r for r in recent_losses if math.isfinite(r)]
        train_loss = float(np.mean(recent)) if recent else None
        history.append((step, last_val))
        metrics.write(kind="eval", step=step, val_loss=last_val, train_loss=train_loss)
        shown = f", train loss {train_loss:.4f} (mean of the last {len(recent)} steps)" if recent else ""
        log(f"step {step}: val loss {last_val:.4f}{shown}  [{time.perf_counter() - t0:.1f}s]")
        recent_losses.clear()
        if cfg.sample_tokens:
            text = sample_text(model, tokenizer, cfg.sample_tokens, seed=cfg.seed + step)
            log("  | " + text.replace("\n", "\n  | "))

    tokens = tokens_before
    recent_losses: list[float] = []
    step = start_step
    stopped = "max_steps"
    step_time_ema = None
    train_time = 0.0
    try:
        with _StopFlag() as stop:
            while True:
                if step % cfg.eval_interval == 0 or step >= cfg.max_steps:
                    if not (cfg.resume and step == start_step):      # the checkpoint already holds this
                        evaluate(step)
                        if step > start_step:
                            checkpoint(step)
                if step >= cfg.max_steps:
                    break
                if cfg.time_budget and time.perf_counter() - run_start >= cfg.time_budget:
                    stopped = "time_budget"
                    break
                if stop.requested:
                    stopped = "interrupted"
                    break
                t0 = time.perf_counter()
                lr = lr_at(step, cfg.lr, cfg.warmup_steps, cfg.decay_steps, cfg.min_lr)
                batches = [data_mod.get_batch(corpus.train_ids, cfg.batch_size, cfg.seq_len, data_rng)
                           for _ in range(cfg.grad_accum)]
                loss, norm = train_step(model, optimizer, batches, lr, cfg.grad_clip)
                if not (math.isfinite(loss) and math.isfinite(norm)):
                    what = f"the loss is {loss}" if not math.isfinite(loss) else f"the gradient norm is {norm}"
                    where = (f"the last good checkpoint, {ckpt_path} (step {saved_step}), is kept"
                             if saved_step is not None else "no checkpoint had been written yet")
                    raise TrainingDiverged(
                        f"step {step + 1}: {what}; training stopped and {where}. Hint: a lower --lr "
                        f"(now {cfg.lr:g}), a longer --warmup-steps or --grad-clip 1.0 usually help; "
                        "--resume continues from the checkpoint with the new values")
                step += 1
                tokens += tokens_per_step
                dt = time.perf_counter() - t0
                train_time += dt
                step_time_ema = dt if step_time_ema is None else 0.9 * step_time_ema + 0.1 * dt
                recent_losses.append(loss)
                tok_s = tokens_per_step / step_time_ema
                metrics.write(kind="train", step=step, loss=loss, lr=lr, grad_norm=norm, tok_per_s=tok_s,
                              elapsed=round(time.perf_counter() - run_start, 3))
                eta = (cfg.max_steps - step) * step_time_ema
                if cfg.time_budget:
                    eta = min(eta, cfg.time_budget - (time.perf_counter() - run_start))
                line = (f"step {step}/{cfg.max_steps} | loss {loss:.4f} | lr {lr:.2e} | "
                        f"{tok_s:,.0f} tok/s | ETA {_fmt_time(max(eta, 0.0))}")
                if is_tty:
                    out.write("\r" + line + "\033[K")
                    out.flush()
                    live["pending"] = True
                elif step % cfg.log_interval == 0:
                    log(line)
            if stopped != "max_steps" and saved_step != step:
                log(f"stopping at step {step} ({'time budget reached' if stopped == 'time_budget' else 'Ctrl-C'})")
                evaluate(step)
                checkpoint(step)
    finally:
        metrics.close()
    if cfg.export:
        from .checkpoint import save
        save(model, cfg.export, format="meta")
    # the deterministic figure to quote: every validation token once, in windows of seq_len
    final_val = full_val_loss(model, corpus.val_ids, cfg.seq_len, cfg.batch_size)
    with open(metrics.path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"kind": "final", "step": step, "full_val_loss": final_val}) + "\n")
    elapsed = time.perf_counter() - run_start
    png = plot_metrics(metrics.path, out_dir / PLOT_NAME)
    shown_val = "?" if last_val is None else f"{last_val:.4f}"
    log(f"done: {step} steps, val loss {shown_val}, {_fmt_time(elapsed)} "
        f"({tokens_per_step * (step - start_step) / max(train_time, 1e-9):,.0f} tok/s while training)")
    log(f"  val loss over the whole validation split ({len(corpus.val_ids):,} tokens): {final_val:.4f}")
    log(f"  checkpoint  {ckpt_path}   (resume: add --resume; sample: npllama generate --model {ckpt_path})")
    if cfg.export:
        log(f"  model       {cfg.export}   (weights, config and tokenizer only: npllama generate --model {cfg.export})")
    log(f"  metrics     {metrics.path}")
    if png is not None:
        log(f"  loss curve  {png}")
    else:
        log(f"  loss curve  not drawn: matplotlib is not installed (pip install 'npllama[plot]' or "
            f"pip install matplotlib), then: python -m npllama.train plot {out_dir}")
    return TrainResult(step, last_val, ckpt_path if saved_step is not None else None, metrics.path, png,
                       stopped, elapsed, final_val, history)


def main(argv: list[str] | None = None) -> int:
    """python -m npllama.train plot RUN_DIR: (re)draw RUN_DIR/loss.png from RUN_DIR/metrics.jsonl."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] != "plot":
        print("usage: python -m npllama.train plot RUN_DIR", file=sys.stderr)
        return 2
    run = Path(argv[1])
    if not (run / METRICS_NAME).is_file():
        print(f"no {METRICS_NAME} in {run}; pass the --out-dir of a training run", file=sys.stderr)
        return 1
    png = plot_metrics(run / METRICS_NAME, run / PLOT_NAME)
    if png is None:
        print("matplotlib is not installed: pip install matplotlib", file=sys.stderr)
        return 1
    print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
