"""Llama: the public model object. Parameters in a flat dict keyed by Meta's names, and methods.
LoraLlama: a frozen Llama with LoRA adapters, the object a LoRA fine-tuning run trains.

    model = Llama(config, seed=0, dtype=np.float32, backend="engine")
    logits = model.forward(tokens)                          # (B, T) ints -> (B, T, V)
    loss, grads = model.loss_and_grads(tokens, targets)     # grads keyed and shaped like params
    new_ids = model.generate(prompt_ids, max_new_tokens=32)

The math lives in npllama.model (pure functions, the reference a reader reads). These methods
check their inputs and hand the arithmetic to the model's backend (npllama/backend.py):
backend="reference" runs the reference itself, single-threaded; backend="engine" (the
default) runs npllama.engine, which is faster and tested equal to it.
"""

from __future__ import annotations

import mmap

import numpy as np

from . import generate as generation, memory
from .backend import Decoder, LoraAdapters, ReferenceBackend, check_backend_name
from .checks import check_dtype, check_int
from .config import LlamaConfig
from .engine import EngineBackend
from .engine.layout import FlatLayout
from .engine.stacked import adjacent_rows, stack_members
from .errors import NpllamaError
from .kvcache import KVCache
from .lora import LoraSpec, adapter_shapes, check_adapters, init_adapters, merge
from .model import TokenError, check_tokens, fill_init_params, layer_weights, model_rope_tables
from .optim import AdamW
from .storage import (STORAGE_DTYPES, compute_dtype_of, is_half, nbytes_per_element, storage_dtype_name,
                      storage_name_of, to_storage)

BACKENDS = {"engine": EngineBackend(), "reference": ReferenceBackend()}


def backend_named(name: str):
    """The backend object of that name ("engine" or "reference")."""
    return BACKENDS[check_backend_name(name)]


def checked_pair(tokens, targets, config: LlamaConfig) -> tuple[np.ndarray, np.ndarray]:
    """tokens and targets (B, T) as int64 arrays, or TokenError naming the problem."""
    tokens = check_tokens(tokens, config)
    targets = check_tokens(targets, config, name="targets", allow_ignore=True)
    if targets.shape != tokens.shape:
        raise TokenError(f"targets shape {targets.shape} != tokens shape {tokens.shape}")
    return tokens, targets


