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

The prefill and the steps are the model's backend's Decoder (npllama/backend.py): on the
reference, model.forward with a KVCache; on the engine, the same arithmetic fused
(npllama.engine.decode). Prompts of different lengths are batched by left-padding them to one
length and masking the padded keys.

Only the positions fed to the model count against max_seq_len: the last new token is sampled
from the logits at the final position and never fed back, as llama2.c's run.c does, so a prompt
of n tokens may ask for max_seq_len - n + 1 new tokens.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from . import memory
from .checks import check_int, is_integer
from .sampling import check_sampling_args, choose_next
from .errors import NpllamaError

PAD_ID = 0  # fills the left of shorter prompts; masked out, so any valid id would do
# Weights mapped from a file are checked unchanged (model._source_check, one fstat: io/mapped.py)
# before the prefill and every this many decode steps: measured 7 us a check on this VM, against
# 550 us for a decode step of a 1-layer dim-16 model and 1.8 ms of stories260K, so every 8th step
# costs under 0.2% of the smallest model's time.
SOURCE_CHECK_STEPS = 8


# ----------------------------------------------------------------------------- argument checks

def _check_prompt(model, prompt_ids, name="prompt_ids") -> np.ndarray:
    arr = np.asarray(prompt_ids)
    if arr.ndim != 1:
        raise NpllamaError(f"{name} must be a 1-D sequence of token ids, got shape {arr.shape}; "
                         "for several prompts use generate_batch")
    if arr.size == 0:
        raise NpllamaError(f"{name} is empty; generation needs at least one token to condition on "
                         "(a sentencepiece model's BOS id, for instance)")
    if arr.dtype == bool or arr.dtype.kind not in "iu":
        raise NpllamaError(f"{name} must hold integer token ids, got dtype {arr.dtype}")
    V = model.config.vocab_size
    bad = np.flatnonzero((arr < 0) | (arr >= V))
    if bad.size:
        raise NpllamaError(f"{name}[{bad[0]}] = {arr[bad[0]]} is outside [0, {V}) (vocab_size={V})")
    return arr.astype(np.int64)


def _check_stop_ids(model, stop_ids) -> frozenset:
    if stop_ids is None:
        return frozenset()
    if is_integer(stop_ids):
        stop_ids = [stop_ids]
    try:
        ids = None if isinstance(stop_ids, str) else [int(i) for i in stop_ids if is_integer(i)]
    except TypeError:
        ids = None
    if ids is None or len(ids) != len(list(stop_ids)):
        raise NpllamaError(f"stop_ids={stop_ids!r} must be a token id or a sequence of token ids "
                         "(for stop strings, use the CLI's --stop)")
    V = model.config.vocab_size
    bad = [i for i in ids if not 0 <= i < V]
    if bad:
        raise NpllamaError(f"stop_ids {bad} are outside [0, {V}) (vocab_size={V})")
    return frozenset(ids)


def _check_length(model, prompt_len, max_new_tokens, sliding_window):
    """Every new token but the last is fed back, so prompt_len + max_new_tokens - 1 positions are
    computed: they must fit in the cache's max_seq_len (unless the window slides)."""
    max_seq_len = model.config.max_seq_len
    if sliding_window:
        return
    if prompt_len > max_seq_len:
        raise NpllamaError(f"prompt of {prompt_len} tokens is longer than the model's max_seq_len={max_seq_len}; "
                           "shorten it, or pass sliding_window=True (npllama generate --sliding-window) to keep "
                           "its newest max_seq_len tokens")
    if prompt_len + max_new_tokens - 1 > max_seq_len:
        raise NpllamaError(
            f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} needs {prompt_len + max_new_tokens - 1} "
            f"positions (the last new token is never fed back), more than the model's max_seq_len={max_seq_len}: "
            f"at most {max_seq_len - prompt_len + 1} new tokens fit; shorten the prompt, lower max_new_tokens, "
            "or pass sliding_window=True (npllama generate --sliding-window) to drop the oldest tokens as it goes")


