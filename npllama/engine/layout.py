"""One flat array per model: every parameter (or gradient, or moment) a view of it.

A training step reads its weights as stacks, [wq; wk; wv] and [w1; w3] (engine/stacked.py),
and writes its gradients the same way. When the members of each stack lie next to each other
in one array, the stacks are views: no copy of the weights per step, and the stacked dW GEMM
writes straight into the gradient array. The optimizer then runs over a few long segments
instead of a hundred arrays, and the decayed matrices, which come first, form one segment.

    layout = FlatLayout(config)
    params = layout.views(layout.new(np.float32))      # {Meta name: view}, config.param_shapes() order
    layout.stacked(params, i)                          # block i as a StackedLayer of views
    gradient_array(layout, params, np.float32)         # a training pass's gradients: reused when free

Order in the array: tok_embeddings, then per block wq, wk, wv, wo, w1, w3, w2, then output
(untied), then every norm weight (the ones AdamW never decays). Built from the reference's own
tables (config.param_shapes, model.layer_param_names), so names and shapes are defined once.
"""

from __future__ import annotations

import math
import sys
import threading
import weakref

import numpy as np

from ..config import LlamaConfig
from ..model import layer_param_names, output_weight_name
from .stacked import StackedLayer


class FlatLayout:
    """Where each parameter of a config lives in one flat array: name -> (offset, shape)."""

    def __init__(self, config: LlamaConfig):
        self.config = config
        shapes = config.param_shapes()
        matrices = ["tok_embeddings.weight"]
        norms = []
        for i in range(config.n_layers):
            n = layer_param_names(i)
            matrices += [n.wq, n.wk, n.wv, n.wo, n.w1, n.w3, n.w2]   # each stack's members adjacent
            norms += [n.attention_norm, n.ffn_norm]
        if not config.tie_embeddings:
            matrices.append("output.weight")
        norms.append("norm.weight")
        self.slots: dict[str, tuple[int, tuple]] = {}
        offset = 0
        for name in matrices + norms:
            self.slots[name] = (offset, shapes[name])
            offset += math.prod(shapes[name])
            if name == matrices[-1]:
                self.n_decayed = offset            # [0, n_decayed): the matrices (ndim >= 2)
        self.size = offset
        self.order = list(shapes)                  # views come back in config.param_shapes() order

    def new(self, dtype) -> np.ndarray:
        """An uninitialised flat array for every parameter."""
        return np.empty(self.size, dtype=dtype)

    def views(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """{Meta name: view of flat}, in config.param_shapes() order."""
        return {name: self._view(flat, name) for name in self.order}

    def _view(self, flat, name):
        offset, shape = self.slots[name]
        return flat[offset:offset + math.prod(shape)].reshape(shape)

    def base_of(self, arrays: dict) -> np.ndarray | None:
        """The flat array whose views `arrays` are, each in its slot; None if they are not (then a
        caller copies). A check of identity and addresses, no pass over the data."""
        first = arrays.get("tok_embeddings.weight")
        base = getattr(first, "base", None)
        if not isinstance(base, np.ndarray) or base.ndim != 1 or base.size != self.size:
            return None
        start = base.__array_interface__["data"][0]
        for name, (offset, shape) in self.slots.items():
            a = arrays.get(name)
            if (a is None or a.base is not base or a.shape != shape or not a.flags.c_contiguous
                    or a.__array_interface__["data"][0] != start + offset * base.itemsize):
                return None
        return base

    def stacked(self, flat: np.ndarray, i: int) -> StackedLayer:
        """Block i's weights (or gradients) in flat as a StackedLayer of views: [wq; wk; wv], [w1; w3]."""
        n = layer_param_names(i)
        return StackedLayer(self._view(flat, n.attention_norm), self._span(flat, n.wq, n.wv),
                            self._view(flat, n.wo), self._view(flat, n.ffn_norm),
                            self._span(flat, n.w1, n.w3), self._view(flat, n.w2))

    def _span(self, flat, first, last):
        """The adjacent slots first .. last (matrices of one width) as one (rows, width) view."""
        start, shape = self.slots[first]
        end = self.slots[last][0] + math.prod(self.slots[last][1])
        return flat[start:end].reshape(-1, shape[1])

    def output(self, flat: np.ndarray) -> np.ndarray:
        """The output projection's view: the embedding itself when tied."""
        return self._view(flat, output_weight_name(self.config))


def flat_params(config: LlamaConfig, dtype) -> dict[str, np.ndarray]:
    """Uninitialised parameters of a model, as views of one new flat array (FlatLayout order)."""
    layout = FlatLayout(config)
    return layout.views(layout.new(dtype))


def stacked_views(params: dict, config: LlamaConfig) -> list[StackedLayer] | None:
    """Every block's StackedLayer as views of the flat array the params are views of (nothing
    copied), or None when they are not (then a caller stacks copies: engine/stacked.py)."""
    layout = FlatLayout(config)
    flat = layout.base_of(params)
    return None if flat is None else [layout.stacked(flat, i) for i in range(config.n_layers)]


# Gradient arrays kept per model for reuse: a step's new gradient array is one mapping of fresh
# pages (330 MB at the 83M cfg k of tools/bench_train.py), and this VM faults fresh pages in slowly
# (huge pages zeroed, memory compacted): a library loop's steps ran 8-9% slower than `npllama
# train`'s, which glibc served from its kept heap. Two: a loop holds the last step's gradients
# (`loss, grads = ...`) while the next call runs.
KEPT_GRADIENT_ARRAYS = 2
_kept: dict[int, tuple[weakref.ref, list]] = {}     # id(params' flat array) -> (its weakref, arrays)
_kept_lock = threading.Lock()


def gradient_array(layout: FlatLayout, params: dict, dtype) -> np.ndarray:
    """An uninitialised flat array for the gradients of `params`: one this returned for the same
    parameters before that nothing else holds any more (no view of it alive anywhere), or a new
    one. Up to KEPT_GRADIENT_ARRAYS are kept while the parameters' flat array lives, and go with
    it; parameters that are not views of one flat array get a new array every call."""
    owner = layout.base_of(params)
    dtype = np.dtype(dtype)
    if owner is None:
        return layout.new(dtype)
    with _kept_lock:
        key = id(owner)
        entry = _kept.get(key)
        if entry is None or entry[0]() is not owner:
            entry = (weakref.ref(owner, lambda _, key=key: _kept.pop(key, None)), [])
            _kept[key] = entry
        arrays = entry[1]
        for i in range(len(arrays)):
            # 2: the list's reference and getrefcount's argument; a view held anywhere adds one
            if arrays[i].size == layout.size and arrays[i].dtype == dtype and sys.getrefcount(arrays[i]) == 2:
                arrays.append(arrays.pop(i))
                return arrays[-1]
        arrays.append(layout.new(dtype))
        del arrays[:-KEPT_GRADIENT_ARRAYS]
        return arrays[-1]


def release_gradient_arrays(params: dict) -> None:
    """Stop keeping gradient arrays for `params` (those still held elsewhere live on with their holders)."""
    owner = next(iter(params.values()), None)
    owner = getattr(owner, "base", None)
    with _kept_lock:
        if owner is not None:
            _kept.pop(id(owner), None)
