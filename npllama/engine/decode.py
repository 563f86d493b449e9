"""The engine's decoding: a prefill through engine/passes.py, then one token a step, fused.

    decoder = EngineDecoder(params, config, rope, batch_size, positions=S)   # the backend's Decoder
    logits = decoder.prefill(tokens, mask)                      # (B, P) -> (B, V), cache filled
    logits = decoder.step(ids, pos, key_ok)                     # (B,) at position pos -> (B, V)

(S: the positions its cache holds, at most max_seq_len: a generation's P + new tokens - 1)

DecodeStep is model.forward(params, config, ids[:, None], kv_cache=kv_cache, start_pos=pos)
with T = 1 (every op of model.block_forward: rmsnorm, the projections, rope, attention,
swiglu; and the final rmsnorm and output), up to rounding (tests/test_backends.py checks 1e-10
in float64). It is the one place the engine does not run engine/block.py: at one position a
step costs per NumPy call (small models) or per byte of weights read (large ones), and the
block's layout for many rows would cost both. The reference's ops, in fewer, larger NumPy calls:
  - the linear layers are StackedProjections or InPlaceProjections (engine.projections), chosen
    by the size of the weights: stacked, norm-folded copies for small models, whose steps cost
    per NumPy call, or the parameters read in place for large ones, whose steps cost per byte of
    weights read (and whose weights may be memory-mapped, or held in float16 / bfloat16);
  - one row on two cores: each large product's second half runs in a helper process forked for
    the generation (engine/helper.py), whose hand-off costs ~2 us where a thread's costs ~75; and
    each layer's attention over half of the heads, when the KV cache is in memory both processes
    share (EngineDecoder makes it so: AttentionHeads), both cores then reading the cache;
  - one query needs no causal mask: every cached key 0 .. pos is in its past (a left-padded
    batch passes key_bias, -inf on its padded keys);
  - RoPE rotates q and k together with one complex multiply, as Meta's reference does: the
    pair (x[2i], x[2i+1]) read as x[2i] + i x[2i+1], times cos + i sin, is the rotation
        y[2i] = x[2i] cos - x[2i+1] sin,   y[2i+1] = x[2i] sin + x[2i+1] cos;
  - the softmax denominator comes out of the same matmul as its numerator (DecodeCache);
  - the softmax exponentiates the scores as they are, without first subtracting each row's max,
    and checks once a step that no row needed it (SOFTMAX_SUM_RANGE).
The cache is a DecodeCache (engine/cache.py), a KVCache in the layout the step reads fastest:
the prefill's blocks fill it, and each step adds one position.
"""

from __future__ import annotations

import math

import numpy as np

from ..config import LlamaConfig
from ..backend import Decoder
from .settings import blas_threads
from .attention import SOFTMAX_SUM_RANGE
from .cache import DecodeCache
from .fused import row_dot
from .passes import forward
from .helper import HelperProcess, available as helper_available
from .projections import (GEMV_THREADS_MIN_WEIGHTS, Activations, InPlaceProjections, RowHalves, StackedProjections,
                          helper_weights, product_threads)
from .upcast import has_half
from ..errors import NpllamaError

# A step's small matmuls (the attention's, a small model's products) cost more in a second
# OpenBLAS thread's hand-off than they save, and on a busy machine its spin-waiting is ruinous
# (measured on 2 cores under load: 431 vs 98 tok/s for an 8M model at batch 1; 110M matvecs
# 0.6-5 GB/s on two threads against 17-30 on one). So a step runs on one BLAS thread, set for
# each step and restored after it, so a paused generator leaves the process as it found it.
# Its large products (projections.CORES_MIN_WEIGHTS multiply-adds and more) run on the process's
# BLAS threads, as many as there were when the step was made; in a process set to one BLAS
# thread (npllama.engine.blas_threads(1), the advice for a busy machine) their rows go in halves
# on the decoder's helper thread instead (projections.RowHalves), which sleeps while it waits. A
# one-row step on two BLAS threads shares its products with a helper process instead, where the
# platform has one (uses_helper_process): both sides then run one BLAS thread.
DECODE_BLAS_THREADS = 1

