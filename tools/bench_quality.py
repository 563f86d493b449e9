"""Quality per wall-clock second: npllama against an equal PyTorch eager model, same run, same budget.

Both sides train the same preset (default shakespeare-char) for the same wall-clock budget
and are then evaluated on the same validation windows:
  - same model and init: the PyTorch model (tools/torch_llama.py, scaled_dot_product_attention)
    starts from a copy of npllama's initial weights;
  - same data: the same tokenizer and the same sequence of training batches (one seeded
    generator each, identically seeded);
  - same optimisation: AdamW with decay on matrices only (two torch parameter groups), the
    same betas/eps/weight decay, gradient clipping, and the same schedule: linear warm-up
    over the preset's warm-up steps, then a cosine to min_lr over the rest of each side's
    *time* budget, so both end their decay exactly at the budget whatever their speed.
Each side runs in its own process (their BLAS/OpenMP thread pools never compete), and the
two take turns in slices of a few seconds so other load on a shared machine hits both
alike. Only training steps count against the budget; the validation estimates (at fifths
of the budget, the same windows on both sides) are off the clock.

    python tools/bench_quality.py                    # 5 minutes each side (about 11 minutes in all)
    python tools/bench_quality.py --budget 60 --preset tiny

Example output (2-core x86_64, OpenBLAS, torch 2.13 CPU, shared machine; per-slice lines cut):
    budget 300s each, preset shakespeare-char: dim 128, 4 layers, 4 heads, seq 64, batch 16x1, ...
      time   npllama val   torch val  npllama steps  torch steps
       60s        1.8175      1.8164           1111         1126
      120s        1.6972      1.6919           2233         2286
      180s        1.6271      1.6254           3349         3440
      240s        1.5960      1.5925           4502         4639
      300s        1.5719      1.5781           5651         5806
    npllama: 5651 steps in 300.0s of training, 19,286 tok/s
    torch: 5806 steps in 300.0s of training, 19,816 tok/s
    final val loss: npllama 1.5719, torch 1.5781 (npllama lower)
Exit code 0 when npllama's final validation loss is the lower, 1 otherwise.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # npllama and tools/ from a checkout

from npllama import Llama  # noqa: E402
from npllama.train import data as data_mod  # noqa: E402
from npllama.engine import FusedAdamW  # noqa: E402
from npllama.optim import lr_at  # noqa: E402
from npllama.train.config import PRESETS, preset  # noqa: E402
from npllama.train.data import prepare_data  # noqa: E402
from npllama.train.loop import estimate_loss, train_step  # noqa: E402
from tools.benchkit import load_average  # noqa: E402


class Side:
    """One contender: step(lr) trains one step, evaluate() -> val loss; its clock counts only its steps."""

    def __init__(self, name, step, evaluate):
        self.name, self._step, self.evaluate = name, step, evaluate
        self.clock, self.steps, self.warmup_end = 0.0, 0, None

    def lr(self, cfg, budget) -> float:
        """Warm-up over cfg.warmup_steps steps, then cosine to min_lr over the rest of the *time* budget.

        Scheduling by time makes both sides end their decay exactly at the budget, whatever their
        speed and whatever the machine's other load does to it.
        """
        if self.steps < cfg.warmup_steps:
            return lr_at(self.steps, cfg.lr, cfg.warmup_steps, cfg.warmup_steps, cfg.min_lr)
        if self.warmup_end is None:
            self.warmup_end = self.clock
        r = min(1.0, (self.clock - self.warmup_end) / max(budget - self.warmup_end, 1e-9))
        return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * r)) * (cfg.lr - cfg.min_lr)

    def step(self, cfg, budget) -> None:
        lr = self.lr(cfg, budget)
        t0 = time.perf_counter()
        self._step(lr)
        self.clock += time.perf_counter() - t0
        self.steps += 1


def resolve(preset_name: str, overrides: list[str]):
    """The preset with KEY=VALUE overrides (TrainConfig field names, values in the field's type)."""
    cfg = preset(preset_name)
    changes = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not hasattr(cfg, key):
            raise SystemExit(f"--set {item!r}: expected FIELD=VALUE with a TrainConfig field")
        kind = type(getattr(cfg, key))
        changes[key] = (value.lower() in ("1", "true", "yes")) if kind is bool else \
            (kind(value) if kind in (int, float) else value)
    cfg = cfg.replace(**changes)
    cfg.validate()
    return cfg


def build_side(name: str, preset_name: str, eval_batches: int, overrides=(), warmup: float = 5.0):
    """The contender `name` ("npllama" or "torch"), warmed up and then built afresh.

    In a new process PyTorch's first ~15 training steps are slow (0.4 s each for the tiny
    preset, which then settles at 5 ms a step): it sets things up lazily. So each side first
    trains a throwaway copy for 30 steps and at least `warmup` seconds, off the clock, and the
    timed run starts from a fresh model, optimizer and batch generator.
    """
    cfg = resolve(preset_name, list(overrides))
    corpus = prepare_data(cfg, log=lambda m: None)
    throwaway = make_side(name, cfg, corpus, eval_batches)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warmup or throwaway.steps < 30:
        throwaway.step(cfg, 1e9)
    throwaway.evaluate()
    return make_side(name, cfg, corpus, eval_batches), cfg


def make_side(name: str, cfg, corpus, eval_batches: int) -> Side:
    """A fresh contender: model from the preset's seed, its optimizer, its batch generator."""
    mcfg = cfg.model_config(corpus.tokenizer.vocab_size)
    B, T, A = cfg.batch_size, cfg.seq_len, cfg.grad_accum
    init = Llama(mcfg, seed=cfg.seed)                    # both sides start from these weights
    rng = np.random.default_rng([cfg.seed, 1])           # and draw the same batches

    if name == "npllama":
        model = init
        opt = FusedAdamW(model.params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                         weight_decay=cfg.weight_decay)        # the optimizer `npllama train` steps with

        def step(lr):
            batches = [data_mod.get_batch(corpus.train_ids, B, T, rng) for _ in range(A)]
            loss, _ = train_step(model, opt, batches, lr, cfg.grad_clip)
            if not math.isfinite(loss):
                raise RuntimeError("npllama diverged")

        def evaluate():
            return estimate_loss(model, corpus.val_ids, B, T, eval_batches, [cfg.seed, 2])
        return Side(name, step, evaluate)

    import torch
    from tools.torch_llama import TorchLlama, adamw
    model = TorchLlama.from_params(mcfg, init.params)
    opt = adamw(model, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)

    def as_tensor(a):
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))

    def step(lr):
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad(set_to_none=True)
        for _ in range(A):
            x, y = data_mod.get_batch(corpus.train_ids, B, T, rng)
            (model(as_tensor(x), as_tensor(y)) / A).backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()

    def evaluate():
        rng_eval = np.random.default_rng([cfg.seed, 2])      # the windows estimate_loss uses
        losses = []
        with torch.no_grad():
            for _ in range(eval_batches):
                x, y = data_mod.get_batch(corpus.val_ids, B, T, rng_eval)
                losses.append(float(model(as_tensor(x), as_tensor(y))))
        return float(np.mean(losses))
    return Side(name, step, evaluate)


