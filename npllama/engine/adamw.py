"""AdamW in cache-sized chunks on the engine's threads: npllama.optim.AdamW, bit for bit, faster.

optim.AdamW makes 13 element-wise passes over each parameter array; on arrays larger than a
core's cache every pass streams the parameter, its gradient, both moments and a scratch array
from memory again. FusedAdamW runs the same 13 operations, in the same order and with the same
scalars, on chunks of CHUNK elements, so the five arrays' chunks stay in the cache (L3) for all 13
passes, and splits the chunks between one thread per core (NumPy releases the GIL in its loops).
Each element sees exactly the operations it would see in optim.AdamW.step, so the result is
the same to the last bit (tests/engine/test_adamw.py). It also keeps no whole-size scratch
array, only one chunk per thread.

    opt = FusedAdamW(model.params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt.step(grads, lr=None)             # as AdamW.step; state_dict() / load_state_dict() as AdamW's

npllama.AdamW, the public optimizer, is this module's AdamW: FusedAdamW's step on an engine model's
parameters (views of one flat array), optim.AdamW's own step on any other (a reference model's),
so a library user's loop and `npllama train` step alike.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ..checks import check_real
from .. import optim
from ..optim import StepScalars, adamw_update
from .shards import _executor, available_cores

# Elements per chunk: the five float32 arrays' chunks (p, g, m, v, scratch) take 2.5 MB, in the
# L3 cache, where a step's 13 NumPy calls a chunk cost less than at L2's 2^15 (640 KB): measured on
# the 2-core AMD EPYC (512 KB of L2 a core, 32 MB of L3; 6 December 2026, medians of 9 alternating
# steps) c's 8.3M parameters 15.5 ms a step against 27.0-29.2 at 2^15 (2^16 20-22, 2^18 13.7, 2^20
# 14.0), k's 83M 127 ms against 220-273 (2^16 164-175, 2^18 138, 2^20 139).
CHUNK = 1 << 17
# Below this many elements in all a step takes a fraction of a millisecond: no threads.
MIN_THREADED = 1 << 18


class FusedAdamW(optim.AdamW):
    """npllama.optim.AdamW with the update run in chunks on threads (module docstring).

    Same constructor, hyper-parameters, state and state_dict as AdamW; workers: threads for
    the update (default: one per core; 1 runs it in the calling thread).
    """

    def __init__(self, params: Mapping[str, np.ndarray], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.1, workers: int | None = None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self._scratch = None                 # AdamW's whole-size scratch arrays (never written: no memory)
        self.workers = workers

    def step(self, grads: Mapping[str, np.ndarray], lr: float | None = None) -> None:
        """AdamW.step: one update of every parameter in place; grads are read, never modified."""
        self._check_grads(grads)
        lr = self.lr if lr is None else check_real("lr", lr, 0.0)
        self.step_count += 1
        scalars = self.step_scalars(lr)
        pieces = []                          # (p, g, m, v, decayed), each at most CHUNK elements
        for name, p in self.params.items():
            arrays = (p, np.asarray(grads[name]), self.exp_avg[name], self.exp_avg_sq[name])
            if not p.flags.c_contiguous:     # a strided parameter: updated whole, in place
                pieces.append((*arrays, self.decayed[name]))
                continue
            p, g, m, v = (a.reshape(-1) for a in arrays)
            pieces += [(p[lo:lo + CHUNK], g[lo:lo + CHUNK], m[lo:lo + CHUNK], v[lo:lo + CHUNK], self.decayed[name])
                       for lo in range(0, p.size, CHUNK)]
        sizes = np.cumsum([piece[0].size for piece in pieces])
        workers = self.workers or available_cores()
        if workers == 1 or sizes[-1] < MIN_THREADED:
            _update(pieces, scalars)
            return
        # contiguous runs of pieces of about equal size, one per thread
        runs = np.split(np.arange(len(pieces)), np.searchsorted(sizes, sizes[-1] * np.arange(1, workers) / workers))
        futures = [_executor(workers).submit(_update, [pieces[i] for i in run], scalars) for run in runs]
        for f in futures:
            f.result()


def _update(pieces, scalars: StepScalars) -> None:
    """adamw_update on each (p, g, m, v, decayed) piece, with one scratch array for all."""
    scratch = np.empty(0)
    for p, g, m, v, decayed in pieces:
        if scratch.size < p.size or scratch.dtype != p.dtype:
            scratch = np.empty(max(p.size, CHUNK), dtype=p.dtype)
        adamw_update(p, g, m, v, scratch[:p.size].reshape(p.shape), decayed, scalars)


def views_of_one_array(params: Mapping[str, np.ndarray]) -> bool:
    """True when every parameter is a view of one 1-D array, as an engine model's are (engine/layout.py)."""
    bases = {id(getattr(p, "base", None)) for p in params.values()}
    base = next(iter(params.values())).base
    return len(bases) == 1 and isinstance(base, np.ndarray) and base.ndim == 1


class AdamW(FusedAdamW):
    """npllama.AdamW: npllama.optim.AdamW's update (read it there), with its constructor and state.

    On an engine model's parameters (views of one flat array) each step is FusedAdamW's, bit for
    bit optim.AdamW's, in cache-sized chunks on threads, with no whole-size scratch array: what
    `npllama train` steps with. On any other parameters (a reference model's, LoRA adapters, a
    user's dict) it is optim.AdamW.step itself.
    """

    def __init__(self, params: Mapping[str, np.ndarray], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.fused = views_of_one_array(self.params)
        if not self.fused:
            self._scratch = {n: np.empty_like(p) for n, p in self.params.items()}

    def step(self, grads: Mapping[str, np.ndarray], lr: float | None = None) -> None:
        """optim.AdamW.step: one update of every parameter in place; grads are read, never modified."""
        (FusedAdamW if self.fused else optim.AdamW).step(self, grads, lr)
