"""The training loop behind `npllama train`, in named steps: start or resume, plan, loop, finish.

One optimizer step (`train_step`), with A = grad_accum micro-batches of B windows of T tokens:

    grads = (1/A) * sum over micro-batches of d(mean cross-entropy)/d(params)
    total = clip_grad_norm(grads, grad_clip)              # joint L2 norm, torch semantics
    lr    = lr_at(step, lr, warmup_steps, decay_steps, min_lr)
    AdamW step with that lr                               # decoupled decay on matrices only

Every eval_interval steps the loop estimates the validation loss on eval_batches fixed
windows (the same windows every time, so the curve is comparable), prints a short sample,
and writes the training checkpoint (train/checkpoint.py) atomically. A metrics log
(metrics.jsonl) gets one line per step and per eval; at the end a loss curve (loss.png)
is drawn when matplotlib is installed (train/metrics.py).

Randomness: the model's init uses `seed`; the training batches come from one
np.random.Generator seeded from (seed, 1) whose state is saved in the checkpoint, so
`--resume` draws exactly the batches the uninterrupted run would have drawn; evals and
samples use their own generators and never disturb it. N steps + resume + N steps gives
the same parameters, bit for bit, as 2N steps straight.
"""

from __future__ import annotations

import json
import math
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np

from ..engine import FusedAdamW
from ..io import save
from ..llama import Llama
from ..ops import cross_entropy_forward
from ..optim import AdamW, clip_grad_norm, lr_at
from .checkpoint import CHECKPOINT_NAME, load_train_checkpoint, rng_from_state, rng_state, save_train_checkpoint
from .config import TrainConfig, check_resume
from .data import Corpus, get_batch, prepare_data
from .metrics import METRICS_NAME, PLOT_NAME, MetricsLog, format_duration, plot_metrics


# ---- the pieces of a step and of an evaluation -------------------------------------------------------

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
        x, y = get_batch(ids, batch_size, seq_len, rng)
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



# ---- the run --------------------------------------------------------------------------------------

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


class Console:
    """Where a run reports: log lines, and on a terminal one live progress line rewritten in place."""

    def __init__(self, out: TextIO):
        self.out = out
        self.is_tty = hasattr(out, "isatty") and out.isatty()
        self._live = False

    def log(self, msg: str = "") -> None:
        if self._live:
            self.out.write("\n")
            self._live = False
        self.out.write(msg + "\n")
        self.out.flush()

    def progress(self, line: str, step: int, log_interval: int) -> None:
        if self.is_tty:
            self.out.write("\r" + line + "\033[K")
            self.out.flush()
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

    @property
    def ckpt_path(self) -> Path:
        return Path(self.cfg.out_dir) / CHECKPOINT_NAME

    def new_optimizer(self) -> AdamW:
        cfg = self.cfg
        return FusedAdamW(self.model.params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                          weight_decay=cfg.weight_decay)


def new_run(cfg: TrainConfig, log) -> Run:
    """A fresh model of the config's shape, on the text's tokens, with the batch generator at (seed, 1)."""
    ckpt_path = Path(cfg.out_dir) / CHECKPOINT_NAME
    if ckpt_path.exists():
        raise ValueError(f"{ckpt_path} already exists; add --resume to continue that run, or choose another "
                         "--out-dir (or delete the folder) to start a new one")
    corpus = prepare_data(cfg, log=log)
    model = Llama(cfg.model_config(corpus.tokenizer.vocab_size), seed=cfg.seed, dtype=np.dtype(cfg.dtype))
    model.tokenizer = corpus.tokenizer
    run = Run(cfg, model, None, corpus, np.random.default_rng([cfg.seed, 1]), start_step=0)
    run.optimizer = run.new_optimizer()
    return run


