"""Memory: what an allocation will take, worked out from sizes before it is made, and what is free.

Every number a user or a file supplies that sizes an array (dim, n_layers, vocab_size,
max_seq_len, batch, a llama2.c or safetensors header) goes through an estimate here first, and
`require` refuses what cannot fit with "needs X GiB, Y GiB available" before anything is
allocated: a typo such as --dim 65536 or a flipped bit in a header is an error in microseconds,
not a MemoryError, a swapping machine or the kernel's OOM killer minutes later.

The estimates, in bytes (itemsize: bytes per element of the dtype the arrays are kept in):

    model_bytes        the parameters (LlamaConfig.n_params, a closed form) and the RoPE tables
    rope_bytes         cos and sin, (max_seq_len, Dh/2) each
    kv_cache_bytes     keys (L, B, KVH, Dh, S) and values with a ones column (L, B, KVH, S, Dh + 1)
    activation_bytes   the caches a forward of `rows` windows keeps for the backward, and one
                       layer's temporaries
    pass_bytes         Llama.forward / loss_and_grads on a batch: the activations of the rows
                       processed at once (npllama.engine.pass_footprint), the engine's stacked
                       weights, the shards' gradients until summed, the logits
    training_bytes     a run: the model, both AdamW moments and its scratch, and one step
    lora_bytes         LoRA adapters, A (r, in) and B (out, r) for each adapted matrix
    generate_bytes     decoding: the KV cache, the decode step's stacked weights, the prefill
    gradcheck_bytes    `npllama gradcheck`: float64 parameters and gradients, the reference pass,
                       the op checks' inputs and their central differences
(tests/test_memory.py holds these against tracemalloc's peaks, on drawn configs.)

What is free (`available_bytes`): the smallest of
    /proc/meminfo's MemAvailable (else the free pages sysconf reports),
    the cgroup's memory limit minus its usage, when the process runs under one (cgroup v2
        memory.max, or v1 memory.limit_in_bytes, this cgroup's or an ancestor's),
    the address-space limit (RLIMIT_AS, `ulimit -v`) minus the process's virtual size (VmSize,
        /proc/self/statm: every mapping counts, not only what is resident, and NumPy and OpenBLAS
        reserve hundreds of MB at import), less THREAD_RESERVE for each CPU (the stack and malloc
        arena a worker thread maps when it starts);
None where none of these exist, and then nothing is refused.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

from .config import LlamaConfig
from .errors import MemoryLimitError

GiB = 1 << 30
INIT_CHUNK_BYTES = 8 << 13    # the float64 draws init_params holds at once (model.INIT_CHUNK of them)
# Below this an estimate is not checked: reading /proc costs ~20 us, more than a decode step's
# worth of small allocations is ever at stake.
CHECK_FLOOR = 64 << 20
# Address space a worker thread maps when it starts: an 8 MiB stack and a 64 MiB glibc malloc arena
# (measured: a training step on 2 threads grew the virtual size by 212 MiB).
THREAD_RESERVE = 80 << 20


# ----------------------------------------------------------------------------- estimates

def rope_bytes(config: LlamaConfig, itemsize: int) -> int:
    """cos and sin tables, (max_seq_len, Dh/2) each in the model's dtype, and while they are built
    the float64 angles and one float64 table (ops/rope.py rounds them once)."""
    return config.max_seq_len * (config.head_dim // 2) * (2 * 8 + 2 * itemsize)


def model_bytes(config: LlamaConfig, itemsize: int) -> int:
    """A model's parameters and RoPE tables; plus, while a fresh one is initialised, one float64
    chunk of its draw (init_params draws in bounded chunks, then rounds into the parameters)."""
    return config.n_params() * itemsize + rope_bytes(config, itemsize) + INIT_CHUNK_BYTES


def kv_cache_bytes(config: LlamaConfig, batch_size: int, itemsize: int, positions: int | None = None) -> int:
    """The decode cache: keys (L, B, KVH, Dh, S) and values with a ones column (L, B, KVH, S, Dh + 1),
    S = positions (a generation's prompt and new tokens; default max_seq_len)."""
    per_row = config.n_layers * config.n_kv_heads * config.cache_positions(positions) * (2 * config.head_dim + 1)
    return batch_size * per_row * itemsize


def activation_bytes(config: LlamaConfig, rows: int, seq_len: int, itemsize: int, causal_half: bool = False) -> int:
    """The caches of a forward of `rows` windows of seq_len tokens, kept for the backward.
    Per layer and token they hold ~8 vectors of D, 6 of F and 3 of the q/k/v width, plus the
    attention probabilities (rows, H, T, T), of which the training pass keeps the causal half
    (causal_half: engine/attention.py's blocks); one layer's temporaries add two more of those.
    """
    D, F, H, KVH, Dh = config.dim, config.hidden_dim, config.n_heads, config.n_kv_heads, config.head_dim
    tokens, scores = rows * seq_len, rows * H * seq_len * seq_len
    if causal_half:
        scores //= 2
    per_layer = tokens * (8 * D + 6 * F + 3 * (H + 2 * KVH) * Dh) + scores
    return itemsize * (config.n_layers * per_layer + 2 * scores)


def running_layer_bytes(config: LlamaConfig, rows: int, seq_len: int, itemsize: int) -> int:
    """A forward that keeps nothing (engine/passes.py): the one block running holds, per token,
    ~10 vectors of D, 4 of F and the q/k/v width, and the scores of one query block (64
    positions, engine/attention.py) against every key, twice (the scores and their exp)."""
    D, F, H, KVH, Dh = config.dim, config.hidden_dim, config.n_heads, config.n_kv_heads, config.head_dim
    tokens = rows * seq_len
    return itemsize * (tokens * (10 * D + 4 * F + (H + 2 * KVH) * Dh) + 2 * rows * H * min(seq_len, 64) * seq_len)


def pass_bytes(config: LlamaConfig, batch_size: int, rows_in_flight: int, seq_len: int, itemsize: int,
               partial_grads: int = 0) -> int:
    """A forward (partial_grads=0) or a forward and backward (partial_grads: the shards, each with
    its own gradients until they are summed) over batch_size windows of an existing model, of
    which rows_in_flight are processed at once. A forward (engine/passes.py, which keeps no
    caches): the engine's stacked copy of the weights (for a model not laid out flat), one
    layer's activations, and four arrays of logits' size (N, V): the whole batch's, gathered
    from the shards, concatenated, and what its caller's loss makes of them. A training pass:
    the gradients, the shards' terms held until summed, the activations with the causal half of
    the attention probabilities, and the logits of the rows in flight, whose softmax and
    gradient are computed in place (two arrays of their size)."""
    params = config.n_params() * itemsize
    if not partial_grads:
        logits = 4 * batch_size * seq_len * config.vocab_size * itemsize
        return params + running_layer_bytes(config, rows_in_flight, seq_len, itemsize) + logits
    logits = 2 * rows_in_flight * seq_len * config.vocab_size * itemsize
    return partial_grads * params + activation_bytes(config, rows_in_flight, seq_len, itemsize, True) + logits


def training_bytes(config: LlamaConfig, batch_size: int, rows_in_flight: int, seq_len: int, itemsize: int,
                   partial_grads: int) -> int:
    """A training run: the model (model_bytes), AdamW's two moments and its scratch, and the largest
    of a step (pass_bytes with the shards' gradients), an evaluation (a forward of the batch) and
    the sample printed after it (generate_bytes of one short prompt, the weights stacked)."""
    step = pass_bytes(config, batch_size, rows_in_flight, seq_len, itemsize, partial_grads)
    evaluation = pass_bytes(config, batch_size, rows_in_flight, seq_len, itemsize)
    sample = generate_bytes(config, 1, 8, itemsize, config.n_params() * itemsize)
    return model_bytes(config, itemsize) + 3 * config.n_params() * itemsize + max(step, evaluation, sample)


def lora_bytes(config: LlamaConfig, rank: int, targets, itemsize: int) -> int:
    """LoRA adapters of `rank` on the projections `targets` (e.g. ("wq", "wv")) of every layer:
    A (r, in) and B (out, r) each, and the float64 draw of one A while it is initialised."""
    shapes = {name.rsplit(".", 2)[-2]: shape for name, shape in config.param_shapes().items()
              if name.startswith("layers.0.") and name.endswith("weight") and len(shape) == 2}
    per_layer = sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets)
    largest_a = max((rank * shapes[t][1] for t in targets), default=0)
    return config.n_layers * per_layer * itemsize + 8 * largest_a


