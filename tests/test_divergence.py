"""Divergence: caught early, before a diverged model is saved, and never by normal noisy training."""

import io
import math

import numpy as np
import pytest

from npllama.train import TrainingDiverged, train
from npllama.train.checkpoint import load_train_checkpoint, load_train_state
from npllama.train.divergence import DivergenceWatch

from .conftest import tiny_cfg


def noisy_curve(steps, noise, seed, start=math.log(65), floor=1.3):
    """A normal run's per-step losses: an exponential fall from log V with batch noise around it,
    noise that grows as the model stops predicting every token alike (at log V it has none)."""
    rng = np.random.default_rng(seed)
    learned = 1 - np.exp(-np.arange(steps) / 300)
    return start - (start - floor) * learned + rng.normal(0, noise, steps) * (0.1 + learned)


@pytest.mark.parametrize("tokens_per_step, noise", [(1024, 0.15), (64, 0.6), (8, 1.5)])
def test_normal_noisy_training_never_trips_the_watch(tokens_per_step, noise):
    for seed in range(20):
        watch = DivergenceWatch(65, tokens_per_step)
        for step, loss in enumerate(noisy_curve(5000, noise, seed), 1):
            assert watch.train_loss(step, float(loss)) is None, (seed, step)
        for val in noisy_curve(20, 0.02, seed)[::-1][:10]:          # validation wanders a little, too
            assert watch.val_loss(float(val)) is None


def test_a_spike_a_settling_at_log_v_and_non_finite_values_trip_it():
    def run(losses, tokens_per_step=1024):
        watch = DivergenceWatch(65, tokens_per_step)
        for step, loss in enumerate(losses, 1):
            broken = watch.train_loss(step, loss)
            if broken:
                return step, broken
        return None, None

    assert run([4.18, 908.99])[0] == 2                               # --lr 100: 4.18 then 909
    step, why = run(list(noisy_curve(2000, 0.1, 0)) + [math.log(65)] * 30)
    assert 2000 < step <= 2015 and "rose far above its best" in why  # trained to ~1.3, back to uniform
    assert run([4.1, math.nan])[1] == "the loss is nan" and run([math.inf])[1] == "the loss is inf"
    watch = DivergenceWatch(65, 1024, best_loss=1.4, best_val_loss=1.5)   # as carried across --resume
    assert watch.train_loss(1, 1.45) is None and "far above" in watch.val_loss(3.2)
    assert watch.threshold(1.5) == pytest.approx(max(2.5, (1.5 + math.log(65)) / 2))
    for _ in range(8):                                                # until its own window is full,
        assert watch.train_loss(2, 3.0) is None                       # only log V + 1 is the bar
    assert "its best, 1.4000" in watch.train_loss(10, 3.0)
    fresh = DivergenceWatch(65, 8)                                    # 8-token batches: a window of 512
    assert fresh.train_loss(1, math.log(65) + 9) is None and fresh.train_loss(2, 40.0)
    assert watch.param_norm(10.0, 12.0) is None and "more than 4x" in watch.param_norm(10.0, 1e30)
    assert watch.param_norm(10.0, math.inf) and watch.param_norm(10.0, math.nan)


def test_lr_100_stops_at_once_without_saving_a_diverged_model(text_file, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    with pytest.raises(TrainingDiverged, match=r"^step 1: one step took the parameters' norm from 9.\d+ to 9\d{3}") as e:
        train(tiny_cfg(text_file, out, lr=100.0, min_lr=0.0, warmup_steps=0, eval_interval=100), out=io.StringIO())
    assert "no checkpoint had been written yet" in str(e.value)
    assert not (out / "ckpt.safetensors").exists()


@pytest.mark.parametrize("lr", [100.0, 1e30])
def test_the_checkpoint_kept_is_from_before_the_divergence_and_resumes(lr, text_file, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    train(tiny_cfg(text_file, out, max_steps=8, eval_interval=4), out=io.StringIO())
    healthy = load_train_checkpoint(out / "ckpt.safetensors")
    with pytest.raises(TrainingDiverged) as e:
        train(tiny_cfg(text_file, out, max_steps=40, eval_interval=1, resume=True, lr=lr, min_lr=0.0), out=io.StringIO())
    msg = str(e.value)
    assert msg.startswith(("step 9:", "step 10:")) and f"{out / 'ckpt.safetensors'} (step 8), is kept" in msg
    kept = load_train_checkpoint(out / "ckpt.safetensors")
    assert kept.state["step"] == 8 and kept.state["best_loss"] == healthy.state["best_loss"]
    assert all(np.array_equal(kept.model.params[n], p) for n, p in healthy.model.params.items())
    assert max(float(np.abs(p).max()) for p in kept.model.params.values()) < 10
    train(tiny_cfg(text_file, out, max_steps=16, eval_interval=4, resume=True), out=io.StringIO())   # as the hint says
    assert load_train_state(out / "ckpt.safetensors")["step"] == 16


def test_a_tiny_noisy_run_is_unaffected(text_file, tmp_path):  # noqa: F811
    """One window of 8 tokens a step: the noisiest batches a run can have."""
    res = train(tiny_cfg(text_file, tmp_path / "run", batch_size=1, seq_len=8, max_steps=400, eval_interval=100,
                         eval_batches=2, lr=1e-2, min_lr=1e-3), out=io.StringIO())
    assert res.steps == 400 and res.stopped == "max_steps"
