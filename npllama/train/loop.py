"""The training loop behind `npllama train`, in named steps: start or resume, plan, loop, finish.

One optimizer step (`train_step`), with A = grad_accum micro-batches of B windows of T tokens:

    grads = (1/A) * sum over micro-batches of d(mean cross-entropy)/d(params)
    total = clip_grad_norm(grads, grad_clip)              # joint L2 norm, torch semantics
    lr    = lr_at(step, lr, warmup_steps, decay_steps, min_lr)
    AdamW step with that lr                               # decoupled decay on matrices only

Every eval_interval steps the loop estimates the validation loss on eval_batches fixed
windows (the same windows every time, so the curve is comparable), prints a short sample,
and writes the training checkpoint (train/checkpoint.py) atomically. A metrics log
(metrics.jsonl) gets one line per step and per eval; at the end the loss curve is printed as
text (train/chart.py) and drawn as loss.png when matplotlib is installed (train/metrics.py).

Randomness: the model's init uses `seed`; the training batches come from one
np.random.Generator seeded from (seed, 1) whose state is saved in the checkpoint, so
`--resume` draws exactly the batches the uninterrupted run would have drawn; evals and
samples use their own generators and never disturb it. N steps + resume + N steps gives
the same parameters, bit for bit, as 2N steps straight.

Over MPI (`mpiexec -n N npllama train`, train/distributed.py) every rank runs this loop on the
same batches and computes its rows of each; one Allreduce a step sums the weighted gradients, a
few small collectives decide together what each rank's clock or Ctrl-C says (stop now?), and
rank 0 alone holds the lock, prints, and writes the checkpoint, metrics and chart.

Faults (docs/faults.md): the run holds OUT_DIR's lock (train/lock.py) from
start to end and removes the temporary files a killed run left there; it refuses, before
allocating, a model and batch that cannot fit in memory (npllama.memory), and settings whose
steps or evaluations could not end within a day (npllama.work); it stops at the
first sign of divergence (train/divergence.py) with the last healthy checkpoint kept; a write
that fails (disk full, read-only) stops it with the last checkpoint intact; SIGINT (Ctrl-C),
SIGTERM or SIGHUP stop it at the next step boundary with a checkpoint, a second one at once
(npllama/interrupts.py StopRequest, which the loop polls); and when its output goes away
(`npllama train | head`) it stops and saves as on Ctrl-C.
"""

from __future__ import annotations

import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np

from .. import memory, work
from ..config import LlamaConfig
from ..engine import freed_memory_kept
from ..engine.layout import release_gradient_arrays
from ..errors import NpllamaError, describe_os_error
from ..interrupts import StopRequest
from ..io import save
from ..io.atomic import stale_temp_files
from ..llama import Llama, backend_named, pass_footprint
from ..ops import cross_entropy_forward
from ..optim import AdamW, clip_grad_norm, lr_at
from .chart import loss_chart
from .checkpoint import (CHECKPOINT_NAME, load_model_config, load_train_checkpoint, rng_from_state, rng_state,
                         save_train_checkpoint)
from .config import TrainConfig, check_resume, export_format
from .data import Corpus, get_batch, prepare_data
from .distributed import ALONE, CHECK_INTERVAL, World, allreduce_gradients, row_bounds
from .divergence import DivergenceWatch
from .finetune import describe_init, init_architecture, init_model
from .lock import RunLock
from .metrics import METRICS_NAME, PLOT_NAME, MetricsLog, format_duration, plot_metrics, read_metrics
from .run_files import check_run_files


# ---- the pieces of a step and of an evaluation -------------------------------------------------------

def train_step(model: Llama, optimizer: AdamW, batches, lr: float, grad_clip: float,
               world: World = ALONE) -> tuple[float, float]:
    """One optimizer step over the micro-batches [(x, y), ...]; returns (loss, grad_norm).

    batches: any iterable, drawn one at a time (a generator keeps one micro-batch in memory,
    however large --grad-accum is). The gradients of the micro-batches are averaged (each is
    already a mean over its B*T targets, so the average is the mean over all of them), clipped,
    and applied. When the loss or the gradient norm is not finite, nothing is updated and that
    value is returned: the caller decides to stop. Over several ranks (train/distributed.py) each computes its
    rows of every micro-batch, weighted by its share of the targets, and one Allreduce sums them.
    """
    try:
        return _accumulate_and_step(model, optimizer, batches, lr, grad_clip, world)
    finally:
        # A run keeps glibc's freed memory (freed_memory_kept), which its evaluations and checkpoints
        # reuse; gradient arrays kept for the next call would sit beside them (engine/layout.py).
        release_gradient_arrays(optimizer.params)              # the model's params