# Weights up to this many bytes are copied once per generation into the stacked, norm-folded
# layout, which saves NumPy calls; larger ones are read in place, with no copy. Measured (float32,
# interleaved): the stacked copies win by 1.5x at stories260K (1 MB), where a step costs per call,
# and by 5-10% at 8M (29 MB) and 15M (61 MB); at 110M (438 MB) the two are within 5% at batch 1
# and tie at batch 8, and a copy would double the memory of a model that costs per byte read.
STACKED_MAX_BYTES = 64 << 20

# A step subtracts no max before its softmax's exp (engine/attention.py's SOFTMAX_SUM_RANGE, which
# the training attention's blocks check too): two NumPy calls a layer fewer (stories260K's step
# 174-181 us against 189-208, the fastest of 7 runs, alternating, AMD EPYC, 6 December 2026; with
# the 2-D divide below). It checks at its end, in two reductions over every layer's denominators,
# that each lay within the range; when a row's falls outside (scores of +-44 and beyond, or NaN),
# the step runs again with each row's max subtracted, as the decoder's later steps then do.
# stories260K's rows peak at scores of -6 to 24.


# OpenBLAS runs a GEMM on its threads from about m n k = 65536 GEMM_MULTITHREAD_THRESHOLD (4 by
# default) on (interface/gemm.c); a gemv from GEMV_THREADS_MIN_WEIGHTS. Neither process of a step
# with a helper may start OpenBLAS's threads (engine/helper.py), so the attention is shared only in
# a cache short enough that no call of a half reaches them (110M's 12 heads of 64: up to 7,089 positions).
GEMM_THREADS_MIN_MNK = 65536 * 4


def choose_layout(params: dict) -> str:
    """"stacked" (copies, for small float models) or "in_place" (large, mapped or half-held ones)."""
    if has_half(params):
        return "in_place"
    return "stacked" if sum(a.nbytes for a in params.values()) <= STACKED_MAX_BYTES else "in_place"


