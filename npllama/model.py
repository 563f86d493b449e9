"""Llama: the LLaMA-2 architecture (Meta's model.py) as NumPy forward and backward passes.

Only this module knows how the ops compose. A block reads top-down:

    h   = x + wo( attention( rope(wq(rmsnorm(x))), rope(wk(rmsnorm(x))), wv(rmsnorm(x)) ) )
    out = h + w2( silu(w1(rmsnorm(h))) * w3(rmsnorm(h)) )

and the model is  logits = output( rmsnorm( block_L( ... block_1( tok_embeddings[tokens] ))))).
block_backward is block_forward read bottom-up, one op per line.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

from .blas import blas_threads
from .config import LlamaConfig
from .kvcache import KVCache
from .ops import (
    IGNORE_INDEX,
    attention_backward, attention_forward,
    cross_entropy_backward, cross_entropy_forward,
    embedding_backward, embedding_forward,
    linear_backward, linear_forward,
    rmsnorm_backward, rmsnorm_forward,
    rope_backward, rope_forward, rope_tables,
    swiglu_backward, swiglu_forward,
)

SUPPORTED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
LAYER_PARAM_NAMES = {
    "attention_norm": "attention_norm.weight", "wq": "attention.wq.weight", "wk": "attention.wk.weight",
    "wv": "attention.wv.weight", "wo": "attention.wo.weight", "ffn_norm": "ffn_norm.weight",
    "w1": "feed_forward.w1.weight", "w2": "feed_forward.w2.weight", "w3": "feed_forward.w3.weight",
}


class LayerWeights(NamedTuple):
    """One block's parameters (or their gradients), by the short names of Meta's modules."""
    attention_norm: np.ndarray   # (D,)
    wq: np.ndarray               # (H*Dh, D)
    wk: np.ndarray               # (KVH*Dh, D)
    wv: np.ndarray               # (KVH*Dh, D)
    wo: np.ndarray               # (D, H*Dh)
    ffn_norm: np.ndarray         # (D,)
    w1: np.ndarray               # (F, D) gate
    w2: np.ndarray               # (D, F) down
    w3: np.ndarray               # (F, D) up


class StackedLayer(NamedTuple):
    """One block's weights as block_forward uses them: projections that read the same input
    stacked into one matrix, so each runs as one GEMM (built once per step by stack_layer)."""
    attention_norm: np.ndarray   # (D,)
    wqkv: np.ndarray             # ((H + 2 KVH) Dh, D): [wq; wk; wv]
    wo: np.ndarray               # (D, H*Dh)
    ffn_norm: np.ndarray         # (D,)
    w13: np.ndarray              # (2F, D): [w1; w3], gate then up
    w2: np.ndarray               # (D, F)


def stack_layer(w: LayerWeights) -> StackedLayer:
    """Stack [wq; wk; wv] and [w1; w3]: a copy of the weights, small next to the activations."""
    return StackedLayer(w.attention_norm, np.concatenate((w.wq, w.wk, w.wv)), w.wo,
                        w.ffn_norm, np.concatenate((w.w1, w.w3)), w.w2)


class BlockCache(NamedTuple):
    attention_norm: tuple
    wqkv: tuple
    rope_q: tuple
    rope_k: tuple
    attention: tuple
    wo: tuple
    ffn_norm: tuple
    w13: tuple
    swiglu: tuple
    w2: tuple


# Below this many activations per layer (B * T * D) a step takes about a millisecond, and handing
# shards to threads costs more than it saves.
_MIN_SHARDED_ACTIVATIONS = 1 << 16


def default_workers(batch_size: int, seq_len: int, dim: int) -> int:
    """Threads for loss_and_grads: one per core the process may use, at most one per batch row,
    and one alone for steps too small to share."""
    if batch_size * seq_len * dim < _MIN_SHARDED_ACTIVATIONS:
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:          # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, batch_size))


_EXECUTORS: dict[int, ThreadPoolExecutor] = {}


def _executor(workers: int) -> ThreadPoolExecutor:
    if workers not in _EXECUTORS:
        _EXECUTORS[workers] = ThreadPoolExecutor(workers, thread_name_prefix="npllama-shard")
    return _EXECUTORS[workers]


def _check_workers(workers) -> int:
    if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or workers < 1:
        raise ValueError(f"workers={workers!r} must be a positive integer")
    return int(workers)


# Activations per layer (rows * T * D) in one shard: small enough that a shard's element-wise
# temporaries stay in a core's cache (measured: 5-10% faster per token than whole batches).
_SHARD_ACTIVATIONS = 1 << 17


def _run_sharded(fn, workers: int, dim: int, *row_arrays):
    """[fn(*shard) for contiguous shards of the arrays' rows], run on `workers` threads, in order.

    NumPy releases the GIL inside ufuncs and BLAS calls, so the shards run in parallel; each gets
    one BLAS thread, so the threads do not fight over the cores. There are at least `workers`
    shards, and more when rows are large, so that a shard holds about _SHARD_ACTIVATIONS.
    """
    B, T = row_arrays[0].shape[:2]
    n_shards = min(B, max(workers, -(-B * T * dim // _SHARD_ACTIVATIONS)))
    shards = np.array_split(np.arange(B), n_shards)
    if workers == 1:            # one after another in this thread, with BLAS as it is
        return [fn(*(a[rows] for a in row_arrays)) for rows in shards]
    with blas_threads(1):
        futures = [_executor(workers).submit(fn, *(a[rows] for a in row_arrays)) for rows in shards]
        return [f.result() for f in futures]


class TokenError(ValueError):
    """Token or target ids that the model cannot take."""


def check_dtype(dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype={dtype} is not supported; use np.float32 (default) or np.float64")
    return dtype


def init_params(config: LlamaConfig, seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    """Weights ~ Normal(0, 0.02), norms = 1, as GPT-2 / llama2.c initialise.

    The two projections that write into the residual stream (wo, w2) get std 0.02 / sqrt(2 L),
    so the stream's variance does not grow with depth (GPT-2 paper, section 2.3). llama2.c's
    model.py scales w3 instead of w2; w2 is the one on the residual path.
    Values are drawn in float64 in the order of config.param_shapes() and then rounded, so a
    float32 and a float64 model of the same seed hold the same numbers up to rounding.
    """
    rng = np.random.default_rng(seed)
    residual_std = 0.02 / math.sqrt(2 * config.n_layers)
    params = {}
    for name, shape in config.param_shapes().items():
        if name.endswith("norm.weight"):
            params[name] = np.ones(shape, dtype=dtype)
            continue
        std = residual_std if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")) else 0.02
        params[name] = (rng.standard_normal(shape) * std).astype(dtype)
    return params


def block_forward(x, w: StackedLayer, cos, sin, *, n_heads, n_kv_heads, eps, kv=None, start_pos=0, mask=None):
    """One transformer block (Meta model.py TransformerBlock).

    Inputs:  x (B, T, D); w the block's weights, stacked (stack_layer); cos, sin (T, Dh/2) RoPE rows;
             kv: None (training), or this layer's (k_cache, v_cache), each (B, KVH, max_seq_len, Dh),
             into which positions start_pos .. start_pos + T - 1 are written before attending;
             mask: None (causal) or booleans (B, T, S), see attention_forward.
    Returns: out (B, T, D), cache for block_backward.

    Projections that read the same input run as one GEMM on their stacked weights: [wq; wk; wv]
    and [w1; w3]. That saves passes over the activations, and in backward the one GEMM
    dx = dy @ W also sums the branches' gradients for free.
    """
    B, T, D = x.shape
    H, KVH = n_heads, n_kv_heads
    Dh = D // H
    # attention sub-block: h = x + wo(attention(rope(q), rope(k), v))
    xn, c_attention_norm = rmsnorm_forward(x, w.attention_norm, eps)
    qkv, c_wqkv = linear_forward(xn, w.wqkv)                                # (B, T, (H + 2 KVH) Dh)
    heads = qkv.reshape(B, T, H + 2 * KVH, Dh).transpose(0, 2, 1, 3)        # -> (B, H + 2 KVH, T, Dh)
    q, k, v = heads[:, :H], heads[:, H:H + KVH], heads[:, H + KVH:]        # (B, H | KVH | KVH, T, Dh)
    q, c_rope_q = rope_forward(q, cos, sin)
    k, c_rope_k = rope_forward(k, cos, sin)
    if kv is not None:
        # decoding: store this chunk's keys and values, then attend to every position so far
        k_cache, v_cache = kv
        end = start_pos + T
        k_cache[:, :, start_pos:end] = k
        v_cache[:, :, start_pos:end] = v
        k, v = k_cache[:, :, :end], v_cache[:, :, :end]          # (B, KVH, S, Dh), S = start_pos + T
    att, c_attention = attention_forward(q, k, v, mask)
    att = att.transpose(0, 2, 1, 3).reshape(B, T, H * Dh)      # (B, H, T, Dh) -> (B, T, H*Dh)
    o, c_wo = linear_forward(att, w.wo)
    h = x + o
    # feed-forward sub-block: out = h + w2(silu(w1(hn)) * w3(hn))
    hn, c_ffn_norm = rmsnorm_forward(h, w.ffn_norm, eps)
    ab, c_w13 = linear_forward(hn, w.w13)                                   # (B, T, 2F): [gate | up]
    g, c_swiglu = swiglu_forward(ab)
    f, c_w2 = linear_forward(g, w.w2)
    out = h + f
    cache = BlockCache(c_attention_norm, c_wqkv, c_rope_q, c_rope_k, c_attention, c_wo,
                       c_ffn_norm, c_w13, c_swiglu, c_w2)
    return out, cache


def block_backward(dout, cache: BlockCache):
    """block_forward read bottom-up. Returns dx (B, T, D) and the weights' gradients (LayerWeights)."""
    B, T, D = dout.shape
    KVH, R = cache.attention.k.shape[1], cache.attention.n_rep
    H = KVH * R
    Dh = D // H
    # undo out = h + f: the residual passes dout to h unchanged, and to the branch
    dg, dw2 = linear_backward(dout, cache.w2)
    dab = swiglu_backward(dg, cache.swiglu)                     # (B, T, 2F): [dgate | dup]
    dhn, dw13 = linear_backward(dab, cache.w13)                  # sums the w1 and w3 branches
    F = dw13.shape[0] // 2
    dw1, dw3 = dw13[:F], dw13[F:]
    dh_branch, dffn_norm = rmsnorm_backward(dhn, cache.ffn_norm)
    dh = dout + dh_branch                                        # residual: skip + branch
    # undo h = x + o
    datt, dwo = linear_backward(dh, cache.wo)
    datt = datt.reshape(B, T, H, Dh).transpose(0, 2, 1, 3)      # (B, T, H*Dh) -> (B, H, T, Dh)
    dq, dk, dv = attention_backward(datt, cache.attention)
    dk = rope_backward(dk, cache.rope_k)
    dq = rope_backward(dq, cache.rope_q)
    # undo the split of qkv into heads: each gradient goes back into its heads' slots
    dqkv = np.empty((B, T, H + 2 * KVH, Dh), dtype=dout.dtype)
    dqkv[:, :, :H] = dq.transpose(0, 2, 1, 3)                   # (B, H, T, Dh) -> (B, T, H, Dh)
    dqkv[:, :, H:H + KVH] = dk.transpose(0, 2, 1, 3)
    dqkv[:, :, H + KVH:] = dv.transpose(0, 2, 1, 3)
    dqkv = dqkv.reshape(B, T, (H + 2 * KVH) * Dh)
    dxn, dwqkv = linear_backward(dqkv, cache.wqkv)              # sums the q, k and v branches
    dwq, dwk, dwv = dwqkv[:H * Dh], dwqkv[H * Dh:(H + KVH) * Dh], dwqkv[(H + KVH) * Dh:]
    dx_branch, dattention_norm = rmsnorm_backward(dxn, cache.attention_norm)
    dx = dh + dx_branch                                          # residual: skip + branch
    return dx, LayerWeights(dattention_norm, dwq, dwk, dwv, dwo, dffn_norm, dw1, dw2, dw3)


class Llama:
    """A LLaMA-2 model: parameters in a flat dict keyed by Meta's names, and pure passes over them.

    model = Llama(config, seed=0, dtype=np.float32)
    logits = model.forward(tokens)                          # (B, T) ints -> (B, T, V)
    loss, grads = model.loss_and_grads(tokens, targets)     # grads keyed and shaped like params
    """

    def __init__(self, config: LlamaConfig, seed: int = 0, dtype=np.float32):
        if not isinstance(config, LlamaConfig):
            raise ValueError(f"config must be a LlamaConfig, got {type(config).__name__}")
        self.config = config
        self.dtype = check_dtype(dtype)
        self.params = init_params(config, seed, self.dtype)
        self.tokenizer = None   # set by npllama.load when the checkpoint carries one
        self._rope_cos, self._rope_sin = rope_tables(config.head_dim, config.max_seq_len,
                                                     config.rope_theta, self.dtype)

    @classmethod
    def from_params(cls, config: LlamaConfig, params: dict, dtype=None) -> "Llama":
        """A model holding the given arrays (cast to dtype; default: their own dtype if float32/64).

        Names and shapes are compared before anything is used; every problem is reported at once.
        """
        expected = config.param_shapes()
        missing = [n for n in expected if n not in params]
        unexpected = [n for n in params if n not in expected]
        misshapen = [f"{n}: {tuple(np.shape(params[n]))} != expected {expected[n]}"
                     for n in expected if n in params and tuple(np.shape(params[n])) != expected[n]]
        if missing or unexpected or misshapen:
            parts = []
            if missing:
                parts.append(f"missing {missing}")
            if unexpected:
                parts.append(f"unexpected {unexpected}")
            if misshapen:
                parts.append(f"wrong shapes {misshapen}")
            raise ValueError("parameters do not fit the config: " + "; ".join(parts))
        if dtype is None:
            first = np.asarray(params["tok_embeddings.weight"]).dtype
            dtype = first if first in SUPPORTED_DTYPES else np.float32
        model = cls.__new__(cls)
        model.config = config
        model.dtype = check_dtype(dtype)
        model.params = {n: np.ascontiguousarray(params[n], dtype=model.dtype) for n in expected}
        model.tokenizer = None
        model._rope_cos, model._rope_sin = rope_tables(config.head_dim, config.max_seq_len,
                                                       config.rope_theta, model.dtype)
        return model

    # ---- input checks at the boundary -------------------------------------------------------

    def validate_tokens(self, tokens, name="tokens", allow_ignore=False, start_pos=0) -> np.ndarray:
        """Return tokens as a 2-D int64 array, or raise TokenError naming what is wrong."""
        arr = np.asarray(tokens)
        if arr.dtype == bool or arr.dtype.kind not in "iu":
            raise TokenError(f"{name} must be an integer array, got dtype {arr.dtype}; "
                             "token ids are integers (use np.asarray(ids, dtype=np.int64))")
        if arr.ndim == 1:
            arr = arr[None, :]
        if arr.ndim != 2:
            raise TokenError(f"{name} must have shape (B, T), got {arr.shape}")
        B, T = arr.shape
        if B == 0 or T == 0:
            raise TokenError(f"{name} is empty, shape {arr.shape}")
        if start_pos + T > self.config.max_seq_len:
            raise TokenError(f"{name}: {T} positions starting at {start_pos} pass max_seq_len="
                             f"{self.config.max_seq_len}; shorten the sequence or build a config "
                             "with a larger max_seq_len")
        V = self.config.vocab_size
        bad = (arr < 0) | (arr >= V)
        if allow_ignore:
            bad &= arr != IGNORE_INDEX
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            allowed = f"[0, {V}) or {IGNORE_INDEX}" if allow_ignore else f"[0, {V})"
            raise TokenError(f"{name} holds id {int(arr[where])} at index {where}, outside {allowed} "
                             f"(vocab_size={V})")
        return arr.astype(np.int64, copy=False)

    # ---- passes ---------------------------------------------------------------------------------

    def _stacked_layers(self) -> list[StackedLayer]:
        """Every block's weights, stacked once per step (not once per shard and layer call)."""
        p = self.params
        return [stack_layer(LayerWeights(*(p[f"layers.{i}.{LAYER_PARAM_NAMES[f]}"] for f in LayerWeights._fields)))
                for i in range(self.config.n_layers)]

    def _output_weight(self):
        # tied: the output projection reads the embedding matrix itself
        return self.params["tok_embeddings.weight" if self.config.tie_embeddings else "output.weight"]

    def _forward(self, tokens, layers, kv_cache=None, start_pos=0, mask=None):
        cfg = self.config
        T = tokens.shape[1]
        cos = self._rope_cos[start_pos:start_pos + T]            # (T, Dh/2)
        sin = self._rope_sin[start_pos:start_pos + T]
        x, c_embedding = embedding_forward(tokens, self.params["tok_embeddings.weight"])   # (B, T, D)
        block_caches = []
        for i in range(cfg.n_layers):
            kv = None if kv_cache is None else (kv_cache.k[i], kv_cache.v[i])
            x, c_block = block_forward(x, layers[i], cos, sin, n_heads=cfg.n_heads,
                                       n_kv_heads=cfg.n_kv_heads, eps=cfg.norm_eps,
                                       kv=kv, start_pos=start_pos, mask=mask)
            block_caches.append(c_block)
        xn, c_norm = rmsnorm_forward(x, self.params["norm.weight"], cfg.norm_eps)
        logits, c_output = linear_forward(xn, self._output_weight())   # (B, T, D) -> (B, T, V)
        return logits, (c_embedding, block_caches, c_norm, c_output)

    def new_kv_cache(self, batch_size: int = 1) -> KVCache:
        cfg = self.config
        return KVCache(cfg.n_layers, batch_size, cfg.n_kv_heads, cfg.max_seq_len, cfg.head_dim, self.dtype)

    def forward(self, tokens, kv_cache: KVCache | None = None, start_pos: int = 0, mask=None, workers=None):
        """Logits of every position.

        tokens: (B, T) ints (a 1-D sequence is taken as B = 1 and gives (T, V)).
        kv_cache, start_pos: for decoding, the tokens sit at positions start_pos .. start_pos + T - 1;
            their keys and values are written into kv_cache and they attend to positions
            0 .. start_pos + T - 1 of it. Without a cache, start_pos must be 0.
        mask: optional booleans (B, T, start_pos + T), True where a query may attend a key
            (left-padded batches); None is causal.
        workers: threads sharing the batch rows, as in loss_and_grads (without a cache or mask only).
        Returns: logits (B, T, V) in the model's dtype.
        """
        one_dim = np.ndim(tokens) == 1
        if isinstance(start_pos, bool) or not isinstance(start_pos, (int, np.integer)) or start_pos < 0:
            raise ValueError(f"start_pos={start_pos!r} must be a non-negative integer")
        tokens = self.validate_tokens(tokens, start_pos=start_pos)
        if kv_cache is None:
            if start_pos:
                raise ValueError(f"start_pos={start_pos} needs a kv_cache holding the earlier positions")
        else:
            if kv_cache.batch_size != tokens.shape[0]:
                raise ValueError(f"kv_cache holds batch {kv_cache.batch_size}, tokens have {tokens.shape[0]} rows")
            if start_pos > kv_cache.length:
                raise ValueError(f"start_pos={start_pos} skips positions: the kv_cache holds only "
                                 f"{kv_cache.length}")
        if kv_cache is None and mask is None:
            workers = default_workers(*tokens.shape, self.config.dim) if workers is None else _check_workers(workers)
            workers = min(workers, tokens.shape[0])
            layers = self._stacked_layers()
            logits = np.concatenate(_run_sharded(lambda x: self._forward(x, layers)[0], workers,
                                                 self.config.dim, tokens))
        else:
            logits, _ = self._forward(tokens, self._stacked_layers(), kv_cache, int(start_pos), mask)
        if kv_cache is not None:
            kv_cache.length = int(start_pos) + tokens.shape[1]
        return logits[0] if one_dim else logits

    def loss_and_grads(self, tokens, targets, workers=None):
        """Mean cross-entropy of the targets (ignoring -100) and its gradient for every parameter.

        tokens, targets: (B, T) ints. Returns (loss: float, grads: dict keyed and shaped like params).
        workers: threads sharing contiguous shards of the batch rows (default: one per CPU core, at
            most B; one for steps under 65536 activations per layer). Large batches are cut into
            more shards than threads, about 2^17 activations each, so temporaries stay in cache. Each shard's loss is divided by the whole batch's target count, so the
            shards' losses and gradients add up to the full batch's exactly (up to rounding). NumPy
            releases the GIL inside its ufuncs and BLAS calls, so shards run in parallel, every
            element-wise op included, where one process with a multi-threaded BLAS would run those
            on one core. The result depends on `workers` only through rounding; pass workers=1 for
            sums in one order on every machine.
        """
        tokens = self.validate_tokens(tokens)
        targets = self.validate_tokens(targets, name="targets", allow_ignore=True)
        if targets.shape != tokens.shape:
            raise TokenError(f"targets shape {targets.shape} != tokens shape {tokens.shape}")
        n_valid = int(np.count_nonzero(targets != IGNORE_INDEX))
        if n_valid == 0:
            raise ValueError("every target is -100 (ignored): the mean cross-entropy has no terms")
        workers = default_workers(*tokens.shape, self.config.dim) if workers is None else _check_workers(workers)
        workers = min(workers, tokens.shape[0])
        layers = self._stacked_layers()
        results = _run_sharded(lambda x, y: self._loss_and_grads(x, y, n_valid, layers), workers,
                               self.config.dim, tokens, targets)
        loss, grads = results[0]
        for shard_loss, shard_grads in results[1:]:         # the batch's gradient is the shards' sum
            loss += shard_loss
            for name, g in shard_grads.items():
                grads[name] += g
        return loss, grads

    def _loss_and_grads(self, tokens, targets, normalizer, layers):
        """Loss and gradients of validated tokens and targets, the loss summed and divided by normalizer."""
        cfg = self.config
        logits, (c_embedding, block_caches, c_norm, c_output) = self._forward(tokens, layers)
        loss, c_loss = cross_entropy_forward(logits, targets, normalizer)
        # The chain rule starts here: dloss = 1.0, and cross-entropy divides by the number of
        # targets that are not -100.
        dlogits = cross_entropy_backward(1.0, c_loss)
        dxn, doutput = linear_backward(dlogits, c_output)
        dx, dnorm = rmsnorm_backward(dxn, c_norm)
        grads = {"norm.weight": dnorm}
        for i in reversed(range(cfg.n_layers)):
            dx, dlayer = block_backward(dx, block_caches[i])
            for field, grad in zip(LayerWeights._fields, dlayer):
                grads[f"layers.{i}.{LAYER_PARAM_NAMES[field]}"] = grad
        dembedding = embedding_backward(dx, c_embedding)
        if cfg.tie_embeddings:
            dembedding += doutput                                # one matrix, read twice: sum both uses
        else:
            grads["output.weight"] = doutput
        grads["tok_embeddings.weight"] = dembedding
        return loss, {name: grads[name] for name in self.params}

    def generate(self, prompt_ids, max_new_tokens=32, temperature=0.0, top_k=None, top_p=None,
                 seed=None, stop_ids=None, min_p=None, repetition_penalty=None, sliding_window=False):
        """New token ids after prompt_ids (1-D), sampled with a KV cache: npllama.generate.generate."""
        from .generate import generate
        return generate(self, prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                        top_k=top_k, top_p=top_p, seed=seed, stop_ids=stop_ids, min_p=min_p,
                        repetition_penalty=repetition_penalty, sliding_window=sliding_window)

    def generate_stream(self, prompt_ids, max_new_tokens=32, **sampling):
        """The ids of generate(), yielded one at a time as they are sampled: npllama.generate.generate_stream."""
        from .generate import generate_stream
        return generate_stream(self, prompt_ids, max_new_tokens=max_new_tokens, **sampling)

    def generate_batch(self, prompts, max_new_tokens=32, **sampling):
        """generate() for several prompts of any lengths at once: npllama.generate.generate_batch."""
        from .generate import generate_batch
        return generate_batch(self, prompts, max_new_tokens=max_new_tokens, **sampling)

    def n_params(self) -> int:
        return sum(p.size for p in self.params.values())

    def __repr__(self):
        return f"Llama({self.config}, dtype={self.dtype.name}, params={self.n_params():,})"