def _accumulate_and_step(model: Llama, optimizer: AdamW, batches, lr: float, grad_clip: float,
                         world: World) -> tuple[float, float]:
    total_loss, grads, n = 0.0, None, 0
    for x, y in batches:
        x, y, share = world.shard(x, y)
        loss, g = model.loss_and_grads(x, y)
        if share != 1.0:
            loss *= share
            for gi in g.values():
                gi *= share
        total_loss += loss
        n += 1
        if grads is None:
            grads = g
        else:
            for name, gi in g.items():
                grads[name] += gi
    if n > 1:
        for gi in grads.values():
            gi *= 1.0 / n
    loss, = world.sums(total_loss / n)
    if not math.isfinite(loss):
        return loss, math.nan
    if world.size > 1:
        grads = allreduce_gradients(world, grads, model.config)
    norm = clip_grad_norm(grads, grad_clip if grad_clip > 0 else math.inf)
    if not math.isfinite(norm):
        return loss, norm
    optimizer.step(grads, lr=lr)
    return loss, norm


def estimate_loss(model: Llama, ids: np.ndarray, batch_size: int, seq_len: int, n_batches: int,
                  seed: int, world: World = ALONE) -> float:
    """Mean cross-entropy over n_batches random windows drawn with a fresh Generator(seed).

    The same seed gives the same windows, so successive estimates differ only by the model.
    Over several ranks each computes its rows of every batch, weighted as in train_step.
    """
    rng = np.random.default_rng(seed)
    total = 0.0
    for _ in range(n_batches):
        x, y, share = world.shard(*get_batch(ids, batch_size, seq_len, rng))
        total += cross_entropy_forward(model.forward(x), y)[0] * share
    total, = world.sums(float(total))
    return total / n_batches


def full_val_loss(model: Llama, ids: np.ndarray, seq_len: int, batch_size: int, world: World = ALONE) -> float:
    """Mean cross-entropy over the whole of ids, cut into consecutive windows of seq_len.

    Window j predicts ids[j*T + 1 : (j + 1)*T + 1] from ids[j*T : (j + 1)*T]; a last window
    too short for T tokens and its target is left out. Deterministic: the figure docs/training.md
    and weights/README.md quote. Over several ranks each takes a contiguous range of the windows.
    """
    n_windows = (len(ids) - 1) // seq_len
    if n_windows < 1:
        raise NpllamaError(f"{len(ids)} tokens hold no full window of seq_len={seq_len}")
    x_all = ids[:n_windows * seq_len].reshape(n_windows, seq_len)
    y_all = ids[1:n_windows * seq_len + 1].reshape(n_windows, seq_len)
    total = 0.0
    first, end = row_bounds(n_windows, world.rank, world.size)
    for start in range(first, end, batch_size):
        x, y = x_all[start:min(start + batch_size, end)], y_all[start:min(start + batch_size, end)]
        total += cross_entropy_forward(model.forward(x), y)[0] * len(x)
    total, = world.sums(total)
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



