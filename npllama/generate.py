"""Text generation with a KV cache: one prefill of the prompt, then one token a step.

    new_ids = generate(model, prompt_ids, max_new_tokens=32, temperature=0.0, top_k=None,
                       top_p=None, seed=None, stop_ids=None, min_p=None, repetition_penalty=None)
    for token_id in generate_stream(model, prompt_ids, ...): ...       # the same ids, one by one
    outs = generate_batch(model, [ids_a, ids_b, ...], ...)             # prompts of any lengths

Decoding a step means logits = model(token at position p | keys and values of 0 .. p-1). The
prefill runs model.forward over the whole prompt with a KVCache, which stores the keys and
values of every layer; each later step feeds only the newest token at start_pos = p. Because
RoPE rotates q and k by their absolute positions and attention is causal, this gives the same
logits as running the full sequence again (tests/test_generate.py checks it to 1e-10 in float64).

The decode step itself is `DecodeStep`: the same arithmetic as Llama.forward with T = 1,
rearranged into fewer, larger NumPy calls, because for small models the cost of a step is the
number of calls, not the flops (see DecodeStep's docstring). Prompts of different lengths are
batched by left-padding them to one length and masking the padded keys.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Sequence

import numpy as np

from .blas import blas_threads
from .ops import rope_tables
from .sampling import check_sampling_args, choose_next

PAD_ID = 0  # fills the left of shorter prompts; masked out, so any valid id would do

# BLAS threads during decoding. A step's matmuls are tiny (one row per prompt), so a second
# OpenBLAS thread costs more in hand-off than it saves, and on a busy machine its spin-waiting
# is ruinous (tools/bench_decode.py, 2 cores under load: 431 vs 98 tok/s for the 8M config at
# batch 1). None leaves BLAS as it is. The prefill keeps every thread.
DECODE_BLAS_THREADS: int | None = 1


def _blas_limit():
    return contextlib.nullcontext() if DECODE_BLAS_THREADS is None else blas_threads(DECODE_BLAS_THREADS)


class DecodeStep:
    """One decode step for a batch: token ids (B,) at position p -> logits (B, V), with its own KV cache.

    Equal, up to rounding, to model.forward(ids[:, None], kv_cache=kv, start_pos=p)[:, 0]
    (tests/test_generate.py checks 1e-10 in float64), in about half the NumPy calls; a step of a
    small model costs per call, not per flop:

    - RMSNorm's weight w is folded into the matrix that follows it, and so are sqrt(D) and wq's
      1/sqrt(Dh):  x * r * w @ Wq.T / sqrt(Dh) = x / sqrt(sum(x**2) + D eps) @ (sqrt(D) w Wq.T / sqrt(Dh)),
      since r = (mean(x**2) + eps) ** -0.5 = sqrt(D) / sqrt(sum(x**2) + D eps);
    - wq, wk, wv form one matrix of (H + 2 KVH) Dh outputs and w1, w3 one of 2F outputs, so each
      sub-block starts with a single matmul (stored in the orientation OpenBLAS runs fastest for
      the batch size: see _linear);
    - RoPE rotates q and k together with one complex multiply, as Meta's reference does: the pair
      (x[2i], x[2i+1]) read as x[2i] + i x[2i+1], times cos + i sin, is the rotation
          y[2i] = x[2i] cos - x[2i+1] sin,   y[2i+1] = x[2i] sin + x[2i+1] cos;
    - keys are cached transposed, (B, KVH, Dh, max_seq_len), so scores = q @ K is one matmul with
      no strided copy, and values carry an extra column of ones, (B, KVH, max_seq_len, Dh + 1),
      so e @ [V | 1] yields both sum_s e_s v_s and the softmax denominator sum_s e_s at once;
    - one query needs no causal mask: every cached key 0 .. p is in its past. A left-padded
      batch passes key_bias, -inf on its padded keys.

    The fused matrices are copies built from model.params when the DecodeStep is made: make a new
    one after changing the weights. `load(kv, length)` takes over a prefilled npllama KVCache.
    """

    def __init__(self, model, batch_size: int):
        cfg = model.config
        p = model.params
        dtype = model.dtype
        self.H, self.KVH, self.Dh, self.F = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden_dim
        self.D_eps = cfg.dim * cfg.norm_eps
        self.embedding = p["tok_embeddings.weight"]
        sqrt_d = math.sqrt(cfg.dim)

        # OpenBLAS picks its kernel by shape. Measured per step (one thread): with 2 rows, x @ W
        # with W stored (in, out) beats (W @ x.T).T with W stored (out, in), as Meta has it, by
        # 1.4x on the 8M config; with 4+ rows the latter wins by up to 1.4x; with one row they tie
        # for dim 288, and x @ W saves ~0.5 us a matmul for dim 64, where calls dominate. Storing
        # (in, out) costs a transposing copy of every weight at setup (~25 ms for 8M parameters),
        # so it is done only where it pays.
        self.rows_first = batch_size == 2 or (batch_size == 1 and cfg.dim <= 128)

        def stacked(names, norm, scales):
            """The matrices W (out, in) stacked along out, each times its folded norm weight on the
            input axis when norm is given; stored transposed, (in, outs), when rows_first."""
            parts = []
            for name, scale in zip(names, scales):
                w = p[name]
                if norm is not None:
                    w = w * (p[norm].astype(np.float64) * (sqrt_d * scale)).astype(dtype)
                parts.append(w)
            w = np.concatenate(parts) if len(parts) > 1 else parts[0]
            return np.ascontiguousarray(w.T if self.rows_first else w, dtype=dtype)

        self.layers = []
        for i in range(cfg.n_layers):
            pre = f"layers.{i}."
            attn = [pre + f"attention.{n}.weight" for n in ("wq", "wk", "wv")]
            ffn = [pre + f"feed_forward.{n}.weight" for n in ("w1", "w3")]
            self.layers.append((
                stacked(attn, pre + "attention_norm.weight", (self.Dh ** -0.5, 1.0, 1.0)),  # (H+2KVH)*Dh by D
                stacked([pre + "attention.wo.weight"], None, (1.0,)),                     # D by H*Dh
                stacked(ffn, pre + "ffn_norm.weight", (1.0, 1.0)),                         # 2F by D
                stacked([pre + "feed_forward.w2.weight"], None, (1.0,)),                  # D by F
            ))
        out_name = "tok_embeddings.weight" if cfg.tie_embeddings else "output.weight"
        self.output = stacked([out_name], "norm.weight", (1.0,))                          # V by D
        # freqs[p, i] = cos(p theta_i) + i sin(p theta_i): the model's RoPE tables as complex numbers
        self.complex_dtype = np.result_type(dtype, np.complex64)
        cos, sin = rope_tables(self.Dh, cfg.max_seq_len, cfg.rope_theta, dtype)
        self.freqs = (cos + 1j * sin).astype(self.complex_dtype)                         # (P, Dh/2)
        L, KVH, Dh, P = cfg.n_layers, self.KVH, self.Dh, cfg.max_seq_len
        self.k = np.zeros((L, batch_size, KVH, Dh, P), dtype=dtype)       # keys, transposed
        self.v = np.zeros((L, batch_size, KVH, P, Dh + 1), dtype=dtype)   # values | 1
        self.v[..., Dh] = 1.0

    def load(self, kv, length: int) -> None:
        """Copy positions 0 .. length-1 of a prefilled KVCache ((L, B, KVH, P, Dh) k and v)."""
        self.k[..., :length] = kv.k[:, :, :, :length].swapaxes(-1, -2)
        self.v[:, :, :, :length, :self.Dh] = kv.v[:, :, :, :length]

    def _rms(self, x):
        """x * sqrt(D) * r with r = (mean(x**2) + eps) ** -0.5; the sqrt(D) and weight live in the next matrix."""
        ms = np.vecdot(x, x, keepdims=True)                            # (B, D) -> (B, 1)
        ms += self.D_eps
        return x / np.sqrt(ms, out=ms)

    def _linear(self, x, w):
        """x (B, in) -> (B, out) through a stacked matrix (see rows_first); may be a transposed view."""
        return x @ w if self.rows_first else (w @ x.T).T

    def __call__(self, ids: np.ndarray, pos: int, key_bias: np.ndarray | None = None) -> np.ndarray:
        """ids (B,) ints at absolute position pos, after positions 0 .. pos-1 in the cache.

        Writes this position's k and v into the cache and returns logits (B, V). key_bias, when
        given, broadcasts to (B, KVH, R, pos + 1): 0 where a key may be attended, -inf where not.
        """
        H, KVH, Dh, F = self.H, self.KVH, self.Dh, self.F
        R, S = H // KVH, pos + 1
        B = ids.shape[0]
        x = self.embedding.take(ids, axis=0)                           # (B,) -> (B, D)
        freq = self.freqs[pos]                                         # (Dh/2,) complex
        with np.errstate(over="ignore"):  # silu: exp(-a) -> inf for very negative a; 1 / inf = 0 is right
            for (wqkv, wo, w13, w2), k_cache, v_cache in zip(self.layers, self.k, self.v):
                qkv = np.ascontiguousarray(self._linear(self._rms(x), wqkv))   # (B, D) -> (B, (H+2KVH)*Dh)
                # RoPE on q and k at once, as complex pairs: (B, (H+KVH)*Dh) -> (B, H+KVH, Dh/2)
                qk = qkv[:, :(H + KVH) * Dh].view(self.complex_dtype).reshape(B, H + KVH, Dh // 2) * freq
                qk = qk.view(x.dtype)                                  # (B, H+KVH, Dh), rotated
                k_cache[:, :, :, pos] = qk[:, H:]                      # (B, KVH, Dh)
                v_cache[:, :, pos, :Dh] = qkv[:, (H + KVH) * Dh:].reshape(B, KVH, Dh)
                scores = qk[:, :H].reshape(B, KVH, R, Dh) @ k_cache[..., :S]   # (B, KVH, R, S); 1/sqrt(Dh) is in wq
                if key_bias is not None:
                    scores += key_bias
                scores -= np.maximum.reduce(scores, axis=-1, keepdims=True)
                e = np.exp(scores, out=scores)
                ev = e @ v_cache[:, :, :S]                             # (B, KVH, R, Dh+1): [sum e v | sum e]
                att = ev[..., :Dh] / ev[..., Dh:]                      # (B, KVH, R, Dh)
                x = x + self._linear(att.reshape(B, H * Dh), wo)       # (B, H*Dh) -> (B, D)
                ab = self._linear(self._rms(x), w13)                   # (B, D) -> (B, 2F)
                a, b = ab[:, :F], ab[:, F:]
                x = x + self._linear(a * b / (1.0 + np.exp(-a)), w2)   # silu(a) * b: (B, F) -> (B, D)
        return np.ascontiguousarray(self._linear(self._rms(x), self.output))   # (B, D) -> (B, V)


# ----------------------------------------------------------------------------- argument checks

def _check_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
    return int(value)


def _check_prompt(model, prompt_ids, name="prompt_ids") -> np.ndarray:
    arr = np.asarray(prompt_ids)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of token ids, got shape {arr.shape}; "
                         "for several prompts use generate_batch")
    if arr.size == 0:
        raise ValueError(f"{name} is empty; generation needs at least one token to condition on "
                         "(a sentencepiece model's BOS id, for instance)")
    if arr.dtype == bool or arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integer token ids, got dtype {arr.dtype}")
    V = model.config.vocab_size
    bad = np.flatnonzero((arr < 0) | (arr >= V))
    if bad.size:
        raise ValueError(f"{name}[{bad[0]}] = {arr[bad[0]]} is outside [0, {V}) (vocab_size={V})")
    return arr.astype(np.int64)


def _check_stop_ids(model, stop_ids) -> frozenset:
    if stop_ids is None:
        return frozenset()
    if isinstance(stop_ids, (int, np.integer)) and not isinstance(stop_ids, bool):
        stop_ids = [stop_ids]
    try:
        ids = [int(i) for i in stop_ids if not isinstance(i, bool)] if not isinstance(stop_ids, str) else None
    except (TypeError, ValueError):
        ids = None
    if ids is None or len(ids) != len(list(stop_ids)):
        raise ValueError(f"stop_ids={stop_ids!r} must be a token id or a sequence of token ids "
                         "(for stop strings, use the CLI's --stop)")
    V = model.config.vocab_size
    bad = [i for i in ids if not 0 <= i < V]
    if bad:
        raise ValueError(f"stop_ids {bad} are outside [0, {V}) (vocab_size={V})")
    return frozenset(ids)


def _check_length(model, prompt_len, max_new_tokens, sliding_window):
    max_seq_len = model.config.max_seq_len
    if not sliding_window and prompt_len + max_new_tokens > max_seq_len:
        raise ValueError(
            f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} = "
            f"{prompt_len + max_new_tokens} passes the model's max_seq_len={max_seq_len}; "
            "shorten the prompt, lower max_new_tokens, or pass sliding_window=True "
            "(npllama generate --sliding-window) to drop the oldest tokens as it goes")


def _rngs(seed, batch_size, temperature):
    """One Generator per row, each from the same seed (or seeds[b]): row b of a batch then
    draws exactly what a single-prompt run with that seed draws."""
    if temperature == 0:
        return None
    if seed is None or isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
        return [np.random.default_rng(seed) for _ in range(batch_size)]
    seeds = list(seed)
    if len(seeds) != batch_size:
        raise ValueError(f"seed: got {len(seeds)} seeds for {batch_size} prompts; pass one int or one per prompt")
    return [np.random.default_rng(s) for s in seeds]


# ----------------------------------------------------------------------------- the decoding loop

def _decode(model, prompts: list[np.ndarray], max_new_tokens: int, temperature, top_k, top_p, min_p,
            repetition_penalty, rngs, stop: frozenset, sliding_window: bool) -> Iterator[np.ndarray]:
    """Yield the ids sampled for all rows at each step (B,); -1 marks a row that has stopped.

    Rows are left-padded to the longest prompt, so row b's tokens sit at positions shifted by
    pad_b = P - len(prompt_b); RoPE depends only on q and k positions' difference, and the mask
    keeps padded keys out of every real query, so each row computes what it would alone.
    """
    cfg = model.config
    B = len(prompts)
    V = cfg.vocab_size
    step = DecodeStep(model, B)
    penalise = repetition_penalty is not None and repetition_penalty != 1.0
    seen = np.zeros((B, V), dtype=bool) if penalise else None
    context = [list(p) for p in prompts]        # the tokens in the cache, for a sliding-window refill
    if seen is not None:
        for b, p in enumerate(prompts):
            seen[b, p] = True

    def prefill():
        """Run the whole context of every row through model.forward; return last logits (B, V)."""
        P = max(len(c) for c in context)
        pads = np.array([P - len(c) for c in context])
        tokens = np.full((B, P), PAD_ID, dtype=np.int64)
        for b, c in enumerate(context):
            tokens[b, pads[b]:] = c
        kv = model.new_kv_cache(B)
        if pads.any():
            s = np.arange(P)
            # query t may see key s if s <= t and s is real; a padded query sees itself only (its
            # output is never read, but a row with no allowed key would be 0/0 in the softmax)
            mask = (s[None, None, :] <= s[None, :, None]) & (
                (s[None, None, :] >= pads[:, None, None]) | (s[None, None, :] == s[None, :, None]))
            # for the decode steps: -inf on each row's padded keys, (B, 1, 1, max_seq_len)
            key_bias = np.zeros((B, 1, 1, cfg.max_seq_len), dtype=model.dtype)
            key_bias[..., :P] = np.where(s >= pads[:, None], 0.0, -np.inf)[:, None, None, :]
        else:
            mask, key_bias = None, None
        logits = model.forward(tokens, kv_cache=kv, start_pos=0, mask=mask)[:, -1]
        step.load(kv, P)
        return logits, P, key_bias

    if max_new_tokens == 0:
        return
    logits, pos, key_bias = prefill()
    done = np.zeros(B, dtype=bool)
    with _blas_limit():  # held across the yields too, until the generator ends or is closed
        for i in range(max_new_tokens):
            if np.isnan(np.maximum.reduce(logits, axis=None)):
                raise ValueError("the model produced NaN logits; check the weights (a diverged checkpoint?)")
            ids = choose_next(logits, temperature, top_k, top_p, min_p, repetition_penalty, seen, rngs)
            finished = np.array([int(t) in stop for t in ids]) if stop else np.zeros(B, dtype=bool)
            ids_out = np.where(done | finished, -1, ids)
            done |= finished
            yield ids_out
            if done.all() or i + 1 == max_new_tokens:
                return
            if seen is not None:
                seen[np.arange(B), ids] = True
            if sliding_window:
                for b in range(B):
                    context[b].append(int(ids[b]))
            if pos == cfg.max_seq_len:
                # sliding window: keep the newest half of every row's context and prefill it afresh
                # from position 0 (cached keys carry their old absolute rotations: no shifting them)
                keep = max(1, cfg.max_seq_len // 2)
                context = [c[-keep:] for c in context]
                logits, pos, key_bias = prefill()
                continue
            logits = step(ids, pos, None if key_bias is None else key_bias[..., :pos + 1])
            pos += 1


def _prepare(model, prompts, max_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty,
             seed, stop_ids, sliding_window):
    max_new_tokens = _check_int("max_new_tokens", max_new_tokens, 0)
    check_sampling_args(temperature, top_k, top_p, min_p, repetition_penalty)
    stop = _check_stop_ids(model, stop_ids)
    if sliding_window:
        # an over-long prompt keeps its newest max_seq_len tokens
        prompts = [p[-model.config.max_seq_len:] for p in prompts]
    for p in prompts:
        _check_length(model, len(p), max_new_tokens, sliding_window)
    rngs = _rngs(seed, len(prompts), temperature)
    return _decode(model, prompts, max_new_tokens, temperature, top_k, top_p, min_p,
                   repetition_penalty, rngs, stop, sliding_window)


def generate_stream(model, prompt_ids, max_new_tokens: int, temperature: float = 0.0,
                    top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                    stop_ids=None, min_p: float | None = None, repetition_penalty: float | None = None,
                    sliding_window: bool = False) -> Iterator[int]:
    """Generator of new token ids (python ints), each yielded as soon as it is sampled.

    Arguments as in generate(). Every argument is checked when this is called, before the
    first id is asked for. sliding_window=True lifts the max_seq_len limit: when the cache is
    full, the newest max_seq_len // 2 tokens are prefilled again from position 0.
    """
    prompt = _check_prompt(model, prompt_ids)
    steps = _prepare(model, [prompt], max_new_tokens, temperature, top_k, top_p, min_p,
                     repetition_penalty, seed, stop_ids, sliding_window)

    def ids():
        for step_ids in steps:
            if step_ids[0] < 0:
                return
            yield int(step_ids[0])
    return ids()


def generate(model, prompt_ids, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             stop_ids=None, min_p: float | None = None, repetition_penalty: float | None = None,
             sliding_window: bool = False) -> np.ndarray:
    """The new token ids after prompt_ids, as a 1-D int64 array (the prompt is not included).

    prompt_ids: 1-D ints in [0, vocab_size), at least one.
    max_new_tokens: how many new tokens at most; len(prompt_ids) + max_new_tokens > max_seq_len
        raises ValueError (unless sliding_window=True, see generate_stream).
    temperature 0 is greedy argmax; otherwise tokens are drawn after top_k / top_p / min_p /
        repetition_penalty (see npllama.sampling), from np.random.default_rng(seed).
    stop_ids: token ids that end generation; the stop id itself is not returned.
    One prefill of the prompt, then one token a step through the KV cache.
    """
    return np.fromiter(generate_stream(model, prompt_ids, max_new_tokens, temperature, top_k, top_p,
                                       seed, stop_ids, min_p, repetition_penalty, sliding_window),
                       dtype=np.int64)


def generate_batch(model, prompts: Sequence, max_new_tokens: int, temperature: float = 0.0,
                   top_k: int | None = None, top_p: float | None = None, seed=None, stop_ids=None,
                   min_p: float | None = None, repetition_penalty: float | None = None,
                   sliding_window: bool = False) -> list[np.ndarray]:
    """generate() for several prompts of any lengths at once: a list of 1-D arrays, one per prompt.

    Row b equals generate(model, prompts[b], ..., seed=seed) (greedy: the same ids; sampling:
    every row gets its own Generator from `seed`, or from seed[b] when a list is given). A row
    that samples a stop id stops there; the others go on.
    """
    if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
        prompts = list(prompts)
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of 1-D token id sequences")
    checked = [_check_prompt(model, p, name=f"prompts[{b}]") for b, p in enumerate(prompts)]
    outs = [[] for _ in checked]
    for step_ids in _prepare(model, checked, max_new_tokens, temperature, top_k, top_p, min_p,
                             repetition_penalty, seed, stop_ids, sliding_window):
        for b, t in enumerate(step_ids):
            if t >= 0:
                outs[b].append(int(t))
    return [np.array(o, dtype=np.int64) for o in outs]