class Llama:
    """A LLaMA-2 model: config, params (Meta names -> arrays), dtype, backend, and an optional tokenizer.

    dtype is the precision the model computes in (float32 or float64); the weights are held in
    it too, unless loaded at half precision (storage_dtype float16 or bfloat16, see from_params).
    backend: "engine" (fast, the default) or "reference" (npllama/backend.py).
    model.params keeps its identity: the arrays in it are the model's for its whole life (an
    optimizer built on them, or a user holding one, sees every update).
    """

    def __init__(self, config: LlamaConfig, seed: int = 0, dtype=np.float32, backend: str = "engine"):
        if not isinstance(config, LlamaConfig):
            raise NpllamaError(f"config must be a LlamaConfig, got {type(config).__name__}")
        dtype = check_dtype(dtype)
        backend = backend_named(backend)
        memory.require(memory.model_bytes(config, dtype.itemsize),
                       f"a {dtype.name} model of {config.n_params():,} parameters",
                       "choose a smaller dim, n_layers, vocab_size or max_seq_len")
        # the engine lays the parameters out as views of one flat array, which its training pass
        # reads and writes without copies (engine/layout.py); the init draws straight into them
        params = fill_init_params(backend.new_params(config, dtype), config, seed)
        self._setup(config, params, dtype, backend)

    # For weights memory-mapped from a file, npllama.io sets this to a check (one fstat) that the
    # file did not change under them (io/mapped.py); forward, loss_and_grads and generation run
    # it first. None: nothing to check.
    _source_check = None

    def _check_source(self) -> None:
        if self._source_check is not None:
            self._source_check()

    def _setup(self, config: LlamaConfig, params: dict, dtype: np.dtype, backend) -> None:
        self.config = config
        self.dtype = dtype
        self.params = params
        self.backend = backend
        self.tokenizer = None   # set by npllama.load when the checkpoint carries one
        self.rope = model_rope_tables(config, dtype)   # (cos, sin), each (max_seq_len, Dh/2)
        # True: keep only each block's input in the forward and run the block again in backward
        # (model.loss_and_grads: the same gradients, less memory, about a third more compute)
        self.gradient_checkpointing = False

    @classmethod
    def from_params(cls, config: LlamaConfig, params: dict, dtype=None, backend: str = "engine",
                    adopt: bool = False, release=None) -> "Llama":
        """A model holding the given arrays, converted to dtype (default: their own dtype when it is
        one npllama holds, else float32). Half-held ones, and mapped arrays already in dtype (a
        memory-mapped file's) when they are most of the weights or the others are arrays in memory,
        are used where they are (so are those others, converted where needed); otherwise all are
        laid out as the backend keeps a model's (the engine's one flat array, which its training
        pass reads without copies), which copies them unless they are laid out so already.
        adopt=True hands the dict over (npllama.load does): its arrays are moved out one by one as
        they are laid out, so the two copies never coexist.
        release: None, or called with each part of a given array once it is converted (a view;
        npllama.load hands the file's pages of that part back).

        dtype np.float16 or "bfloat16" holds the weights at half precision, half the memory of
        float32 (bfloat16 as its raw bits, uint16 arrays: npllama.storage); such a model computes
        in float32, one layer at a time (model.dtype is then float32).
        Names and shapes are compared before anything is used; every problem is reported at once.
        """
        backend = backend_named(backend)
        expected = config.param_shapes()
        missing = [n for n in expected if n not in params]
        unexpected = [n for n in params if n not in expected]
        misshapen = [f"{n}: {tuple(np.shape(params[n]))} != expected {expected[n]}"
                     for n in expected if n in params and tuple(np.shape(params[n])) != expected[n]]
        dtypes = {n: _dtype_of(params[n]) for n in expected if n in params}
        not_real = [f"{n}: {d}" for n, d in dtypes.items()
                    if not (np.issubdtype(d, np.floating) or np.issubdtype(d, np.integer))]
        if missing or unexpected or misshapen or not_real:
            parts = [f"{what} {names}" for what, names in
                     (("missing", missing), ("unexpected", unexpected), ("wrong shapes", misshapen),
                      ("not real numbers", not_real)) if names]
            raise NpllamaError("parameters do not fit the config: " + "; ".join(parts))
        if dtype is None:
            own = storage_name_of(np.asarray(params["tok_embeddings.weight"]))
            storage = own if own in STORAGE_DTYPES else "float32"
        else:
            storage = storage_dtype_name(dtype)
        compute = compute_dtype_of(storage)
        copies = sum(memory.array_bytes(np.size(params[n]), nbytes_per_element(storage)) for n in expected
                     if not (isinstance(params[n], np.ndarray) and storage_name_of(params[n]) == storage))
        # arrays are laid out as the backend's new ones (the engine's one flat array, which its
        # training pass needs), each converted straight into it, unless the model is half-held or
        # some are a mapped file's arrays held as they are (read in place, not copied) and either
        # they are most of the weights or the others are in memory already (a quantized GGUF file's
        # decoded tensors: laid out, the largest would be held twice for a moment). A float16 GGUF
        # file's float32 norms beside tensors widened from the file join those in the layout.
        in_place = sum(np.size(params[n]) for n in expected
                       if is_mapped(params[n]) and storage_name_of(params[n]) == storage)
        in_memory = not all(is_mapped(params[n]) for n in expected)
        relayout = not is_half(storage) and (in_place == 0 or (2 * in_place < config.n_params() and not in_memory))
        if relayout and backend.name == "engine":      # the flat array, the one copy whatever the dtypes
            copies = memory.array_bytes(config.n_params(), compute.itemsize)
            if adopt:       # handed over: each array in memory freed once copied, the one being copied alive beside it
                sources = sum(getattr(params[n], "nbytes", 0) for n in expected if not is_mapped(params[n]))
                copies = max(0, copies - sources) + memory.array_bytes(max(map(np.size, params.values())),
                                                                       compute.itemsize)
        memory.require(copies + memory.rope_bytes(config, compute.itemsize),
                       f"a model held in {storage} with max_seq_len={config.max_seq_len}",
                       "a smaller max_seq_len (npllama.load(..., max_seq_len=N)), or weights held in float16")
        take = params.pop if adopt else params.__getitem__
        if relayout:                                       # each array dropped once copied into the layout
            held = backend.lay_out({n: np.asarray(take(n)) for n in expected}, config, compute, release)
        else:
            held = {n: _held_as(np.asarray(take(n)), storage, release) for n in expected}
        model = cls.__new__(cls)
        model._setup(config, held, compute, backend)
        return model

    @property
    def storage_dtype(self) -> str:
        """The dtype the weights are held in: "float32", "float64", "float16" or "bfloat16"
        (npllama.storage); model.dtype is the one the model computes in."""
        return storage_name_of(self.params["tok_embeddings.weight"])

    def new_kv_cache(self, batch_size: int = 1) -> KVCache:
        """An empty cache for batch_size rows, in the layout the backend's decode step reads fastest."""
        cfg = self.config
        self._require_kv(batch_size)
        return self.backend.new_kv_cache(cfg, batch_size, self.dtype)

    def new_decoder(self, batch_size: int = 1, positions: int | None = None) -> Decoder:
        """The backend's KV-cached decoder for batch_size rows (backend.Decoder): generate drives it.
        positions: the most its cache will hold (a generation's prompt and fed tokens), 1 to
        max_seq_len; None: max_seq_len. A cache only as long as the generation needs is made and
        faulted in that much faster (110M, 8 rows, 64 new tokens: 3.7-3.8 s against 4.8-5.2)."""
        if positions is not None:
            positions = check_int("positions", positions, 1)
            if positions > self.config.max_seq_len:
                raise NpllamaError(f"positions={positions} is more than the model's max_seq_len="
                                   f"{self.config.max_seq_len}")
        self._require_kv(batch_size, positions)
        return self.backend.decoder(self.params, self.config, self.rope, batch_size, positions)

    def _require_kv(self, batch_size: int, positions: int | None = None) -> None:
        cfg = self.config
        check_int("batch_size", batch_size, 1)
        memory.require(memory.kv_cache_bytes(cfg, batch_size, self.dtype.itemsize, positions),
                       f"a KV cache of {batch_size} rows x {cfg.cache_positions(positions)} positions x "
                       f"{cfg.n_layers} layers", "fewer prompts at once, or a smaller max_seq_len")

    def forward(self, tokens, kv_cache: KVCache | None = None, start_pos: int = 0, mask=None, workers=None):
        """Logits of every position.

        tokens: (B, T) ints (a 1-D sequence is taken as B = 1 and gives (T, V)).
        kv_cache, start_pos: for decoding, the tokens sit at positions start_pos .. start_pos + T - 1;
            their keys and values are written into kv_cache and they attend to positions
            0 .. start_pos + T - 1 of it. Without a cache, start_pos must be 0.
        mask: optional booleans (B, T, start_pos + T), True where a query may attend a key
            (left-padded batches); None is causal.
        workers: threads sharing the batch rows, as in loss_and_grads (the engine's; the reference
            runs on the calling thread).
        Returns: logits (B, T, V) in the model's dtype.
        """
        one_dim = np.ndim(tokens) == 1
        self._check_source()
        start_pos = check_int("start_pos", start_pos, 0)
        tokens = check_tokens(tokens, self.config, start_pos=start_pos)
        self._require_pass(tokens, workers, grads=False)
        if kv_cache is None:
            if start_pos:
                raise NpllamaError(f"start_pos={start_pos} needs a kv_cache holding the earlier positions")
        else:
            if kv_cache.batch_size != tokens.shape[0]:
                raise NpllamaError(f"kv_cache holds batch {kv_cache.batch_size}, tokens have {tokens.shape[0]} rows")
            if start_pos > kv_cache.length:
                raise NpllamaError(f"start_pos={start_pos} skips positions: the kv_cache holds only "
                                   f"{kv_cache.length}")
        logits = self.backend.forward(self.params, self.config, self.rope, tokens, kv_cache=kv_cache,
                                      start_pos=start_pos, mask=mask, workers=workers)
        if kv_cache is not None:
            kv_cache.length = start_pos + tokens.shape[1]
        return logits[0] if one_dim else logits

    def loss_and_grads(self, tokens, targets, workers=None):
        """Mean cross-entropy of the targets (ignoring -100) and its gradient for every parameter.

        tokens, targets: (B, T) ints. Returns (loss: float, grads: dict keyed and shaped like params,
            new arrays every call (on the engine, views of one flat array: an array of an earlier
            call that nothing holds any more, no view of it alive, or a new one; engine/layout.py)).
        workers: the engine's threads sharing contiguous shards of the batch rows (default: one per
            CPU core, at most B; one for small steps); see npllama.engine.passes. The shards' terms
            are summed in a fixed order, so a call gives the same bits whatever the threads'
            timing; the number of shards (and so the rounding) depends on `workers` and the
            batch's size only.
        """
        if is_half(self.storage_dtype):
            raise NpllamaError(f"this model holds its weights in {self.storage_dtype}, which npllama keeps for "
                               "inference only (forward and generate compute in float32); training needs float32 "
                               "or float64 weights: load them with npllama.load(path, dtype=np.float32)")
        self._check_source()
        tokens, targets = checked_pair(tokens, targets, self.config)
        self._require_pass(tokens, workers, grads=True)
        return self.backend.loss_and_grads(self.params, self.config, self.rope, tokens, targets,
                                           checkpointing=self.gradient_checkpointing, workers=workers)

    def optimizer(self, lr: float = 1e-3, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1) -> AdamW:
        """AdamW over model.params from the model's backend (the engine's is optim.AdamW bit for bit, faster)."""
        return self.backend.optimizer(self.params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def _require_pass(self, tokens: np.ndarray, workers, grads: bool) -> None:
        """Refuse a batch whose activations cannot fit (npllama.memory), before computing it."""
        B, T = tokens.shape
        rows, shards = pass_footprint(self.backend, B, T, self.config.dim, workers)
        memory.require(memory.pass_bytes(self.config, B, rows, T, self.dtype.itemsize, shards if grads else 0),
                       f"{'loss_and_grads' if grads else 'forward'} on {B} x {T} tokens", "a smaller batch")

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
        return (f"Llama({self.config}, dtype={self.dtype.name}{held}, backend={self.backend.name}, "
                f"params={self.n_params():,})")


def _held_as(source: np.ndarray, storage: str, release) -> np.ndarray:
    """source held as `storage` (itself when it is already), release told of it once converted."""
    held = np.ascontiguousarray(to_storage(source, storage))
    if release is not None and held is not source:
        release(source)
    return held


def is_mapped(a) -> bool:
    """True when the array's memory is a mapped file (np.memmap, or a view of an mmap.mmap)."""
    while isinstance(a, np.ndarray):
        if isinstance(a, np.memmap):
            return True
        a = a.base
    return isinstance(getattr(a, "obj", a), mmap.mmap)          # np.frombuffer's memoryview of the mmap


def pass_footprint(backend, batch_size: int, seq_len: int, dim: int, workers=None) -> tuple[int, int]:
    """(rows whose activations are alive at once, shards whose gradients are held until summed):
    the engine's shards, or the reference's one whole batch."""
    if hasattr(backend, "pass_footprint"):
        return backend.pass_footprint(batch_size, seq_len, dim, workers)
    return batch_size, 1


def _require_lora(base: Llama, spec: LoraSpec) -> None:
    """Refuse, before they are built, adapters that cannot fit (npllama.memory), with the frozen
    stacks of the base's blocks ([wq; wk; wv] and [w1; w3]: a copy of those weights, unless they are
    one flat array already or lie next to each other, as in a mapped file that npllama saved)."""
    itemsize = base.dtype.itemsize
    stacks = 0
    if base.backend.name == "engine" and FlatLayout(base.config).base_of(base.params) is None:
        for i in range(base.config.n_layers):
            for members in stack_members(layer_weights(base.params, i)).values():
                if len(members) > 1 and (members[0].dtype != base.dtype or adjacent_rows(members) is None):
                    stacks += sum(p.size for p in members) * itemsize
    memory.require(memory.lora_bytes(base.config, spec.rank, spec.targets, itemsize) + stacks,
                   f"LoRA adapters of rank {spec.rank} on {','.join(spec.targets)} ({base.config.n_layers} layers)",
                   "choose a smaller rank (--lora-rank)")


class LoraLlama:
    """A frozen Llama with LoRA adapters (npllama.lora): the adapters train, the base never changes.

        lora = LoraLlama(npllama.load("stories260K.bin"), LoraSpec(rank=8, alpha=16), seed=0)
        lora.params                                # the adapters only: AdamW(lora.params) trains them
        loss, grads = lora.loss_and_grads(x, y)    # grads keyed like lora.params; none for the base
        lora.forward(x)                            # (B, T, V), through W + s B A without forming it
        lora.merged()                              # a Llama holding W + s B A: generate, save, export

    It runs on its base's backend (the reference: npllama.lora; the engine: engine/lora.py, on
    stacks of the base's weights, views when the base is laid out flat). The base's arrays are
    never touched; the base must not be trained while it is adapted.
    """

    def __init__(self, base: Llama, spec: LoraSpec, seed: int = 0, adapters: dict | None = None):
        if not isinstance(base, Llama):
            raise NpllamaError(f"base must be an npllama.Llama, got {type(base).__name__}")
        if not isinstance(spec, LoraSpec):
            raise NpllamaError(f"spec must be an npllama.lora.LoraSpec, got {type(spec).__name__}")
        if is_half(base.storage_dtype):
            raise NpllamaError(f"the base model holds its weights in {base.storage_dtype}, which npllama keeps for "
                               "inference only; LoRA needs a float32 or float64 base: load it with "
                               "npllama.load(path, dtype=np.float32)")
        self.base, self.spec = base, spec
        self.config, self.dtype, self.rope, self.backend = base.config, base.dtype, base.rope, base.backend
        self.tokenizer = base.tokenizer
        _require_lora(base, spec)
        if adapters is None:
            adapters = init_adapters(base.config, spec, seed, base.dtype)
        else:
            check_adapters(adapters, base.config, spec)
            adapters = {n: np.ascontiguousarray(adapters[n], dtype=base.dtype)
                        for n in adapter_shapes(base.config, spec)}
        self.params = adapters
        self.gradient_checkpointing = False            # as Llama's
        # where the base came from, when it is a file: a LoRA checkpoint records both (io/lora.py)
        self.base_path: str | None = None
        self.base_sha256: str | None = None

    def _adapters(self) -> LoraAdapters:
        return LoraAdapters(self.params, self.spec)

    def _check_source(self) -> None:
        self.base._check_source()

    def forward(self, tokens, workers=None):
        """Logits (B, T, V) of the adapted model for tokens (B, T); a 1-D sequence gives (T, V)."""
        one_dim = np.ndim(tokens) == 1
        self._check_source()
        tokens = check_tokens(tokens, self.config)
        logits = self.backend.forward(self.base.params, self.config, self.rope, tokens, lora=self._adapters(),
                                      workers=workers)
        return logits[0] if one_dim else logits

    def loss_and_grads(self, tokens, targets, workers=None):
        """Mean cross-entropy (ignoring -100) and its gradient for every adapter: keyed and shaped like
        self.params. The base gets none (on the engine no weight-gradient GEMM of it is formed)."""
        self._check_source()
        tokens, targets = checked_pair(tokens, targets, self.config)
        return self.backend.loss_and_grads(self.base.params, self.config, self.rope, tokens, targets,
                                           lora=self._adapters(), checkpointing=self.gradient_checkpointing,
                                           workers=workers)

    def optimizer(self, lr: float = 1e-3, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1) -> AdamW:
        """AdamW over the adapters, from the base's backend."""
        return self.backend.optimizer(self.params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def merged(self) -> Llama:
        """An ordinary Llama whose adapted weights are W + s B A (the others shared with the base)."""
        adapted = [self.base.params[n.removesuffix(".lora_a") + ".weight"].size for n in self.params
                   if n.endswith(".lora_a")]     # each a new W + s B A, with B A and its scaling on the way
        memory.require((sum(adapted) + 2 * max(adapted, default=0)) * self.dtype.itemsize,
                       f"merging LoRA adapters of rank {self.spec.rank} into {len(adapted)} weights",
                       "merge on a machine with more memory")
        model = Llama.from_params(self.config, merge(self.base.params, self.params, self.spec), self.dtype,
                                  backend=self.backend.name)
        model.tokenizer = self.tokenizer
        model._source_check = self.base._source_check         # it may share the base's mapped arrays
        return model

    def generate(self, prompt_ids, max_new_tokens=32, **sampling):
        """Llama.generate on the merged model."""
        return self.merged().generate(prompt_ids, max_new_tokens=max_new_tokens, **sampling)

    def n_params(self) -> int:
        """The trainable numbers: the adapters' (the base has base.n_params())."""
        return sum(p.size for p in self.params.values())

    def __repr__(self):
        return (f"LoraLlama(rank={self.spec.rank}, alpha={self.spec.alpha}, targets={','.join(self.spec.targets)}, "
                f"adapters={self.n_params():,}, base={self.base!r})")


def _dtype_of(value) -> np.dtype:
    """The dtype an array-like parameter has (or would have as an array)."""
    return value.dtype if isinstance(value, np.ndarray) else np.asarray(value).dtype