def parameter_norm(params: dict) -> float:
    """The L2 norm of all parameters together (inf when it overflows: a blown-up model)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return math.sqrt(sum(float(np.vdot(p, p)) for p in params.values()))


# ---- the run --------------------------------------------------------------------------------------

class TrainingDiverged(NpllamaError):
    """The loss or the gradient norm stopped being finite, or a loss rose far above its best."""


class RunWriteError(NpllamaError):
    """A checkpoint or metrics.jsonl could not be written (disk full, read-only, permission denied)."""


@dataclass
class TrainResult:
    steps: int                      # optimizer steps completed in total
    val_loss: float | None          # last validation estimate
    checkpoint: Path | None         # the last checkpoint written
    metrics: Path
    plot: Path | None
    stopped: str                    # "max_steps", "time_budget", "interrupted", "output_closed"
    elapsed: float                  # seconds of this run
    full_val_loss: float            # over every validation token (full_val_loss)
    history: list = field(default_factory=list)   # (step, val_loss) of every eval
    signal: int | None = None       # stopped "interrupted": the signal (SIGINT, SIGTERM or SIGHUP)


class Console:
    """Where a run reports: log lines, and on a terminal one live progress line rewritten in place.

    When the reader goes away (`npllama train | head`), `closed` becomes True, later output is
    dropped, and the loop stops and saves as on Ctrl-C.
    """

    def __init__(self, out: TextIO | None):
        self.out = out                  # None: say nothing (a rank other than 0)
        self.is_tty = hasattr(out, "isatty") and out.isatty()
        self._live = False
        self.closed = False

    def _write(self, text: str) -> None:
        if self.closed or self.out is None:
            return
        try:
            self.out.write(text)
            self.out.flush()
        except BrokenPipeError:
            self.closed = True
            try:    # point the descriptor at /dev/null, so the buffered rest fails nowhere at exit
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, self.out.fileno())
                os.close(devnull)
            except (AttributeError, OSError, ValueError):
                pass

    def log(self, msg: str = "") -> None:
        if self._live:
            self._write("\n")
            self._live = False
        self._write(msg + "\n")

    def progress(self, line: str, step: int, log_interval: int) -> None:
        if self.is_tty:
            self._write("\r" + line + "\033[K")
            self._live = True
        elif step % log_interval == 0:
            self.log(line)


@dataclass
class Run:
    """Everything a run advances and checkpoints, whether it started now or was resumed."""
    cfg: TrainConfig
    model: Llama
    optimizer: AdamW
    corpus: Corpus
    data_rng: np.random.Generator   # draws the training batches; its state is checkpointed
    start_step: int                 # the step this process started from
    elapsed_before: float = 0.0     # seconds spent by earlier processes of the run
    tokens: int = 0                 # training tokens seen, all processes
    val_loss: float | None = None   # the last validation estimate
    history: list = field(default_factory=list)   # (step, val_loss) of every eval
    saved_step: int | None = None   # the step of the last checkpoint written
    best_loss: float | None = None  # the divergence watch's best smoothed training loss
    world: World = ALONE            # the ranks sharing each batch (train/distributed.py)

    @property
    def ckpt_path(self) -> Path:
        return Path(self.cfg.out_dir) / CHECKPOINT_NAME

    def new_optimizer(self) -> AdamW:
        """The model's backend's AdamW (the engine's runs optim.AdamW's update, bit for bit, faster)."""
        cfg = self.cfg
        return self.model.optimizer(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)


def require_memory(cfg: TrainConfig, model_config: LlamaConfig, world: World = ALONE) -> None:
    """Refuse, before allocating, a run whose model, optimizer and batch cannot fit (npllama.memory).

    A LoRA run's base is loaded by then, and its optimizer holds the adapters' moments only: what
    is still to come is a pass over the batch (with the frozen stacks), not a model and its moments.
    Over several ranks each passes over its rows only, and the ranks on this host all need memory."""
    batch = -(-cfg.batch_size // world.size)
    rows, shards = pass_footprint(backend_named(cfg.backend), batch, cfg.seq_len, model_config.dim)
    itemsize = np.dtype(cfg.dtype).itemsize
    if cfg.lora_rank:
        needed = memory.pass_bytes(model_config, batch, rows, cfg.seq_len, itemsize)
    else:
        needed = memory.training_bytes(model_config, batch, rows, cfg.seq_len, itemsize, shards)
    memory.require(needed * world.ranks_here,
                   f"training {model_config.n_params():,} parameters ({cfg.dtype}) on batches of "
                   f"{cfg.batch_size} x {cfg.seq_len} tokens"
                   f"{f' in {world.ranks_here} processes' if world.ranks_here > 1 else ''}",
                   "choose a smaller --dim, --n-layers, --vocab-size, --batch-size or --seq-len"
                   f"{' (or fewer ranks on this machine)' if world.ranks_here > 1 else ''}")


# One optimizer step (--grad-accum micro-batches) or one evaluation (--eval-batches forwards) that
# cannot end within a day even at work.CEILING_FLOPS is a typo, not a run: refused before it starts.
MAX_STEP_SECONDS = 86400.0


def require_time(cfg: TrainConfig, model_config: LlamaConfig) -> None:
    """Refuse settings whose every step or evaluation would take longer than MAX_STEP_SECONDS at
    the least (npllama.work); micro-batches are drawn one at a time, so their count costs time,
    not memory."""
    B, T = cfg.batch_size, cfg.seq_len
    step = work.minimum_seconds(cfg.grad_accum * work.pass_flops(model_config, B, T, backward=True))
    work.require_time(step, MAX_STEP_SECONDS, f"one optimizer step of {cfg.grad_accum:,} micro-batches "
                      f"(--grad-accum) of {B} x {T} tokens", "lower --grad-accum", lower_bound=True)
    evaluation = work.minimum_seconds(cfg.eval_batches * work.pass_flops(model_config, B, T))
    work.require_time(evaluation, MAX_STEP_SECONDS, f"one evaluation of {cfg.eval_batches:,} batches "
                      f"(--eval-batches) of {B} x {T} tokens", "lower --eval-batches", lower_bound=True)


def new_run(cfg: TrainConfig, log, explicit=(), world: World = ALONE) -> Run:
    """A fresh model of the config's shape (or the --init model: train/finetune.py), on the text's
    tokens, with the batch generator at (seed, 1). explicit: the fields the user set (init_model)."""
    ckpt_path = Path(cfg.out_dir) / CHECKPOINT_NAME
    if ckpt_path.exists():
        raise NpllamaError(f"{ckpt_path} already exists; add --resume to continue that run, or choose another "
                           "--out-dir (or delete the folder) to start a new one")
    if cfg.init:
        model, cfg = init_model(cfg, explicit)
        require_memory(cfg, model.config, world)
        require_time(cfg, model.config)
        corpus = prepare_data(cfg, tokenizer=model.tokenizer, log=log)
    else:
        require_memory(cfg, cfg.model_config(max(1, cfg.vocab_size)), world)   # before the data: a bound from below
        require_time(cfg, cfg.model_config(max(1, cfg.vocab_size)))
        corpus = prepare_data(cfg, log=log)
        require_memory(cfg, cfg.model_config(corpus.tokenizer.vocab_size), world)
        model = Llama(cfg.model_config(corpus.tokenizer.vocab_size), seed=cfg.seed, dtype=np.dtype(cfg.dtype),
                      backend=cfg.backend)
        model.tokenizer = corpus.tokenizer
    run = Run(cfg, model, None, corpus, np.random.default_rng([cfg.seed, 1]), start_step=0, world=world)
    run.optimizer = run.new_optimizer()
    return run


def resume_run(cfg: TrainConfig, log, explicit=(), world: World = ALONE) -> Run:
    """The run saved in OUT_DIR/ckpt.safetensors, exactly where it stopped, with cfg's non-structural values."""
    ckpt_path = Path(cfg.out_dir) / CHECKPOINT_NAME
    require_memory(cfg, load_model_config(ckpt_path), world)
    require_time(cfg, load_model_config(ckpt_path))
    ck = load_train_checkpoint(ckpt_path, backend=cfg.backend)
    saved = TrainConfig.from_dict(ck.state["train_config"])
    cfg = init_architecture(saved, cfg, explicit)
    check_resume(saved, cfg, ckpt_path)
    model = ck.model
    if model.dtype != np.dtype(cfg.dtype):
        raise NpllamaError(f"{ckpt_path} holds {model.dtype} parameters but --dtype is {cfg.dtype}")
    corpus = prepare_data(cfg, tokenizer=ck.tokenizer, log=log)
    if corpus.text_sha256 != ck.state.get("text_sha256"):
        raise NpllamaError(f"the training text {corpus.text_path} is not the one {ckpt_path} was trained on "
                           "(sha256 differs); resume with the same --data")
    step = int(ck.state["step"])
    run = Run(cfg, model, None, corpus, rng_from_state(ck.state["rng"]), start_step=step,
              elapsed_before=float(ck.state.get("elapsed", 0.0)), tokens=int(ck.state.get("tokens", 0)),
              val_loss=ck.state.get("val_loss"), history=[tuple(h) for h in ck.state.get("history", [])],
              saved_step=step, best_loss=ck.state.get("best_loss"), world=world)
    run.optimizer = run.new_optimizer()
    run.optimizer.load_state_dict(ck.optimizer_state)
    # hyper-parameters given now win over the saved ones (the same values when nothing changed)
    run.optimizer.lr, run.optimizer.beta1, run.optimizer.beta2 = cfg.lr, cfg.beta1, cfg.beta2
    run.optimizer.eps, run.optimizer.weight_decay = cfg.eps, cfg.weight_decay
    if step >= (cfg.max_steps or math.inf):
        log(f"{ckpt_path} is already at step {step} >= --max-steps {cfg.max_steps}; "
            "raise --max-steps to train further")
    return run


