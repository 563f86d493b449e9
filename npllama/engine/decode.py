"""The decode step: one new token per row through a KV cache, npllama.model.forward with T = 1, fused.

    step = DecodeStep(params, config, rope, batch_size)
    logits = step(ids, pos, kv_cache)            # ids (B,) at position pos -> logits (B, V)

Equal, up to rounding, to model.forward(params, config, ids[:, None], kv_cache=kv_cache,
start_pos=pos)[:, 0] (tests/engine/ checks 1e-10 in float64). For a small model a step costs
per NumPy call, not per flop, so the same arithmetic is laid out in fewer, larger calls:
  - the weights are the engine's stacked ones (engine.stacked): one GEMM for [wq; wk; wv] and
    one for [w1; w3], with the RMSNorm weights and 1/sqrt(Dh) folded in (stacked.fold_norms), and
    stored in the orientation OpenBLAS runs fastest for the batch size;
  - one query needs no causal mask: every cached key 0 .. pos is in its past (a left-padded
    batch passes key_bias, -inf on its padded keys);
  - RoPE rotates q and k together with one complex multiply, as Meta's reference does: the
    pair (x[2i], x[2i+1]) read as x[2i] + i x[2i+1], times cos + i sin, is the rotation
        y[2i] = x[2i] cos - x[2i+1] sin,   y[2i+1] = x[2i] sin + x[2i+1] cos;
  - RMSNorm is then one row sum and one division.
The cache is a DecodeCache, a KVCache in the layout the step reads fastest: the prefill
(model.forward over the prompt) fills it through KVCache.append, and each step adds one position.
"""

from __future__ import annotations

import functools

import numpy as np

from ..config import LlamaConfig
from ..kvcache import KVCache
from ..model import output_weight_name
from .blas import blas_threads
from .stacked import fold_norms, stack_layers

# row_dot(a, b): sum(a * b) over the last axis, kept, (B, D) -> (B, 1). np.vecdot (NumPy >= 2.0) is
# one ufunc call, half of einsum's time at D = 64; NumPy 1.x gets the einsum.
if hasattr(np, "vecdot"):
    row_dot = functools.partial(np.vecdot, keepdims=True)
else:
    def row_dot(a, b):
        return np.einsum("...d,...d->...", a, b)[..., None]


