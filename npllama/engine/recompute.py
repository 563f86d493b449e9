"""Gradient checkpointing: blocks that keep only their input and recompute their forward in backward.

A training step normally holds every block's caches (about 20 numbers per position for each
of D and F, plus the attention probabilities) from the forward pass until its backward. These
blocks keep only each block's input x (D numbers a position) and, in backward, run the block's
forward once more to rebuild its caches, which then live only during that block's backward
(Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"). The cost is one more
forward of every block per step: about a third more compute for full training, a half more
for LoRA (whose backward skips the weight gradients). The arithmetic is the same, so the loss
and gradients are bit for bit those without it (tests/engine/test_lora_engine.py).
LoRA's blocks use this wrapper; the plain model's training pass does the same inside
engine/training.py (`recompute=True`), on its own flat layout.
"""

from __future__ import annotations

from .. import model


def recomputed(blocks: model.Blocks) -> model.Blocks:
    """blocks (the engine's or LoRA's) with gradient checkpointing: caches (x, w, cos, sin, eps, mask) only."""

    def forward(x, w, cos, sin, *, eps, kv=None, start_pos=0, mask=None):
        out, _ = blocks.forward(x, w, cos, sin, eps=eps, kv=kv, start_pos=start_pos, mask=mask)
        return out, (x, w, cos, sin, eps, mask)           # the block's own caches are dropped here

    def backward(dout, saved):
        x, w, cos, sin, eps, mask = saved
        _, cache = blocks.forward(x, w, cos, sin, eps=eps, mask=mask)
        return blocks.backward(dout, cache)

    return model.Blocks(blocks.weights, forward, backward, blocks.names)