def worker(name, preset_name, eval_batches, overrides, budget, conn) -> None:
    """A side in its own process: ("until", t) trains until its clock reaches t; ("eval",) estimates."""
    side, cfg = build_side(name, preset_name, eval_batches, overrides)
    conn.send(("ready", None))
    while True:
        cmd, arg = conn.recv()
        if cmd == "until":
            while side.clock < arg:
                side.step(cfg, budget)
            conn.send((side.steps, side.clock))
        elif cmd == "eval":
            conn.send(side.evaluate())
        else:
            conn.close()
            return


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--budget", type=float, default=300.0, help="training seconds for each side")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="shakespeare-char")
    ap.add_argument("--eval-batches", type=int, default=40, help="validation batches at each mark")
    ap.add_argument("--marks", type=int, default=5, help="validation estimates along the budget")
    ap.add_argument("--slice", type=float, default=5.0,
                    help="seconds each side trains before the other's turn")
    ap.add_argument("--verbose", action="store_true", help="print every slice")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a preset field (repeatable), e.g. --set seq_len=64")
    args = ap.parse_args(argv)

    import multiprocessing as mp
    import torch
    cfg = resolve(args.preset, args.set)
    corpus = prepare_data(cfg, log=lambda m: None)
    mcfg = cfg.model_config(corpus.tokenizer.vocab_size)
    B, T, A = cfg.batch_size, cfg.seq_len, cfg.grad_accum
    overrides = "".join(f" --set {item}" for item in args.set)
    print(f"budget {args.budget:.0f}s each, preset {args.preset}{overrides}: dim {mcfg.dim}, {mcfg.n_layers} layers, "
          f"{mcfg.n_heads} heads, seq {T}, batch {B}x{A}, lr {cfg.lr:g}->{cfg.min_lr:g}, "
          f"warm-up {cfg.warmup_steps} steps then cosine over the time budget")
    print(f"  numpy {np.__version__}, torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"{os.cpu_count()} cpus, load average {load_average():.2f}", flush=True)

    # One process per side (their thread pools never meet), taking turns in --slice second slices
    # so that whatever else runs on the machine slows both alike.
    ctx = mp.get_context("spawn")
    conns, procs = {}, []
    for name in ("npllama", "torch"):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=worker, args=(name, args.preset, args.eval_batches, args.set, args.budget, child))
        proc.start()
        conns[name] = parent
        procs.append(proc)
    for conn in conns.values():
        assert conn.recv()[0] == "ready"
    marks = [args.budget * (k + 1) / args.marks for k in range(args.marks)]
    curves = {name: [] for name in conns}
    progress = {name: (0, 0.0) for name in conns}
    target = 0.0
    try:
        for mark in marks:
            while target < mark:
                target = min(target + args.slice, mark)
                for name, conn in conns.items():
                    conn.send(("until", target))
                    before = progress[name][0]
                    progress[name] = conn.recv()
                    if args.verbose:
                        print(f"    {name}: clock {progress[name][1]:6.1f}s, {progress[name][0] - before} steps "
                              "this slice", flush=True)
            for name, conn in conns.items():
                conn.send(("eval", None))
                curves[name].append((mark, conn.recv(), progress[name][0]))
            print(f"  {mark:5.0f}s  " + "   ".join(f"{n}: step {c[-1][2]}, val {c[-1][1]:.4f}"
                                                   for n, c in curves.items()), flush=True)
    finally:
        for conn in conns.values():
            try:
                conn.send(("stop", None))
            except (BrokenPipeError, OSError):
                pass
        for proc in procs:
            proc.join(timeout=30)

    print(f"\n{'time':>6}  {'npllama val':>12}  {'torch val':>10}  {'npllama steps':>13}  {'torch steps':>11}")
    for (mark, v_np, s_np), (_, v_t, s_t) in zip(curves["npllama"], curves["torch"]):
        print(f"{mark:5.0f}s  {v_np:12.4f}  {v_t:10.4f}  {s_np:13d}  {s_t:11d}")
    tokens = B * T * A
    for name, (steps, clock) in progress.items():
        print(f"{name}: {steps} steps in {clock:.1f}s of training, {steps * tokens / clock:,.0f} tok/s")
    final_np, final_t = curves["npllama"][-1][1], curves["torch"][-1][1]
    verdict = "npllama lower" if final_np < final_t else "torch lower"
    print(f"final val loss: npllama {final_np:.4f}, torch {final_t:.4f} ({verdict})")
    return 0 if final_np < final_t else 1


if __name__ == "__main__":
    sys.exit(main())
