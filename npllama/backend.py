"""The seam: what npllama.Llama hands its arithmetic to, and the reference's side of it.

A backend runs four things for a model, given its params (Meta names -> arrays), config and
RoPE tables (cos, sin):

    backend.forward(params, config, rope, tokens, kv_cache=, start_pos=, mask=, lora=)   -> logits (B, T, V)
    backend.loss_and_grads(params, config, rope, tokens, targets, lora=, checkpointing=) -> (loss, grads)
    backend.optimizer(params, lr=, betas=, eps=, weight_decay=)                           -> an optim.AdamW
    backend.decoder(params, config, rope, batch_size, positions)                          -> a Decoder

and allocates what those read: new_params(config, dtype) (the arrays a new model is drawn
into), lay_out(params, config, dtype, release) (given arrays kept as it keeps them; release(part)
hears of each part of a source once converted) and
new_kv_cache(config, batch_size, dtype, positions) (positions: what the cache holds, at most
max_seq_len, by default that). lora, when given, is a LoraAdapters: the
adapters are what trains, params are frozen (npllama/lora.py).

Two backends implement it. ReferenceBackend, here, runs the readable reference and nothing
else: npllama.model's forward and chain rule, npllama.lora, optim.AdamW, and the decode step
below, which is model.forward on one new position with a KVCache. npllama.engine.EngineBackend
(the default) runs the same arithmetic fast, and tests/test_backends.py holds the two equal
(float64, 1e-10): whatever a user does through Llama, the reference can do too.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import numpy as np

from . import lora as lora_math, model
from .config import LlamaConfig
from .errors import NpllamaError
from .kvcache import KVCache
from .lora import LoraSpec
from .optim import AdamW
from .storage import copy_into, is_half, storage_name_of, to_float


class LoraAdapters(NamedTuple):
    """The trainable part of a LoRA model: adapters keyed as npllama.lora names them, and their spec."""
    params: dict
    spec: LoraSpec


class Decoder(ABC):
    """One batch's KV-cached decoding (npllama/generate.py drives it):

        logits = decoder.prefill(tokens, mask)     # (B, P) prompt at positions 0 .. P-1 -> (B, V)
        logits = decoder.step(ids, pos, key_ok)    # (B,) at position pos -> (B, V)
        decoder.close()                            # let go of the cache and any helper

    prefill returns the logits of the last position only; mask is None (causal) or (B, P, P)
    booleans as in model.forward. step feeds one token per row at absolute position pos, after
    positions 0 .. pos-1 in the cache; key_ok is None or (B, pos + 1) booleans, False on the
    keys a row must not see (a left-padded row's padding).
    """

    @abstractmethod
    def prefill(self, tokens: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
        """(B, P) ids -> (B, V) logits of position P - 1; the cache then holds 0 .. P-1."""

    @abstractmethod
    def step(self, ids: np.ndarray, pos: int, key_ok: np.ndarray | None) -> np.ndarray:
        """(B,) ids at position pos -> (B, V) logits; the cache then holds 0 .. pos."""

    def close(self) -> None:
        """Release what the decoder holds; the default holds nothing that needs it."""


class ReferenceDecoder(Decoder):
    """The reference's decode step: model.forward with a KVCache, nothing fused.

    The prompt runs through the full forward once (the prefill), writing every layer's keys
    and values into the cache; each later step runs the same forward on one position, whose
    query attends to the cached keys 0 .. pos. RoPE rotates by absolute position and attention
    is causal, so this equals running the whole sequence again (tests/test_generate.py).
    """

    def __init__(self, params: dict, config: LlamaConfig, rope, batch_size: int, positions: int | None = None):
        self.params, self.config, self.rope = params, config, rope
        self.kv = ReferenceBackend().new_kv_cache(config, batch_size, rope[0].dtype, positions)

    def prefill(self, tokens, mask):
        logits, _ = model.forward(self.params, self.config, tokens, rope=self.rope, kv_cache=self.kv, mask=mask)
        return logits[:, -1]                                                # (B, P, V) -> (B, V)

    def step(self, ids, pos, key_ok):
        mask = None if key_ok is None else key_ok[:, None, :]               # (B, S) -> (B, 1, S)
        logits, _ = model.forward(self.params, self.config, ids[:, None], rope=self.rope, kv_cache=self.kv,
                                  start_pos=pos, mask=mask)
        return logits[:, 0]                                                 # (B, 1, V) -> (B, V)

    def close(self):
        self.kv = None


def float_params(params: dict, dtype) -> dict:
    """params, with weights held at half precision (npllama.storage) turned into `dtype` floats:
    the reference computes in float32 / float64 only, so a half-held model costs a float copy here."""
    if not any(is_half(storage_name_of(a)) for a in params.values()):
        return params
    return {name: to_float(a, dtype) for name, a in params.items()}


class ReferenceBackend:
    """The readable reference behind Llama: single-threaded, no process-wide settings."""

    name = "reference"
    scores_in_blocks = False        # the prefill's attention scores (B, H, P, P) whole (npllama.memory)

    def new_params(self, config: LlamaConfig, dtype) -> dict:
        """Uninitialised arrays of every parameter, each its own array."""
        return {name: np.empty(shape, dtype=dtype) for name, shape in config.param_shapes().items()}

    def lay_out(self, params: dict, config: LlamaConfig, dtype, release=None) -> dict:
        """params (held in any storage dtype) as this backend keeps a model's arrays in dtype, each
        dropped from `params` once converted: the reference keeps each array as its own, converted
        when its dtype differs (a backend with a layout of its own converts each straight into it).
        release: None, or called with each part of a converted array once copied (storage.copy_into)."""
        held = {}
        for name in list(params):
            source = params.pop(name)
            if source.dtype == dtype:
                held[name] = np.ascontiguousarray(source)
            else:
                held[name] = np.empty(source.shape, dtype)
                copy_into(held[name], source, release)
        return held

    def new_kv_cache(self, config: LlamaConfig, batch_size: int, dtype, positions: int | None = None) -> KVCache:
        return KVCache(config.n_layers, batch_size, config.n_kv_heads, config.cache_positions(positions),
                       config.head_dim, dtype)

    def forward(self, params, config, rope, tokens, *, kv_cache=None, start_pos=0, mask=None, lora=None,
                workers=None):
        """model.forward's logits (lora: the adapted model's, lora_math.forward). workers: ignored
        (the reference runs on the calling thread)."""
        params = float_params(params, rope[0].dtype)
        layers = None if lora is None else lora_math.adapted_layers(params, lora.params, config, lora.spec)
        logits, _ = model.forward(params, config, tokens, rope=rope, kv_cache=kv_cache, start_pos=start_pos,
                                  mask=mask, layers=layers)
        return logits

    def loss_and_grads(self, params, config, rope, tokens, targets, *, lora=None, checkpointing=False,
                       workers=None):
        """model.loss_and_grads (lora: lora_math.loss_and_grads, the adapters' gradients)."""
        if lora is not None:
            return lora_math.loss_and_grads(params, lora.params, config, lora.spec, tokens, targets, rope=rope,
                                            checkpointing=checkpointing)
        return model.loss_and_grads(params, config, tokens, targets, rope=rope, checkpointing=checkpointing)

    def optimizer(self, params, **hyper) -> AdamW:
        return AdamW(params, **hyper)

    def decoder(self, params, config, rope, batch_size: int, positions: int | None = None) -> Decoder:
        return ReferenceDecoder(float_params(params, rope[0].dtype), config, rope, batch_size, positions)

    def decoder_copy_bytes(self, params: dict, dtype, batch_size: int = 1, steps: int | None = None) -> int:
        """The bytes a decoder copies of the weights: their float copy when they are held at half precision
        (whatever the batch and the steps)."""
        if float_params(params, dtype) is params:
            return 0
        return sum(a.size for a in params.values()) * np.dtype(dtype).itemsize


def check_backend_name(name) -> str:
    """name if it is one of npllama's backends, else NpllamaError naming them."""
    if name not in ("engine", "reference"):
        raise NpllamaError(f"backend={name!r}; choose 'engine' (fast, the default) or 'reference' (the readable "
                           "math in npllama/ops, model.py, lora.py and optim.py, single-threaded)")
    return name
