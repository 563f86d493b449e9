"""Data parallelism (mpiexec -n N npllama train): measured on this machine, and modelled for N machines.

    python tools/bench_ddp.py                        # bench_train's default cfg, then the cost model
    python tools/bench_ddp.py --configs default b    # others of bench_train's cfgs
    python tools/bench_ddp.py --quick                # small shapes, a few seconds a side (CI)
    python tools/bench_ddp.py --model-only           # the cost model alone (it times one step per cfg)

Here: the same global batch trained by 1 process with 2 BLAS threads (and the engine's 2 shard
threads) against 2 ranks of 1 thread each (`mpiexec -n 2`, each pinned to its core: train/
distributed.py share_cores). A step is npllama.train.train_step, as `npllama train` runs it:
forward and backward of this rank's rows, one Allreduce of the flat gradient, clipping, AdamW.
Each side runs in fresh processes (this script with --worker), the two taking turns round by
round, so other load on the machine slows both alike; the figure is the median over rounds of
each side's median step. The 2-rank side also times an Allreduce of a gradient-sized array alone.

Cost model: N machines, each with the cfg's batch (the global batch N x B), connected by a
network of bandwidth W. A ring Allreduce sends and receives 2(N-1)/N x G bytes per rank for a
gradient of G bytes, in 2(N-1) messages; with no overlap of communication and computation,

    step(N) = compute + 2(N-1)/N x G / W + 2(N-1) x latency,    efficiency = compute / step(N)

compute being one step measured here in one process. The table gives the communication time
at N = 8 and the largest N that keeps 80% efficiency, at 1, 10 and 100 Gb/s.

Timing figures from a busy machine are noise: the load average is printed before and after.
Exit code 0 once it has measured; 2 without mpiexec and mpi4py (pip install -e '.[mpi]').
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import npllama  # noqa: E402
from bench_train import CONFIGS, QUICK_CONFIGS, describe  # noqa: E402
from npllama.engine import FusedAdamW  # noqa: E402
from npllama.train import distributed, train_step  # noqa: E402

BANDWIDTHS = (1, 10, 100)         # Gb/s
LATENCY = 20e-6                   # seconds per message of the ring (TCP over Ethernet: 10-50 us)
EFFICIENCY = 0.8
MAX_N = 1 << 20


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def model_and_batch(name: str, quick: bool):
    """The cfg's model (float32, seed 0) and one global batch (B, T) of its shape."""
    fields, B, T = (QUICK_CONFIGS if quick else CONFIGS)[name]
    cfg = npllama.LlamaConfig(**fields)
    rng = np.random.default_rng(0)
    return npllama.Llama(cfg, seed=0), rng.integers(0, cfg.vocab_size, (B, T)), rng.integers(0, cfg.vocab_size, (B, T))


