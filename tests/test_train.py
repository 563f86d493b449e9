"""The training loop: exact resume, atomic checkpoints, divergence, gradient accumulation, budgets, BPE."""

import importlib.util
import io
import json
import math
import os
import signal

import numpy as np
import pytest

import npllama
from npllama import Llama
from npllama.train import config as train_config, data as train_data, loop as train_loop
from npllama.optim import AdamW
from npllama.train import TrainConfig, TrainingDiverged, train, train_step
from npllama.train.checkpoint import load_train_checkpoint, load_train_state, save_train_checkpoint

from .conftest import block_matplotlib, synthetic_text, tiny_cfg


def params_equal(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)


def test_resume_is_bit_exact(text_file, tmp_path):
    """N steps + resume + N steps == 2N steps straight: parameters, moments, step, RNG state."""
    common = dict(grad_accum=2, eval_interval=5)
    a, b = tmp_path / "a", tmp_path / "b"
    train(tiny_cfg(text_file, a, max_steps=7, decay_steps=14, **common), out=io.StringIO())
    mid = load_train_state(a / "ckpt.safetensors")
    assert mid["step"] == 7
    res = train(tiny_cfg(text_file, a, max_steps=14, decay_steps=14, resume=True, **common), out=io.StringIO())
    assert res.steps == 14 and res.stopped == "max_steps"
    train(tiny_cfg(text_file, b, max_steps=14, **common), out=io.StringIO())
    ca, cb = load_train_checkpoint(a / "ckpt.safetensors"), load_train_checkpoint(b / "ckpt.safetensors")
    assert params_equal(ca.model.params, cb.model.params)
    assert params_equal(ca.optimizer_state, {k: v for k, v in cb.optimizer_state.items()})
    assert ca.state["rng"] == cb.state["rng"] and ca.state["step"] == cb.state["step"] == 14
    # and the run really moved: the middle checkpoint differs from the end
    assert not np.array_equal(ca.model.params["norm.weight"], np.ones_like(ca.model.params["norm.weight"]))
    # the metrics of the resumed run continue the first one's (no duplicated or missing steps)
    steps = [json.loads(l)["step"] for l in (a / "metrics.jsonl").read_text().splitlines()
             if json.loads(l)["kind"] == "train"]
    assert steps == list(range(1, 15))


def test_interrupt_saves_and_resumes_exactly(text_file, tmp_path, monkeypatch):
    """Ctrl-C (SIGINT) stops at the next step boundary with a checkpoint; --resume carries on exactly."""
    a, b = tmp_path / "a", tmp_path / "b"
    original = Llama.loss_and_grads
    calls = {"n": 0}

    def interrupting(self, x, y):
        calls["n"] += 1
        if calls["n"] == 5:
            os.kill(os.getpid(), signal.SIGINT)
        return original(self, x, y)

    monkeypatch.setattr(Llama, "loss_and_grads", interrupting)
    res = train(tiny_cfg(text_file, a), out=io.StringIO())
    monkeypatch.setattr(Llama, "loss_and_grads", original)
    assert res.stopped == "interrupted" and res.steps == 5
    assert load_train_state(a / "ckpt.safetensors")["step"] == 5
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler     # handler restored
    train(tiny_cfg(text_file, a, resume=True, decay_steps=12), out=io.StringIO())
    train(tiny_cfg(text_file, b), out=io.StringIO())
    assert params_equal(load_train_checkpoint(a / "ckpt.safetensors").model.params,
                        load_train_checkpoint(b / "ckpt.safetensors").model.params)


