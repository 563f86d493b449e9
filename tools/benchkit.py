"""What the benchmarks in tools/ measure alike: the machine's load, peak memory, threads and time.

On a shared machine every figure moves with whatever else runs, so each benchmark prints the
load average its figures ran under, lets the contenders take turns (take_turns) and reports
medians. PyTorch, the peer, gets its better of 1 and 2 threads (PEER_THREADS). Memory comes from
Linux's /proc/self/status: VmHWM is the peak resident memory, which reset_peak_rss restarts.
Workers in fresh processes (so that peaks and thread pools never mix) answer with one JSON line.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import time

PEER_THREADS = (1, 2)          # torch.set_num_threads values the peer runs with; its faster one counts
MB = 1 << 20


def load_average() -> float:
    """The 1-minute load average: how many processes wanted a CPU, on average, lately."""
    return os.getloadavg()[0]


def load_averages() -> str:
    """The 1-, 5- and 15-minute load averages, as printed: "1.02 1.20 1.31"."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def torch_version() -> str | None:
    """The installed torch's version, or None without torch (the benchmarks then measure npllama
    alone). Read from its package metadata: importing torch here would start its thread pools."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def threads_label(n: int) -> str:
    return f"{n} thread{'s' if n > 1 else ''}"


def memory_status() -> dict[str, int]:
    """This process's memory counters in bytes, from /proc/self/status (Linux): VmRSS (resident
    now), VmHWM (the peak since the start or reset_peak_rss), RssAnon, RssFile and the others."""
    with open("/proc/self/status") as f:
        return {key: int(value.split()[0]) * 1024 for key, _, value in (line.partition(":") for line in f)
                if value.strip().endswith(" kB")}


def can_reset_peak_rss() -> bool:
    return os.path.exists("/proc/self/clear_refs")


def reset_peak_rss() -> None:
    """Restart the kernel's count of this process's peak resident memory (VmHWM) from now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def median_seconds(fn, repeats: int, warmup: int = 0) -> float:
    """The median seconds of `repeats` calls of fn, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def calls_per_turn(fn, seconds: float, most: int = 20) -> int:
    """How many calls of fn fill about `seconds` (1 to `most`), from one timed call."""
    start = time.perf_counter()
    fn()
    return max(1, min(most, round(seconds / max(time.perf_counter() - start, 1e-6))))


def take_turns(fns: dict, rounds: int, calls: dict | None = None, switch: bool = False) -> dict[str, float]:
    """{name: median over the rounds of seconds per call}: the functions take turns, round after round.

    The order alternates between rounds, so neither side always follows the other, and load
    from elsewhere falls on all alike. Each turn times calls[name] calls (default 1), after one
    untimed call when `switch` (the switch from the other side is paid there: waking thread
    pools, refilling caches).
    """
    times = {name: [] for name in fns}
    for r in range(rounds):
        for name in (list(fns) if r % 2 == 0 else list(reversed(fns))):
            if switch:
                fns[name]()
            n = calls[name] if calls else 1
            start = time.perf_counter()
            for _ in range(n):
                fns[name]()
            times[name].append((time.perf_counter() - start) / n)
    return {name: statistics.median(t) for name, t in times.items()}


def start_worker(script: str, *args: str) -> subprocess.Popen:
    """Run `python script args...` as a fresh process (a benchmark calling itself as a worker)."""
    return subprocess.Popen([sys.executable, script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def worker_result(proc: subprocess.Popen) -> dict:
    """The JSON object a worker printed as its last line; RuntimeError with its stderr when it failed."""
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(proc.args)} failed ({proc.returncode}):\n{err[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


def run_worker(script: str, *args: str) -> dict:
    """start_worker and wait for its worker_result."""
    return worker_result(start_worker(script, *args))


# ----------------------------------------------------------------------------- roofline

def gemm_peak(threads: int, n: int = 1024, repeats: int = 9) -> float:
    """FLOP/s of one float32 (n, n) @ (n, n) NumPy matmul on `threads` BLAS threads, its fastest of
    `repeats` (a peak: what the machine gives when nothing else takes it): the GEMM peak as NumPy
    reaches it, what a training step's FLOP/s are held against."""
    import numpy as np
    from npllama.engine.settings import blas_threads
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    out = np.empty_like(a)
    with blas_threads(threads):
        for _ in range(2):
            np.matmul(a, a, out=out)
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            np.matmul(a, a, out=out)
            seconds.append(time.perf_counter() - start)
    return 2 * n ** 3 / min(seconds)