def generate_bytes(config: LlamaConfig, batch_size: int, prompt_len: int, itemsize: int, stacked_bytes: int,
                   scores_in_blocks: bool = False, positions: int | None = None) -> int:
    """Decoding batch_size prompts of up to prompt_len tokens from a model already held: the KV
    cache of `positions` (default max_seq_len); stacked_bytes, the weights' copy the decode step
    keeps (engine.decode: stacked for small models, none for large ones); the prefill: the
    reference's forward keeps every layer's caches, the attention probabilities (B, H, P, P)
    whole, and the logits of every position (model.forward returns them all); the engine's
    (scores_in_blocks) runs one layer at a time, its attention in query blocks
    (running_layer_bytes); its mask, and a layer's weights stacked or upcast; each step's logits
    and the sampling's copies of them, (B, V) a few times."""
    one_layer = config.replace(n_layers=1)
    layer_weights = (one_layer.n_params() - config.vocab_size * config.dim * (1 if config.tie_embeddings else 2)
                     - config.dim) * itemsize
    if scores_in_blocks:
        layer = running_layer_bytes(one_layer, batch_size, prompt_len, itemsize)
    else:
        scores = batch_size * config.n_heads * prompt_len ** 2 * itemsize        # one more temporary of them
        all_logits = batch_size * prompt_len * config.vocab_size * itemsize      # (B, P, V): every position's
        layer = activation_bytes(config, batch_size, prompt_len, itemsize) + scores + all_logits
    prefill = layer + batch_size * prompt_len ** 2 + layer_weights
    logits = 6 * batch_size * config.vocab_size * 8
    return kv_cache_bytes(config, batch_size, itemsize, positions) + stacked_bytes + prefill + logits