def test_failure_mid_save_keeps_the_previous_checkpoint(text_file, tmp_path, monkeypatch):
    out = tmp_path / "run"
    train(tiny_cfg(text_file, out, max_steps=4), out=io.StringIO())
    path = out / "ckpt.safetensors"
    before = path.read_bytes()
    ck = load_train_checkpoint(path)
    opt = AdamW(ck.model.params)
    opt.load_state_dict(ck.optimizer_state)
    for p in ck.model.params.values():
        p += 1.0                            # something new to save

    real_fsync = os.fsync

    def dying_fsync(fd):                    # the data is written to the temp file; the process dies here
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(os, "fsync", dying_fsync)
    with pytest.raises(KeyboardInterrupt):
        save_train_checkpoint(path, ck.model, ck.tokenizer, opt, dict(ck.state, step=99))
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert path.read_bytes() == before
    left = sorted(p.name for p in out.iterdir() if p.name != "loss.png")   # loss.png: with matplotlib only
    assert left == ["ckpt.safetensors", "metrics.jsonl"]
    assert load_train_state(path)["step"] == 4
    assert npllama.load(path).config == ck.model.config       # still a loadable model


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(text_file, tmp_path, monkeypatch):
    out = tmp_path / "run"
    original = Llama.loss_and_grads
    calls = {"n": 0}

    def diverging(self, x, y):
        calls["n"] += 1
        loss, grads = original(self, x, y)
        return (math.nan if calls["n"] >= 10 else loss), grads

    monkeypatch.setattr(Llama, "loss_and_grads", diverging)
    log = io.StringIO()
    with pytest.raises(TrainingDiverged) as e:
        train(tiny_cfg(text_file, out), out=log)
    msg = str(e.value)
    assert "step 10" in msg and "nan" in msg and "ckpt.safetensors (step 8)" in msg and "--lr" in msg
    assert isinstance(e.value, ValueError)
    assert load_train_state(out / "ckpt.safetensors")["step"] == 8
    ck = load_train_checkpoint(out / "ckpt.safetensors")
    assert all(np.isfinite(p).all() for p in ck.model.params.values())


def test_train_step_refuses_non_finite_values_without_updating():
    params = {"w": np.ones((2, 2)), "n": np.ones(2)}

    class Stub:                              # a model whose loss or gradients went bad
        def __init__(self, loss, grad):
            self.result = (loss, {"w": np.full((2, 2), grad), "n": np.zeros(2)})

        def loss_and_grads(self, x, y):
            return self.result

    opt = AdamW(params)
    batch = [(None, None)]
    assert math.isnan(train_step(Stub(math.nan, 0.1), opt, batch, lr=1e-3, grad_clip=1.0)[0])
    loss, norm = train_step(Stub(2.0, math.inf), opt, batch, lr=1e-3, grad_clip=1.0)
    assert loss == 2.0 and math.isinf(norm)
    loss, norm = train_step(Stub(2.0, math.nan), opt, batch, lr=1e-3, grad_clip=0.0)    # no clipping either
    assert math.isnan(norm)
    assert opt.step_count == 0 and params_equal(params, {"w": np.ones((2, 2)), "n": np.ones(2)})
    loss, norm = train_step(Stub(2.0, 0.5), opt, batch, lr=1e-3, grad_clip=1.0)
    assert (loss, norm) == (2.0, 1.0) and opt.step_count == 1


def test_gradient_accumulation_equals_one_big_batch():
    cfg = npllama.LlamaConfig(dim=16, n_layers=2, n_heads=2, vocab_size=13, multiple_of=8, max_seq_len=8)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 13, (6, 8))
    y = rng.integers(0, 13, (6, 8))
    m1, m2 = Llama(cfg, seed=1, dtype=np.float64), Llama(cfg, seed=1, dtype=np.float64)
    o1, o2 = AdamW(m1.params, weight_decay=0.1), AdamW(m2.params, weight_decay=0.1)
    for _ in range(3):
        l1, n1 = train_step(m1, o1, [(x[:2], y[:2]), (x[2:4], y[2:4]), (x[4:], y[4:])], lr=1e-2, grad_clip=0.5)
        l2, n2 = train_step(m2, o2, [(x, y)], lr=1e-2, grad_clip=0.5)
        assert l1 == pytest.approx(l2, rel=1e-12) and n1 == pytest.approx(n2, rel=1e-10)
    for n in m1.params:
        np.testing.assert_allclose(m1.params[n], m2.params[n], rtol=1e-9, atol=1e-12)


