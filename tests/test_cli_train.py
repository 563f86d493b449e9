"""`npllama train` end to end: flags <-> TrainConfig, a short real run, resume, errors and exit codes."""

import dataclasses
import importlib.util
import json

import pytest

import npllama
from npllama import cli
from npllama.cli import train as cli_train
from npllama.train import TrainConfig
from npllama.train.chart import loss_chart
from npllama.train.metrics import read_metrics

from .conftest import block_matplotlib, data_file


@pytest.fixture
def shakespeare_slice(tmp_path):
    """The first 60,000 characters of TinyShakespeare (54,000 to train on, 6,000 to validate)."""
    text = data_file("tinyshakespeare.txt").read_text(encoding="utf-8")[:60000]
    path = tmp_path / "slice.txt"
    path.write_text(text, encoding="utf-8")
    return path


def test_help_lists_one_flag_per_train_config_field(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for f in dataclasses.fields(TrainConfig):
        assert "--" + f.name.replace("_", "-") in out, f.name
    for name in ("--preset", "shakespeare-char", "shakespeare-bpe", "tiny"):
        assert name in out


def test_flags_override_the_preset():
    parser = cli.build_parser()
    cfg = cli_train.resolve_config(parser.parse_args(
        ["train", "--preset", "tiny", "--dim", "48", "--time-budget", "2m", "--no-tie-embeddings",
         "--tokenizer", "bpe", "--vocab-size", "600"]))
    assert cfg == npllama.train.config.tiny().replace(dim=48, time_budget=120.0, tie_embeddings=False,
                                               tokenizer="bpe", vocab_size=600)
    assert cli_train.resolve_config(parser.parse_args(["train"])) == TrainConfig()


def test_short_run_learns_and_its_checkpoint_loads_and_generates(shakespeare_slice, tmp_path, capsys):
    out = tmp_path / "run"
    code = cli.main(["train", "--preset", "tiny", "--data", str(shakespeare_slice), "--max-steps", "40",
                     "--eval-interval", "20", "--sample-tokens", "20", "--out-dir", str(out), "--seed", "3"])
    assert code == 0
    printed = capsys.readouterr().out
    for needle in ("npllama train --preset tiny", "val loss", "tok/s", "ETA", "done: 40 steps",
                   "npllama generate --model"):
        assert needle in printed, needle
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 20, 40]
    assert evals[0]["val_loss"] > 3.8                           # ~ln(vocab) at initialisation
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.7   # it learned
    assert len([r for r in records if r["kind"] == "train"]) == 40
    model = npllama.load(out / "ckpt.safetensors")
    assert model.tokenizer is not None and model.config.dim == 32
    prompt = model.tokenizer.encode("ROMEO:")
    new = model.generate(prompt, max_new_tokens=20, temperature=0.8, seed=0)
    assert len(new) == 20 and all(0 <= int(i) < model.config.vocab_size for i in new)
    text = model.tokenizer.decode([int(i) for i in new])
    assert isinstance(text, str) and len(text) == 20
    assert (out / "loss.png").is_file() or "pip install" in printed


def test_resume_from_the_command_line_keeps_the_saved_settings(shakespeare_slice, tmp_path, capsys):
    out = str(tmp_path / "run")
    common = ["--data", str(shakespeare_slice), "--out-dir", out]
    assert cli.main(["train", "--preset", "tiny", "--dim", "24", "--n-heads", "2", "--max-steps", "6",
                     "--decay-steps", "12", "--sample-tokens", "0", *common]) == 0
    assert cli.main(["train", "--resume", "--max-steps", "12", *common]) == 0
    printed = capsys.readouterr().out
    assert "--resume from step 6" in printed and "done: 12 steps" in printed
    model = npllama.load(tmp_path / "run" / "ckpt.safetensors")
    assert model.config.dim == 24 and model.config.n_heads == 2
    # a structural change is refused with exit code 1 and a message naming the flag
    assert cli.main(["train", "--resume", "--dim", "32", *common]) == 1
    assert "--dim" in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["--lr", "-1"], "--lr"),
    (["--min-lr", "1.0"], "--min-lr"),
    (["--max-steps", "0"], "--max-steps"),
    (["--resume"], "no training checkpoint"),
    (["--data", "/nonexistent/text.txt"], "does not exist"),
])
def test_bad_settings_exit_1_with_a_message(argv, needle, tmp_path, capsys):
    code = cli.main(["train", "--out-dir", str(tmp_path / "r"), *argv])
    assert code == 1
    err = capsys.readouterr().err
    assert needle in err and "npllama train: error" in err


@pytest.mark.parametrize("argv", [["--max-steps", "abc"], ["--max-steps", "-3"], ["--lr", "nan"],
                                  ["--time-budget", "soon"], ["--tokenizer", "words"], ["--preset", "huge"]])
def test_malformed_flags_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", *argv])
    assert e.value.code == 2
    assert "usage" in capsys.readouterr().err


def test_plot_command_prints_the_chart_and_draws_the_png(shakespeare_slice, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert cli.main(["train", "--preset", "tiny", "--data", str(shakespeare_slice), "--max-steps", "6",
                     "--eval-interval", "3", "--sample-tokens", "0", "--out-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "o validation" in printed and "    step  0" in printed      # the chart at the end of training
    (out / "loss.png").unlink(missing_ok=True)
    assert cli.main(["plot", str(out), "--width", "60", "--height", "8"]) == 0
    shown = capsys.readouterr()
    assert shown.out.startswith(loss_chart(*read_metrics(out / "metrics.jsonl"), width=60, height=8) + "\n")
    if importlib.util.find_spec("matplotlib"):
        assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    else:
        assert not (out / "loss.png").exists() and "pip install" in shown.err

    block_matplotlib(monkeypatch)
    assert cli.main(["plot", str(out)]) == 0          # without matplotlib: the chart, and how to get the PNG
    shown = capsys.readouterr()
    assert "o validation" in shown.out and "matplotlib is not installed" in shown.err
    assert cli.main(["plot", str(tmp_path / "nothing")]) == 1
