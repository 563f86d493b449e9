"""The engine: everything in npllama that exists only for speed.

The reference (npllama.ops, npllama.model) is what a reader reads: pure, single-threaded
functions. The engine runs the same arithmetic faster and is tested equal to it (tests/engine/,
float64, 1e-10 relative, on hypothesis-drawn configs):

    passes.forward / passes.loss_and_grads   the batch in shards on one thread per core
                                              (shards.py), blocks on stacked weights (block.py,
                                              stacked.py)
    decode.DecodeStep, DecodeCache            one token per row through the KV cache, fused; the
                                              weights stacked (small models) or read in place
                                              (large, memory-mapped or half-held ones: projections.py)
    inference.forward                         a forward with nothing to differentiate (prefill):
                                              one layer's weights and activations at a time
    upcast                                    float16 / bfloat16 weights into float32, exactly
    blas.blas_threads                         OpenBLAS's thread count, set for a block and restored

It is built from the reference's own tables (parameter names and layer order from
npllama.model, RoPE tables from npllama.ops.rope), and it owns every process-wide setting it
changes (BLAS threads, its thread pool), restoring each on return. A reader can ignore it.
"""

from .blas import blas_threads
from . import inference
from .decode import DecodeCache, DecodeStep
from .passes import forward, loss_and_grads

__all__ = ["blas_threads", "DecodeCache", "DecodeStep", "forward", "inference", "loss_and_grads"]
