"""The LLaMA-2 architecture (Meta's model.py) as NumPy forward and backward passes: the reference.

Only this module knows how the ops compose. A block reads top-down:

    xn  = rmsnorm(x)
    h   = x + wo( attention( rope(wq(xn)), rope(wk(xn)), wv(xn) ) )
    hn  = rmsnorm(h)
    out = h + w2( silu(w1(hn)) * w3(hn) )

and the model is

    logits = output( rmsnorm( block_L( ... block_1( tok_embeddings[tokens] ) ... ) ) )

block_backward is block_forward read bottom-up, one op per line, and loss_and_grads is
forward followed by the chain rule from the loss back to every parameter. (A projection whose
weight is Adapted runs through the LoRA op instead of the plain linear one: npllama/lora.py.)

Everything here is a pure function of (params, config, arrays): single-threaded, no state, no
process-wide settings. npllama.Llama(..., backend="reference") runs exactly these functions
(npllama/backend.py); the default backend, npllama.engine, runs the same arithmetic faster
and is tested equal to them (tests/test_backends.py).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from .checks import check_dtype
from .config import LlamaConfig
from .errors import NpllamaError
from .kvcache import KVCache
from .ops import (
    IGNORE_INDEX,
    attention_backward, attention_forward,
    cross_entropy_backward, cross_entropy_forward,
    embedding_backward, embedding_forward,
    LoraCache, linear_backward, linear_forward, lora_backward, lora_forward,
    rmsnorm_backward, rmsnorm_forward,
    rope_backward, rope_forward, rope_tables,
    swiglu_backward, swiglu_forward,
)

# The short name of each of a block's parameters -> its Meta name after "layers.{i}.".
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


class Adapted(NamedTuple):
    """A frozen projection weight with a LoRA adapter (ops/lora.py): it acts as W + scale * B A.

    A LayerWeights field holds one of these instead of the bare W when that projection is
    adapted (npllama/lora.py builds them); block_forward then runs it through lora_forward.
    """
    weight: np.ndarray           # (out, in), frozen
    a: np.ndarray                # (r, in)
    b: np.ndarray                # (out, r)
    scale: float                 # alpha / r

    @property
    def shape(self) -> tuple[int, int]:
        """W's shape, so block_forward reads its sizes from a plain or an adapted weight alike."""
        return self.weight.shape


class LoraGrads(NamedTuple):
    """The gradient of an Adapted projection: its adapter's, never the frozen weight's."""
    a: np.ndarray                # (r, in)
    b: np.ndarray                # (out, r)


def layer_param_names(i: int) -> LayerWeights:
    """The Meta names of block i's parameters, as a LayerWeights of strings."""
    return LayerWeights(*[f"layers.{i}.{LAYER_PARAM_NAMES[f]}" for f in LayerWeights._fields])


def layer_weights(params: dict, i: int) -> LayerWeights:
    """Block i's arrays out of the flat params dict (views, no copies)."""
    return LayerWeights(*(params[name] for name in layer_param_names(i)))


def output_weight_name(config: LlamaConfig) -> str:
    # tied: the output projection reads the embedding matrix itself
    return "tok_embeddings.weight" if config.tie_embeddings else "output.weight"


class TokenError(NpllamaError):
    """Token or target ids that the model cannot take."""


def check_tokens(tokens, config: LlamaConfig, name: str = "tokens", allow_ignore: bool = False,
                 start_pos: int = 0) -> np.ndarray:
    """tokens as a 2-D int64 array (a 1-D sequence becomes one row), or TokenError naming the problem."""
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
    if start_pos + T > config.max_seq_len:
        raise TokenError(f"{name}: {T} positions starting at {start_pos} pass max_seq_len="
                         f"{config.max_seq_len}; shorten the sequence or build a config "
                         "with a larger max_seq_len")
    V = config.vocab_size
    bad = (arr < 0) | (arr >= V)
    if allow_ignore:
        bad &= arr != IGNORE_INDEX
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        allowed = f"[0, {V}) or {IGNORE_INDEX}" if allow_ignore else f"[0, {V})"
        raise TokenError(f"{name} holds id {int(arr[where])} at index {where}, outside {allowed} "
                         f"(vocab_size={V})")
    return arr.astype(np.int64, copy=False)


# Normal draws made at a time by init_params: 64 KB of float64, whatever the model's size.
INIT_CHUNK = 1 << 13


