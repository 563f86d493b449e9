"""Fine-tuning speed and memory: a full step and a LoRA step, npllama against PyTorch eager.

For the 110M shape of llama2.c's stories110M (dim 768, 12 layers, 12 heads, vocab 32000, tied
embeddings; random weights), times one optimizer step of

    full   every weight trains: loss and gradients, clipping, AdamW
    lora   rank-8 LoRA adapters on wq, wk, wv, wo, w1, w2, w3; the base frozen (no gradient, no
           optimizer state): npllama.llama.LoraLlama against plain PyTorch LoRA modules
           (x W^T + s (x A^T) B^T, W with requires_grad=False, PEFT's init)

and measures each side's peak resident memory during the steps. Every (side, mode, threads)
runs in a process of its own (with --quick, all in this one), so peaks do not mix; the
processes take turns (--repeats rounds, medians reported). Each side gets its better of 1 and 2 threads (npllama: batch shards and BLAS
threads; PyTorch: torch.set_num_threads), as the other benchmarks give PyTorch. Memory is the
process's peak RSS (VmHWM) over the timed steps, after the model is built (init's temporaries
handed back to the OS on both sides), against the base weights' bytes.

    python tools/bench_finetune.py                 # 110M shape, batch 4 x 128 tokens
    python tools/bench_finetune.py --quick         # a small shape, all in one process, under 30 s
    python tools/bench_finetune.py --batch 1 --seq 256 --modes lora
    python tools/bench_finetune.py --gradient-checkpointing    # both sides recompute blocks in backward

Example output (2-core x86_64, OpenBLAS, torch 2.13 CPU; docs/speed.md "Fine-tuning"; lora: 2 December
2026, load average 1.3-1.7; full: an earlier day, load average 1.0-1.4):
    shape 110m: dim 768, 12 layers, 12 heads, vocab 32000, tied (109.5M params, 418 MB float32); batch 4 x 128
    tokens; LoRA rank 8 on wq,wk,wv,wo,w1,w2,w3
      lora | npllama 260 tok/s (2 threads), peak 613 MB = 1.47 x weights | torch 208 tok/s (2 threads),
             peak 1,678 MB = 4.02 x weights | speed ratio npllama / torch 1.25
      full | npllama 192 tok/s (2 threads), peak 2,459 MB = 5.89 x weights | torch 204 tok/s (2 threads),
             peak 2,522 MB = 6.04 x weights | speed ratio npllama / torch 0.95
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # npllama and tools/ from a checkout

from tools.benchkit import (MB, PEER_THREADS, gemm_peaks, load_averages, median_seconds, memory_status,  # noqa: E402
                            reset_peak_rss, roofline, run_worker, threads_label, torch_version, training_flops)

SHAPES = {
    "110m": dict(dim=768, n_layers=12, n_heads=12, vocab_size=32000, tie_embeddings=True),
    "quick": dict(dim=128, n_layers=4, n_heads=4, vocab_size=512, tie_embeddings=True),
}
TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


def release_and_reset_peak():
    """Hand freed heap pages back to the OS, then restart the kernel's peak-RSS counter (VmHWM)."""
    from npllama.engine.settings import release_freed_memory
    release_freed_memory()
    reset_peak_rss()


def timed_steps(step, warmup, steps):
    """(median seconds of a step, peak RSS in MB over the timed steps)."""
    for _ in range(warmup):
        step()
    release_and_reset_peak()
    return median_seconds(step, steps), memory_status()["VmHWM"] / MB


def batch(cfg, B, T):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (B, T + 1))
    return np.ascontiguousarray(tokens[:, :-1]), np.ascontiguousarray(tokens[:, 1:])


def run_npllama(cfg, mode, B, T, rank, warmup, steps, threads, checkpointing):
    import npllama
    from npllama.engine import FusedAdamW
    from npllama.engine.settings import set_blas_threads
    from npllama.llama import LoraLlama
    from npllama.lora import LoraSpec
    set_blas_threads(threads)
    model = npllama.Llama(cfg, seed=0)
    weight_bytes = sum(p.nbytes for p in model.params.values())
    if mode == "lora":
        model = LoraLlama(model, LoraSpec(rank=rank, alpha=2.0 * rank, targets=TARGETS), seed=0)
    model.gradient_checkpointing = checkpointing
    opt = FusedAdamW(model.params, lr=1e-4, workers=threads)      # the optimizer `npllama train` runs
    x, y = batch(cfg, B, T)

    def step():
        _, grads = model.loss_and_grads(x, y, workers=threads)
        npllama.clip_grad_norm(grads, 1.0)
        opt.step(grads)

    seconds, peak = timed_steps(step, warmup, steps)
    return dict(seconds=seconds, peak_mb=peak, weight_mb=weight_bytes / MB, threads=threads)