def calibrate_steps(run: Run, budget_left: float, log) -> int:
    """How many steps fit in budget_left seconds, eval and sample time included.

    Times two gradient computations of one micro-batch (after one warm-up) and one forward
    without touching the parameters, so the run itself is unaffected. Over several ranks, on this
    rank's rows; rank 0's count is the one every rank takes.
    """
    cfg, model = run.cfg, run.model
    rng = np.random.default_rng([cfg.seed, 9])
    x, y, _ = run.world.shard(*get_batch(run.corpus.train_ids, cfg.batch_size, cfg.seq_len, rng))
    model.loss_and_grads(x, y)
    t0 = time.perf_counter()
    for _ in range(2):
        model.loss_and_grads(x, y)
    # grad_accum micro-batches a step, + clipping and the AdamW update
    step_time = (time.perf_counter() - t0) / 2 * cfg.grad_accum * 1.03
    t0 = time.perf_counter()
    model.forward(x)
    eval_time = (time.perf_counter() - t0) * cfg.eval_batches + (0.002 * cfg.sample_tokens)
    per_step = step_time + eval_time / cfg.eval_interval
    steps = run.world.broadcast_int(max(1, int(budget_left / per_step)))
    log(f"time budget {format_duration(budget_left)}: {step_time:.3f}s a step, so about {steps} steps; "
        "the cosine decays over them")
    return steps