def time_steps(model, x, y, world, steps: int) -> list[float]:
    """Seconds of each of `steps` training steps (after an untimed one), as `npllama train` runs them."""
    optimizer = FusedAdamW(model.params, lr=1e-4, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        train_step(model, optimizer, [(x, y)], 1e-4, 1.0, world)
        times.append(time.perf_counter() - t0)
    return times[1:]


def worker(name: str, quick: bool, steps: int) -> None:
    """One side's turn (a rank of an mpiexec job, or one process): JSON of its step times on stdout (rank 0)."""
    world = distributed.connect("bench_ddp")
    with world.share_cores():
        model, x, y = model_and_batch(name, quick)
        step = time_steps(model, x, y, world, steps)
        allreduce = []
        if world.size > 1:                  # the Allreduce alone, on an array the size of the gradient
            flat = np.ones(model.n_params(), dtype=np.float32)
            for _ in range(steps + 1):
                world.broadcast_int(0)      # start together
                t0 = time.perf_counter()
                world.allreduce_sum_(flat)
                allreduce.append(time.perf_counter() - t0)
            allreduce = allreduce[1:]
        world.close()
    if world.rank == 0:
        print(json.dumps({"step": step, "allreduce": allreduce}), flush=True)


def run_side(mpiexec: str | None, name: str, quick: bool, steps: int) -> dict:
    """One turn of a side in fresh processes: 2 ranks under mpiexec, or 1 process."""
    command = [sys.executable, __file__, "--worker", name, "--steps", str(steps)] + (["--quick"] if quick else [])
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run(([mpiexec, "-n", "2"] if mpiexec else []) + command, capture_output=True, text=True,
                          env=env, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"bench_ddp: a {'2-rank' if mpiexec else '1-process'} turn failed: {done.stderr.strip()}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(mpiexec: str, name: str, quick: bool, rounds: int, steps: int) -> float:
    """Print one cfg's 1-process and 2-rank figures; returns the 1-process seconds a step."""
    fields, B, T = (QUICK_CONFIGS if quick else CONFIGS)[name]
    one, two, allreduce = [], [], []
    for r in range(rounds):
        for side in ((None, mpiexec) if r % 2 == 0 else (mpiexec, None)):
            result = run_side(side, name, quick, steps)
            (two if side else one).append(float(np.median(result["step"])))
            allreduce += result["allreduce"]
    t1, t2, ta = (float(np.median(v)) for v in (one, two, allreduce))
    print(f"  {'1 process, 2 threads':<24}{t1 * 1e3:9.1f} ms a step {B * T / t1:12,.0f} tokens/s")
    print(f"  {'2 ranks, 1 thread each':<24}{t2 * 1e3:9.1f} ms a step {B * T / t2:12,.0f} tokens/s"
          f"   ({t1 / t2:.2f}x the 1-process speed)")
    n_params = npllama.LlamaConfig(**fields).n_params()
    print(f"  Allreduce of the gradient ({n_params * 4 / 1e6:.2f} MB, float32) alone: {ta * 1e3:.2f} ms, "
          f"{ta / t2:.1%} of the 2-rank step")
    return t1


def comm_seconds(n: int, grad_bytes: float, gbps: float) -> float:
    """Ring Allreduce time: 2(N-1)/N x G bytes at W, plus 2(N-1) message latencies."""
    return 2 * (n - 1) / n * grad_bytes * 8 / (gbps * 1e9) + 2 * (n - 1) * LATENCY


def largest_n(compute: float, grad_bytes: float, gbps: float) -> int:
    """The largest N with compute / (compute + comm(N)) >= EFFICIENCY (comm grows with N), by bisection."""
    def ok(n):
        return compute / (compute + comm_seconds(n, grad_bytes, gbps)) >= EFFICIENCY
    if not ok(2):
        return 1
    lo, hi = 2, MAX_N
    if ok(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def cost_model(names: list[str], quick: bool, measured: dict) -> None:
    """The cost-model table (module docstring), timing one step of each cfg not measured yet."""
    print(f"\ncost model: N machines, each with the cfg's batch; ring Allreduce of the float32 gradient G, "
          f"{LATENCY * 1e6:.0f} us a message, no overlap; compute = one step here (1 process)")
    head = "".join(f" | {f'{w} Gb/s: N=8 comm, N at 80%':>27}" for w in BANDWIDTHS)
    print(f"  {'cfg':<9}{'params':>12}{'G (MB)':>9}{'compute':>10}{head}")
    for name in names:
        fields, B, T = (QUICK_CONFIGS if quick else CONFIGS)[name]
        n_params = npllama.LlamaConfig(**fields).n_params()
        if name not in measured:
            model, x, y = model_and_batch(name, quick)
            measured[name] = float(np.median(time_steps(model, x, y, distributed.World(), 2)))
        compute, grad_bytes = measured[name], 4.0 * n_params
        cells = "".join(f" | {comm_seconds(8, grad_bytes, w) * 1e3:10.1f} ms, {largest_n(compute, grad_bytes, w):>8,}"
                        f"{'+' if largest_n(compute, grad_bytes, w) == MAX_N else ' '}      " for w in BANDWIDTHS)
        print(f"  {name:<9}{n_params:>12,}{grad_bytes / 1e6:>9.1f}{compute * 1e3:>8.0f}ms{cells}")
    print(f"  ({MAX_N:,}+: the latency term alone keeps it above 80% up to there)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--configs", nargs="+", help="bench_train cfgs to measure here (default: its first)")
    ap.add_argument("--quick", action="store_true", help="bench_train's small shapes: seconds (CI)")
    ap.add_argument("--rounds", type=int, default=4, help="turns of each side")
    ap.add_argument("--steps", type=int, default=5, help="timed steps in a turn")
    ap.add_argument("--model-only", action="store_true", help="only the cost model")
    ap.add_argument("--worker", metavar="CFG", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.quick, args.steps)
        return 0
    table = QUICK_CONFIGS if args.quick else CONFIGS
    names = args.configs or [next(iter(table))]
    unknown = [n for n in names if n not in table]
    if unknown:
        ap.error(f"unknown cfg {unknown}; choose from {list(table)}")
    print(f"load average {load_average()} (1, 5, 15 min) on {os.cpu_count()} cores")
    measured = {}
    if not args.model_only:
        sibling = Path(sys.executable).parent / "mpiexec"
        mpiexec = str(sibling) if sibling.exists() else shutil.which("mpiexec")
        if not (mpiexec and importlib.util.find_spec("mpi4py")):
            print("bench_ddp: needs mpiexec and mpi4py: pip install -e '.[mpi]'", file=sys.stderr)
            return 2
        for name in names:
            fields, B, T = table[name]
            print(f"{name}: {describe(npllama.LlamaConfig(**fields), B, T)}, the same global batch on both sides")
            measured[name] = compare(mpiexec, name, args.quick, args.rounds, args.steps)
    cost_model(list(table), args.quick, measured)
    print(f"load average {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
