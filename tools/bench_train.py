"""Training-step speed: npllama (NumPy) against an equal PyTorch eager model, in the same run.

Times one full training step, forward + backward (and, separately, the AdamW update), for the
two configurations of issue 2, and prints tokens/s for both and their ratio (npllama / torch).

    python tools/bench_train.py                 # both configs, 2 warm-up + 5 timed steps each
    python tools/bench_train.py --steps 10 --config small
    python tools/bench_train.py --threads 1       # both sides on one core

Run it on an otherwise idle machine: with the cores shared, multi-threaded BLAS and OpenMP
(torch) lose far more than their share, and the ratio measures the contention, not the code.

Example output (2-core x86_64, OpenBLAS, torch 2.13 CPU):
    config  small: dim 128, 4 layers, 4 heads, 4 kv heads, seq 128, batch 32, vocab 65 (0.8M params)
      npllama  fwd+bwd  ... tokens/s
      torch    fwd+bwd  ... tokens/s
      ratio (npllama / torch): ...
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

import npllama
from npllama.engine.blas import get_blas_threads, set_blas_threads

CONFIGS = {
    "small": (dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=4, vocab_size=65, max_seq_len=128), 32, 128),
    "medium": (dict(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, vocab_size=65, max_seq_len=256), 16, 256),
}


def best_time(fn, steps, warmup):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def bench_numpy(cfg, B, T, steps, warmup, threads):
    model = npllama.Llama(cfg, seed=0)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (B, T))
    targets = rng.integers(0, cfg.vocab_size, (B, T))
    # threads=None: npllama's defaults (one batch shard per core, each with one BLAS thread).
    # threads=n: n shards, and n BLAS threads for whatever runs outside them.
    if threads is not None:
        set_blas_threads(threads)
    fwd_bwd = best_time(lambda: model.loss_and_grads(tokens, targets, workers=threads), steps, warmup)
    opt_time = None
    if hasattr(npllama, "AdamW"):
        _, grads = model.loss_and_grads(tokens, targets)
        opt = npllama.AdamW(model.params, lr=1e-4)
        opt_time = best_time(lambda: opt.step(grads), steps, warmup)
    return model, tokens, targets, fwd_bwd, opt_time


def bench_torch(model, tokens, targets, steps, warmup):
    import torch
    sys.path.insert(0, os.path.dirname(__file__))
    from torch_llama import TorchLlama
    tm = TorchLlama.from_npllama(model)
    x, y = torch.from_numpy(tokens), torch.from_numpy(targets)

    def step():
        tm.zero_grad(set_to_none=True)
        tm(x, y).backward()

    fwd_bwd = best_time(step, steps, warmup)
    opt = torch.optim.AdamW(tm.parameters(), lr=1e-4)
    step()
    opt_time = best_time(opt.step, steps, warmup)
    return fwd_bwd, opt_time


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", choices=["small", "medium", "both"], default="both")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-torch", action="store_true", help="time npllama only")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for both sides (torch.set_num_threads; npllama shards and BLAS threads); "
                             "default: each library's own default")
    args = parser.parse_args(argv)
    try:
        import torch
        torch_version = None if args.no_torch else torch.__version__
    except ImportError:
        torch_version = None
    if torch_version and args.threads is not None:
        torch.set_num_threads(args.threads)
    print(f"numpy {np.__version__}, torch {torch_version or 'not used'}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.2f}, npllama shards {args.threads or 'default'} "
          f"(BLAS threads {args.threads or get_blas_threads()})"
          + (f", torch threads {torch.get_num_threads()}" if torch_version else ""))
    names = ["small", "medium"] if args.config == "both" else [args.config]
    for name in names:
        kw, B, T = CONFIGS[name]
        cfg = npllama.LlamaConfig(**kw)
        print(f"config {name}: dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads} heads, {cfg.n_kv_heads} kv heads, "
              f"seq {T}, batch {B}, vocab {cfg.vocab_size} ({cfg.n_params() / 1e6:.2f}M params)")
        model, tokens, targets, np_t, np_opt = bench_numpy(cfg, B, T, args.steps, args.warmup, args.threads)
        tokens_per_step = B * T
        print(f"  npllama  fwd+bwd {np_t * 1e3:8.1f} ms  {tokens_per_step / np_t:9.0f} tokens/s"
              + (f"   AdamW step {np_opt * 1e3:6.1f} ms" if np_opt is not None else ""))
        if torch_version:
            th_t, th_opt = bench_torch(model, tokens, targets, args.steps, args.warmup)
            print(f"  torch    fwd+bwd {th_t * 1e3:8.1f} ms  {tokens_per_step / th_t:9.0f} tokens/s"
                  f"   AdamW step {th_opt * 1e3:6.1f} ms")
            print(f"  ratio (npllama / torch tokens/s): fwd+bwd {th_t / np_t:.2f}"
                  + (f", with AdamW {(th_t + th_opt) / (np_t + np_opt):.2f}" if np_opt is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