def run_torch(cfg, mode, B, T, rank, warmup, steps, threads, checkpointing):
    import torch
    import torch.nn as nn
    from tools.torch_llama import TorchLlama
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = TorchLlama(cfg)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if mode == "lora":
        class LoraLinear(nn.Module):
            """PEFT's LoRA on a frozen nn.Linear: base(x) + s * B(A(x)), A kaiming-uniform, B = 0."""

            def __init__(self, base, r, alpha):
                super().__init__()
                self.base, self.scale = base, alpha / r
                self.lora_A = nn.Parameter(torch.empty(r, base.in_features))
                self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))
                nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

            def forward(self, x):
                return self.base(x) + (x @ self.lora_A.T @ self.lora_B.T) * self.scale

        for p in model.parameters():
            p.requires_grad_(False)
        for layer in model.layers:
            for parent, names in ((layer.attention, TARGETS[:4]), (layer.feed_forward, TARGETS[4:])):
                for name in names:
                    setattr(parent, name, LoraLinear(getattr(parent, name), rank, 2.0 * rank))
    if checkpointing:                   # torch.utils.checkpoint around every block, as HF's gradient_checkpointing
        from torch.utils.checkpoint import checkpoint
        for layer in model.layers:
            layer.forward = partial(checkpoint, layer.forward, use_reentrant=False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    x, y = (torch.from_numpy(a) for a in batch(cfg, B, T))

    def step():
        opt.zero_grad(set_to_none=True)
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()

    seconds, peak = timed_steps(step, warmup, steps)
    return dict(seconds=seconds, peak_mb=peak, weight_mb=weight_bytes / MB, threads=threads)


def run_here(args, side, mode, threads):
    """One (side, mode, threads) measurement in this process."""
    import npllama
    cfg = npllama.LlamaConfig(**SHAPES[args.shape], max_seq_len=args.seq)
    run = run_npllama if side == "npllama" else run_torch
    return run(cfg, mode, args.batch, args.seq, args.rank, args.warmup, args.steps, threads,
               args.gradient_checkpointing)


def measure(args, side, mode, threads):
    """One (side, mode, threads) measurement: in its own process, or in this one with --quick."""
    if args.quick:              # small shapes: the memory figures mean little, the startup would dominate
        return run_here(args, side, mode, threads)
    return run_worker(__file__, "--worker", side, "--mode-one", mode, "--shape", args.shape, "--batch", str(args.batch),
                      "--seq", str(args.seq), "--rank", str(args.rank), "--warmup", str(args.warmup),
                      "--steps", str(args.steps), "--threads", str(threads),
                      *(["--gradient-checkpointing"] if args.gradient_checkpointing else []))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a small shape (dim 128, 4 layers), every run in this process: under 30 s")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="110m")
    parser.add_argument("--modes", default="lora,full", help="comma-separated: lora, full")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per process (median)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of every process, interleaved (medians)")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="both sides recompute each block in backward (npllama: model.gradient_checkpointing; "
                             "torch: torch.utils.checkpoint around every block)")
    parser.add_argument("--worker", choices=["npllama", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--mode-one", dest="mode", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(run_here(args, args.worker, args.mode, args.threads)))
        return 0
    if args.quick:
        args.shape, args.batch, args.seq, args.steps, args.repeats = "quick", 4, 64, 2, 1
    use_torch = torch_version() is not None and not args.no_torch
    import npllama
    cfg = npllama.LlamaConfig(**SHAPES[args.shape], max_seq_len=args.seq)
    print(f"numpy {np.__version__}, torch {torch_version() or 'not installed'}, {os.cpu_count()} cores, load average {load_averages()}")
    print(f"shape {args.shape}: dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads} heads, vocab {cfg.vocab_size}, "
          f"{'tied' if cfg.tie_embeddings else 'untied'} ({cfg.n_params() / 1e6:.1f}M params, "
          f"{cfg.n_params() * 4 / MB:.0f} MB float32); batch {args.batch} x {args.seq} tokens; LoRA rank "
          f"{args.rank} on {','.join(TARGETS)}{'; gradient checkpointing' if args.gradient_checkpointing else ''}")
    tokens = args.batch * args.seq
    peaks = gemm_peaks()
    print(f"NumPy float32 GEMM peak {peaks[1] / 1e9:,.0f} GFLOP/s on 1 thread, {peaks[2] / 1e9:,.0f} on 2; roofline: "
          "each side's model matmul FLOP/s (no recomputation counted) against them")
    for mode in args.modes.split(","):
        sides = ["npllama"] + (["torch"] if use_torch else [])
        runs = {(side, threads): [] for side in sides for threads in PEER_THREADS}
        for _ in range(args.repeats):
            for side, threads in runs:
                runs[side, threads].append(measure(args, side, mode, threads))

        def best(side):
            """(seconds, peak MB, threads) of the side's faster thread count, medians over the repeats."""
            threads = min(PEER_THREADS, key=lambda t: statistics.median(r["seconds"] for r in runs[side, t]))
            rs = runs[side, threads]
            return statistics.median(r["seconds"] for r in rs), statistics.median(r["peak_mb"] for r in rs), threads

        weight_mb = runs["npllama", 1][0]["weight_mb"]
        flops = training_flops(cfg, args.batch, args.seq, weight_grads=mode == "full")
        line = f"  {mode:4}"
        for side in sides:
            seconds, peak, threads = best(side)
            line += (f" | {side} {tokens / seconds:7,.0f} tok/s ({threads_label(threads)}), "
                     f"peak {peak:5,.0f} MB = {peak / weight_mb:.2f} x weights")
        if use_torch:
            line += f" | speed ratio npllama / torch {best('torch')[0] / best('npllama')[0]:.2f}"
        print(line)
        for side in sides:
            print(f"       {side} roofline {roofline(flops / best(side)[0], peaks)}")
        sys.stdout.flush()
    print(f"load average at the end {load_averages()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
