import time

import pytest

import npllama
from npllama.cli import build_parser, main
from npllama.cli import gradcheck as gradcheck_command
from npllama.work import MachineSpeed


def test_gradcheck_command_passes_and_prints_every_parameter(capsys):
    assert main(["gradcheck", "--seq-len", "4"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "attention (GQA, causal)" in out
    cfg = npllama.LlamaConfig(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=13, multiple_of=8)
    for name in cfg.param_shapes():
        assert name in out


def test_gradcheck_command_can_fail(capsys):
    assert main(["gradcheck", "--seq-len", "3", "--n-layers", "1", "--tol", "1e-30"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_help_lists_subcommands(capsys):
    import pytest
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for command in ("train", "generate", "gradcheck"):
        assert command in out


def test_bad_flag_value_is_refused(capsys):
    import pytest
    with pytest.raises(SystemExit) as e:
        main(["gradcheck", "--n-heads", "0"])
    assert e.value.code == 2
    assert "must be >= 1" in capsys.readouterr().err


def test_gradcheck_says_how_long_it_will_take_and_refuses_above_the_limit(capsys):
    """The estimate (evaluations needed x each one's time, before anything runs) against the run's
    own time: within 5x either way, on a machine that may be running other work."""
    argv = ["gradcheck", "--n-layers", "3", "--vocab-size", "40", "--seq-len", "5"]
    cfg = npllama.LlamaConfig(dim=16, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=40, multiple_of=8, max_seq_len=5)
    estimate, passes, evaluations = gradcheck_command.estimate_seconds(cfg, 2, 5, 4, MachineSpeed.measure())
    t0 = time.perf_counter()
    assert main(argv) == 0
    took = time.perf_counter() - t0
    out = capsys.readouterr().out
    assert "estimated time: " in out and f"({passes:,} forward passes of the model, {evaluations:,} op evaluations)" in out
    assert took / 5 <= estimate <= 5 * took, (estimate, took)
    assert main([*argv, "--max-minutes", f"{estimate / 60 / 20:.6f}"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "npllama gradcheck: error: this gradcheck would take" in err
    assert "more than the limit of" in err and "--max-minutes" in err
    big = build_parser().parse_args(["gradcheck", "--n-layers", "1000"])
    t0 = time.perf_counter()
    with pytest.raises(npllama.NpllamaError, match="would take"):
        gradcheck_command.run(big)
    assert time.perf_counter() - t0 < 5
