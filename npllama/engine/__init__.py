"""The engine: everything in npllama that exists only for speed.

The reference (npllama.ops, npllama.model) is what a reader reads: pure, single-threaded
functions. The engine runs the same arithmetic faster and is tested equal to it (tests/engine/,
float64, 1e-10 relative, on hypothesis-drawn configs):

    training.loss_and_grads                   the training pass: parameters and gradients in one
                                              flat array each (layout.py), the batch in shards on
                                              one thread per core (shards.py), block-causal
                                              attention (attention.py)
    adamw.FusedAdamW                          optim.AdamW bit for bit, in cache-sized chunks on threads
    memory.keep_freed_memory                  glibc keeps a step's freed arrays for the next step
    passes.forward / passes.loss_and_grads   the reference's model-level passes in shards, with the
                                              blocks on stacked weights (block.py, stacked.py)
    decode.DecodeStep, DecodeCache            one token per row through the KV cache, fused; the
                                              weights stacked (small models) or read in place
                                              (large, memory-mapped or half-held ones: projections.py)
    inference.forward                         a forward with nothing to differentiate (prefill):
                                              one layer's weights and activations at a time
    upcast                                    float16 / bfloat16 weights into float32, exactly
    lora.lora_blocks                          LoRA: the block on frozen stacks plus adapters, no
                                              weight gradients (npllama.LoraLlama runs it)
    blas.blas_threads                         OpenBLAS's thread count, set for a block and restored
    shards.pass_footprint                     rows and shards alive at once (for npllama.memory)

It is built from the reference's own tables (parameter names and layer order from
npllama.model, RoPE tables from npllama.ops.rope), and it owns every process-wide setting it
changes: BLAS threads, restored on return; its thread pool and glibc's thresholds for handing
freed memory back (memory.py), both made once and kept. A reader can ignore it.
"""

from . import inference, training
from .adamw import FusedAdamW
from .blas import blas_threads
from .decode import DecodeCache, DecodeStep
from .passes import forward, loss_and_grads
from .shards import pass_footprint

__all__ = ["blas_threads", "DecodeCache", "DecodeStep", "forward", "FusedAdamW", "inference", "loss_and_grads",
           "pass_footprint", "training"]
