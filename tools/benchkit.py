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


def attention_block_flops(cfg, batch_size: int, seq_len: int, block: int | None = None) -> int:
    """The FLOPs of a training step's attention matmuls run in query blocks of `block` positions (default
    the engine's, engine/attention.py's BLOCK), as the engine runs them with its probabilities kept: six
    products a block, each of 2 Dh FLOPs per score of the block's (block, e) tile of every head (e: the
    keys up to its end)."""
    from npllama.engine.attention import BLOCK
    block = block or BLOCK
    tiles = sum((min(seq_len, s + block) - s) * min(seq_len, s + block) for s in range(0, seq_len, block))
    return 6 * 2 * cfg.head_dim * batch_size * cfg.n_heads * cfg.n_layers * tiles


def training_exps(cfg, batch_size: int, seq_len: int) -> int:
    """The exps of a training step no exact implementation can skip: one per causal score (T (T + 1) / 2
    a head and layer), per gate of SwiGLU's sigmoid (T F a layer) and per logit (T V), each batch row."""
    T = seq_len
    return batch_size * (cfg.n_layers * (cfg.n_heads * T * (T + 1) // 2 + T * cfg.hidden_dim) + T * cfg.vocab_size)


def matmul_exp_floor(cfg, batch_size: int, seq_len: int, workers: int, block: int | None = None, seed: int = 0):
    """linear_gemm_floor's closure, plus the attention's matmuls and the exps: the work of a training
    step that no exact NumPy step can skip, on NumPy's own kernels, each worker on its batch rows.

    The attention, per layer and per query block [s, e) of `block` positions (engine/attention.py's
    BLOCK by default, its blocks and layout: a kv head's R query heads stacked along the rows), with the probabilities kept
    (no recomputation in backward): forward S = q k^T and P v over the keys [0, e); backward
    dP = dO v^T, dq = dS k, dk += dS^T q, dv += P^T dO. Then np.exp once per causal score
    (H T (T + 1) / 2 a row and layer), per gate of SwiGLU's sigmoid (T F a row and layer) and per
    logit of the loss's softmax (T V a row), over contiguous arrays. NumPy's float32 exp costs a few
    ns an element on CPUs where it has no SIMD loop (2.0-2.7 ns on the AMD EPYC with NumPy 2.4,
    against 0.18 for a multiply): there the exps are a floor of their own.

    Left out, and so on top: the score mask and the product dS = P * dP, the norms, RoPE, the rest
    of SwiGLU and of the loss, the residual adds, the shards' gradient sums, clipping and the
    optimizer. The closure carries .attention_flops and .exps, its counts over all workers
    (attention_block_flops and training_exps of workers x its rows)."""
    import numpy as np
    from concurrent.futures import ThreadPoolExecutor
    from npllama.engine.attention import BLOCK
    from npllama.engine.settings import blas_threads
    block = block or BLOCK
    linear = linear_gemm_floor(cfg, batch_size, seq_len, workers, seed)
    rng = np.random.default_rng(seed + 1)
    rows = -(-batch_size // workers)
    T, H, KVH, Dh, F, V = seq_len, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden_dim, cfg.vocab_size
    R = H // KVH
    spans = [(s, min(T, s + block)) for s in range(0, T, block)]

    def normal(*shape, scale=1.0):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    def exp_operands(count, scale):     # the exp's input, and the array it writes
        return normal(count, scale=scale), np.empty(count, dtype=np.float32)

    per_worker = [dict(q=normal(rows, KVH, T * R, Dh, scale=Dh ** -0.5), k=normal(rows, KVH, T, Dh),
                       v=normal(rows, KVH, T, Dh), dout=normal(rows, KVH, T * R, Dh),
                       scores=exp_operands(rows * H * T * (T + 1) // 2, 1.0),
                       gates=exp_operands(rows * T * F, 1.0), logits=exp_operands(rows * T * V, 2.0))
                  for _ in range(workers)]
    pool = ThreadPoolExecutor(workers)

    def attention(q, k, v, dout, dk, dv):
        for s, e in spans:
            at = slice(s * R, e * R)
            P = q[:, :, at] @ k[:, :, :e].swapaxes(-1, -2)
            P @ v[:, :, :e]
            dS = dout[:, :, at] @ v[:, :, :e].swapaxes(-1, -2)
            dS @ k[:, :, :e]
            dk[:, :, :e] += dS.swapaxes(-1, -2) @ q[:, :, at]
            dv[:, :, :e] += P.swapaxes(-1, -2) @ dout[:, :, at]

    def worker(ops):
        dk, dv = np.zeros_like(ops["k"]), np.zeros_like(ops["v"])
        for _ in range(cfg.n_layers):
            attention(ops["q"], ops["k"], ops["v"], ops["dout"], dk, dv)
            np.exp(*ops["scores"])
            np.exp(*ops["gates"])
        np.exp(*ops["logits"])

    def step():
        linear()
        with blas_threads(1):
            for done in [pool.submit(worker, ops) for ops in per_worker]:
                done.result()
    step.operands, step.linear = per_worker, linear
    step.attention_flops = attention_block_flops(cfg, workers * rows, seq_len, block)
    step.exps = training_exps(cfg, workers * rows, seq_len)
    return step


def adamw_traffic_bytes(n_params: int) -> int:
    """The bytes one AdamW step over n_params float32 parameters must move: p, g, m, v read, p, m, v
    written (adamw_traffic_floor)."""
    return 7 * 4 * n_params


def adamw_traffic_floor(n_params: int, threads: int | None = None, seed: int = 0):
    """A closure that moves the memory one AdamW step must move over n_params float32 parameters and
    computes nothing more: the least an exact optimizer step can cost once its arrays outgrow the cache.

    AdamW's new m, v and p each depend on their old values and on the gradient g, so a step reads
    p, g, m and v and writes p, m and v: 7 x 4 bytes a parameter (npllama's fused step makes 13 passes
    over each cache-sized chunk, engine/adamw.py). The closure holds the four arrays flat (as an engine
    model keeps its parameters: views of one array) and runs, chunk by chunk (that module's CHUNK)
    on `threads` threads (default one per core, as the fused step runs), one contiguous run of chunks
    each: m += g, v += g, p += m, each array's chunk read from memory once and g's from the cache the
    second time. Left out: the clip's sum of squares over g (a step could fold it into the gradient
    sums). The closure carries .arrays = (p, g, m, v) and .bytes, the traffic counted (adamw_traffic_bytes)."""
    import numpy as np
    from concurrent.futures import ThreadPoolExecutor
    from npllama.engine.adamw import CHUNK
    from npllama.engine.shards import available_cores
    threads = threads or available_cores()
    rng = np.random.default_rng(seed)
    p, g, m, v = (rng.standard_normal(n_params, dtype=np.float32) for _ in range(4))
    starts = np.arange(0, n_params, CHUNK)
    runs = [run for run in np.array_split(starts, threads) if run.size]
    pool = ThreadPoolExecutor(len(runs))

    def update(run):
        for lo in run:
            hi = lo + CHUNK
            np.add(m[lo:hi], g[lo:hi], out=m[lo:hi])
            np.add(v[lo:hi], g[lo:hi], out=v[lo:hi])
            np.add(p[lo:hi], m[lo:hi], out=p[lo:hi])

    def step():
        for done in [pool.submit(update, run) for run in runs]:
            done.result()
    step.arrays, step.bytes = (p, g, m, v), adamw_traffic_bytes(n_params)
    return step


def training_floor(cfg, batch_size: int, seq_len: int, workers: int, block: int | None = None, seed: int = 0):
    """matmul_exp_floor's closure, then adamw_traffic_floor's over the model's cfg.n_params()
    parameters: the matmuls, the exps and the optimizer's memory traffic of a training step, the
    work no exact NumPy step can skip. Left out, and so on top: the element-wise passes (norms,
    RoPE, the rest of SwiGLU and of the loss, the residual adds, the score mask and dS = P * dP),
    the shards' gradient sums, clipping and the optimizer's arithmetic. Carries .matmul_exp and
    .adamw, the two closures it runs."""
    matmul_exp = matmul_exp_floor(cfg, batch_size, seq_len, workers, block, seed)
    adamw = adamw_traffic_floor(cfg.n_params(), seed=seed + 2)

    def step():
        matmul_exp()
        adamw()
    step.matmul_exp, step.adamw = matmul_exp, adamw
    return step


def roofline(flops_per_second: float, peaks: dict[int, float]) -> str:
    """"157 GFLOP/s = 56% of the 2-thread GEMM peak, 112% of the 1-thread one"."""
    return (f"{flops_per_second / 1e9:,.0f} GFLOP/s = {100 * flops_per_second / peaks[2]:.0f}% of the 2-thread "
            f"GEMM peak, {100 * flops_per_second / peaks[1]:.0f}% of the 1-thread one")