def plan(run: Run, run_start: float, log) -> None:
    """Settle the schedule: the steps a time budget allows, and where the cosine ends."""
    cfg = run.cfg
    if cfg.max_steps == 0:
        budget_left = cfg.time_budget - (time.perf_counter() - run_start)
        cfg = cfg.replace(max_steps=run.start_step + calibrate_steps(run, budget_left, log))
    if cfg.decay_steps == 0:
        cfg = cfg.replace(decay_steps=cfg.max_steps)
    run.cfg = cfg


def log_header(run: Run, preset_name: str | None, log) -> None:
    """The resolved settings, printed once at the start (llm.c's [GPT-2] header)."""
    cfg, mcfg, corpus = run.cfg, run.model.config, run.corpus
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum
    log(f"npllama train{f' --preset {preset_name}' if preset_name else ''}"
        f"{f' --resume from step {run.start_step}' if cfg.resume else ''}")
    log(f"  data       {corpus.text_path}: train {len(corpus.train_ids):,} / val {len(corpus.val_ids):,} tokens")
    tokenizer = f"from {cfg.init_tokenizer or cfg.init}" if cfg.init else cfg.tokenizer
    log(f"  tokenizer  {tokenizer}, vocab {mcfg.vocab_size}")
    log(f"  model      dim {mcfg.dim}, {mcfg.n_layers} layers, {mcfg.n_heads} heads ({mcfg.n_kv_heads} kv), hidden "
        f"{mcfg.hidden_dim}, seq {cfg.seq_len} (max {mcfg.max_seq_len}): {mcfg.n_params():,} params, {cfg.dtype}")
    if cfg.init:
        log(f"  init       {describe_init(run.model, cfg)}")
    log(f"  optimizer  AdamW lr {cfg.lr:g} -> {cfg.min_lr:g} (warm-up {cfg.warmup_steps}, cosine to step "
        f"{cfg.decay_steps}), betas ({cfg.beta1}, {cfg.beta2}), weight decay {cfg.weight_decay}, clip {cfg.grad_clip}")
    log(f"  batch      {cfg.batch_size} x {cfg.seq_len} tokens x {cfg.grad_accum} accum = "
        f"{tokens_per_step:,} tokens a step{', gradient checkpointing' if cfg.gradient_checkpointing else ''}")
    if run.world.size > 1:
        shares = " + ".join(str(hi - lo) for lo, hi in (row_bounds(cfg.batch_size, r, run.world.size)
                                                        for r in range(run.world.size)))
        log(f"  ranks      {run.world.describe()}; rows {shares} of every batch")
    log(f"  run        steps {run.start_step} -> {cfg.max_steps}"
        f"{f', time budget {format_duration(cfg.time_budget)}' if cfg.time_budget else ''}, eval every "
        f"{cfg.eval_interval} ({cfg.eval_batches} batches), seed {cfg.seed}, out {cfg.out_dir}/")
    if cfg.warmup_steps >= cfg.decay_steps:
        log(f"  note: --warmup-steps {cfg.warmup_steps} >= the {cfg.decay_steps}-step schedule; the lr never "
            "reaches its peak or decays (lower --warmup-steps for short runs)")