class DecodeStep:
    """One decode step for a batch of batch_size rows.

    layout: "stacked" (copies of the weights, stacked and norm-folded: make a new step after
    changing the parameters), "in_place" (the parameters themselves, never copied), or None to
    choose by size (choose_layout). Half-held parameters (float16 / bfloat16) are always read in
    place, a block of rows at a time in float32. halves: the helper thread the large products
    share their rows with (projections.RowHalves), or None for one thread; a one-row step forks a
    helper process instead where it can (uses_helper_process), ended by close(). steps: how many steps
    the generation will run (None: not known), by which a stacked step decides whether copying its
    classifier pays (projections.copies_classifier).

    The activations live in buffers made here (projections.Activations) and every view the step
    reads them through is made here too: a step makes no array but its scores and its results.
    """

    def __init__(self, params: dict, config: LlamaConfig, rope, batch_size: int, layout: str | None = None,
                 halves: RowHalves | None = None, steps: int | None = None, cache: DecodeCache | None = None):
        cos, sin = rope
        dtype = cos.dtype
        B, D, H, KVH, Dh = batch_size, config.dim, config.n_heads, config.n_kv_heads, config.head_dim
        R, F = H // KVH, config.hidden_dim
        self.layout = layout = _checked_layout(layout) or choose_layout(params)
        self.closed = False
        helper = HelperProcess() if uses_helper_process(params, B, steps or config.max_seq_len) else None
        try:
            self._make_projections(params, config, B, dtype, helper, halves, steps, cache)
        except OSError:                 # no fork, no shared memory (a process limit, no memory): one process
            if helper is None:
                raise
            helper.close()
            if getattr(self, "projections", None) is not None:     # made, then the fork refused: its memory again
                self.projections.release()
            self._make_projections(params, config, B, dtype, None, halves, steps, None)
        acts = self.acts
        # The step's BLAS thread count, set for each step and restored after it; none set beside a
        # helper process, whose products' blocks are all too small for OpenBLAS's threads
        # (projections.helper_cuts): after the fork, setting it would start OpenBLAS's pool anew.
        self.blas = blas_threads(None if self.helper else DECODE_BLAS_THREADS)
        complex_dtype = np.result_type(dtype, np.complex64)
        self.rotations = (cos + 1j * sin).astype(complex_dtype)          # (max_seq_len, Dh/2): e^(i p theta_j)
        # a position's rotations repeated for each of q's and k's heads, copied once a step: each
        # layer's multiply then runs one inner loop over them all (stories260K 0.44 us, against 1.3
        # broadcasting (Dh/2,) over the heads)
        self.rotation = np.empty((H + KVH, Dh // 2), complex_dtype)
        heads = _view(acts.qkv, (B, H + 2 * KVH, Dh))
        self.qk = _view(acts.qkv[:, :(H + KVH) * Dh].view(complex_dtype), (B, H + KVH, Dh // 2))  # q, k as pairs
        self.q = _view(heads[:, :H], (B, KVH, R, Dh))
        self.k, self.v = heads[:, H:H + KVH], heads[:, H + KVH:]                                # (B, KVH, Dh)
        self.shift = False                                              # subtract each row's max (SOFTMAX_SUM_RANGE)
        self.no_halves = [None] * config.n_layers
        self.att_rows = _view(acts.att, (B * H, Dh))
        self.minus_a, self.b = acts.ab[:, :F], acts.ab[:, F:]
        self.d_eps, self.one = D * config.norm_eps, np.array(1.0, dtype)
        # a row's norm in Python floats: 2 us, against 6 for the (B, 1) ufuncs' broadcasting
        self.one_row = B == 1
        if self.one_row:
            self.x_row, self.xn_row, self.norm = acts.x[0], acts.xn[0], np.empty((), dtype)
        else:
            self.sum_squares = np.empty((B, 1), dtype)

    def _make_projections(self, params, config, B, dtype, helper, halves, steps, cache):
        """self.acts, self.ev and self.projections, sharing the large products with helper (forked
        here, after everything it needs is made; dropped when no product is large enough) or with
        halves; and, when cache was made shared, half of each layer's attention heads
        (self.attention_halves)."""
        self.helper = helper
        empty = helper.empty if helper else np.empty
        self.acts = acts = Activations(config, B, dtype, empty=empty)
        H, KVH, Dh, L = config.n_heads, config.n_kv_heads, config.head_dim, config.n_layers
        ev = empty((L, B * H, Dh + 1), dtype)               # each layer's [sum e v | sum e], rows (b, head)
        self.e_sums = ev[:, :, Dh]                          # every layer's softmax denominators
        # per layer: the values' matmul's out (B, KVH, R, Dh + 1), and the divide's operands
        self.ev = [(_view(e, (B, KVH, H // KVH, Dh + 1)), e[:, :Dh], e[:, Dh:]) for e in ev]
        if self.layout == "stacked":
            self.projections = StackedProjections(params, config, acts, helper or halves, steps)
        else:
            self.projections = InPlaceProjections(params, config, acts, helper or halves)
        self.attention_halves = [None] * L
        if helper is not None:
            if helper.jobs:
                if cache is not None and cache.shared:
                    self.attention_halves = self._share_attention(config, helper, cache)
                helper.start()
            else:
                self.helper = None
        self.cache = cache

    def _share_attention(self, config, helper, cache) -> list:
        """Per layer, (the helper's job, [our call]): each computing one layer's attention over its
        half of the heads (AttentionHeads), reading the step's positions from the helper's arg.
        Split by kv heads, or by the query heads of the one kv head there is; [None] * L for one head,
        or for a cache so long that a call would run on OpenBLAS's threads (GEMM_THREADS_MIN_MNK)."""
        H, KVH, Dh = config.n_heads, config.n_kv_heads, config.head_dim
        R = H // KVH
        q = _view(self.acts.qkv[:, :H * Dh], (1, KVH, R, Dh))
        att_rows = _view(self.acts.att, (H, Dh))
        if KVH >= 2:
            parts = [(slice(0, KVH // 2), slice(None)), (slice(KVH // 2, KVH), slice(None))]
        elif R >= 2:
            parts = [(slice(None), slice(0, R // 2)), (slice(None), slice(R // 2, R))]
        else:
            return [None] * config.n_layers
        per_call = R if KVH >= 2 else R - R // 2        # the most query heads a call of a half multiplies
        largest = per_call * cache.positions * (Dh + 1)  # the values' product at the last position, m n k
        if largest >= (GEMV_THREADS_MIN_WEIGHTS if per_call == 1 else GEMM_THREADS_MIN_MNK):
            return [None] * config.n_layers
        halves = []
        for k, v, (e_v, ev_sum, e_sum) in zip(cache.k, cache.v, self.ev):
            ours, theirs = (AttentionHeads(q[:, g, r], k[:, g], v[:, g], e_v[:, g, r],
                                           *(a[_head_rows(g, r, KVH, R)] for a in (ev_sum, e_sum, att_rows)),
                                           cache.keys_transposed, helper.arg)
                            for g, r in parts)
            halves.append((helper.register([theirs]), [ours]))
        return halves

    def close(self) -> None:
        """End the helper process, if the step has one (a step unclosed ends it when collected), and
        hand the memory of the step's copies on to the next step's (projections.Arena): a closed
        step refuses to run."""
        if self.helper is not None:
            self.helper.close()
        if not self.closed:
            self.closed = True
            self.projections.release()

    def __call__(self, ids: np.ndarray, pos: int, kv_cache: DecodeCache,
                 key_bias: np.ndarray | None = None) -> np.ndarray:
        """ids (B,) ints at absolute position pos, after positions 0 .. pos-1 in kv_cache.

        Writes this position's keys and values into kv_cache and returns logits (B, V).
        key_bias, when given, broadcasts to (B, KVH, R, pos + 1): 0 where a key may be attended,
        -inf where not.
        """
        if self.closed:
            raise NpllamaError("this DecodeStep was closed: its copies' memory is another step's now; make a new one")
        with self.blas:
            if not self.shift:
                # exp(-a) -> inf gives silu 0, right; a row's exp overflowing (and then inf / inf) is caught below
                with np.errstate(over="ignore", invalid="ignore"):
                    logits = self._step(ids, pos, kv_cache, key_bias)
                low, high = SOFTMAX_SUM_RANGE
                sums = self.e_sums
                if low <= np.minimum.reduce(sums, axis=None) and np.maximum.reduce(sums, axis=None) <= high:
                    return logits
                self.shift = True                                       # and again: it rewrites position pos
            with np.errstate(over="ignore"):
                return self._step(ids, pos, kv_cache, key_bias)

    def _step(self, ids, pos, kv_cache, key_bias):
        # Every name the layers' loop reads is a local, bound once a step: a layer read some 25
        # attributes and globals, and called the attention as a method (now one function, attend,
        # of locals, which its helper's half runs too). With the tiled rotations
        # and the position-first writes, stories260K's step runs 3-5% faster for it, the same bits
        # (medians of per-round ratios 0.954-0.968, alternating in one process, AMD EPYC, 6 December 2026).
        # (the norm picked here, not stored on self: a bound method held by its own object would make a
        # cycle, and an unclosed step would wait for the garbage collector to end its helper process)
        norm = self._normalize_row if self.one_row else self._normalize
        # each layer's attention over half of its heads on the helper process, the other half here
        # (AttentionHeads), where the step has one and runs in its shared cache: None to run it whole
        halves = (self.attention_halves if kv_cache is self.cache and not self.shift and key_bias is None
                  else self.no_halves)
        run = self.helper.run if self.helper is not None else None
        acts, minus_a, b, one = self.acts, self.minus_a, self.b, self.one
        x, res, g = acts.x, acts.res, acts.g
        qk, q, k, v, att_rows, shift = self.qk, self.q, self.k, self.v, self.att_rows, self.shift
        multiply, exp, add, subtract, divide = np.multiply, np.exp, np.add, np.subtract, np.divide
        keys_transposed, S = kv_cache.keys_transposed, pos + 1
        rotation = self.rotation
        rotation[...] = self.rotations[pos]                                 # (H + KVH, Dh/2) complex
        self.projections.embed(ids, x)                                      # (B,) -> (B, D), the residual
        for (qkv, o, gate_up, down), k_cache, v_cache, k_at, v_at, (e_v, ev_sum, e_sum), shared in zip(
                self.projections.layers, kv_cache.k, kv_cache.v, kv_cache.k_at, kv_cache.v_at, self.ev, halves):
            norm(x)
            qkv()                                                           # xn -> [q / sqrt(Dh) | k | v]
            # attention of this position's q over the keys and values 0 .. pos, its own written first
            multiply(qk, rotation, qk)                                      # RoPE on q and k at once
            k_at[pos] = k                                                   # (B, KVH, Dh)
            v_at[pos] = v
            if shared is not None:                                          # half of the heads each
                run(shared[0], shared[1], S)
            else:
                attend(q, k_cache, v_cache, S, keys_transposed, e_v, ev_sum, e_sum, att_rows, key_bias, shift)
            o()                                                             # att -> res
            add(x, res, x)
            norm(x)
            gate_up()                                                       # xn -> [-a | b]
            multiply(minus_a, b, g)                                         # silu(a) b = a b / (1 + exp(-a)),
            exp(minus_a, minus_a)                                           # here negated: -a b / (1 + exp(-a))
            add(minus_a, one, minus_a)
            divide(g, minus_a, g)
            down()                                                          # g -> res = -down(silu(a) b)
            subtract(x, res, x)
        norm(x)
        self.projections.logits()                                           # xn -> logits
        return acts.logits.copy()

    def _normalize(self, x):
        """acts.xn = x / sqrt(sum(x**2) + D eps), each row: RMSNorm without its weight and sqrt(D) (the
        projections apply those). (B, D) -> (B, D)"""
        ss = self.sum_squares
        row_dot(x, x, out=ss)
        np.add(ss, self.d_eps, out=ss)
        np.sqrt(ss, out=ss)
        np.divide(x, ss, out=self.acts.xn)

    def _normalize_row(self, x):
        """_normalize of one row (x is acts.x)."""
        x, norm = self.x_row, self.norm
        norm[()] = math.sqrt(x.dot(x) + self.d_eps)
        np.divide(x, norm, self.xn_row)


class AttentionHeads:
    """The one-row step's attention over some of a layer's heads, a call without arguments: attend on
    views of those heads, the positions S read from positions() when called. A step with a helper process runs one half of the
    heads so in the helper and the other here (DecodeStep._share_attention). Split by kv heads, each
    kv head's calls are those of the whole (one BLAS call a kv head): the same bits; by the query
    heads of one kv head (MQA), equal to rounding (a gemv for one query head, a GEMM for several).
    Both halves and the step's loop for all heads run the one function attend (a call a layer: about
    a microsecond of stories260K's ~180 us step, within the noise of alternating runs here).

    q (1, g, r, Dh); k (1, g, Dh, max_seq_len) transposed or (1, g, max_seq_len, Dh); v (1, g,
    max_seq_len, Dh + 1); e_v (1, g, r, Dh + 1) and its 2-D views ev_sum (g r, Dh), e_sum (g r, 1);
    att_rows (g r, Dh): these heads' rows of the attention's output."""

    def __init__(self, q, k, v, e_v, ev_sum, e_sum, att_rows, keys_transposed: bool, positions):
        self.q, self.k, self.v, self.e_v = q, k, v, e_v
        self.ev_sum, self.e_sum, self.att_rows = ev_sum, e_sum, att_rows
        self.keys_transposed, self.positions = keys_transposed, positions

    def __call__(self):
        attend(self.q, self.k, self.v, self.positions(), self.keys_transposed, self.e_v, self.ev_sum, self.e_sum,
               self.att_rows)


def attend(q, k, v, S, keys_transposed, e_v, ev_sum, e_sum, att_rows, key_bias=None, shift=False):
    """One layer's attention of a step's query over positions 0 .. S-1, for the heads of q's views:
    the scores, their exp (unshifted unless shift: SOFTMAX_SUM_RANGE), e_v = [sum e v | sum e] and
    att_rows = sum e v / sum e. Shapes as AttentionHeads' (B rows for the whole step); key_bias, when
    given, is added to the scores (-inf on a padded row's keys)."""
    if keys_transposed:                                                 # (B, KVH, Dh, max_seq_len)
        scores = np.matmul(q, k[..., :S])                               # (B, KVH, R, S)
    else:                                                               # (B, KVH, max_seq_len, Dh)
        scores = np.matmul(q, k[:, :, :S].swapaxes(-1, -2))
    if key_bias is not None:
        scores += key_bias
    if shift:
        scores -= np.maximum.reduce(scores, axis=-1, keepdims=True)
    np.exp(scores, scores)
    np.matmul(scores, v[:, :, :S], e_v)                                 # [sum e v | sum e] (B, KVH, R, Dh + 1)
    np.divide(ev_sum, e_sum, att_rows)                                  # -> att; 2-D: 1.8 us, against 2.9 in 4-D


def _head_rows(g: slice, r: slice, KVH: int, R: int) -> slice:
    """The rows (heads, kv head major) of kv heads g and their query heads r: one contiguous range
    when either takes all (DecodeStep._share_attention's halves)."""
    g0, g1, _ = g.indices(KVH)
    r0, r1, _ = r.indices(R)
    assert g1 - g0 == 1 or (r0, r1) == (0, R), (g, r)
    return slice(g0 * R + r0, (g1 - 1) * R + r1)


# A step forks a helper process only where it pays for the fork: 6-9 ms to fork and 7-9 to end it
# (15M's process, measured 6 December 2026, AMD EPYC), against a step 0.29 ms faster on 8M's shape
# (7.2M weights shared a step) and on 15M's (15.3M, its classifier already on OpenBLAS's threads
# before): about 50 steps to break even on either. So a generation's steps times the weights
# its step shares (projections.helper_weights) must reach this.
HELPER_MIN_WEIGHT_STEPS = 5 * 10 ** 8


def uses_helper_process(params: dict, batch_size: int, steps: int) -> bool:
    """Whether a step of batch_size rows, made for `steps` steps, shares its large products with a
    helper process (engine/helper.py): one row, a generation long enough to pay for the fork
    (HELPER_MIN_WEIGHT_STEPS), where the platform allows one (helper.available) and the process
    two BLAS threads on two cores (projections.product_threads), whose place it then takes."""
    if batch_size != 1 or not helper_available() or product_threads() < 2:
        return False
    shared = helper_weights(params)
    return shared > 0 and steps * shared >= HELPER_MIN_WEIGHT_STEPS


def _checked_layout(layout: str | None) -> str | None:
    if layout not in (None, "stacked", "in_place"):
        raise NpllamaError(f"layout={layout!r}; use 'stacked', 'in_place' or None (chosen by size)")
    return layout


def _view(a: np.ndarray, shape) -> np.ndarray:
    """a seen in another shape, never a copy (raises if that needs one): the step writes through it."""
    view = a.view()
    view.shape = shape
    return view


class EngineDecoder(Decoder):
    """backend.Decoder on the engine: the prefill is engine/passes.forward into a DecodeCache of
    `positions` (default max_seq_len; the last position's logits only), each step a DecodeStep,
    made at the first step for the positions left in the cache (the steps the generation runs):
    the first token, which the prefill gives, comes before a small model's copies are made (8M:
    12-20 ms), and a generation of one token never makes them.
    Owns the helper thread of its few-row GEMMs (projections.RowHalves), ended by close()."""

    def __init__(self, params: dict, config: LlamaConfig, rope, batch_size: int, layout: str | None = None,
                 positions: int | None = None):
        self.params, self.config, self.rope = params, config, rope
        self.batch_size, self.layout = batch_size, _checked_layout(layout)
        # shared with a helper process, where a step would fork one (half of its heads each)
        shared = uses_helper_process(params, batch_size, config.cache_positions(positions))
        self.cache = DecodeCache.for_config(config, batch_size, rope[0].dtype, positions, shared=shared)
        self.halves = RowHalves()
        self.step_fn = None

    def prefill(self, tokens, mask):
        logits = forward(self.params, self.config, self.rope, tokens, kv_cache=self.cache, mask=mask, last_only=True)
        self.cache.length = tokens.shape[1]
        return logits

    def step(self, ids, pos, key_ok):
        key_bias = None
        if key_ok is not None:                                  # (B, S) -> (B, 1, 1, S): -inf on padding
            key_bias = np.where(key_ok, 0.0, -np.inf).astype(self.cache.k.dtype)[:, None, None, :]
        if self.step_fn is None:                                # one step for each position left in the cache
            self.step_fn = DecodeStep(self.params, self.config, self.rope, self.batch_size, self.layout, self.halves,
                                      steps=self.cache.positions - pos, cache=self.cache)
        logits = self.step_fn(ids, pos, self.cache, key_bias)
        self.cache.length = pos + 1
        return logits

    def close(self):
        self.halves.close()
        if self.step_fn is not None:
            self.step_fn.close()
        self.cache = None