def test_time_budget_calibrates_the_schedule_and_stops(text_file, tmp_path):
    log = io.StringIO()
    res = train(tiny_cfg(text_file, tmp_path / "run", max_steps=0, time_budget=1.5, eval_interval=50), out=log)
    state = load_train_state(tmp_path / "run" / "ckpt.safetensors")
    cfg = state["train_config"]
    assert cfg["max_steps"] > 0 and cfg["decay_steps"] == cfg["max_steps"]
    assert res.stopped in ("time_budget", "max_steps") and state["step"] == res.steps > 0
    assert res.elapsed < 1.5 + 10.0          # generous: a loaded machine slows the evals around it
    assert "time budget" in log.getvalue()


def test_bpe_tokenizer_is_trained_on_the_training_split_only(text_file, tmp_path, monkeypatch):
    seen = []
    real = train_data.train_sentencepiece

    def spy(text, vocab_size, seed=0):
        seen.append(text)
        return real(text, vocab_size, seed)

    monkeypatch.setattr(train_data, "train_sentencepiece", spy)
    text = text_file.read_text()
    cfg = tiny_cfg(text_file, tmp_path / "bpe", tokenizer="bpe", vocab_size=400, max_steps=4)
    train(cfg, out=io.StringIO())
    assert seen == [text[:int(len(text) * 0.9)]]
    model = npllama.load(tmp_path / "bpe" / "ckpt.safetensors")
    tok = model.tokenizer
    assert tok.vocab_size == 400 == model.config.vocab_size
    val = text[int(len(text) * 0.9):]
    assert tok.decode(tok.encode(val)) == val                       # round trip through the saved tokenizer
    assert len(tok.encode(val)) < 0.6 * len(val)                     # it merged something


def test_char_tokenizer_round_trips_from_the_checkpoint(text_file, tmp_path):
    train(tiny_cfg(text_file, tmp_path / "c", max_steps=2), out=io.StringIO())
    tok = npllama.load(tmp_path / "c" / "ckpt.safetensors").tokenizer
    text = text_file.read_text()
    assert tok.vocab_size == len(set(text))
    assert tok.decode(tok.encode(text)) == text


