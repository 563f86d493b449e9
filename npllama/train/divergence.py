"""Divergence: noticing that training has blown up, before the blown-up model is saved.

A NaN or infinite loss or gradient norm is divergence, and so is a loss far above the best the
run has reached: that is how a learning rate far too high usually shows, the loss jumping by
orders of magnitude and then often settling at log V, the loss of a model that gives every
token the same probability, with every number still finite. An absurd learning rate can even
leave the loss at log V from the first step while the weights grow to 1e29, so a step that
multiplies the parameters' norm by more than NORM_GROWTH counts too: AdamW moves each weight by
about lr a step, and a healthy run changes the norm by a fraction of a percent.

The loss rule, in nats per token (V: the vocabulary size):

    smoothed  the mean training loss of the last W steps, W = max(10, ceil(4096 / tokens a
              step)): at least ~4k tokens, so the noise of small batches cannot trip it
    best      the lowest smoothed value of a full window so far (kept in the checkpoint, so it
              carries across --resume)
    diverged  when smoothed > max(best + 1, (best + log V) / 2): a whole nat (2.7x the
              perplexity) above the best, and at least halfway back to knowing nothing.
              Until a process has W steps of its own, the bar is log V + max(1, 10 / k) for
              its first k steps instead (log V: the loss of a model that knows nothing): a
              spike (the loss 4.18 then 909 of --lr 100) is caught at once, and one noisy
              small batch just after a resume cannot trip it.

Each evaluation holds the validation loss to the same rule against the best validation loss.
The loop writes a checkpoint only after a healthy evaluation and stops at the first step that
breaks a rule, so the checkpoint it keeps is from before the divergence; the error names the
step. A normal run stays far from the thresholds (tests/test_divergence.py checks noisy loss
curves and real runs with 8-token batches).
"""

from __future__ import annotations

import math
from collections import deque

MIN_WINDOW = 10
WINDOW_TOKENS = 4096
MARGIN = 1.0          # nats above the best
NORM_GROWTH = 4.0     # a step multiplying the parameters' norm by more than this has blown up


class DivergenceWatch:
    """The rule above, fed one loss at a time; each check returns None while healthy, else what broke."""

    def __init__(self, vocab_size: int, tokens_per_step: int, best_loss: float | None = None,
                 best_val_loss: float | None = None):
        self.window = max(MIN_WINDOW, -(-WINDOW_TOKENS // max(1, tokens_per_step)))
        self.log_v = math.log(vocab_size)
        self.recent: deque[float] = deque(maxlen=self.window)
        self.best, self.best_step = best_loss, None
        self.best_val = best_val_loss

    def threshold(self, best: float) -> float:
        return max(best + MARGIN, (best + self.log_v) / 2)

    def train_loss(self, step: int, loss: float) -> str | None:
        """Record the training loss of `step`; a description of the divergence, or None."""
        if not math.isfinite(loss):
            return f"the loss is {loss}"
        self.recent.append(loss)
        smoothed = sum(self.recent) / len(self.recent)
        full = len(self.recent) == self.window
        if full and self.best is not None:
            reference = (self.best, f"its best, {self.best:.4f}"
                         + (f" at step {self.best_step}" if self.best_step is not None else ""))
        else:
            reference = (self.log_v, f"log V = {self.log_v:.4f}, the loss of a model that knows nothing")
        allowance = max(MARGIN, MIN_WINDOW * MARGIN / len(self.recent)) if not full else 0.0
        if smoothed > max(self.threshold(reference[0]), reference[0] + allowance):
            return (f"the training loss rose far above {reference[1]}: {smoothed:.4f} (mean of the last "
                    f"{len(self.recent)} steps)")
        if full and (self.best is None or smoothed < self.best):
            self.best, self.best_step = smoothed, step
        return None

    def param_norm(self, before: float, after: float) -> str | None:
        """Check one step's change of the parameters' L2 norm; a description of the divergence, or None."""
        if not math.isfinite(after) or after > NORM_GROWTH * before:
            return (f"one step took the parameters' norm from {before:.4g} to {after:.4g} "
                    f"(more than {NORM_GROWTH:g}x)")
        return None

    def val_loss(self, val_loss: float) -> str | None:
        """Check a validation loss against the best so far; a description of the divergence, or None."""
        if not math.isfinite(val_loss):
            return f"the validation loss is {val_loss}"
        if self.best_val is not None and val_loss > self.threshold(self.best_val):
            return f"the validation loss rose far above its best: {val_loss:.4f} against {self.best_val:.4f}"
        self.best_val = val_loss if self.best_val is None else min(self.best_val, val_loss)
        return None