def gradcheck_bytes(config: LlamaConfig, batch_size: int, seq_len: int) -> int:
    """`npllama gradcheck` (cli/gradcheck.py), all in float64: the parameters and their gradients,
    kept from the first pass to the end, with the larger of
      - the perturbation of the largest weight (two temporaries of its size),
      - the reference forward and backward (its caches, the logits, probabilities and their
        gradient (B, T, V), the gradients it returns),
      - the op checks: every op's inputs at once, and for the largest check its copies of them,
        the analytic and numerical gradients, the outputs and caches of its forward calls;
    and, before all of it, the speed probe of its time estimate (npllama.work.MachineSpeed.measure:
    two float64 arrays of 2**16 elements, two of 128 x 128).
    """
    B, T, D, F, V = batch_size, seq_len, config.dim, config.hidden_dim, config.vocab_size
    H, KVH, Dh = config.n_heads, config.n_kv_heads, config.head_dim
    params = 8 * config.n_params()
    largest = 8 * max(V * D, F * D, H * Dh * D)
    reference_pass = activation_bytes(config, B, T, 8) + 8 * 4 * B * T * V + params
    # (inputs, outputs with caches) of each op check, in elements
    ops = [(V * D, B * T * D), (B * T * D + D, 2 * B * T * D), (B * T * D + F * D, B * T * F + B * T * D),
           (B * H * T * Dh, B * H * T * Dh), ((H + 2 * KVH) * B * T * Dh, 3 * B * H * T * Dh + B * H * T * T),
           (2 * B * T * F, 3 * B * T * F), (B * T * V, 2 * B * T * V)]
    checks = 8 * (sum(i for i, _ in ops) + max(3 * i + 4 * o for i, o in ops))
    speed_probe = 8 * (2 * (1 << 16) + 2 * 128 * 128)
    return max(speed_probe, params + max(2 * largest, reference_pass, params + checks))


def array_bytes(count: int, itemsize: int) -> int:
    """count elements of itemsize bytes: a tensor read from a file, or its cast to the model's dtype."""
    return count * itemsize


# ----------------------------------------------------------------------------- what is free

def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None      # "max" (no limit) reads as None


def _meminfo_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024      # reported in kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_headroom(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Limit minus usage of the tightest memory cgroup this process is in (and its ancestors)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    headrooms = []
    for line in lines:
        _, controllers, rel = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":                                   # v2: "0::/path"
            base, limit_name, usage_name = root, "memory.max", "memory.current"
        elif "memory" in controllers.split(","):                # v1: "4:memory:/path"
            base, limit_name, usage_name = root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        folder = base / rel.strip().lstrip("/")
        while True:                                             # a parent's limit binds too
            limit, usage = _read_int(folder / limit_name), _read_int(folder / usage_name)
            if limit is not None and limit < 1 << 60:           # v1 writes a huge number for "none"
                headrooms.append(max(0, limit - (usage or 0)))
            if folder == base or base not in folder.parents:
                break
            folder = folder.parent
    return min(headrooms) if headrooms else None


def _sysconf_available() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _virtual_size(statm: Path = Path("/proc/self/statm")) -> int | None:
    """The process's virtual size (VmSize) in bytes: the first field of statm, in pages."""
    try:
        return int(statm.read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _address_space_headroom(statm: Path = Path("/proc/self/statm")) -> int | None:
    """RLIMIT_AS (soft) minus the virtual size and the threads' reserve; None without a limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    used = _virtual_size(statm)
    if used is None:
        return None
    return max(0, soft - used - THREAD_RESERVE * (os.cpu_count() or 1))


def available_bytes() -> int | None:
    """Bytes this process may still allocate (see the module docstring), or None when unknown."""
    memory = _meminfo_available()
    if memory is None:
        memory = _sysconf_available()
    figures = [f for f in (memory, _cgroup_headroom(), _address_space_headroom()) if f is not None]
    return min(figures) if figures else None


def gib(nbytes: int) -> str:
    """nbytes in GiB, as the messages print it: '824.0', '1.25', '0.06'."""
    value = nbytes / GiB
    return f"{value:,.1f}" if value >= 10 else f"{value:.2f}"


def require(nbytes: int, what: str, hint: str = "") -> None:
    """Refuse, before allocating, what cannot fit: MemoryLimitError
    "{what} needs X GiB, Y GiB available; {hint}". Estimates under CHECK_FLOOR pass unchecked."""
    if nbytes <= CHECK_FLOOR:
        return
    available = available_bytes()
    if available is not None and nbytes > available:
        bound = " (the address-space limit, ulimit -v)" if available == _address_space_headroom() else ""
        raise MemoryLimitError(f"{what} needs {gib(nbytes)} GiB, {gib(available)} GiB available{bound}"
                               + (f"; {hint}" if hint else ""))
