"""Training speed and memory: npllama against an equal PyTorch eager model, per configuration.

    python tools/bench_train.py                      # the default preset's shape and cfgs a, b, c, k
    python tools/bench_train.py --configs b c        # some of them
    python tools/bench_train.py --quick              # small shapes, under 30 s (CI)
    python tools/bench_train.py --no-memory --rounds 9

A step is what `npllama train` runs: forward, backward, gradient clipping (norm 1.0) and the
AdamW update (decay on matrices only); PyTorch's (tools/torch_llama.py, scaled_dot_product_
attention) does the same with torch.optim.AdamW in two parameter groups and clip_grad_norm_,
from the same initial weights and on the same batch.

Speed: both sides in this one process, taking turns round by round (the order alternating), so
whatever else runs on the machine slows both alike. Each turn runs one untimed step (the switch
from the other side is paid there: waking thread pools, refilling caches), then times a few.
npllama runs with its defaults and with workers=1, PyTorch with 1 and 2 threads, and each
side's faster setting counts: the median over rounds of its time per step, as tokens/s.

Memory: each side alone in a fresh process of its own (this script with --memory-probe; with
--quick the two processes run at the same time: they share the CPUs, not their memory). Model
creation: the peak resident memory while the model is built, minus the resident memory after
the imports and a warm-up on a tiny model (which pages the libraries' code in). Training: the
peak while the optimizer is built and two steps run, minus the resident memory after the model
was built (Linux: VmHWM, reset through /proc/self/clear_refs).

Example output, per configuration (2-core x86_64, OpenBLAS, torch 2.13 CPU):
  default: dim 128, 4 layers, 4/4 heads, vocab 65, T 64, B 16 (0.82M params)   load average 1.16 ... -> 1.26 ...
    npllama                   46.6 ms a step      21,992 tokens/s
    npllama workers=1         82.7 ms a step      12,388 tokens/s
    torch 1 thread            90.5 ms a step      11,318 tokens/s
    torch 2 threads           54.6 ms a step      18,760 tokens/s
    speed   npllama 21,992 tokens/s (npllama), torch 18,760 (torch 2 threads): ratio 1.17
    memory  training peak npllama 53 MB, torch 69 MB: ratio 0.77
    create  npllama 3.0 MB (0.96x the 3.1 MB of float32 parameters), torch 2.3 MB (0.73x)
Exit code 0 once it has measured (ratios are reported, not asserted); 2 without torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # npllama and tools/ from a checkout

import npllama  # noqa: E402
from npllama.engine import FusedAdamW  # noqa: E402
from tools.benchkit import (MB, PEER_THREADS, calls_per_turn, can_reset_peak_rss, load_averages,  # noqa: E402
                            memory_status, reset_peak_rss, start_worker, take_turns, threads_label, torch_version,
                            worker_result)

# name -> (LlamaConfig fields, batch B, sequence T)
CONFIGS = {
    "default": (dict(dim=128, n_layers=4, n_heads=4, vocab_size=65, max_seq_len=64), 16, 64),
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


def batch(cfg, B, T, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg.vocab_size, (B, T)), rng.integers(0, cfg.vocab_size, (B, T))


# ---- the two sides' training steps -----------------------------------------------------------------

def npllama_step(model, tokens, targets, workers=None):
    """One `npllama train` step (train.loop.train_step's work) as a closure."""
    opt = FusedAdamW(model.params, **HYPER)

    def step():
        _, grads = model.loss_and_grads(tokens, targets, workers=workers)
        npllama.clip_grad_norm(grads, CLIP)
        opt.step(grads)
    return step


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


# ---- speed: interleaved rounds in this process -------------------------------------------------------

def measure_speed(cfg, B, T, rounds, turn_seconds, use_torch, warmup=2):
    """{setting: median seconds per step} over interleaved rounds (module docstring)."""
    tokens, targets = batch(cfg, B, T)
    model = npllama.Llama(cfg, seed=0)
    steps = {"npllama": npllama_step(model, tokens, targets),
             "npllama workers=1": npllama_step(npllama.Llama(cfg, seed=0), tokens, targets, workers=1)}
    if use_torch:
        from tools.torch_llama import TorchLlama
        for threads in PEER_THREADS:
            steps[f"torch {threads_label(threads)}"] = torch_step(
                TorchLlama.from_params(cfg, model.params), tokens, targets, threads)
    per_turn = {}
    for name, step in steps.items():          # warm up (PyTorch sets itself up lazily), then size the turns
        for _ in range(warmup):
            step()
        per_turn[name] = calls_per_turn(step, turn_seconds)
    return take_turns(steps, rounds, per_turn, switch=True)


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
    build = (lambda c: npllama.Llama(c, seed=0)) if side == "npllama" else TorchLlama
    train = npllama_step if side == "npllama" else torch_step
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
    step = train(model, tokens, targets)
    for _ in range(2):
        step()
    print(json.dumps({"create": create, "train": memory_status()["VmHWM"] - after_create}))


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


def best(times, prefix):
    name = min((n for n in times if n.startswith(prefix)), key=times.get)
    return name, times[name]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS),
                    help="which configurations (default: all, in the order default a b c k)")
    ap.add_argument("--quick", action="store_true", help="two small configurations, few rounds: under 30 s")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 7, quick 3)")
    ap.add_argument("--turn", type=float, default=None, help="seconds per side per round (default 1.0, quick 0.2)")
    ap.add_argument("--no-memory", action="store_true", help="speed only")
    ap.add_argument("--no-torch", action="store_true", help="npllama only")
    ap.add_argument("--memory-probe", nargs=2, metavar=("SIDE", "CFG"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.memory_probe:
        memory_probe(*args.memory_probe, args.quick)
        return 0
    configs = QUICK_CONFIGS if args.quick else {n: CONFIGS[n] for n in args.configs}
    rounds = args.rounds or (3 if args.quick else 7)
    turn = args.turn or (0.2 if args.quick else 1.0)
    use_torch = torch_version() is not None and not args.no_torch
    print(f"numpy {np.__version__}, torch {torch_version() if use_torch else 'not used'}, "
          f"{os.cpu_count()} cpus; a step = forward + backward + clip + AdamW; {rounds} rounds; "
          "tokens/s: median, each side's faster setting", flush=True)
    for name, (kw, B, T) in configs.items():
        cfg = npllama.LlamaConfig(**kw)
        load_before = load_averages()
        times = measure_speed(cfg, B, T, rounds, turn, use_torch, warmup=1 if args.quick else 2)
        load_after = load_averages()
        tokens = B * T
        print(f"\n{name}: {describe(cfg, B, T)}   load average {load_before} -> {load_after}")
        for setting, seconds in times.items():
            print(f"  {setting:20s} {seconds * 1e3:9.1f} ms a step  {tokens / seconds:10,.0f} tokens/s")
        np_name, np_time = best(times, "npllama")
        line = f"  speed   npllama {tokens / np_time:,.0f} tokens/s ({np_name})"
        if use_torch:
            t_name, t_time = best(times, "torch")
            line += f", torch {tokens / t_time:,.0f} ({t_name}): ratio {t_time / np_time:.2f}"
        print(line, flush=True)
        if args.no_memory:
            continue
        param_bytes = cfg.n_params() * 4
        mem = measure_memory(["npllama", "torch"] if use_torch else ["npllama"], name, args.quick)
        if mem is None:
            print("  memory  not measured (needs Linux's /proc/self/clear_refs)")
            continue
        line = f"  memory  training peak npllama {mem['npllama']['train'] / MB:,.0f} MB"
        if use_torch:
            line += (f", torch {mem['torch']['train'] / MB:,.0f} MB: ratio "
                     f"{mem['npllama']['train'] / mem['torch']['train']:.2f}")
        print(line)
        line = (f"  create  npllama {mem['npllama']['create'] / MB:,.1f} MB "
                f"({mem['npllama']['create'] / param_bytes:.2f}x the {param_bytes / MB:,.1f} MB of float32 parameters)")
        if use_torch:
            line += f", torch {mem['torch']['create'] / MB:,.1f} MB ({mem['torch']['create'] / param_bytes:.2f}x)"
        print(line, flush=True)
    print(f"\nload average at the end {load_averages()}")
    return 0 if use_torch or args.no_torch else 2


if __name__ == "__main__":
    sys.exit(main())
