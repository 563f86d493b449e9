"""The product on both backends: backend="reference" (the readable math alone) is the spec, and
the engine (the default) must give its results.

In float64 from the same seed, on hypothesis-drawn configs (MHA, GQA, MQA, tied or not):
20 training steps (loss_and_grads, clip_grad_norm, the backend's AdamW), full and LoRA, with
and without gradient checkpointing: every loss and the final parameters within 1e-10; and
generate, batch 1 and batched, greedy and seeded sampling: the same ids. Then the command line:
`npllama train --reference` and `npllama generate --reference` against the same commands on the
engine.
"""

import io

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

import npllama
from npllama import lora
from npllama.cli import main
from npllama.engine import FusedAdamW
from npllama.gradcheck import rel_error
from npllama.llama import LoraLlama
from npllama.optim import AdamW, clip_grad_norm
from npllama.train.loop import train

from .conftest import tiny_cfg
from .engine.test_engine_equals_reference import configs

TOL = 1e-10
STEPS = 20
# Two trajectories of STEPS AdamW steps: the backends' rounding differences (1e-16 in a step's
# loss) grow as the steps go, since AdamW divides each gradient entry by its own running RMS and
# so magnifies the relative differences of the small ones. Measured: up to 2.6e-10 in the losses
# of steps 7-9 (dim 24, 3 layers, vocab 2, seed 6384, below), 1e-16 to 8e-14 in steps 0-4. One
# pass (a loss and its gradients, a forward, a decode step) is compared at TOL.
TRAJECTORY_TOL = 1e-9


def pair(cfg, seed):
    """The same float64 model on each backend (from one seed: the same init)."""
    return [npllama.Llama(cfg, seed=seed, dtype=np.float64, backend=b) for b in ("reference", "engine")]


def batches(cfg, seed, B=3, T=7):
    """Windows at random offsets of one periodic sequence: something to learn."""
    rng = np.random.default_rng(seed)
    text = np.tile(rng.integers(0, cfg.vocab_size, 5), 20)
    for _ in range(STEPS):
        starts = rng.integers(0, len(text) - T - 1, B)
        tokens = np.stack([text[s:s + T] for s in starts])
        targets = np.stack([text[s + 1:s + T + 1] for s in starts])
        targets[:, 0] = -100
        yield tokens, targets


def train_steps(model, cfg, seed, lr=3e-2):
    """STEPS steps of the library user's loop; the losses."""
    opt = model.optimizer(lr=lr, weight_decay=0.1)
    losses = []
    for step, (x, y) in enumerate(batches(cfg, seed)):
        loss, grads = model.loss_and_grads(x, y)
        clip_grad_norm(grads, 1.0)
        opt.step(grads, lr=lr * (1 - step / STEPS))
        losses.append(loss)
    return losses


def assert_same_training(ref, eng, ref_losses, eng_losses):
    """Losses to TOL relative; each parameter to TOL relative to the larger of its own norm and the
    norm of all the trained parameters together. (A LoRA B matrix starts at 0; where its gradient
    is zero in exact arithmetic, as in a window of one repeated token, where every value row is
    equal, so the scores do not matter and dq = dk = 0, all it holds after 20 steps is each
    backend's rounding noise, 1e-15 to 1e-13, amplified by AdamW and differently summed, which no
    relative error of its own can compare.)"""
    assert abs(ref_losses[0] - eng_losses[0]) <= TOL * abs(ref_losses[0])              # the same first pass
    assert all(abs(a - b) <= TRAJECTORY_TOL * abs(a) for a, b in zip(ref_losses, eng_losses)), (ref_losses, eng_losses)
    assert list(ref.params) == list(eng.params)
    scale = float(np.sqrt(sum(np.sum(np.square(p)) for p in ref.params.values())))
    for name in ref.params:
        assert rel_error(eng.params[name], ref.params[name], floor=scale) < TRAJECTORY_TOL, name


def test_each_backend_has_its_own_optimizer_and_both_step_alike():
    cfg = npllama.LlamaConfig(dim=8, n_layers=1, n_heads=2, vocab_size=5, multiple_of=4, max_seq_len=8)
    ref, eng = pair(cfg, 0)
    assert type(ref.optimizer()) is AdamW and isinstance(eng.optimizer(), FusedAdamW)
    assert ref.backend.name == "reference" and eng.backend.name == "engine"
    with pytest.raises(ValueError, match="backend='torch'.*'engine'.*'reference'"):
        npllama.Llama(cfg, backend="torch")


@settings(max_examples=8)
@given(configs(), st.booleans(), st.integers(0, 10_000))
@example(npllama.LlamaConfig(dim=24, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=2, hidden_dim=12,
                             multiple_of=32, max_seq_len=12), False, 6384)
def test_twenty_training_steps_are_the_same_on_both_backends(cfg, checkpointing, seed):
    ref, eng = pair(cfg, seed)
    for m in (ref, eng):
        m.gradient_checkpointing = checkpointing
    init = {n: p.copy() for n, p in ref.params.items()}
    ref_losses, eng_losses = train_steps(ref, cfg, seed), train_steps(eng, cfg, seed)
    # a trajectory, not a still model: every weight moved. (A drawn model as small as dim 2, vocab 2
    # need not lower one batch's loss in 20 steps: seed 43's went 0.690 -> 0.695. That the steps
    # train is test_the_compared_steps_train's, on the example's model.)
    assert all(not np.array_equal(ref.params[n], init[n]) for n in init)
    assert_same_training(ref, eng, ref_losses, eng_losses)


