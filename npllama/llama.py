"""Llama: the public model object. Parameters in a flat dict keyed by Meta's names, and methods.

    model = Llama(config, seed=0, dtype=np.float32)
    logits = model.forward(tokens)                          # (B, T) ints -> (B, T, V)
    loss, grads = model.loss_and_grads(tokens, targets)     # grads keyed and shaped like params
    new_ids = model.generate(prompt_ids, max_new_tokens=32)

The math lives in npllama.model (pure functions, the reference a reader reads). These methods
check their inputs and run that math through npllama.engine, which is faster and tested equal
to the reference; npllama.model.forward(model.params, model.config, tokens) gives the same
logits single-threaded, in the order the reference writes it.
"""

from __future__ import annotations

import numpy as np

from . import engine, generate as generation
from .checks import check_dtype, check_int
from .config import LlamaConfig
from .engine.layout import FlatLayout, flat_params
from .kvcache import KVCache
from .model import TokenError, check_tokens, init_params, model_rope_tables


class Llama:
    """A LLaMA-2 model: config, params (Meta names -> arrays), dtype, and an optional tokenizer."""

    def __init__(self, config: LlamaConfig, seed: int = 0, dtype=np.float32):
        if not isinstance(config, LlamaConfig):
            raise ValueError(f"config must be a LlamaConfig, got {type(config).__name__}")
        dtype = check_dtype(dtype)
        # the parameters are views of one flat array, which the training engine reads and writes
        # without copies (engine/layout.py); init_params draws straight into them
        self._setup(config, init_params(config, seed, dtype, out=flat_params(config, dtype)), dtype)

    def _setup(self, config: LlamaConfig, params: dict, dtype: np.dtype) -> None:
        self.config = config
        self.dtype = dtype
        self.params = params
        self.tokenizer = None   # set by npllama.load when the checkpoint carries one
        self.rope = model_rope_tables(config, dtype)   # (cos, sin), each (max_seq_len, Dh/2)

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
            parts = [f"{what} {names}" for what, names in
                     (("missing", missing), ("unexpected", unexpected), ("wrong shapes", misshapen)) if names]
            raise ValueError("parameters do not fit the config: " + "; ".join(parts))
        if dtype is None:
            first = np.asarray(params["tok_embeddings.weight"]).dtype
            dtype = first if first in (np.float32, np.float64) else np.float32
        dtype = check_dtype(dtype)
        model = cls.__new__(cls)
        model._setup(config, {n: np.ascontiguousarray(params[n], dtype=dtype) for n in expected}, dtype)
        return model

    def new_kv_cache(self, batch_size: int = 1) -> KVCache:
        """An empty cache for batch_size rows, in the layout the engine's decode step reads fastest."""
        cfg = self.config
        return engine.DecodeCache(cfg.n_layers, batch_size, cfg.n_kv_heads, cfg.max_seq_len, cfg.head_dim, self.dtype)

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
        start_pos = check_int("start_pos", start_pos, 0)
        tokens = check_tokens(tokens, self.config, start_pos=start_pos)
        if kv_cache is None:
            if start_pos:
                raise ValueError(f"start_pos={start_pos} needs a kv_cache holding the earlier positions")
        else:
            if kv_cache.batch_size != tokens.shape[0]:
                raise ValueError(f"kv_cache holds batch {kv_cache.batch_size}, tokens have {tokens.shape[0]} rows")
            if start_pos > kv_cache.length:
                raise ValueError(f"start_pos={start_pos} skips positions: the kv_cache holds only "
                                 f"{kv_cache.length}")
        logits = engine.forward(self.params, self.config, self.rope, tokens, kv_cache=kv_cache,
                                start_pos=start_pos, mask=mask, workers=workers)
        if kv_cache is not None:
            kv_cache.length = start_pos + tokens.shape[1]
        return logits[0] if one_dim else logits

    def loss_and_grads(self, tokens, targets, workers=None):
        """Mean cross-entropy of the targets (ignoring -100) and its gradient for every parameter.

        tokens, targets: (B, T) ints. Returns (loss: float, grads: dict keyed and shaped like params;
            its arrays are views of one new flat array, so a later call never overwrites them).
        The first call on a loaded model moves its parameters into one flat array (the same values;
        model.params then holds views of it): arrays taken from model.params before are copies.
        workers: threads sharing contiguous shards of the batch rows (default: one per CPU core, at
            most B; one for small steps); see npllama.engine.training. The shards' terms are summed
            in shard order, so a call gives the same bits whatever the threads' timing; the number
            of shards (and so the rounding) depends on `workers` and the batch's size only.
        """
        tokens = check_tokens(tokens, self.config)
        targets = check_tokens(targets, self.config, name="targets", allow_ignore=True)
        if targets.shape != tokens.shape:
            raise TokenError(f"targets shape {targets.shape} != tokens shape {tokens.shape}")
        return engine.training.loss_and_grads(self._flat_params(), self.config, self.rope, tokens, targets,
                                              workers=workers)

    def _flat_params(self) -> dict:
        """self.params, made views of one flat array if they are not yet (a loaded model), which the
        training pass reads and writes without copies (engine/layout.py). The same values in the
        same dict: an optimizer built on model.params goes on updating them."""
        if FlatLayout(self.config).base_of(self.params) is None:
            flat = flat_params(self.config, self.dtype)
            for name, view in flat.items():
                view[...] = self.params[name]
            self.params.update(flat)
        return self.params

    def generate(self, prompt_ids, max_new_tokens=32, temperature=0.0, top_k=None, top_p=None,
                 seed=None, stop_ids=None, min_p=None, repetition_penalty=None, sliding_window=False):
        """New token ids after prompt_ids (1-D), sampled with a KV cache: npllama.generate.generate."""
        return generation.generate(self, prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                   top_k=top_k, top_p=top_p, seed=seed, stop_ids=stop_ids, min_p=min_p,
                                   repetition_penalty=repetition_penalty, sliding_window=sliding_window)

    def generate_stream(self, prompt_ids, max_new_tokens=32, **sampling):
        """The ids of generate(), yielded one at a time as they are sampled: npllama.generate.generate_stream."""
        return generation.generate_stream(self, prompt_ids, max_new_tokens=max_new_tokens, **sampling)

    def generate_batch(self, prompts, max_new_tokens=32, **sampling):
        """generate() for several prompts of any lengths at once: npllama.generate.generate_batch."""
        return generation.generate_batch(self, prompts, max_new_tokens=max_new_tokens, **sampling)

    def n_params(self) -> int:
        return sum(p.size for p in self.params.values())

    def __repr__(self):
        return f"Llama({self.config}, dtype={self.dtype.name}, params={self.n_params():,})"
