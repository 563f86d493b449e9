"""The decode step: one new token per row through a KV cache, npllama.model.forward with T = 1, fused.

    step = DecodeStep(params, config, rope, batch_size)
    logits = step(ids, pos, kv_cache)            # ids (B,) at position pos -> logits (B, V)

Equal, up to rounding, to model.forward(params, config, ids[:, None], kv_cache=kv_cache,
start_pos=pos)[:, 0] (tests/engine/ checks 1e-10 in float64). The block is the reference's,
in fewer, larger NumPy calls:
  - the linear layers are a Projections object (engine.projections), one of two layouts chosen
    by the size of the weights: stacked, norm-folded copies for small models, whose steps cost
    per NumPy call, or the parameters read in place for large ones, whose steps cost per byte of
    weights read (and whose weights may be memory-mapped, or held in float16 / bfloat16);
  - one query needs no causal mask: every cached key 0 .. pos is in its past (a left-padded
    batch passes key_bias, -inf on its padded keys);
  - RoPE rotates q and k together with one complex multiply, as Meta's reference does: the
    pair (x[2i], x[2i+1]) read as x[2i] + i x[2i+1], times cos + i sin, is the rotation
        y[2i] = x[2i] cos - x[2i+1] sin,   y[2i+1] = x[2i] sin + x[2i+1] cos;
  - the softmax denominator comes out of the same matmul as its numerator (DecodeCache).
The cache is a DecodeCache, a KVCache in the layout the step reads fastest: the prefill
(model.forward over the prompt) fills it through KVCache.append, and each step adds one position.
"""

from __future__ import annotations

import numpy as np

from ..config import LlamaConfig
from ..kvcache import KVCache
from .blas import blas_threads
from .projections import InPlaceProjections, StackedProjections
from .shards import _executor as shard_executor, available_cores
from .upcast import has_half

# A step's matmuls, at one row per prompt, are small or bandwidth-bound: a second OpenBLAS thread
# costs more in hand-off than it saves, and on a busy machine its spin-waiting is ruinous (measured
# on 2 cores under load: 431 vs 98 tok/s for an 8M model at batch 1; 110M matvecs 0.6-5 GB/s on
# two threads against 17-30 on one). Set for each step and restored after it, so a paused
# generator leaves the process as it found it. (np.vecdot, the one-row matvec of large models,
# runs on the calling thread whatever this says.)
DECODE_BLAS_THREADS = 1

# A step of several rows on a large model is compute-bound (110M, 8 rows: ~1.8 GFLOP a step), so
# its rows are cut into shards run on one thread per core, each shard a whole step with one BLAS
# thread: a single hand-off a step, where OpenBLAS's own threads would meet at every matmul and,
# on a busy machine, wait for each other there (measured at 110M, 8 rows: 1 BLAS thread ~107
# tok/s; 2 BLAS threads 21-182, by the load). Each shard reads all the weights, so a shard needs
# rows enough to be compute-bound.
MIN_ROWS_PER_SHARD = 4

# Weights up to this many bytes are copied once per generation into the stacked, norm-folded
# layout; larger ones are read in place. Measured (float32, interleaved, batch 1): the stacked
# copies win by 1.4-1.5x up to 7 MB, where a step costs per NumPy call, and lose from 22 MB on
# (8M: 700 vs 480 tok/s), where it costs per byte read; batch 8 ties from 7 MB on.
STACKED_MAX_BYTES = 16 << 20


def choose_layout(params: dict) -> str:
    """"stacked" (copies, for small float models) or "in_place" (large, mapped or half-held ones)."""
    if has_half(params):
        return "in_place"
    return "stacked" if sum(a.nbytes for a in params.values()) <= STACKED_MAX_BYTES else "in_place"


class DecodeCache(KVCache):
    """A KVCache stored as the decode step reads it fastest (tests/engine/ checks it equal to KVCache):

        k  (L, B, KVH, Dh, max_seq_len)       keys transposed, so scores = q @ k is one plain matmul
        v  (L, B, KVH, max_seq_len, Dh + 1)   values and a column of ones, so e @ v gives both
                                               sum_s e_s v_s and the softmax denominator sum_s e_s
    (measured at dim 64: 2.3 and 1.1 us a layer per step saved). append hands out the usual
    (B, KVH, S, Dh) views, so the prefill's forward writes it like any KVCache.
    """

    def __init__(self, n_layers, batch_size, n_kv_heads, max_seq_len, head_dim, dtype=np.float32):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.k = np.zeros((n_layers, batch_size, n_kv_heads, head_dim, max_seq_len), dtype=dtype)
        self.v = np.zeros((n_layers, batch_size, n_kv_heads, max_seq_len, head_dim + 1), dtype=dtype)
        self.v[..., head_dim] = 1.0
        self.length = 0

    def append(self, layer: int, k, v, start_pos: int):
        end = start_pos + k.shape[2]
        Dh = k.shape[3]
        self.k[layer, :, :, :, start_pos:end] = k.swapaxes(-1, -2)
        self.v[layer, :, :, start_pos:end, :Dh] = v
        return self.k[layer, :, :, :, :end].swapaxes(-1, -2), self.v[layer, :, :, :end, :Dh]