def _rngs(seed, batch_size, temperature):
    """One Generator per row, each from the same seed (or seeds[b]): row b of a batch then
    draws exactly what a single-prompt run with that seed draws."""
    if temperature == 0:
        return None
    if seed is None or is_integer(seed):
        return [np.random.default_rng(seed) for _ in range(batch_size)]
    seeds = list(seed)
    if len(seeds) != batch_size:
        raise NpllamaError(f"seed: got {len(seeds)} seeds for {batch_size} prompts; pass one int or one per prompt")
    return [np.random.default_rng(s) for s in seeds]


# ----------------------------------------------------------------------------- the decoding loop

NAN_MESSAGE = "the model produced NaN logits; check the weights (a diverged checkpoint?)"


def _has_nan(logits: np.ndarray) -> bool:
    """Whether any logit is NaN (a max propagates NaN: one reduction, no (B, V) temporary)."""
    return bool(np.isnan(np.maximum.reduce(logits, axis=None)))


def _chose_nan(logits: np.ndarray, ids: np.ndarray) -> bool:
    """Whether greedy ids (B,) came from rows holding a NaN: argmax returns a row's first NaN, so
    such a row has a NaN at its chosen id. Checks B numbers instead of B V (a stories260K step's
    1.3 us reduction)."""
    if ids.shape[0] == 1:
        return logits[0, ids[0]] != logits[0, ids[0]]
    return bool(np.isnan(logits[np.arange(ids.shape[0]), ids]).any())


def _left_padded(context: list[list[int]], max_seq_len: int):
    """The rows left-padded to one length P: tokens (B, P), the prefill's mask (B, P, P) and the
    steps' key_ok (B, max_seq_len), both None when no row is padded.

    Row b's tokens sit at positions shifted by pad_b = P - len(row b); RoPE depends only on the
    difference of q's and k's positions, and the masks keep padded keys away from every real
    query, so each row computes what it would alone. A padded query sees itself only (its output
    is never read, but a row with no allowed key would be 0/0 in the softmax).
    """
    B, P = len(context), max(len(c) for c in context)
    pads = np.array([P - len(c) for c in context])
    tokens = np.full((B, P), PAD_ID, dtype=np.int64)
    for b, c in enumerate(context):
        tokens[b, pads[b]:] = c
    if not pads.any():
        return tokens, None, None
    s = np.arange(P)
    real = s[None, :] >= pads[:, None]                                  # (B, P): key s of row b is real
    mask = (s[None, None, :] <= s[None, :, None]) & (real[:, None, :] | (s[None, None, :] == s[None, :, None]))
    key_ok = np.ones((B, max_seq_len), dtype=bool)
    key_ok[:, :P] = real
    return tokens, mask, key_ok


def _decode(model, prompts: list[np.ndarray], max_new_tokens: int, temperature, top_k, top_p, min_p,
            repetition_penalty, rngs, stop: frozenset, sliding_window: bool, positions: int) -> Iterator[np.ndarray]:
    """Yield the ids sampled for all rows at each step (B,); -1 marks a row that has stopped.
    positions: what the decoder's cache holds (_cache_positions)."""
    cfg = model.config
    B, V = len(prompts), cfg.vocab_size
    # weights memory-mapped from a file: checked unchanged before the prefill and every
    # SOURCE_CHECK_STEPS steps (npllama.io sets model._source_check; io/mapped.py)
    check_source = getattr(model, "_check_source", None) or (lambda: None)
    check_source()
    penalise = repetition_penalty is not None and repetition_penalty != 1.0
    seen = np.zeros((B, V), dtype=bool) if penalise else None
    context = [list(p) for p in prompts]        # the tokens in the cache, for a sliding-window refill
    if seen is not None:
        for b, p in enumerate(prompts):
            seen[b, p] = True
    if max_new_tokens == 0:
        return
    decoder = model.new_decoder(B, positions)
    try:
        tokens, mask, key_ok = _left_padded(context, cfg.max_seq_len)
        logits, pos = decoder.prefill(tokens, mask), tokens.shape[1]
        done = np.zeros(B, dtype=bool)
        greedy = temperature == 0
        for i in range(max_new_tokens):
            if not greedy and _has_nan(logits):
                raise NpllamaError(NAN_MESSAGE)
            ids = choose_next(logits, temperature, top_k, top_p, min_p, repetition_penalty, seen, rngs)
            if greedy and _chose_nan(logits, ids):
                raise NpllamaError(NAN_MESSAGE)
            if stop:
                finished = np.fromiter((t in stop for t in ids.tolist()), dtype=bool, count=B)
                ids_out = np.where(done | finished, -1, ids)
                done |= finished
                yield ids_out
                if done.all():
                    return
            else:                               # no row can stop: the ids as they are (a step's ~2 us less)
                yield ids
            if i + 1 == max_new_tokens:
                return                          # the last token is never fed back
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
                decoder.close()
                decoder = model.new_decoder(B)
                tokens, mask, key_ok = _left_padded(context, cfg.max_seq_len)
                logits, pos = decoder.prefill(tokens, mask), tokens.shape[1]
                continue
            if i % SOURCE_CHECK_STEPS == SOURCE_CHECK_STEPS - 1:
                check_source()
            logits = decoder.step(ids, pos, None if key_ok is None else key_ok[:, :pos + 1])
            pos += 1
    finally:
        decoder.close()


