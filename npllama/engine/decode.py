"""The decode step: one new token per row through a KV cache, npllama.model.forward with T = 1, fused.

    step = DecodeStep(params, config, rope)
    logits = step(ids, pos, kv_cache)            # ids (B,) at position pos -> logits (B, V)

Equal, up to rounding, to model.forward(params, config, ids[:, None], kv_cache=kv_cache,
start_pos=pos)[:, 0] (tests/engine/ checks 1e-10 in float64). For a small model a step costs
per NumPy call, not per flop, so the same arithmetic is laid out in fewer, larger calls:
  - the weights are the engine's stacked ones (engine.stacked): one GEMM for [wq; wk; wv] and
    one for [w1; w3];
  - one query needs no causal mask: every cached key 0 .. pos is in its past (a left-padded
    batch passes key_bias, -inf on its padded keys);
  - RoPE rotates q and k together with one complex multiply, as Meta's reference does: the
    pair (x[2i], x[2i+1]) read as x[2i] + i x[2i+1], times cos + i sin, is the rotation
        y[2i] = x[2i] cos - x[2i+1] sin,   y[2i+1] = x[2i] sin + x[2i+1] cos;
  - RMSNorm is one row sum and one multiply by r * w.
The cache is the reference's KVCache: the prefill (model.forward over the prompt) fills it, and
each step appends one position.
"""

from __future__ import annotations

import math

import numpy as np

from ..config import LlamaConfig
from ..kvcache import KVCache
from ..model import output_weight_name
from .blas import blas_threads
from .stacked import stack_layers

# A step's matmuls are tiny (one row per prompt), so a second OpenBLAS thread costs more in
# hand-off than it saves, and on a busy machine its spin-waiting is ruinous (measured on 2 cores
# under load: 431 vs 98 tok/s for an 8M model at batch 1). Set for each step and restored after
# it, so a paused generator leaves the process as it found it.
DECODE_BLAS_THREADS = 1


class DecodeStep:
    """One decode step for a batch; its stacked weights are copies made when it is built, so make
    a new one after changing the parameters."""

    def __init__(self, params: dict, config: LlamaConfig, rope):
        self.config = config
        self.layers = stack_layers(params, config)
        self.embedding = params["tok_embeddings.weight"]
        self.norm = params["norm.weight"]
        self.output = params[output_weight_name(config)]
        cos, sin = rope
        self.complex_dtype = np.result_type(cos.dtype, np.complex64)
        self.rotations = (cos + 1j * sin).astype(self.complex_dtype)      # (max_seq_len, Dh/2): e^(i p theta_j)
        self.scale = 1.0 / math.sqrt(config.head_dim)

    def _rmsnorm(self, x, w):
        """x * r * w with r = (mean(x**2) + eps) ** -0.5 over the last axis: (B, D) -> (B, D)."""
        ms = np.einsum("bd,bd->b", x, x)[:, None]
        ms /= x.shape[-1]
        ms += self.config.norm_eps
        return x * (w / np.sqrt(ms))

    def __call__(self, ids: np.ndarray, pos: int, kv_cache: KVCache, key_bias: np.ndarray | None = None) -> np.ndarray:
        """ids (B,) ints at absolute position pos, after positions 0 .. pos-1 in kv_cache.

        Writes this position's keys and values into kv_cache and returns logits (B, V).
        key_bias, when given, broadcasts to (B, KVH, R, pos + 1): 0 where a key may be attended,
        -inf where not.
        """
        with blas_threads(DECODE_BLAS_THREADS):
            return self._step(ids, pos, kv_cache, key_bias)

    def _step(self, ids, pos, kv_cache, key_bias):
        cfg = self.config
        H, KVH, Dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        R, S = H // KVH, pos + 1
        B = ids.shape[0]
        x = self.embedding.take(ids, axis=0)                                # (B,) -> (B, D)
        rotation = self.rotations[pos]                                      # (Dh/2,) complex
        for w, k_cache, v_cache in zip(self.layers, kv_cache.k, kv_cache.v):
            qkv = self._rmsnorm(x, w.attention_norm) @ w.wqkv.T             # (B, D) -> (B, (H + 2 KVH) Dh)
            qk = qkv[:, :(H + KVH) * Dh].view(self.complex_dtype).reshape(B, H + KVH, Dh // 2) * rotation
            qk = qk.view(x.dtype)                                           # (B, H + KVH, Dh), rotated
            k_cache[:, :, pos] = qk[:, H:]                                  # (B, KVH, Dh)
            v_cache[:, :, pos] = qkv[:, (H + KVH) * Dh:].reshape(B, KVH, Dh)
            q = qk[:, :H].reshape(B, KVH, R, Dh) * self.scale
            scores = q @ k_cache[:, :, :S].swapaxes(-1, -2)                 # (B, KVH, R, S)
            if key_bias is not None:
                scores += key_bias
            scores -= scores.max(axis=-1, keepdims=True)
            e = np.exp(scores, out=scores)
            att = (e @ v_cache[:, :, :S]) / e.sum(axis=-1, keepdims=True)  # (B, KVH, R, Dh)
            x = x + att.reshape(B, H * Dh) @ w.wo.T                         # (B, H*Dh) -> (B, D)
            ab = self._rmsnorm(x, w.ffn_norm) @ w.w13.T                     # (B, D) -> (B, 2F)
            F = ab.shape[1] // 2
            a, b = ab[:, :F], ab[:, F:]
            with np.errstate(over="ignore"):                                # exp(-a) -> inf: silu -> 0, right
                x = x + (a * b / (1.0 + np.exp(-a))) @ w.w2.T               # silu(a) * b: (B, F) -> (B, D)
        return self._rmsnorm(x, self.norm) @ self.output.T                  # (B, D) -> (B, V)