def init_params(config: LlamaConfig, seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    """A new model's parameters: new arrays of config.param_shapes(), filled by fill_init_params."""
    dtype = check_dtype(dtype)
    params = {name: np.empty(shape, dtype=dtype) for name, shape in config.param_shapes().items()}
    fill_init_params(params, config, seed)
    return params


def fill_init_params(params: dict, config: LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Weights ~ Normal(0, 0.02), norms = 1, as GPT-2 / llama2.c initialise, written into params.

    params: contiguous arrays of every name and shape of config.param_shapes(), filled in place.
    The two projections that write into the residual stream (wo, w2) get std 0.02 / sqrt(2 L),
    so the stream's variance does not grow with depth (GPT-2 paper, section 2.3). llama2.c's
    model.py scales w3 instead of w2; w2 is the one on the residual path.
    Values are drawn in float64 in the order of config.param_shapes(), INIT_CHUNK at a time
    (a generator gives the same stream however its draws are cut), scaled in float64 and then
    rounded into the parameter: a float32 and a float64 model of the same seed hold the same
    numbers up to rounding, and no float64 copy of a whole matrix is ever made.
    """
    rng = np.random.default_rng(seed)
    residual_std = 0.02 / math.sqrt(2 * config.n_layers)
    draws = np.empty(INIT_CHUNK)
    for name, shape in config.param_shapes().items():
        p = params[name]
        assert p.flags.c_contiguous and p.shape == shape, f"{name}: {p.shape} != {shape}"
        if name.endswith("norm.weight"):
            p[...] = 1
            continue
        std = residual_std if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")) else 0.02
        flat = p.reshape(-1)                                     # a view, since p is contiguous
        for start in range(0, flat.size, INIT_CHUNK):
            chunk = draws[:min(INIT_CHUNK, flat.size - start)]
            rng.standard_normal(out=chunk)
            chunk *= std
            flat[start:start + chunk.size] = chunk
    return params


# ----------------------------------------------------------------------------- one block

def projection_forward(x, w):
    """x W^T (ops/linear.py), or x W^T + s (x A^T) B^T when w is Adapted (ops/lora.py)."""
    if isinstance(w, Adapted):
        return lora_forward(x, w.weight, w.a, w.b, scale=w.scale)
    return linear_forward(x, w)


def projection_backward(dy, cache):
    """(dx, dW) of a plain projection; (dx, LoraGrads(dA, dB)) of an Adapted one."""
    if isinstance(cache, LoraCache):
        dx, da, db = lora_backward(dy, cache)
        return dx, LoraGrads(da, db)
    return linear_backward(dy, cache)


class BlockCache(NamedTuple):
    """What block_backward needs: each op's cache, in the order block_forward made them."""
    attention_norm: tuple
    wq: tuple
    wk: tuple
    wv: tuple
    rope_q: tuple
    rope_k: tuple
    attention: tuple
    wo: tuple
    ffn_norm: tuple
    w1: tuple
    w3: tuple
    swiglu: tuple
    w2: tuple


def block_forward(x, w: LayerWeights, cos, sin, *, eps, kv=None, start_pos=0, mask=None):
    """One transformer block (Meta model.py TransformerBlock).

    Inputs:  x (B, T, D); w the block's weights; cos, sin (T, Dh/2), the RoPE rows of positions
             start_pos .. start_pos + T - 1; eps, RMSNorm's epsilon;
             kv: None (training), or (kv_cache, layer): positions start_pos .. start_pos + T - 1
             are appended to that layer of the KVCache before attending;
             mask: None (causal) or booleans (B, T, S), see attention_forward.
    Returns: out (B, T, D), cache for block_backward.
    """
    B, T, D = x.shape
    Dh = 2 * cos.shape[-1]
    H, KVH = w.wq.shape[0] // Dh, w.wk.shape[0] // Dh
    # attention sub-block: h = x + wo(attention(rope(q), rope(k), v))
    xn, c_attention_norm = rmsnorm_forward(x, w.attention_norm, eps)
    q, c_wq = projection_forward(xn, w.wq)                               # (B, T, D) -> (B, T, H*Dh)
    k, c_wk = projection_forward(xn, w.wk)                               # (B, T, D) -> (B, T, KVH*Dh)
    v, c_wv = projection_forward(xn, w.wv)
    q = q.reshape(B, T, H, Dh).transpose(0, 2, 1, 3)                     # -> (B, H, T, Dh)
    k = k.reshape(B, T, KVH, Dh).transpose(0, 2, 1, 3)                   # -> (B, KVH, T, Dh)
    v = v.reshape(B, T, KVH, Dh).transpose(0, 2, 1, 3)
    q, c_rope_q = rope_forward(q, cos, sin)
    k, c_rope_k = rope_forward(k, cos, sin)
    if kv is not None:
        # decoding: store this chunk's keys and values, then attend to every position so far
        kv_cache, layer = kv
        k, v = kv_cache.append(layer, k, v, start_pos)                   # (B, KVH, S, Dh), S = start_pos + T
    att, c_attention = attention_forward(q, k, v, mask)
    att = att.transpose(0, 2, 1, 3).reshape(B, T, H * Dh)                # (B, H, T, Dh) -> (B, T, H*Dh)
    o, c_wo = projection_forward(att, w.wo)
    h = x + o
    # feed-forward sub-block: out = h + w2(silu(w1(hn)) * w3(hn))
    hn, c_ffn_norm = rmsnorm_forward(h, w.ffn_norm, eps)
    a, c_w1 = projection_forward(hn, w.w1)                               # (B, T, D) -> (B, T, F) gate
    b, c_w3 = projection_forward(hn, w.w3)                               # (B, T, D) -> (B, T, F) up
    g, c_swiglu = swiglu_forward(a, b)
    f, c_w2 = projection_forward(g, w.w2)                                # (B, T, F) -> (B, T, D)
    out = h + f
    cache = BlockCache(c_attention_norm, c_wq, c_wk, c_wv, c_rope_q, c_rope_k, c_attention, c_wo,
                       c_ffn_norm, c_w1, c_w3, c_swiglu, c_w2)
    return out, cache


def block_backward(dout, cache: BlockCache):
    """block_forward read bottom-up. Returns dx (B, T, D) and the weights' gradients (LayerWeights;
    an Adapted projection's entry is its adapter's LoraGrads)."""
    B, T, D = dout.shape
    # undo out = h + f: the residual passes dout to h unchanged, and to the branch
    dg, dw2 = projection_backward(dout, cache.w2)
    da, db = swiglu_backward(dg, cache.swiglu)
    dhn_up, dw3 = projection_backward(db, cache.w3)
    dhn_gate, dw1 = projection_backward(da, cache.w1)
    dhn = dhn_gate + dhn_up                                              # hn fed two projections: sum both
    dh_branch, dffn_norm = rmsnorm_backward(dhn, cache.ffn_norm)
    dh = dout + dh_branch                                                # residual: skip + branch
    # undo h = x + o
    datt, dwo = projection_backward(dh, cache.wo)
    H, Dh = cache.attention.n_rep * cache.attention.k.shape[1], cache.attention.k.shape[-1]
    datt = datt.reshape(B, T, H, Dh).transpose(0, 2, 1, 3)              # (B, T, H*Dh) -> (B, H, T, Dh)
    dq, dk, dv = attention_backward(datt, cache.attention)
    dk = rope_backward(dk, cache.rope_k)
    dq = rope_backward(dq, cache.rope_q)
    dq = dq.transpose(0, 2, 1, 3).reshape(B, T, -1)                      # (B, H, T, Dh) -> (B, T, H*Dh)
    dk = dk.transpose(0, 2, 1, 3).reshape(B, T, -1)                      # (B, KVH, T, Dh) -> (B, T, KVH*Dh)
    dv = dv.transpose(0, 2, 1, 3).reshape(B, T, -1)
    dxn_v, dwv = projection_backward(dv, cache.wv)
    dxn_k, dwk = projection_backward(dk, cache.wk)
    dxn_q, dwq = projection_backward(dq, cache.wq)
    dxn = dxn_q + dxn_k + dxn_v                                          # xn fed three projections: sum all
    dx_branch, dattention_norm = rmsnorm_backward(dxn, cache.attention_norm)
    dx = dh + dx_branch                                                  # residual: skip + branch
    return dx, LayerWeights(dattention_norm, dwq, dwk, dwv, dwo, dffn_norm, dw1, dw2, dw3)


# ----------------------------------------------------------------------------- the whole model

def model_layers(params: dict, config: LlamaConfig) -> list[LayerWeights]:
    """Every block's weights, in order (views of params)."""
    return [layer_weights(params, i) for i in range(config.n_layers)]


class ModelCache(NamedTuple):
    embedding: tuple
    blocks: list             # per block: its BlockCache, or with checkpointing only its input x (B, T, D)
    norm: tuple
    output: tuple
    rope: tuple              # (cos, sin) rows of these positions, for blocks run again in backward


def model_rope_tables(config: LlamaConfig, dtype) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin (max_seq_len, Dh/2) of the model's RoPE angles, in its dtype."""
    return rope_tables(config.head_dim, config.max_seq_len, config.rope_theta, dtype)


def forward(params: dict, config: LlamaConfig, tokens, *, rope=None, kv_cache: KVCache | None = None,
            start_pos: int = 0, mask=None, layers: list | None = None, checkpointing: bool = False):
    """Logits of every position, and the cache loss_and_grads differentiates through.

    Inputs:  params (Meta names -> arrays); tokens (B, T) ints, already checked (check_tokens);
             rope: (cos, sin) of model_rope_tables, computed when None;
             kv_cache, start_pos: the tokens sit at positions start_pos .. start_pos + T - 1, their
             keys and values are written into kv_cache and they attend to 0 .. start_pos + T - 1;
             mask: None (causal) or booleans (B, T, start_pos + T), True where a query may attend;
             layers: each block's weights, by default model_layers(params, config) (LoRA passes
             weights whose adapted projections are Adapted: npllama/lora.py);
             checkpointing: keep only each block's input in the cache (see loss_and_grads).
    Returns: logits (B, T, V) in the params' dtype, ModelCache.
    """
    T = tokens.shape[1]
    emb = params["tok_embeddings.weight"]
    cos, sin = model_rope_tables(config, emb.dtype) if rope is None else rope
    cos, sin = cos[start_pos:start_pos + T], sin[start_pos:start_pos + T]   # (T, Dh/2)
    layers = model_layers(params, config) if layers is None else layers
    x, c_embedding = embedding_forward(tokens, emb)                          # (B, T) -> (B, T, D)
    block_caches = []
    for i, w in enumerate(layers):
        kv = None if kv_cache is None else (kv_cache, i)
        x_in = x
        x, c_block = block_forward(x, w, cos, sin, eps=config.norm_eps, kv=kv, start_pos=start_pos, mask=mask)
        block_caches.append(x_in if checkpointing else c_block)
    xn, c_norm = rmsnorm_forward(x, params["norm.weight"], config.norm_eps)
    logits, c_output = linear_forward(xn, params[output_weight_name(config)])   # (B, T, D) -> (B, T, V)
    return logits, ModelCache(c_embedding, block_caches, c_norm, c_output, (cos, sin))


def loss_and_grads(params: dict, config: LlamaConfig, tokens, targets, *, rope=None, layers: list | None = None,
                   checkpointing: bool = False):
    """Mean cross-entropy of the targets that are not -100, and its gradient for every parameter.

    Inputs:  tokens, targets (B, T) ints, already checked; rope, layers: as in forward;
             checkpointing: gradient checkpointing (Chen et al. 2016, "Training Deep Nets with
             Sublinear Memory Cost"): the forward keeps only each block's input, and backward
             runs that block's forward again to rebuild its cache just before its backward. The
             same arithmetic on the same input, so the same gradients bit for bit, for one more
             forward of every block; the memory of all the blocks' caches becomes one block's.
    Returns: loss (python float), grads (dict with exactly the keys and shapes of params; when
             layers hold Adapted projections, an adapted weight's entry is its adapter's
             LoraGrads(dA, dB) instead: npllama/lora.py keeps those).
    """
    layers = model_layers(params, config) if layers is None else layers
    logits, cache = forward(params, config, tokens, rope=rope, layers=layers, checkpointing=checkpointing)
    loss, c_loss = cross_entropy_forward(logits, targets)
    # The chain rule starts here: dloss = 1.0, and cross-entropy divides by the number of
    # targets that are not -100.
    dlogits = cross_entropy_backward(1.0, c_loss)
    dxn, doutput = linear_backward(dlogits, cache.output)
    dx, dnorm = rmsnorm_backward(dxn, cache.norm)
    grads = {"norm.weight": dnorm}
    cos, sin = cache.rope
    for i in reversed(range(config.n_layers)):
        c_block = cache.blocks[i]
        if checkpointing:                                    # rebuild this block's cache from its input
            _, c_block = block_forward(c_block, layers[i], cos, sin, eps=config.norm_eps)
        dx, dlayer = block_backward(dx, c_block)
        grads.update(zip(layer_param_names(i), dlayer))
    dembedding = embedding_backward(dx, cache.embedding)
    if config.tie_embeddings:
        dembedding += doutput                                # one matrix, read twice: sum both uses
    else:
        grads["output.weight"] = doutput
    grads["tok_embeddings.weight"] = dembedding
    return loss, {name: grads[name] for name in params}