class Loop:
    """The steps of a run between two evaluations, and the evaluations and checkpoints themselves."""

    def __init__(self, run: Run, console: Console, metrics: MetricsLog | None, run_start: float):
        self.run, self.console, self.metrics, self.run_start = run, console, metrics, run_start
        self.recent_losses: list[float] = []
        self.step_time_ema = None
        self.train_time = 0.0
        cfg = run.cfg
        self.watch = DivergenceWatch(run.model.config.vocab_size, cfg.batch_size * cfg.seq_len * cfg.grad_accum,
                                     run.best_loss, min((v for _, v in run.history), default=None))
        self.param_norm = parameter_norm(run.model.params)
        self.signal = None              # the stop signal that ended the run, if one did

    def _kept(self) -> str:
        run = self.run
        return (f"the last good checkpoint, {run.ckpt_path} (step {run.saved_step}), is kept"
                if run.saved_step is not None else "no checkpoint had been written yet")

    def diverged(self, step: int, what: str) -> TrainingDiverged:
        return TrainingDiverged(
            f"step {step}: {what}; training stopped and {self._kept()}. Hint: a lower --lr "
            f"(now {self.run.cfg.lr:g}), a longer --warmup-steps or --grad-clip 1.0 usually help; "
            "--resume continues from the checkpoint with the new values")

    def write_failed(self, step: int, error: OSError) -> RunWriteError:
        return RunWriteError(f"step {step}: {describe_os_error(error)}; training stopped and {self._kept()} "
                             "(resume with --resume once the cause is fixed)")

    def log_metrics(self, **record) -> None:
        if self.metrics is None:        # not rank 0
            return
        try:
            self.metrics.write(**record)
        except OSError as e:
            raise self.write_failed(record["step"], e) from e

    def checkpoint(self, step: int) -> None:
        run = self.run
        if not all(np.isfinite(p).all() for p in run.model.params.values()):
            raise self.diverged(step, "the parameters hold NaN or infinite values")
        run.world.check_same(run.model.params, f"step {step}: the parameters")
        if run.world.rank != 0:         # rank 0 alone writes
            run.saved_step = step
            return
        state = {"step": step, "rng": rng_state(run.data_rng), "train_config": run.cfg.to_dict(),
                 "elapsed": run.elapsed_before + (time.perf_counter() - self.run_start), "tokens": run.tokens,
                 "val_loss": run.val_loss, "history": run.history, "text_sha256": run.corpus.text_sha256,
                 "best_loss": self.watch.best}
        try:
            save_train_checkpoint(run.ckpt_path, run.model, run.model.tokenizer, run.optimizer, state)
        except OSError as e:
            raise self.write_failed(step, e) from e
        run.saved_step = step

    def evaluate(self, step: int) -> None:
        run, cfg, log = self.run, self.run.cfg, self.console.log
        t0 = time.perf_counter()
        run.val_loss = estimate_loss(run.model, run.corpus.val_ids, cfg.batch_size, cfg.seq_len, cfg.eval_batches,
                                     [cfg.seed, 2], run.world)
        recent = [r for r in self.recent_losses if math.isfinite(r)]
        train_loss = float(np.mean(recent)) if recent else None
        self.log_metrics(kind="eval", step=step, val_loss=run.val_loss, train_loss=train_loss)
        shown = f", train loss {train_loss:.4f} (mean of the last {len(recent)} steps)" if recent else ""
        log(f"step {step}: val loss {run.val_loss:.4f}{shown}  [{time.perf_counter() - t0:.1f}s]")
        broken = self.watch.val_loss(run.val_loss)
        if broken:
            raise self.diverged(step, broken)
        run.history.append((step, run.val_loss))
        self.recent_losses.clear()
        if cfg.sample_tokens and run.world.rank == 0:
            text = sample_text(run.model, run.model.tokenizer, cfg.sample_tokens, seed=cfg.seed + step)
            log("  | " + text.replace("\n", "\n  | "))

    def train_one_step(self, step: int) -> None:
        """Step `step` -> step + 1: draw the batches, update the model, log; raise on divergence."""
        run, cfg = self.run, self.run.cfg
        t0 = time.perf_counter()
        lr = lr_at(step, cfg.lr, cfg.warmup_steps, cfg.decay_steps, cfg.min_lr)
        batches = (get_batch(run.corpus.train_ids, cfg.batch_size, cfg.seq_len, run.data_rng)
                   for _ in range(cfg.grad_accum))         # drawn one at a time, as the step uses them
        loss, norm = train_step(run.model, run.optimizer, batches, lr, cfg.grad_clip, run.world)
        broken = f"the gradient norm is {norm}" if not math.isfinite(norm) and math.isfinite(loss) else None
        before, self.param_norm = self.param_norm, parameter_norm(run.model.params)
        broken = broken or self.watch.train_loss(step + 1, loss) or self.watch.param_norm(before, self.param_norm)
        if broken:
            raise self.diverged(step + 1, broken)
        if (step + 1) % CHECK_INTERVAL == 0:
            run.world.check_same(run.model.params, f"step {step + 1}: the parameters")
        tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum
        run.tokens += tokens_per_step
        dt = time.perf_counter() - t0
        self.train_time += dt
        self.step_time_ema = dt if self.step_time_ema is None else 0.9 * self.step_time_ema + 0.1 * dt
        self.recent_losses.append(loss)
        tok_s = tokens_per_step / self.step_time_ema
        elapsed = time.perf_counter() - self.run_start
        self.log_metrics(kind="train", step=step + 1, loss=loss, lr=lr, grad_norm=norm, tok_per_s=tok_s,
                           elapsed=round(elapsed, 3))
        eta = (cfg.max_steps - step - 1) * self.step_time_ema
        if cfg.time_budget:
            eta = min(eta, cfg.time_budget - elapsed)
        self.console.progress(f"step {step + 1}/{cfg.max_steps} | loss {loss:.4f} | lr {lr:.2e} | "
                              f"{tok_s:,.0f} tok/s | ETA {format_duration(max(eta, 0.0))}", step + 1, cfg.log_interval)

    def run_until_done(self, stop: StopRequest | None = None) -> tuple[int, str]:
        """Train until max_steps, the time budget or a stop signal; evaluate and checkpoint on the way.

        Returns the step reached and why it stopped ("max_steps", "time_budget", "interrupted": a
        SIGINT, SIGTERM or SIGHUP, then in self.signal; "output_closed": the reader of the console
        went away). stop: what the loop polls between steps (default: a StopRequest of this
        process's signals). The first signal ends the run at the next step boundary, after an
        evaluation and a checkpoint; a second raises KeyboardInterrupt at once, its message saying
        which checkpoint is kept (an atomic write it interrupts leaves no partial file).
        """
        with stop or StopRequest() as stop:
            try:
                step, stopped = self._train(stop)
            except KeyboardInterrupt as e:
                if not stop.requested:
                    raise
                raise KeyboardInterrupt(*(e.args or (stop.signal,))[:1],
                                        f"a second signal stopped training at once; {self._kept()}") from None
        self.signal = stop.signal
        return step, stopped

    def _train(self, stop: StopRequest) -> tuple[int, str]:
        run, cfg = self.run, self.run.cfg
        step, stopped = run.start_step, "max_steps"
        while True:
            if step % cfg.eval_interval == 0 or step >= cfg.max_steps:
                if not (cfg.resume and step == run.start_step):      # the checkpoint already holds this
                    self.evaluate(step)
                    if step > run.start_step:
                        self.checkpoint(step)
            if step >= cfg.max_steps:
                break
            # decided together: the ranks' clocks and stop signals differ (one process: as they are)
            over_budget, interrupted, closed = run.world.any_of(
                cfg.time_budget and time.perf_counter() - self.run_start >= cfg.time_budget,
                stop.poll(), self.console.closed)
            if over_budget:
                stopped = "time_budget"
                break
            if interrupted or closed:
                stopped = "interrupted" if interrupted else "output_closed"
                break
            self.train_one_step(step)
            step += 1
        if stopped != "max_steps" and run.saved_step != step:
            why = {"time_budget": "time budget reached", "output_closed": "output closed"}.get(
                stopped, stop.signal.name if stop.signal else "a stop signal on another rank")
            self.console.log(f"stopping at step {step} ({why})")
            self.evaluate(step)
            self.checkpoint(step)
        return step, stopped