def test_the_compared_steps_train():
    """The steps the backends are compared on lower the loss of a model that can learn the periodic
    text: dim 24, 3 layers (the example above), on both backends."""
    cfg = npllama.LlamaConfig(dim=24, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=2, hidden_dim=12,
                              multiple_of=32, max_seq_len=12)
    for model in pair(cfg, 6384):
        losses = train_steps(model, cfg, 6384)
        assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), losses


@settings(max_examples=8)
@given(configs(), st.integers(1, 3), st.booleans(), st.integers(0, 10_000))
def test_twenty_lora_steps_are_the_same_on_both_backends(cfg, rank, checkpointing, seed):
    spec = lora.LoraSpec(rank=rank, alpha=2.0 * rank, targets=("wq", "wv", "w2"))
    ref, eng = (LoraLlama(m, spec, seed=seed) for m in pair(cfg, seed))
    for m in (ref, eng):
        m.gradient_checkpointing = checkpointing
    base = {n: p.copy() for n, p in ref.base.params.items()}
    ref_losses, eng_losses = train_steps(ref, cfg, seed, lr=5e-2), train_steps(eng, cfg, seed, lr=5e-2)
    assert_same_training(ref, eng, ref_losses, eng_losses)
    assert all(np.array_equal(ref.base.params[n], base[n]) and np.array_equal(eng.base.params[n], base[n])
               for n in base)                                        # the base never trains
    tokens = np.arange(10).reshape(2, 5) % cfg.vocab_size
    assert rel_error(eng.merged().forward(tokens), ref.merged().forward(tokens)) < TOL


@settings(max_examples=10)
@given(configs(), st.integers(0, 10_000))
def test_generate_gives_the_same_ids_on_both_backends(cfg, seed):
    ref, eng = pair(cfg, seed)
    for m in (ref, eng):                      # weights far from the init, so the ids vary
        rng = np.random.default_rng(seed + 1)
        for p in m.params.values():
            p += rng.standard_normal(p.shape) * 0.5
    prompts = [[1 % cfg.vocab_size], [0, 1 % cfg.vocab_size, 0, 1 % cfg.vocab_size]]
    n = cfg.max_seq_len - 4 + 1
    for sampling in (dict(temperature=0.0), dict(temperature=1.0, top_k=3, seed=seed),
                     dict(temperature=0.9, top_p=0.9, repetition_penalty=1.3, seed=[seed, seed + 1])):
        single = {k: (v[0] if k == "seed" and isinstance(v, list) else v) for k, v in sampling.items()}
        assert ref.generate(prompts[1], n, **single).tolist() == eng.generate(prompts[1], n, **single).tolist()
        got = [o.tolist() for o in eng.generate_batch(prompts, n, **sampling)]
        assert got == [o.tolist() for o in ref.generate_batch(prompts, n, **sampling)]
    long = dict(temperature=1.0, seed=seed, sliding_window=True)
    assert ref.generate(prompts[0], 30, **long).tolist() == eng.generate(prompts[0], 30, **long).tolist()


def test_a_training_run_and_its_resume_are_the_same_on_both_backends(text_file, tmp_path):
    """npllama.train's whole loop (batches, clipping, schedule, evals, checkpoint, resume) in float64."""
    results = {}
    for backend in ("reference", "engine"):
        out = tmp_path / backend
        cfg = tiny_cfg(text_file, out, dtype="float64", max_steps=6, reference=backend == "reference",
                       gradient_checkpointing=True)
        train(cfg, out=io.StringIO())
        train(cfg.replace(resume=True, max_steps=10), out=io.StringIO())
        results[backend] = npllama.load(out / "ckpt.safetensors", dtype=np.float64)
    ref, eng = results["reference"], results["engine"]
    for name in ref.params:
        assert rel_error(eng.params[name], ref.params[name]) < TOL, name


def test_train_and_generate_on_the_command_line_with_reference(text_file, tmp_path, capsys):
    common = ["--data", str(text_file), "--dim", "16", "--n-layers", "2", "--n-heads", "2", "--seq-len", "16",
              "--batch-size", "4", "--max-steps", "4", "--eval-interval", "4", "--eval-batches", "1",
              "--sample-tokens", "0", "--dtype", "float64", "--warmup-steps", "1"]
    for name, extra in (("ref", ["--reference"]), ("eng", [])):
        assert main(["train", *common, "--out-dir", str(tmp_path / name), *extra]) == 0
    capsys.readouterr()
    texts = {}
    for name, extra in (("ref", ["--reference"]), ("eng", [])):
        assert main(["generate", "-m", str(tmp_path / name / "ckpt.safetensors"), "-p", "ROMEO:", "-n", "10",
                     "--temp", "0", "--dtype", "float64", *extra]) == 0
        texts[name] = capsys.readouterr().out
    assert texts["ref"] == texts["eng"] and texts["ref"].startswith("ROMEO:")
    ref = npllama.load(tmp_path / "ref" / "ckpt.safetensors", dtype=np.float64)
    eng = npllama.load(tmp_path / "eng" / "ckpt.safetensors", dtype=np.float64)
    assert all(rel_error(eng.params[n], ref.params[n]) < TOL for n in ref.params)
