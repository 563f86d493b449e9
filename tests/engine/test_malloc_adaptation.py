"""The passes let glibc's adaptive malloc thresholds rise once (engine/settings.py
adapt_malloc_once): a library user's training loop then keeps its freed activations for the next
step instead of faulting them in again, without any mallopt. Run in fresh processes, whose glibc
no earlier test has touched."""

import subprocess
import sys
import textwrap

import pytest

from npllama.engine import settings

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or settings._MALLOPT is None,
                                reason="glibc's malloc is what is tested (Linux)")

# cfg a of tools/bench_train.py (dim 128, T 128, B 32): about 80 MB of activations a step
LOOP = textwrap.dedent("""
    import resource, sys
    import numpy as np
    import npllama
    from npllama.engine import settings
    if sys.argv[1] == "without":
        settings._adapted = True                      # as if adapted already: the pass leaves glibc alone
    cfg = npllama.LlamaConfig(dim=128, n_layers=4, n_heads=4, vocab_size=65, max_seq_len=128)
    model = npllama.Llama(cfg, seed=0)
    opt = npllama.AdamW(model.params, lr=1e-3)
    tokens = np.random.default_rng(0).integers(0, 65, (32, 129))
    def step():
        _, grads = model.loss_and_grads(tokens[:, :-1], tokens[:, 1:], workers=2)
        npllama.clip_grad_norm(grads, 1.0)
        opt.step(grads)
    for _ in range(3):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        step()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4)
""")


def faults_per_step(mode: str) -> float:
    done = subprocess.run([sys.executable, "-c", LOOP, mode], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return float(done.stdout)


def test_a_library_loop_keeps_its_freed_activations_for_the_next_step():
    adapted, left_alone = faults_per_step("with"), faults_per_step("without")
    # left alone, glibc hands most of each step's activations back and faults them in again
    assert left_alone > 4_000, f"{left_alone:.0f} faults a step without adapting: the test shows nothing"
    assert adapted < 1_000, f"{adapted:.0f} page faults a step: the freed activations went back to the OS"


def test_adapting_is_done_once_and_makes_no_mallopt(monkeypatch):
    calls = []
    monkeypatch.setattr(settings, "_adapted", False)
    monkeypatch.setattr(settings, "_MALLOPT", lambda *a: calls.append(a) or 1)
    monkeypatch.setattr(settings.numpy, "empty", lambda *a, **k: calls.append(("empty", a)))
    settings.adapt_malloc_once()
    settings.adapt_malloc_once()
    assert calls == [("empty", (settings.ADAPT_BLOCK_BYTES,))]


def test_adapting_under_a_tight_memory_limit_is_skipped_quietly(monkeypatch):
    def no_memory(*a, **k):
        raise MemoryError("address space limit")
    monkeypatch.setattr(settings, "_adapted", False)
    monkeypatch.setattr(settings.numpy, "empty", no_memory)
    settings.adapt_malloc_once()                       # only speed is lost: no error
    assert settings._adapted