def finish(run: Run, loop: Loop, step: int, stopped: str, log) -> TrainResult:
    """Export, the full validation loss, the loss curve, and the closing summary."""
    cfg, out_dir = run.cfg, Path(run.cfg.out_dir)
    # the deterministic figure to quote: every validation token once, in windows of seq_len
    final_val = full_val_loss(run.model, run.corpus.val_ids, cfg.seq_len, cfg.batch_size, run.world)
    run.world.close()                   # the last collective: the rest is rank 0's alone
    elapsed = time.perf_counter() - loop.run_start
    if run.world.rank != 0:
        return TrainResult(step, run.val_loss, run.ckpt_path if run.saved_step is not None else None,
                           out_dir / METRICS_NAME, None, stopped, elapsed, final_val, run.history)
    if cfg.export:
        save(run.model, cfg.export, format=export_format(cfg.export))     # LoRA: merged
    loop.log_metrics(kind="final", step=step, full_val_loss=final_val)
    try:
        png = plot_metrics(loop.metrics.path, out_dir / PLOT_NAME)
    except OSError as e:            # the run is saved; a picture that cannot be written is no failure
        png, unwritten = None, describe_os_error(e)
    else:
        unwritten = None
    log(loss_chart(*read_metrics(loop.metrics.path)))
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum
    shown_val = "?" if run.val_loss is None else f"{run.val_loss:.4f}"
    log(f"done: {step} steps, val loss {shown_val}, {format_duration(elapsed)} "
        f"({tokens_per_step * (step - run.start_step) / max(loop.train_time, 1e-9):,.0f} tok/s while training)")
    log(f"  val loss over the whole validation split ({len(run.corpus.val_ids):,} tokens): {final_val:.4f}")
    log(f"  checkpoint  {run.ckpt_path}   (resume: add --resume; sample: npllama generate --model {run.ckpt_path})")
    if cfg.export:
        log(f"  model       {cfg.export}   (weights, config and tokenizer only: npllama generate --model {cfg.export})")
    log(f"  metrics     {loop.metrics.path}")
    if png is not None:
        log(f"  loss curve  {png}")
    elif unwritten:
        log(f"  loss curve  not written: {unwritten}")
    else:
        log(f"  loss curve  the chart above; {PLOT_NAME} not drawn: matplotlib is not installed "
            f"(pip install matplotlib), then: npllama plot {out_dir}")
    return TrainResult(step, run.val_loss, run.ckpt_path if run.saved_step is not None else None, loop.metrics.path,
                       png, stopped, elapsed, final_val, run.history, loop.signal)