def resume_run(cfg: TrainConfig, log) -> Run:
    """The run saved in OUT_DIR/ckpt.safetensors, exactly where it stopped, with cfg's non-structural values."""
    ckpt_path = Path(cfg.out_dir) / CHECKPOINT_NAME
    ck = load_train_checkpoint(ckpt_path)
    check_resume(TrainConfig.from_dict(ck.state["train_config"]), cfg, ckpt_path)
    model = ck.model
    if model.dtype != np.dtype(cfg.dtype):
        raise ValueError(f"{ckpt_path} holds {model.dtype} parameters but --dtype is {cfg.dtype}")
    corpus = prepare_data(cfg, tokenizer=ck.tokenizer, log=log)
    if corpus.text_sha256 != ck.state.get("text_sha256"):
        raise ValueError(f"the training text {corpus.text_path} is not the one {ckpt_path} was trained on "
                         "(sha256 differs); resume with the same --data")
    step = int(ck.state["step"])
    run = Run(cfg, model, None, corpus, rng_from_state(ck.state["rng"]), start_step=step,
              elapsed_before=float(ck.state.get("elapsed", 0.0)), tokens=int(ck.state.get("tokens", 0)),
              val_loss=ck.state.get("val_loss"), history=[tuple(h) for h in ck.state.get("history", [])],
              saved_step=step)
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

    Times two gradient computations (after one warm-up) and one forward without touching
    the parameters, so the run itself is unaffected.
    """
    cfg, model = run.cfg, run.model
    rng = np.random.default_rng([cfg.seed, 9])
    batches = [get_batch(run.corpus.train_ids, cfg.batch_size, cfg.seq_len, rng) for _ in range(cfg.grad_accum)]
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
    log(f"  tokenizer  {cfg.tokenizer}, vocab {mcfg.vocab_size}")
    log(f"  model      dim {mcfg.dim}, {mcfg.n_layers} layers, {mcfg.n_heads} heads ({mcfg.n_kv_heads} kv), hidden "
        f"{mcfg.hidden_dim}, seq {cfg.seq_len} (max {mcfg.max_seq_len}): {run.model.n_params():,} params, {cfg.dtype}")
    log(f"  optimizer  AdamW lr {cfg.lr:g} -> {cfg.min_lr:g} (warm-up {cfg.warmup_steps}, cosine to step "
        f"{cfg.decay_steps}), betas ({cfg.beta1}, {cfg.beta2}), weight decay {cfg.weight_decay}, clip {cfg.grad_clip}")
    log(f"  batch      {cfg.batch_size} x {cfg.seq_len} tokens x {cfg.grad_accum} accum = "
        f"{tokens_per_step:,} tokens a step")
    log(f"  run        steps {run.start_step} -> {cfg.max_steps}"
        f"{f', time budget {format_duration(cfg.time_budget)}' if cfg.time_budget else ''}, eval every "
        f"{cfg.eval_interval} ({cfg.eval_batches} batches), seed {cfg.seed}, out {cfg.out_dir}/")
    if cfg.warmup_steps >= cfg.decay_steps:
        log(f"  note: --warmup-steps {cfg.warmup_steps} >= the {cfg.decay_steps}-step schedule; the lr never "
            "reaches its peak or decays (lower --warmup-steps for short runs)")


class StopFlag:
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


class Loop:
    """The steps of a run between two evaluations, and the evaluations and checkpoints themselves."""

    def __init__(self, run: Run, console: Console, metrics: MetricsLog, run_start: float):
        self.run, self.console, self.metrics, self.run_start = run, console, metrics, run_start
        self.recent_losses: list[float] = []
        self.step_time_ema = None
        self.train_time = 0.0

    def checkpoint(self, step: int) -> None:
        run = self.run
        state = {"step": step, "rng": rng_state(run.data_rng), "train_config": run.cfg.to_dict(),
                 "elapsed": run.elapsed_before + (time.perf_counter() - self.run_start), "tokens": run.tokens,
                 "val_loss": run.val_loss, "history": run.history, "text_sha256": run.corpus.text_sha256}
        save_train_checkpoint(run.ckpt_path, run.model, run.model.tokenizer, run.optimizer, state)
        run.saved_step = step

    def evaluate(self, step: int) -> None:
        run, cfg, log = self.run, self.run.cfg, self.console.log
        t0 = time.perf_counter()
        run.val_loss = estimate_loss(run.model, run.corpus.val_ids, cfg.batch_size, cfg.seq_len, cfg.eval_batches,
                                     [cfg.seed, 2])
        recent = [r for r in self.recent_losses if math.isfinite(r)]
        train_loss = float(np.mean(recent)) if recent else None
        run.history.append((step, run.val_loss))
        self.metrics.write(kind="eval", step=step, val_loss=run.val_loss, train_loss=train_loss)
        shown = f", train loss {train_loss:.4f} (mean of the last {len(recent)} steps)" if recent else ""
        log(f"step {step}: val loss {run.val_loss:.4f}{shown}  [{time.perf_counter() - t0:.1f}s]")
        self.recent_losses.clear()
        if cfg.sample_tokens:
            text = sample_text(run.model, run.model.tokenizer, cfg.sample_tokens, seed=cfg.seed + step)
            log("  | " + text.replace("\n", "\n  | "))

    def train_one_step(self, step: int) -> None:
        """Step `step` -> step + 1: draw the batches, update the model, log; raise on divergence."""
        run, cfg = self.run, self.run.cfg
        t0 = time.perf_counter()
        lr = lr_at(step, cfg.lr, cfg.warmup_steps, cfg.decay_steps, cfg.min_lr)
        batches = [get_batch(run.corpus.train_ids, cfg.batch_size, cfg.seq_len, run.data_rng)
                   for _ in range(cfg.grad_accum)]
        loss, norm = train_step(run.model, run.optimizer, batches, lr, cfg.grad_clip)
        if not (math.isfinite(loss) and math.isfinite(norm)):
            what = f"the loss is {loss}" if not math.isfinite(loss) else f"the gradient norm is {norm}"
            where = (f"the last good checkpoint, {run.ckpt_path} (step {run.saved_step}), is kept"
                     if run.saved_step is not None else "no checkpoint had been written yet")
            raise TrainingDiverged(
                f"step {step + 1}: {what}; training stopped and {where}. Hint: a lower --lr "
                f"(now {cfg.lr:g}), a longer --warmup-steps or --grad-clip 1.0 usually help; "
                "--resume continues from the checkpoint with the new values")
        tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum
        run.tokens += tokens_per_step
        dt = time.perf_counter() - t0
        self.train_time += dt
        self.step_time_ema = dt if self.step_time_ema is None else 0.9 * self.step_time_ema + 0.1 * dt
        self.recent_losses.append(loss)
        tok_s = tokens_per_step / self.step_time_ema
        elapsed = time.perf_counter() - self.run_start
        self.metrics.write(kind="train", step=step + 1, loss=loss, lr=lr, grad_norm=norm, tok_per_s=tok_s,
                           elapsed=round(elapsed, 3))
        eta = (cfg.max_steps - step - 1) * self.step_time_ema
        if cfg.time_budget:
            eta = min(eta, cfg.time_budget - elapsed)
        self.console.progress(f"step {step + 1}/{cfg.max_steps} | loss {loss:.4f} | lr {lr:.2e} | "
                              f"{tok_s:,.0f} tok/s | ETA {format_duration(max(eta, 0.0))}", step + 1, cfg.log_interval)

    def run_until_done(self) -> tuple[int, str]:
        """Train until max_steps, the time budget or Ctrl-C; evaluate and checkpoint on the way.

        Returns the step reached and why it stopped ("max_steps", "time_budget", "interrupted").
        """
        run, cfg = self.run, self.run.cfg
        step, stopped = run.start_step, "max_steps"
        with StopFlag() as stop:
            while True:
                if step % cfg.eval_interval == 0 or step >= cfg.max_steps:
                    if not (cfg.resume and step == run.start_step):      # the checkpoint already holds this
                        self.evaluate(step)
                        if step > run.start_step:
                            self.checkpoint(step)
                if step >= cfg.max_steps:
                    break
                if cfg.time_budget and time.perf_counter() - self.run_start >= cfg.time_budget:
                    stopped = "time_budget"
                    break
                if stop.requested:
                    stopped = "interrupted"
                    break
                self.train_one_step(step)
                step += 1
            if stopped != "max_steps" and run.saved_step != step:
                self.console.log(f"stopping at step {step} "
                                 f"({'time budget reached' if stopped == 'time_budget' else 'Ctrl-C'})")
                self.evaluate(step)
                self.checkpoint(step)
        return step, stopped


def finish(run: Run, loop: Loop, step: int, stopped: str, log) -> TrainResult:
    """Export, the full validation loss, the loss curve, and the closing summary."""
    cfg, out_dir = run.cfg, Path(run.cfg.out_dir)
    if cfg.export:
        save(run.model, cfg.export, format="meta")
    # the deterministic figure to quote: every validation token once, in windows of seq_len
    final_val = full_val_loss(run.model, run.corpus.val_ids, cfg.seq_len, cfg.batch_size)
    with open(loop.metrics.path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"kind": "final", "step": step, "full_val_loss": final_val}) + "\n")
    elapsed = time.perf_counter() - loop.run_start
    png = plot_metrics(loop.metrics.path, out_dir / PLOT_NAME)
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
    else:
        log(f"  loss curve  not drawn: matplotlib is not installed (pip install 'npllama[plot]' or "
            f"pip install matplotlib), then: npllama plot {out_dir}")
    return TrainResult(step, run.val_loss, run.ckpt_path if run.saved_step is not None else None, loop.metrics.path,
                       png, stopped, elapsed, final_val, run.history)


def train(cfg: TrainConfig, out: TextIO | None = None, preset_name: str | None = None) -> TrainResult:
    """Run (or resume) training as cfg says; returns what happened. See the module docstring.

    Raises ValueError for unusable settings, FileNotFoundError for missing data or checkpoint,
    and TrainingDiverged when the loss stops being finite (the last checkpoint is kept).
    """
    console = Console(out or sys.stdout)
    cfg.validate()
    run_start = time.perf_counter()
    run = resume_run(cfg, console.log) if cfg.resume else new_run(cfg, console.log)
    Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
    plan(run, run_start, console.log)
    log_header(run, preset_name, console.log)
    metrics = MetricsLog(Path(cfg.out_dir) / METRICS_NAME, run.start_step if cfg.resume else None)
    loop = Loop(run, console, metrics, run_start)
    try:
        step, stopped = loop.run_until_done()
    finally:
        metrics.close()
    return finish(run, loop, step, stopped, console.log)
