"""Each engine pass keeps glibc's freed memory for its own duration (engine/settings.py): a
library user's loop then does not fault its activations in again every step, and after the
pass the process's malloc behaves as glibc's defaults again."""

import ctypes.util
import resource
import sys

import numpy as np
import pytest

import npllama
from npllama.engine import settings

glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or settings._MALLOPT is None
                           or "libc" not in (ctypes.util.find_library("c") or ""),
                           reason="glibc's mallopt is what is tested (Linux)")

# cfg a of tools/bench_train.py: about 70 MB of activations a step (18,000 pages) on two shards
CFG = npllama.LlamaConfig(dim=128, n_layers=4, n_heads=4, vocab_size=65, max_seq_len=128)


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


@glibc
def test_a_library_loop_does_not_fault_its_activations_in_again_every_step():
    model = npllama.Llama(CFG, seed=0)
    opt = npllama.AdamW(model.params, lr=1e-3)
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (32, 129))
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step():
        _, grads = model.loss_and_grads(x, y, workers=2)
        npllama.clip_grad_norm(grads, 1.0)
        opt.step(grads)

    for _ in range(3):
        step()
    before = faults()
    for _ in range(4):
        step()
    per_step = (faults() - before) / 4
    # what remains is the new gradient array each step returns (3.3 MB: 800 pages) and small change
    assert per_step < 4_000, f"{per_step:.0f} page faults a step: the passes' freed memory went back to the OS"


@glibc
def test_after_a_pass_a_large_array_freed_goes_back_to_the_os_as_by_default():
    model = npllama.Llama(CFG, seed=0)
    model.loss_and_grads([[1, 2, 3, 4]], [[2, 3, 4, 5]])
    model.forward([[1, 2, 3]])
    settings.release_freed_memory()
    base = resident()
    a = np.ones(8 << 20, dtype=np.uint8)                 # 8 MB: above glibc's default mmap threshold
    assert resident() - base > 6 << 20
    del a
    assert resident() - base < 2 << 20, "a pass left glibc's raised thresholds behind"
