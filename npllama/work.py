"""Time: the work a command will do, worked out before it starts, so that what cannot finish in
any reasonable time is refused in one line instead of running for days (as memory.py refuses what
cannot fit).

    pass_flops(config, rows, seq_len, backward)   the arithmetic of a pass over rows windows of
                                                  seq_len tokens, in FLOPs (2 per multiply-add)
    minimum_seconds(flops)                        a lower bound on its time: at CEILING_FLOPS,
                                                  faster than any CPU npllama runs on
    MachineSpeed.measure()                        this machine, timed in a few milliseconds:
                                                  seconds per element of elementwise work and per
                                                  multiply-add of a matmul, in float64
    require_time(seconds, limit, what, hint)      WorkLimitError above the limit

A forward over N = rows * seq_len tokens multiplies each token by every weight matrix once (the
embedding is a lookup), 2 N (n_params - V D) FLOPs, and attends over the causal half of its
window, 2 * 2 L N T/2 D for the scores and att @ v; the backward costs twice the forward.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from .config import LlamaConfig
from .errors import NpllamaError

CEILING_FLOPS = 1e12        # 1 TFLOP/s: more than a CPU core count's worth of NumPy ever reaches


class WorkLimitError(NpllamaError):
    """A command that would run longer than its limit, refused before it starts."""


def pass_flops(config: LlamaConfig, rows: int, seq_len: int, backward: bool = False) -> float:
    """FLOPs of a forward (backward=True: forward and backward) over rows windows of seq_len tokens."""
    tokens = rows * seq_len
    matrices = config.n_params() - config.vocab_size * config.dim                 # all but the lookup
    forward = 2.0 * tokens * matrices + 2.0 * config.n_layers * tokens * seq_len * config.dim
    return 3 * forward if backward else forward


def minimum_seconds(flops: float) -> float:
    """The time flops take at CEILING_FLOPS: the run cannot be faster than this."""
    return flops / CEILING_FLOPS


def describe_seconds(seconds: float) -> str:
    """'0.4 s', '42 s', '3.5 min', '2.1 h', '41 days', '3.2e+04 years'."""
    for unit, size, below in (("s", 1, 120), ("min", 60, 7200), ("h", 3600, 2 * 86400),
                              ("days", 86400, 2 * 365 * 86400)):
        if seconds < below:
            value = seconds / size
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{seconds / (365 * 86400):.2g} years"


def require_time(seconds: float, limit: float, what: str, hint: str, lower_bound: bool = False) -> None:
    """Refuse, before it starts, work estimated to take longer than limit (both in seconds):
    WorkLimitError "{what} would take X, more than the limit of Y; {hint}". lower_bound: seconds
    is minimum_seconds, and the message says so ("at least X even at 1 TFLOP/s")."""
    if seconds > limit:
        took = (f"at least {describe_seconds(seconds)} even at {CEILING_FLOPS / 1e12:g} TFLOP/s" if lower_bound
                else describe_seconds(seconds))
        raise WorkLimitError(f"{what} would take {took}, more than the limit of {describe_seconds(limit)}; {hint}")


def _best_of(fn, repeats: int = 5) -> float:
    """The shortest of a few timings of fn(): the least disturbed by other work on the machine."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


class MachineSpeed(NamedTuple):
    """What this machine takes in float64: per element of elementwise work (a ufunc pass over an
    array) and per multiply-add of a matmul. Timed on arrays that fit in cache, so the figures
    are the fast end: an estimate from them errs towards too short."""
    per_element: float
    per_mac: float

    @classmethod
    def measure(cls) -> "MachineSpeed":
        """Time a ufunc over 2**16 elements and a 128^3 matmul (a few milliseconds in all)."""
        x = np.linspace(0.0, 1.0, 1 << 16)
        m = np.ones((128, 128))
        per_element = _best_of(lambda: np.exp(x)) / x.size
        per_mac = _best_of(lambda: m @ m) / 128 ** 3
        return cls(per_element, per_mac)

    def seconds(self, elements: float = 0.0, macs: float = 0.0) -> float:
        """Time of `elements` elementwise operations and `macs` multiply-adds."""
        return elements * self.per_element + macs * self.per_mac