def _cache_positions(model, prompts, max_new_tokens: int, sliding_window: bool) -> int:
    """The positions a generation's cache must hold: the longest prompt (the batch is left-padded
    to it) and every new token fed back, which is all but the last; every position of max_seq_len
    when a sliding window may refill it."""
    if sliding_window:
        return model.config.max_seq_len
    return max(len(p) for p in prompts) + max(max_new_tokens, 1) - 1


def _require_memory(model, prompts, positions: int) -> None:
    """Refuse, before anything is allocated, a generation whose cache, prefill and decode step
    cannot fit (npllama.memory.generate_bytes)."""
    cfg, B, longest = model.config, len(prompts), max(len(p) for p in prompts)
    stacked = model.backend.decoder_copy_bytes(model.params, model.dtype, B, steps=positions - longest)
    memory.require(memory.generate_bytes(cfg, B, longest, model.dtype.itemsize, stacked,
                                         model.backend.scores_in_blocks, positions),
                   f"generating from {B} prompt(s) with a cache of {positions} positions x {cfg.n_layers} layers",
                   "fewer prompts at once, shorter prompts, or a smaller max_seq_len")


def _prepare(model, prompts, max_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty,
             seed, stop_ids, sliding_window):
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, 0)
    check_sampling_args(temperature, top_k, top_p, min_p, repetition_penalty)
    stop = _check_stop_ids(model, stop_ids)
    if sliding_window:
        # an over-long prompt keeps its newest max_seq_len tokens
        prompts = [p[-model.config.max_seq_len:] for p in prompts]
    for p in prompts:
        _check_length(model, len(p), max_new_tokens, sliding_window)
    rngs = _rngs(seed, len(prompts), temperature)
    positions = _cache_positions(model, prompts, max_new_tokens, sliding_window)
    _require_memory(model, prompts, positions)
    return _decode(model, prompts, max_new_tokens, temperature, top_k, top_p, min_p,
                   repetition_penalty, rngs, stop, sliding_window, positions)


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
            token = step_ids.item()
            if token < 0:
                return
            yield token
    return ids()


def generate(model, prompt_ids, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             stop_ids=None, min_p: float | None = None, repetition_penalty: float | None = None,
             sliding_window: bool = False) -> np.ndarray:
    """The new token ids after prompt_ids, as a 1-D int64 array (the prompt is not included).

    prompt_ids: 1-D ints in [0, vocab_size), at least one.
    max_new_tokens: how many new tokens at most. Only fed positions count: the last new token is
        sampled from the logits at the final position and never fed back, as llama2.c's run.c
        does, so len(prompt_ids) + max_new_tokens - 1 > max_seq_len raises ValueError (unless
        sliding_window=True, see generate_stream), and a 1-token prompt may ask for max_seq_len.
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
        raise NpllamaError("prompts must be a non-empty list of 1-D token id sequences")
    checked = [_check_prompt(model, p, name=f"prompts[{b}]") for b, p in enumerate(prompts)]
    outs = [[] for _ in checked]
    for step_ids in _prepare(model, checked, max_new_tokens, temperature, top_k, top_p, min_p,
                             repetition_penalty, seed, stop_ids, sliding_window):
        for b, t in enumerate(step_ids.tolist()):
            if t >= 0:
                outs[b].append(t)
    return [np.array(o, dtype=np.int64) for o in outs]