def test_refusals(text_file, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(FileNotFoundError, match="--resume"):
        train(tiny_cfg(text_file, out, resume=True), out=io.StringIO())
    train(tiny_cfg(text_file, out, max_steps=2), out=io.StringIO())
    with pytest.raises(ValueError, match="already exists.*--resume"):
        train(tiny_cfg(text_file, out, max_steps=2), out=io.StringIO())
    with pytest.raises(ValueError, match="--dim"):
        train(tiny_cfg(text_file, out, resume=True, dim=32), out=io.StringIO())
    other = tmp_path / "other.txt"
    other.write_text(synthetic_text(seed=1))
    with pytest.raises(ValueError, match="--data"):
        train(tiny_cfg(other, out, resume=True), out=io.StringIO())
    with pytest.raises(ValueError, match="vocab-size"):
        train(tiny_cfg(text_file, tmp_path / "v", vocab_size=99), out=io.StringIO())
    with pytest.raises(ValueError, match="seq-len"):
        train(tiny_cfg(text_file, tmp_path / "s", seq_len=10 ** 6, max_seq_len=0), out=io.StringIO())


@pytest.mark.parametrize("changes, needle", [
    (dict(lr=0.0), "--lr"), (dict(min_lr=1.0), "--min-lr"), (dict(beta2=1.0), "--beta2"),
    (dict(batch_size=0), "--batch-size"), (dict(max_steps=0, time_budget=0.0), "--max-steps"),
    (dict(tokenizer="word"), "--tokenizer"), (dict(max_seq_len=8, seq_len=16), "--max-seq-len"),
    (dict(grad_accum=1.5), "--grad-accum"), (dict(train_fraction=1.0), "--train-fraction"),
    (dict(time_budget=float("inf")), "--time-budget"),
])
def test_config_validation_names_the_flag(changes, needle):
    with pytest.raises(ValueError, match=needle):
        TrainConfig(**changes).validate()


def test_presets_are_valid_and_distinct():
    names = sorted(train_config.PRESETS)
    assert "shakespeare-char" in names
    for name in names:
        train_config.preset(name).validate()
    assert train_config.preset("shakespeare-char") == TrainConfig()
    assert train_config.preset("shakespeare-bpe").tokenizer == "bpe"
    with pytest.raises(ValueError, match="shakespeare-char"):
        train_config.preset("nope")


def test_parse_duration():
    assert train_config.parse_duration("90") == 90.0
    assert train_config.parse_duration("90s") == 90.0
    assert train_config.parse_duration("5m") == 300.0
    assert train_config.parse_duration("1.5h") == 5400.0
    for bad in ("fast", "-5m", "inf"):
        with pytest.raises(ValueError, match="duration"):
            train_config.parse_duration(bad)


def test_loss_curve_or_how_to_get_it(text_file, tmp_path, monkeypatch):
    res = train(tiny_cfg(text_file, tmp_path / "p", max_steps=4), out=io.StringIO())
    if importlib.util.find_spec("matplotlib"):
        assert res.plot is not None and res.plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert res.plot is None
    block_matplotlib(monkeypatch)
    log = io.StringIO()
    res = train(tiny_cfg(text_file, tmp_path / "q", max_steps=4), out=log)
    assert res.plot is None and "pip install" in log.getvalue()
    assert "npllama plot" in log.getvalue()
    assert "o validation" in log.getvalue() and "    last: train" in log.getvalue()   # the text chart still


def test_export_writes_the_model_alone(text_file, tmp_path):
    from npllama.io.safetensors import read_safetensors
    export = tmp_path / "weights" / "model.safetensors"
    (tmp_path / "weights").mkdir()
    res = train(tiny_cfg(text_file, tmp_path / "run", max_steps=3, export=str(export)), out=io.StringIO())
    tensors, metadata = read_safetensors(export)
    assert not any(n.startswith("optimizer.") for n in tensors) and "npllama_train_state" not in metadata
    model = npllama.load(export)
    ck = load_train_checkpoint(res.checkpoint)
    assert params_equal(model.params, ck.model.params)
    assert model.tokenizer.decode(model.tokenizer.encode("KING:\nGood night.")) == "KING:\nGood night."
    with pytest.raises(ValueError, match="--export"):
        tiny_cfg(text_file, tmp_path / "x", export="model.bin").validate()


def test_full_val_loss_covers_every_window_once():
    from npllama.ops import cross_entropy_forward
    cfg = npllama.LlamaConfig(dim=16, n_layers=1, n_heads=2, vocab_size=11, multiple_of=8, max_seq_len=8)
    model = Llama(cfg, seed=2, dtype=np.float64)
    ids = np.random.default_rng(0).integers(0, 11, 8 * 5 + 3)       # 5 full windows and a remainder
    got = train_loop.full_val_loss(model, ids, seq_len=8, batch_size=2)
    per_window = [cross_entropy_forward(model.forward(ids[None, j * 8:(j + 1) * 8]), ids[None, j * 8 + 1:(j + 1) * 8 + 1])[0]
                  for j in range(5)]
    assert got == pytest.approx(np.mean(per_window), rel=1e-12)
    with pytest.raises(ValueError, match="no full window"):
        train_loop.full_val_loss(model, ids[:8], seq_len=8, batch_size=2)