def train(cfg: TrainConfig, out: TextIO | None = None, preset_name: str | None = None,
          explicit=(), world: World = ALONE) -> TrainResult:
    """Run (or resume) training as cfg says; returns what happened. See the module docstring.

    explicit: the fields the user set (npllama train's flags): with --init, those that fix the
    architecture must agree with the checkpoint (train/finetune.py); the others follow it.
    world: the ranks of an `mpiexec` run (train/distributed.py connect()), which share every
    batch; rank 0 alone holds the lock, prints and writes files. RanksDisagree when the ranks
    were given different settings.
    Raises NpllamaError (a ValueError) for unusable settings (OutputPathError for a file of the run
    that would overwrite one of its inputs or go through a symbolic link), MemoryLimitError for a run that
    cannot fit, RunLockedError when another run holds the --out-dir, FileNotFoundError for
    missing data or checkpoint, TrainingDiverged when the loss stops being finite or rises far
    above its best, RunWriteError when a file cannot be written (the last checkpoint is kept
    in both), and an OSError naming the path when the --out-dir cannot be made or read.
    """
    console = Console((out or sys.stdout) if world.rank == 0 else None)
    world.check_same_config({"config": cfg.to_dict(), "explicit": sorted(explicit), "preset": preset_name})
    try:
        cfg.validate()
        check_run_files(cfg)        # before anything is made or read: no output over an input (run_files.py)
        if cfg.batch_size < world.size:
            raise NpllamaError(f"--batch-size {cfg.batch_size} cannot be shared by {world.size} ranks, which need "
                               f"a window of every batch each; use --batch-size {world.size} or more, or fewer ranks")
    except NpllamaError as error:
        world.raise_together(error)
    else:
        world.raise_together(None)
    run_start = time.perf_counter()
    with world.share_cores(), RunLock(cfg.out_dir) if world.rank == 0 else nullcontext() as lock:
        if lock is not None:
            if lock.stale_note():
                console.log(lock.stale_note())
            remove_stale_temp_files(Path(cfg.out_dir), console.log)
        run = (resume_run(cfg, console.log, explicit, world) if cfg.resume
               else new_run(cfg, console.log, explicit, world))
        world.check_same({**run.model.params, "tokens": run.corpus.train_ids}, f"at step {run.start_step}: the "
                         "parameters or the training tokens")
        run.model.gradient_checkpointing = cfg.gradient_checkpointing
        plan(run, run_start, console.log)
        log_header(run, preset_name, console.log)
        metrics = MetricsLog(Path(cfg.out_dir) / METRICS_NAME, run.start_step if cfg.resume else None) \
            if world.rank == 0 else None
        try:
            loop = Loop(run, console, metrics, run_start)
            # the run's steps reuse the memory the last one freed (engine/settings.py), restored after
            with freed_memory_kept():
                step, stopped = loop.run_until_done()
            return finish(run, loop, step, stopped, console.log)
        finally:
            if metrics is not None:
                metrics.close()


def remove_stale_temp_files(out_dir: Path, log) -> None:
    """Delete the temporary files a killed run left in out_dir (only ever called under its lock)."""
    stale = [p for name in (CHECKPOINT_NAME, METRICS_NAME) for p in stale_temp_files(out_dir / name)]
    if stale:
        size = sum(p.stat().st_size for p in stale)
        for p in stale:
            p.unlink()
        log(f"removed {len(stale)} temporary file(s) ({size / 1e6:.1f} MB) left by a run killed while writing")
