"""The engine: everything in npllama that exists only for speed, behind one seam.

npllama.Llama hands its arithmetic to a backend (npllama/backend.py). The reference backend
runs the readable math (npllama.ops, model.py, lora.py, optim.py) and nothing else; this
package is the other, EngineBackend (backend.py), which runs the same arithmetic faster and is
tested equal to the reference (tests/test_backends.py: float64, 1e-10, hypothesis-drawn
configs). A reader can ignore it entirely. Its parts, each one implementation:

    backend.EngineBackend    the seam's fast side: forward, loss_and_grads, optimizer, decoder
    passes                   the whole-model passes: training (full, LoRA, checkpointing),
                             forward and prefill; the batch in shards on threads (shards.py)
    block                    the one transformer block every pass runs, on 2-D activations
    attention                block-causal attention (no score in a query's future is formed)
    fused                    the reference's element-wise ops fused (each named, tested equal)
    lora                     stacked projections with LoRA adapters, no frozen-weight gradient
    layout, stacked          parameters in one flat array; [wq; wk; wv] and [w1; w3] as views
    shards                   rows in shards on one thread per core; fixed-order gradient sums
    adamw.FusedAdamW         optim.AdamW bit for bit, in cache-sized chunks on threads
    decode, cache            one token a step, fused; the KV cache in the step's layout
    projections, upcast      a step's linear layers; float16 / bfloat16 weights read in place
    settings                 BLAS threads and glibc's freed-memory thresholds, each set for a
                             block and restored after

It is built from the reference's own tables (parameter names and layer order from
npllama.model, RoPE tables from npllama.ops.rope), and every process-wide setting it changes
is scoped (settings.py). Threads: the shard pool's threads are joined at interpreter exit;
a decoder's helper thread, and its helper process (helper.py), end with the decoder. Memory: a
closed decode step's copies of the weights leave their block to the next step's
(projections.Arena); release_spare_memory() frees it.
"""

from .adamw import FusedAdamW
from .backend import EngineBackend
from .cache import DecodeCache
from .projections import release_spare_memory
from .settings import blas_threads, freed_memory_kept
from .shards import pass_footprint

__all__ = ["blas_threads", "DecodeCache", "EngineBackend", "freed_memory_kept", "FusedAdamW", "pass_footprint",
           "release_spare_memory"]