# A step's matmuls are tiny (one row per prompt), so a second OpenBLAS thread costs more in
# hand-off than it saves, and on a busy machine its spin-waiting is ruinous (measured on 2 cores
# under load: 431 vs 98 tok/s for an 8M model at batch 1). Set for each step and restored after
# it, so a paused generator leaves the process as it found it.
DECODE_BLAS_THREADS = 1


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
    """One decode step for a batch of batch_size rows; its weights are copies made when it is built
    (stacked, norms folded in), so make a new one after changing the parameters."""

    def __init__(self, params: dict, config: LlamaConfig, rope, batch_size: int):
        self.config = config
        H, Dh = config.n_heads, config.head_dim
        # OpenBLAS picks its kernel by shape. Measured per step (one thread): with 2 rows, x @ W
        # with W stored (in, out) beats (W @ x.T).T with W stored (out, in), as Meta has it, by
        # 1.4x on an 8M model; with 4+ rows the latter wins by up to 1.4x; with one row they tie
        # for dim 288, and x @ W saves ~0.5 us a matmul for dim 64, where calls dominate. Storing
        # (in, out) costs a transposing copy of every matrix at setup, so it is done only where it pays.
        self.rows_first = batch_size == 2 or (batch_size == 1 and config.dim <= 128)
        self.layers = [tuple(self._oriented(m) for m in (w.wqkv, w.wo, w.w13, w.w2))
                       for w in (fold_norms(w, Dh, H) for w in stack_layers(params, config))]
        self.embedding = params["tok_embeddings.weight"]
        norm = params["norm.weight"]
        self.output = self._oriented(params[output_weight_name(config)]
                                     * (norm * np.sqrt(config.dim, dtype=np.float64)).astype(norm.dtype))
        self.d_eps = config.dim * config.norm_eps
        cos, sin = rope
        self.complex_dtype = np.result_type(cos.dtype, np.complex64)
        self.rotations = (cos + 1j * sin).astype(self.complex_dtype)      # (max_seq_len, Dh/2): e^(i p theta_j)

    def _oriented(self, w):
        return np.ascontiguousarray(w.T) if self.rows_first else w

    def _linear(self, x, w):
        """x (B, in) -> (B, out) through a matrix stored as _oriented made it."""
        return x @ w if self.rows_first else (w @ x.T).T

    def _normalized(self, x):
        """x / sqrt(sum(x**2) + D eps) over the last axis: RMSNorm whose sqrt(D) and weight are folded
        into the next matrix (stacked.fold_norms). (B, D) -> (B, D)."""
        ss = row_dot(x, x)
        ss += self.d_eps
        return x / np.sqrt(ss, out=ss)

    def __call__(self, ids: np.ndarray, pos: int, kv_cache: DecodeCache,
                 key_bias: np.ndarray | None = None) -> np.ndarray:
        """ids (B,) ints at absolute position pos, after positions 0 .. pos-1 in kv_cache.

        Writes this position's keys and values into kv_cache and returns logits (B, V).
        key_bias, when given, broadcasts to (B, KVH, R, pos + 1): 0 where a key may be attended,
        -inf where not.
        """
        with blas_threads(DECODE_BLAS_THREADS):
            return self._step(ids, pos, kv_cache, key_bias)

    def _step(self, ids, pos, kv_cache, key_bias):
        x = self.embedding.take(ids, axis=0)                                # (B,) -> (B, D)
        rotation = self.rotations[pos]                                      # (Dh/2,) complex
        with np.errstate(over="ignore"):                                    # silu: exp(-a) -> inf gives 0, right
            x = self._layers(x, rotation, pos, kv_cache, key_bias)
        return np.ascontiguousarray(self._linear(self._normalized(x), self.output))   # (B, D) -> (B, V)

    def _layers(self, x, rotation, pos, kv_cache, key_bias):
        cfg = self.config
        H, KVH, Dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        R, S = H // KVH, pos + 1
        B = x.shape[0]
        for (wqkv, wo, w13, w2), k_cache, v_cache in zip(self.layers, kv_cache.k, kv_cache.v):
            qkv = np.ascontiguousarray(self._linear(self._normalized(x), wqkv))   # (B, D) -> (B, (H + 2 KVH) Dh)
            # RoPE on q and k at once, as complex pairs: (B, (H + KVH) Dh) -> (B, H + KVH, Dh/2)
            qk = qkv[:, :(H + KVH) * Dh].view(self.complex_dtype).reshape(B, H + KVH, Dh // 2) * rotation
            qk = qk.view(x.dtype)                                           # (B, H + KVH, Dh), rotated
            k_cache[:, :, :, pos] = qk[:, H:]                               # (B, KVH, Dh)
            v_cache[:, :, pos, :Dh] = qkv[:, (H + KVH) * Dh:].reshape(B, KVH, Dh)
            scores = qk[:, :H].reshape(B, KVH, R, Dh) @ k_cache[..., :S]   # (B, KVH, R, S); 1/sqrt(Dh) is in wq
            if key_bias is not None:
                scores += key_bias
            scores -= np.maximum.reduce(scores, axis=-1, keepdims=True)
            e = np.exp(scores, out=scores)
            ev = e @ v_cache[:, :, :S]                                      # (B, KVH, R, Dh + 1): [sum e v | sum e]
            att = ev[..., :Dh] / ev[..., Dh:]                               # (B, KVH, R, Dh)
            x = x + self._linear(att.reshape(B, H * Dh), wo)               # (B, H*Dh) -> (B, D)
            ab = self._linear(self._normalized(x), w13)                     # (B, D) -> (B, 2F)
            F = ab.shape[1] // 2
            a, b = ab[:, :F], ab[:, F:]
            x = x + self._linear(a * b / (1.0 + np.exp(-a)), w2)            # silu(a) * b: (B, F) -> (B, D)
        return x
