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
from .kvcache import KVCache
from .model import TokenError, check_tokens, init_params, model_rope_tables
from .storage import STORAGE_DTYPES, compute_dtype_of, is_half, storage_dtype_name, storage_name_of, to_storage


class Llama:
    """A LLaMA-2 model: config, params (Meta names -> arrays), dtype, and an optional tokenizer.

    dtype is the precision the model computes in (float32 or float64); the weights are held in
    it too, unless loaded at half precision (storage_dtype float16 or bfloat16, see from_params).
    """

    def __init__(self, config: LlamaConfig, seed: int = 0, dtype=np.float32):
        if not isinstance(config, LlamaConfig):
            raise ValueError(f"config must be a LlamaConfig, got {type(config).__name__}")
        self._setup(config, init_params(config, seed, dtype), check_dtype(dtype))

    def _setup(self, config: LlamaConfig, params: dict, dtype: np.dtype) -> None:
        self.config = config
        self.dtype = dtype
        self.params = params
        self.tokenizer = None   # set by npllama.load when the checkpoint carries one
        self.rope = model_rope_tables(config, dtype)   # (cos, sin), each (max_seq_len, Dh/2)

    @classmethod
    def from_params(cls, config: LlamaConfig, params: dict, dtype=None) -> "Llama":
        """A model holding the given arrays, converted to dtype (default: their own dtype when it is
        one npllama holds, else float32). Arrays already of that dtype are used as they are, not
        copied (a memory-mapped file stays mapped).

        dtype np.float16 or "bfloat16" holds the weights at half precision, half the memory of
        float32 (bfloat16 as its raw bits, uint16 arrays: npllama.storage); such a model computes
        in float32, one layer at a time (model.dtype is then float32).
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
            own = storage_name_of(np.asarray(params["tok_embeddings.weight"]))
            storage = own if own in STORAGE_DTYPES else "float32"
        else:
            storage = storage_dtype_name(dtype)
        model = cls.__new__(cls)
        held = {n: np.ascontiguousarray(to_storage(np.asarray(params[n]), storage)) for n in expected}
        model._setup(config, held, compute_dtype_of(storage))
        return model

    @property
    def storage_dtype(self) -> str:
        """The dtype the weights are held in: "float32", "float64", "float16" or "bfloat16"
        (npllama.storage); model.dtype is the one the model computes in."""
        return storage_name_of(self.params["tok_embeddings.weight"])

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

        tokens, targets: (B, T) ints. Returns (loss: float, grads: dict keyed and shaped like params).
        workers: threads sharing contiguous shards of the batch rows (default: one per CPU core, at
            most B; one for small steps); see npllama.engine.passes. The result depends on
            `workers` only through rounding; pass workers=1 for sums in one order on every machine.
        """
        if is_half(self.storage_dtype):
            raise ValueError(f"this model holds its weights in {self.storage_dtype}, which npllama keeps for "
                             "inference only (forward and generate compute in float32); training needs float32 "
                             "or float64 weights: load them with npllama.load(path, dtype=np.float32)")
        tokens = check_tokens(tokens, self.config)
        targets = check_tokens(targets, self.config, name="targets", allow_ignore=True)
        if targets.shape != tokens.shape:
            raise TokenError(f"targets shape {targets.shape} != tokens shape {tokens.shape}")
        return engine.loss_and_grads(self.params, self.config, self.rope, tokens, targets, workers=workers)

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
        held = f", storage_dtype={self.storage_dtype}" if self.storage_dtype != self.dtype.name else ""
        return f"Llama({self.config}, dtype={self.dtype.name}{held}, params={self.n_params():,})"
