"""Training speed and memory: npllama against an equal PyTorch eager model, per configuration.

    python tools/bench_train.py                      # cfgs p (the default preset's shape), a, b, c, k
    python tools/bench_train.py --configs b c        # some of them
    python tools/bench_train.py --quick              # small shapes, under 60 s (CI)
    python tools/bench_train.py --no-memory --rounds 9
    python tools/bench_train.py --configs k --kept-loop --no-memory    # and the library loop kept

A step is forward, backward, gradient clipping (norm 1.0) and the AdamW update (decay on
matrices only), through npllama's two ways of training:

    npllama         the library user's loop, as the README writes it: Llama.loss_and_grads,
                    npllama.clip_grad_norm, npllama.AdamW
    npllama train   what `npllama train` runs: train.loop.train_step with model.optimizer(),
                    inside engine.freed_memory_kept(), held for the process's life as a run holds
                    it; in a process of its own, since glibc, once told its thresholds, no longer
                    raises them by itself: a process that held freed_memory_kept is not the one a
                    library user starts with
    npllama kept    (with --kept-loop) the library user's loop inside engine.freed_memory_kept(),
                    held from before the model is made, as `npllama train` holds it

PyTorch's (tools/torch_llama.py, scaled_dot_product_attention) does the same with
torch.optim.AdamW in two parameter groups and clip_grad_norm_, from the same initial weights and
on the same batch.

Speed: the sides take turns round by round (the order alternating), PyTorch in this process and
each npllama side in a worker process of its own (stepping when told), so whatever else runs on the
machine slows all alike, and neither side's allocations shape the other's heap. (The library loop
once ran in this process, beside PyTorch's steps: there it measured 700 ms a step on cfg c,
against 535-673 alone, level with `npllama train`'s step at 551-628.) Each turn runs one untimed
step (the switch from the other side is paid there: waking thread pools, refilling caches), then
times a few.
npllama runs with its defaults, PyTorch with 1 and 2 threads (its faster one counts): the
median over rounds of the time per step, as tokens/s. The roofline line holds each side's
matmul FLOP/s (benchkit.training_flops: the model's, no recomputation) against NumPy's GEMM
peak on one and two threads, measured at the start.

Memory: each side alone in a fresh process of its own (this script with --memory-probe; with
--quick the processes run at the same time: they share the CPUs, not their memory). Model
creation: the peak resident memory while the model is built, minus the resident memory after
the imports and a warm-up on a tiny model (which pages the libraries' code in). Training: the
peak while the optimizer is built and two steps run, minus the resident memory after the model
was built (Linux: VmHWM, reset through /proc/self/clear_refs).

The floors (FLOORS, in the same rounds, each in its own worker process): the step's linear-layer
matmuls alone, run as the engine runs them (benchkit.linear_gemm_floor); those plus the
attention's matmuls and the exps no exact step can skip, one per causal score, gate and logit
(benchkit.matmul_exp_floor); and those plus the memory an AdamW step must move, every parameter,
gradient and moment read and the parameters and moments written (benchkit.training_floor).
PyTorch's step over a floor is the most a NumPy step whose matmuls (exps, optimizer traffic) run
so could reach against PyTorch in that run; each npllama side's time above the first is its
attention, norms, SwiGLU, loss, clipping and optimizer, above the second its element-wise passes,
gradient sums, clipping and optimizer, above the third all of that but the optimizer's traffic
(--no-floor leaves the three out).

Example output, one configuration (2-core AMD EPYC, OpenBLAS 0.3.31, torch 2.13 CPU, 5 rounds,
`--configs c --no-memory --rounds 5`, 6 December 2026):

    c: dim 288, 6 layers, 6/6 heads, vocab 4096, T 256, B 8 (8.34M params)   load average 0.54 0.66 1.13 -> 1.26 0.86 1.17
      npllama              908.0 ms a step       2,256 tokens/s   roofline 103 GFLOP/s = 71% of the 2-thread GEMM peak, ...
      npllama train        997.3 ms a step       2,054 tokens/s   roofline 94 GFLOP/s = 64% of the 2-thread GEMM peak, ...
      torch 1 thread      1677.2 ms a step       1,221 tokens/s   roofline 56 GFLOP/s = 38% of the 2-thread GEMM peak, ...
      torch 2 threads     1030.5 ms a step       1,987 tokens/s   roofline 91 GFLOP/s = 62% of the 2-thread GEMM peak, ...
      speed   npllama / torch 1.13, npllama train / torch 1.03 (torch's best: torch 2 threads)
      floor   the linear layers' matmuls alone (benchkit.linear_gemm_floor) 597.8 ms a step (147 GFLOP/s): at most
              1.72x torch over it; above it: npllama 310.1 ms, npllama train 399.5 ms

and since 7 December the second floor's line (the same cfg, all five cfgs' run, 5 rounds, that day):

      floor   + the attention's matmuls (6.8 GFLOP) and the exps (27.3M; benchkit.matmul_exp_floor) 615.2 ms a
              step: at most 1.40x torch over it; above it: npllama 172.6 ms, npllama train 147.5 ms

and the third floor's line (the same cfg, 7 December, a later run of all five cfgs, 5 rounds):

      floor   + AdamW's memory traffic (0.23 GB: p, g, m, v read, p, m, v written; benchkit.training_floor)
              582.5 ms a step: at most 1.39x torch over it; above it: npllama 123.7 ms, npllama train 113.0 ms

Exit code 0 once it has measured (ratios are reported, not asserted); 2 without torch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # npllama and tools/ from a checkout

import npllama  # noqa: E402
from npllama.engine import freed_memory_kept  # noqa: E402
from npllama.engine.shards import resolve_workers  # noqa: E402
from npllama.train.loop import train_step  # noqa: E402
from tools.benchkit import (MB, PEER_THREADS, adamw_traffic_bytes, attention_block_flops, calls_per_turn,  # noqa: E402
                            can_reset_peak_rss, gemm_peaks, linear_flops, linear_gemm_floor, load_averages,
                            matmul_exp_floor, memory_status, reset_peak_rss, roofline, start_worker, take_turns,
                            threads_label, torch_version, training_exps, training_floor, training_flops,
                            worker_result)

# name -> (LlamaConfig fields, batch B, sequence T)
CONFIGS = {
    "p": (dict(dim=128, n_layers=4, n_heads=4, vocab_size=65, max_seq_len=64), 16, 64),   # the default preset
    "a": (dict(dim=128, n_layers=4, n_heads=4, vocab_size=65, max_seq_len=128), 32, 128),
    "b": (dict(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, vocab_size=65, max_seq_len=256), 16, 256),
    "c": (dict(dim=288, n_layers=6, n_heads=6, vocab_size=4096, max_seq_len=256), 8, 256),
    "k": (dict(dim=768, n_layers=12, n_heads=16, n_kv_heads=8, vocab_size=6144, tie_embeddings=True,
               max_seq_len=512), 2, 512),
}
QUICK_CONFIGS = {
    "quick": (dict(dim=64, n_layers=2, n_heads=4, vocab_size=65, max_seq_len=64), 8, 64),
    "quick-gqa": (dict(dim=96, n_layers=2, n_heads=6, n_kv_heads=2, vocab_size=300, tie_embeddings=True,
                       max_seq_len=96), 4, 96),
}
HYPER = dict(lr=1e-4, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
CLIP = 1.0
NPLLAMA_SIDES = ("npllama", "npllama train")
KEPT_LOOP = "npllama kept"
FLOOR = "GEMM floor"
EXP_FLOOR = "matmul+exp floor"
ADAMW_FLOOR = "matmul+exp+AdamW floor"
FLOORS = {FLOOR: linear_gemm_floor, EXP_FLOOR: matmul_exp_floor, ADAMW_FLOOR: training_floor}


def batch(cfg, B, T, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg.vocab_size, (B, T)), rng.integers(0, cfg.vocab_size, (B, T))


# ---- the sides' training steps --------------------------------------------------------------------

def library_step(model, tokens, targets):
    """One step of the library user's loop (the README's) as a closure."""
    opt = npllama.AdamW(model.params, **HYPER)

    def step():
        _, grads = model.loss_and_grads(tokens, targets)
        npllama.clip_grad_norm(grads, CLIP)
        opt.step(grads)
    return step


def train_command_step(model, tokens, targets):
    """One `npllama train` step (train.loop.train_step, the model's optimizer) as a closure; the
    caller holds freed_memory_kept() around the steps, as a run does."""
    opt = model.optimizer(**HYPER)
    return lambda: train_step(model, opt, [(tokens, targets)], HYPER["lr"], CLIP)


def torch_step(tm, tokens, targets, threads=None):
    """The same step in PyTorch as a closure, on `threads` threads (set at each step: the sides share a process)."""
    import torch
    from tools.torch_llama import adamw
    opt = adamw(tm, **HYPER)
    x, y = torch.from_numpy(tokens), torch.from_numpy(targets)

    def step():
        if threads is not None:
            torch.set_num_threads(threads)
        opt.zero_grad(set_to_none=True)
        tm(x, y).backward()
        torch.nn.utils.clip_grad_norm_(tm.parameters(), CLIP)
        opt.step()
    return step


# ---- speed: interleaved rounds -------------------------------------------------------------------------

class StepWorker:
    """An npllama side ("npllama" or "npllama train") in a process of its own (module docstring):
    each call runs one step there."""

    def __init__(self, side, name, quick):
        self.side = side
        self.proc = subprocess.Popen([sys.executable, __file__, "--step-worker", side, name,
                                      *(["--quick"] if quick else [])],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._expect("ready")

    def _expect(self, word):
        if self.proc.stdout.readline().strip() != word:
            raise RuntimeError(f"the {self.side} worker stopped ({self.proc.wait()}); see its error above")

    def __call__(self):
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        self._expect("done")

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def step_worker(side, name, quick):
    """Runs in its own process: one step of the side per line read (`npllama train`'s inside
    freed_memory_kept, as a run holds it; the library loop's as a user's script runs it, or inside
    freed_memory_kept for the KEPT_LOOP side; for a floor (FLOORS), its benchkit closure's work on
    as many threads as the engine's passes take)."""
    kw, B, T = (QUICK_CONFIGS if quick else CONFIGS)[name]
    cfg = npllama.LlamaConfig(**kw)
    train = side == "npllama train"
    with freed_memory_kept() if train or side == KEPT_LOOP else nullcontext():
        if side in FLOORS:
            step = FLOORS[side](cfg, B, T, resolve_workers(None, B, T, cfg.dim))
        else:
            step = (train_command_step if train else library_step)(npllama.Llama(cfg, seed=0), *batch(cfg, B, T))
        print("ready", flush=True)
        for _ in sys.stdin:
            step()
            print("done", flush=True)


def measure_speed(name, quick, rounds, turn_seconds, use_torch, warmup=2, kept_loop=False, floor=True):
    """{setting: median seconds per step} over interleaved rounds (module docstring); kept_loop
    adds the KEPT_LOOP side, floor the three FLOORS (module docstring), in the same rounds."""
    kw, B, T = (QUICK_CONFIGS if quick else CONFIGS)[name]
    cfg = npllama.LlamaConfig(**kw)
    tokens, targets = batch(cfg, B, T)
    workers, per_turn = [], {}
    try:
        for side in (*NPLLAMA_SIDES, *([KEPT_LOOP] if kept_loop else []), *(FLOORS if floor else [])):
            workers.append(StepWorker(side, name, quick))
        steps = {worker.side: worker for worker in workers}
        if use_torch:
            from tools.torch_llama import TorchLlama
            model = npllama.Llama(cfg, seed=0)      # the workers' initial weights
            for threads in PEER_THREADS:
                steps[f"torch {threads_label(threads)}"] = torch_step(
                    TorchLlama.from_params(cfg, model.params), tokens, targets, threads)
        for setting, step in steps.items():     # warm up (PyTorch sets itself up lazily), then size the turns
            for _ in range(warmup):
                step()
            per_turn[setting] = calls_per_turn(step, turn_seconds)
        return take_turns(steps, rounds, per_turn, switch=True)
    finally:
        for worker in workers:
            worker.close()


# ---- memory: one side alone in a fresh process ---------------------------------------------------------

def memory_probe(side, name, quick):
    """Runs in its own process: prints JSON {create, train} in bytes (module docstring)."""
    kw, B, T = (QUICK_CONFIGS if quick else CONFIGS)[name]
    cfg = npllama.LlamaConfig(**kw)
    tokens, targets = batch(cfg, B, T)
    if side == "torch":
        import torch
        from tools.torch_llama import TorchLlama
        torch.set_num_threads(max(PEER_THREADS))
    build = TorchLlama if side == "torch" else (lambda c: npllama.Llama(c, seed=0))
    train = {"npllama": library_step, "npllama train": train_command_step, "torch": torch_step}[side]
    # first a tiny model, built and trained a step: the libraries' code and tables are paged in
    # then, and not counted below
    tiny = npllama.LlamaConfig(dim=16, n_layers=1, n_heads=2, vocab_size=cfg.vocab_size, max_seq_len=8)
    train(build(tiny), *batch(tiny, 2, 8))()
    start = memory_status()["VmRSS"]
    reset_peak_rss()
    model = build(cfg)
    create = memory_status()["VmHWM"] - start
    after_create = memory_status()["VmRSS"]
    reset_peak_rss()
    with freed_memory_kept() if side == "npllama train" else nullcontext():
        step = train(model, tokens, targets)
        for _ in range(2):
            step()
        peak = memory_status()["VmHWM"]
    print(json.dumps({"create": create, "train": peak - after_create}))


def measure_memory(sides, name, quick):
    """{side: memory_probe's figures}, each from a fresh process, or None where it cannot measure
    (not Linux). Quick: the sides' processes run at once (they share time, not memory)."""
    if not can_reset_peak_rss():
        return None

    def start(side):
        return start_worker(__file__, "--memory-probe", side, name, *(["--quick"] if quick else []))

    started = {side: start(side) for side in sides} if quick else {}
    return {side: worker_result(started.get(side) or start(side)) for side in sides}


# ---- the report ----------------------------------------------------------------------------------------

def describe(cfg, B, T):
    return (f"dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads}/{cfg.n_kv_heads} heads, vocab {cfg.vocab_size}"
            f"{', tied' if cfg.tie_embeddings else ''}, T {T}, B {B} ({cfg.n_params() / 1e6:.2f}M params)")


def report(name, cfg, B, T, times, peaks, loads, use_torch):
    """The speed, roofline and ratio lines of one configuration."""
    tokens, flops = B * T, training_flops(cfg, B, T)
    floor, exp_floor, adamw_floor = (times.pop(side, None) for side in FLOORS)
    print(f"\n{name}: {describe(cfg, B, T)}   load average {loads[0]} -> {loads[1]}")
    for setting, seconds in times.items():
        print(f"  {setting:16s} {seconds * 1e3:9.1f} ms a step  {tokens / seconds:10,.0f} tokens/s   "
              f"roofline {roofline(flops / seconds, peaks)}")
    if use_torch:
        t_name = min((n for n in times if n.startswith("torch")), key=times.get)
        print("  speed   " + ", ".join(f"{side} / torch {times[t_name] / times[side]:.2f}"
                                      for side in times if side.startswith("npllama"))
              + f" (torch's best: {t_name})", flush=True)

    def floor_line(what, seconds, rate=""):
        return (f"  floor   {what} {seconds * 1e3:,.1f} ms a step{rate}"
                + (f": at most {times[t_name] / seconds:.2f}x torch over it" if use_torch else "")
                + "; above it: " + ", ".join(f"{side} {(times[side] - seconds) * 1e3:,.1f} ms"
                                             for side in times if side.startswith("npllama")))
    if floor is not None:
        print(floor_line("the linear layers' matmuls alone (benchkit.linear_gemm_floor)", floor,
                         f" ({3 * linear_flops(cfg, tokens) / floor / 1e9:,.0f} GFLOP/s)"), flush=True)
    if exp_floor is not None:
        print(floor_line(f"+ the attention's matmuls ({attention_block_flops(cfg, B, T) / 1e9:,.1f} GFLOP) and the exps "
                         f"({training_exps(cfg, B, T) / 1e6:,.1f}M; benchkit.matmul_exp_floor)", exp_floor), flush=True)
    if adamw_floor is not None:
        print(floor_line(f"+ AdamW's memory traffic ({adamw_traffic_bytes(cfg.n_params()) / 1e9:,.2f} GB: p, g, m, v read, "
                         f"p, m, v written; benchkit.training_floor)", adamw_floor), flush=True)


def report_memory(cfg, mem, use_torch):
    """The training-peak and model-creation lines of one configuration."""
    train = {side: figures["train"] / MB for side, figures in mem.items()}
    line = "  memory  training peak " + ", ".join(f"{side} {mb:,.0f} MB" for side, mb in train.items())
    if use_torch:
        line += " (ratios " + ", ".join(f"{side} / torch {train[side] / train['torch']:.2f}"
                                        for side in NPLLAMA_SIDES) + ")"
    print(line)
    param_bytes = cfg.n_params() * 4
    create = mem["npllama"]["create"]
    line = (f"  create  npllama {create / MB:,.1f} MB "
            f"({create / param_bytes:.2f}x the {param_bytes / MB:,.1f} MB of float32 parameters)")
    if use_torch:
        line += f", torch {mem['torch']['create'] / MB:,.1f} MB ({mem['torch']['create'] / param_bytes:.2f}x)"
    print(line, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS),
                    help="which configurations (default: all, in the order p a b c k)")
    ap.add_argument("--quick", action="store_true", help="two small configurations, few rounds: under 60 s")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 7, quick 3)")
    ap.add_argument("--turn", type=float, default=None, help="seconds per side per round (default 1.0, quick 0.2)")
    ap.add_argument("--no-memory", action="store_true", help="speed only")
    ap.add_argument("--no-torch", action="store_true", help="npllama only")
    ap.add_argument("--no-floor", action="store_true", help="leave out the three floors (module docstring)")
    ap.add_argument("--kept-loop", action="store_true",
                    help="also time the library loop inside engine.freed_memory_kept() (speed only)")
    ap.add_argument("--memory-probe", nargs=2, metavar=("SIDE", "CFG"), help=argparse.SUPPRESS)
    ap.add_argument("--step-worker", nargs=2, metavar=("SIDE", "CFG"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.step_worker:
        step_worker(*args.step_worker, args.quick)
        return 0
    if args.memory_probe:
        memory_probe(*args.memory_probe, args.quick)
        return 0
    configs = QUICK_CONFIGS if args.quick else {n: CONFIGS[n] for n in args.configs}
    rounds = args.rounds or (3 if args.quick else 7)
    turn = args.turn or (0.2 if args.quick else 1.0)
    use_torch = torch_version() is not None and not args.no_torch
    peaks = gemm_peaks()
    print(f"numpy {np.__version__}, torch {torch_version() if use_torch else 'not used'}, "
          f"{os.cpu_count()} cpus; a step = forward + backward + clip + AdamW; {rounds} rounds; "
          f"tokens/s: median; NumPy float32 GEMM peak {peaks[1] / 1e9:,.0f} GFLOP/s on 1 thread, "
          f"{peaks[2] / 1e9:,.0f} on 2", flush=True)
    for name, (kw, B, T) in configs.items():
        cfg = npllama.LlamaConfig(**kw)
        load_before = load_averages()
        times = measure_speed(name, args.quick, rounds, turn, use_torch, warmup=1 if args.quick else 2,
                              kept_loop=args.kept_loop, floor=not args.no_floor)
        report(name, cfg, B, T, times, peaks, (load_before, load_averages()), use_torch)
        if args.no_memory:
            continue
        mem = measure_memory([*NPLLAMA_SIDES, *(["torch"] if use_torch else [])], name, args.quick)
        if mem is None:
            print("  memory  not measured (needs Linux's /proc/self/clear_refs)")
            continue
        report_memory(cfg, mem, use_torch)
    print(f"\nload average at the end {load_averages()}")
    return 0 if use_torch or args.no_torch else 2


if __name__ == "__main__":
    sys.exit(main())