def gemm_peaks() -> dict[int, float]:
    """{threads: gemm_peak(threads)} for 1 and 2 threads."""
    return {threads: gemm_peak(threads) for threads in (1, 2)}


def linear_weight_shapes(cfg) -> list[tuple[int, int]]:
    """(out, in) of every weight matrix a token goes through, fused as the engine fuses them: each
    block's q|k|v, wo, w1|w3 and w2, then the classifier."""
    D, Dh, H, KVH, F = cfg.dim, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.hidden_dim
    return [((H + 2 * KVH) * Dh, D), (D, H * Dh), (2 * F, D), (D, F)] * cfg.n_layers + [(cfg.vocab_size, D)]


def linear_flops(cfg, tokens: int) -> float:
    """The forward FLOPs of the linear layers (every block's projections and the classifier) over
    `tokens` tokens: 2 per weight per token. Backward's are twice these."""
    return 2 * tokens * sum(n * m for n, m in linear_weight_shapes(cfg))


def training_flops(cfg, batch_size: int, seq_len: int, weight_grads: bool = True) -> float:
    """The matmul FLOPs of one training step of the model (no recomputation counted, as MFU counts).

    Forward, per token: 2 x (every block's projections + the classifier), plus causal attention's
    q k^T and P v, 4 Dh (t + 1) per head for the query at position t. Backward: twice the forward
    (the inputs' gradients and the weights'), or with weight_grads False (LoRA: frozen weights)
    the inputs' gradients alone for the projections and classifier, the adapters' own FLOPs
    (a percent at rank 8) not counted.
    """
    linear = linear_flops(cfg, batch_size * seq_len)
    attention = batch_size * cfg.n_layers * cfg.n_heads * 4 * cfg.head_dim * seq_len * (seq_len + 1) / 2
    return linear * (3 if weight_grads else 2) + attention * 3


def linear_gemm_floor(cfg, batch_size: int, seq_len: int, workers: int, seed: int = 0):
    """A closure that runs the matmuls of a training step's linear layers and nothing else: for every
    weight W (n, m) the forward y = x W^T, and backward's dx = dy W and dW = dy^T x, with the
    projections fused as the engine fuses them (q|k|v, w1|w3); the batch's rows split evenly among
    `workers` threads, one BLAS thread each, as the engine's passes split them.

    Every exact implementation of the step does these FLOPs (training_flops' linear part), so the
    time the closure takes is a floor under a step that runs them on NumPy's GEMM the way the engine
    does (its shards are these rows or fewer): such a step runs at most (PyTorch's step) / (this)
    times PyTorch's speed. The attention's matmuls, the norms, SwiGLU, the loss and the optimizer
    all come on top."""
    import numpy as np
    from concurrent.futures import ThreadPoolExecutor
    from npllama.engine.settings import blas_threads
    rows = -(-batch_size * seq_len // workers)
    rng = np.random.default_rng(seed)

    def operands(n, m):             # x (rows, m), W (n, m), dy (rows, n); the layers' weights differ
        return (rng.standard_normal((rows, m), dtype=np.float32), rng.standard_normal((n, m), dtype=np.float32),
                rng.standard_normal((rows, n), dtype=np.float32))
    per_worker = [[operands(n, m) for n, m in linear_weight_shapes(cfg)] for _ in range(workers)]
    pool = ThreadPoolExecutor(workers)

    def worker(ops):
        for x, w, dy in ops:
            x @ w.T
            dy @ w
            dy.T @ x

    def step():
        with blas_threads(1):           # OpenBLAS's count is the process's: set here, for every worker
            for done in [pool.submit(worker, ops) for ops in per_worker]:
                done.result()
    step.operands = per_worker          # [(x, W, dy) of each matrix] per worker
    return step


def roofline(flops_per_second: float, peaks: dict[int, float]) -> str:
    """"157 GFLOP/s = 56% of the 2-thread GEMM peak, 112% of the 1-thread one"."""
    return (f"{flops_per_second / 1e9:,.0f} GFLOP/s = {100 * flops_per_second / peaks[2]:.0f}% of the 2-thread "
            f"GEMM peak, {100 * flops_per_second / peaks[1]:.0f}% of the 1-thread one")
