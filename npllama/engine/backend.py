"""EngineBackend: the seam's fast side (npllama/backend.py), what npllama.Llama runs by default.

The same four things as the reference's backend, each from the engine:

    forward          passes.forward (sharded rows, the one block, nothing kept)
    loss_and_grads   passes.loss_and_grads (full or LoRA, with or without checkpointing)
    optimizer        adamw.FusedAdamW (optim.AdamW bit for bit, in chunks on threads)
    decoder          decode.EngineDecoder (a prefill through passes.forward, fused steps)

and new models' parameters as views of one flat array (layout.py), which the training pass
reads and writes without copies.
"""

from __future__ import annotations

import numpy as np

from ..config import LlamaConfig
from ..model import layer_param_names, layer_weights
from ..storage import copy_into
from .adamw import FusedAdamW
from .cache import DecodeCache
from .decode import EngineDecoder, choose_layout, uses_helper_process
from .layout import FlatLayout, flat_params
from .passes import forward, loss_and_grads
from .projections import copies_classifier, gemv_padded_rows
from .stacked import stack_members
from .shards import pass_footprint


class EngineBackend:
    """npllama's fast backend (module docstring); tested equal to backend.ReferenceBackend."""

    name = "engine"
    scores_in_blocks = True         # the prefill's attention in query blocks (attention.py; npllama.memory)

    def new_params(self, config: LlamaConfig, dtype) -> dict:
        """Uninitialised parameters as views of one new flat array (layout.FlatLayout order)."""
        return flat_params(config, dtype)

    def lay_out(self, params: dict, config: LlamaConfig, dtype, release=None) -> dict:
        """params (held in any storage dtype) as views of one flat array of dtype: themselves when
        they are already, else each converted straight into a new one (storage.copy_into) and
        dropped from `params` once copied (so, when nothing else holds them, a model's two copies
        never coexist whole, nor does a whole converted copy beside them). release: None, or
        called with each part of a source once copied (npllama.load hands back its file pages)."""
        layout = FlatLayout(config)
        base = layout.base_of(params)
        if base is not None and base.dtype == dtype:
            return params
        flat = layout.views(layout.new(dtype))
        for name, view in flat.items():
            copy_into(view, params.pop(name), release)
        return flat

    def new_kv_cache(self, config: LlamaConfig, batch_size: int, dtype, positions: int | None = None) -> DecodeCache:
        return DecodeCache.for_config(config, batch_size, dtype, positions)

    def forward(self, params, config, rope, tokens, *, kv_cache=None, start_pos=0, mask=None, lora=None,
                workers=None) -> np.ndarray:
        return forward(params, config, rope, tokens, kv_cache=kv_cache, start_pos=start_pos, mask=mask, lora=lora,
                       workers=workers)

    def loss_and_grads(self, params, config, rope, tokens, targets, *, lora=None, checkpointing=False,
                       workers=None):
        return loss_and_grads(params, config, rope, tokens, targets, lora=lora, checkpointing=checkpointing,
                              workers=workers)

    def optimizer(self, params, **hyper) -> FusedAdamW:
        return FusedAdamW(params, **hyper)

    def decoder(self, params, config, rope, batch_size: int, positions: int | None = None) -> EngineDecoder:
        return EngineDecoder(params, config, rope, batch_size, positions=positions)

    def decoder_copy_bytes(self, params: dict, dtype, batch_size: int = 1, steps: int | None = None) -> int:
        """The bytes a decoder of batch_size rows, for `steps` steps (None: not known), copies of the
        weights: the stacked, norm-folded copies of a small model's blocks (at most every block's
        matrices, each stack padded as projections.gemv_padded_rows may pad it where no helper process
        takes half of it, decode.uses_helper_process), and its classifier
        where projections.copies_classifier copies it; the embedding is read in place."""
        if choose_layout(params) != "stacked":
            return 0
        stacks, i = [], 0
        while layer_param_names(i).wq in params:
            stacks += stack_members(layer_weights(params, i)).values()
            i += 1
        classifier = params.get("output.weight", params["tok_embeddings.weight"])
        if copies_classifier(classifier.size, batch_size, steps):
            stacks.append([classifier])
        itemsize = np.dtype(dtype).itemsize
        padding = not uses_helper_process(params, batch_size, steps or 0)     # a helper's blocks are never padded
        total = 0
        for stack in stacks:
            rows, n_in = sum(a.shape[0] for a in stack), stack[0].shape[1]
            total += (gemv_padded_rows(rows, n_in) if padding else rows) * n_in * itemsize
        return total

    def pass_footprint(self, batch_size: int, seq_len: int, dim: int, workers=None) -> tuple[int, int]:
        """(rows whose activations are alive at once, shards whose gradients are summed): shards.pass_footprint."""
        return pass_footprint(batch_size, seq_len, dim, workers)