class DecodeStep:
    """One decode step for a batch of batch_size rows.

    layout: "stacked" (copies of the weights, stacked and norm-folded: make a new step after
    changing the parameters), "in_place" (the parameters themselves, never copied), or None to
    choose by size (choose_layout). Half-held parameters (float16 / bfloat16) are always read in
    place, a block of rows at a time in float32.
    """

    def __init__(self, params: dict, config: LlamaConfig, rope, batch_size: int, layout: str | None = None):
        self.config = config
        cos, sin = rope
        layout = choose_layout(params) if layout is None else layout
        if layout == "stacked":
            self.projections = StackedProjections(params, config, batch_size)
        elif layout == "in_place":
            self.projections = InPlaceProjections(params, config, cos.dtype)
        else:
            raise ValueError(f"layout={layout!r}; use 'stacked', 'in_place' or None (chosen by size)")
        self.layout = layout
        self.complex_dtype = np.result_type(cos.dtype, np.complex64)
        self.rotations = (cos + 1j * sin).astype(self.complex_dtype)      # (max_seq_len, Dh/2): e^(i p theta_j)
        workers = min(available_cores(), batch_size // MIN_ROWS_PER_SHARD) if layout == "in_place" else 1
        self.row_shards = [slice(r[0], r[-1] + 1) for r in np.array_split(np.arange(batch_size), workers)] \
            if workers > 1 else None

    def __call__(self, ids: np.ndarray, pos: int, kv_cache: DecodeCache,
                 key_bias: np.ndarray | None = None) -> np.ndarray:
        """ids (B,) ints at absolute position pos, after positions 0 .. pos-1 in kv_cache.

        Writes this position's keys and values into kv_cache and returns logits (B, V).
        key_bias, when given, broadcasts to (B, KVH, R, pos + 1): 0 where a key may be attended,
        -inf where not.
        """
        with blas_threads(DECODE_BLAS_THREADS):
            if self.row_shards is None or len(ids) != self.row_shards[-1].stop:
                return self._step(ids, pos, kv_cache.k, kv_cache.v, key_bias)
            whole = key_bias is None or key_bias.shape[0] == 1
            futures = [shard_executor(len(self.row_shards)).submit(
                self._step, ids[rows], pos, kv_cache.k[:, rows], kv_cache.v[:, rows],
                key_bias if whole else key_bias[rows]) for rows in self.row_shards]
            return np.concatenate([f.result() for f in futures])

    def _step(self, ids, pos, k, v, key_bias):
        """The step for rows ids (B,) whose caches are k, v (L, B, ...): see __call__."""
        proj = self.projections
        x = proj.embed(ids)                                                 # (B,) -> (B, D)
        rotation = self.rotations[pos]                                      # (Dh/2,) complex
        with np.errstate(over="ignore"):                                    # silu: exp(-a) -> inf gives 0, right
            for layer, k_cache, v_cache in zip(proj.layers, k, v):
                qkv = proj.qkv(layer, x)                                    # (B, D) -> (B, (H + 2 KVH) Dh)
                x = x + proj.o(layer, self._attend(qkv, rotation, pos, k_cache, v_cache, key_bias))
                ab = proj.gate_up(layer, x)                                 # (B, D) -> (B, 2F)
                F = ab.shape[1] // 2
                a, b = ab[:, :F], ab[:, F:]
                x = x + proj.down(layer, a * b / (1.0 + np.exp(-a)))        # silu(a) * b: (B, F) -> (B, D)
        return proj.logits(x)                                               # (B, D) -> (B, V)

    def _attend(self, qkv, rotation, pos, k_cache, v_cache, key_bias):
        """Attention of this position's q over keys and values 0 .. pos, after writing its k and v.

        qkv (B, (H + 2 KVH) Dh) with q already scaled by 1/sqrt(Dh) -> (B, H Dh)."""
        cfg = self.config
        H, KVH, Dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        R, S, B = H // KVH, pos + 1, qkv.shape[0]
        # RoPE on q and k at once, as complex pairs: (B, (H + KVH) Dh) -> (B, H + KVH, Dh/2)
        qk = qkv[:, :(H + KVH) * Dh].view(self.complex_dtype).reshape(B, H + KVH, Dh // 2) * rotation
        qk = qk.view(qkv.dtype)                                             # (B, H + KVH, Dh), rotated
        k_cache[:, :, :, pos] = qk[:, H:]                                   # (B, KVH, Dh)
        v_cache[:, :, pos, :Dh] = qkv[:, (H + KVH) * Dh:].reshape(B, KVH, Dh)
        scores = qk[:, :H].reshape(B, KVH, R, Dh) @ k_cache[..., :S]       # (B, KVH, R, S)
        if key_bias is not None:
            scores += key_bias
        scores -= np.maximum.reduce(scores, axis=-1, keepdims=True)
        e = np.exp(scores, out=scores)
        ev = e @ v_cache[:, :, :S]                                          # (B, KVH, R, Dh + 1): [sum e v | sum e]
        att = ev[..., :Dh] / ev[..., Dh:]                                   # (B, KVH, R, Dh)
        return att.reshape(B, H * Dh)
