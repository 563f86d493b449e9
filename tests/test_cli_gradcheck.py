import time

import pytest

import npllama
from npllama.cli import build_parser, main
from npllama.cli import gradcheck as gradcheck_command
from npllama.work import MachineSpeed, describe_seconds


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


def test_gradcheck_says_how_long_it_will_take_and_refuses_above_the_limit(capsys, monkeypatch):
    """The estimate (evaluations needed x each one's time, before anything runs) is printed, and a
    limit below it refuses the run in one line. The timings the estimate is made of are fixed here,
    so the test reads the arithmetic, not the machine's load: compared with the run's own time it
    once came out 13x too long on a busy machine (2.7 s against 0.21), which no bound can allow."""
    speed = MachineSpeed(per_element=1e-9, per_mac=1e-10)
    monkeypatch.setattr(gradcheck_command, "_timed", lambda fn, inputs: 1e-5)
    monkeypatch.setattr(gradcheck_command.MachineSpeed, "measure", classmethod(lambda cls: speed))
    argv = ["gradcheck", "--n-layers", "3", "--vocab-size", "40", "--seq-len", "5"]
    cfg = npllama.LlamaConfig(dim=16, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=40, multiple_of=8, max_seq_len=5)
    estimate, passes, evaluations = gradcheck_command.estimate_seconds(cfg, 2, 5, 4, speed)
    deeper, _, _ = gradcheck_command.estimate_seconds(cfg.replace(n_layers=6), 2, 5, 4, speed)
    assert 0 < estimate < deeper                                 # more layers: more passes, each longer
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert (f"estimated time: {describe_seconds(estimate)} ({passes:,} forward passes of the model, "
            f"{evaluations:,} op evaluations)") in out
    assert main([*argv, "--max-minutes", f"{estimate / 60 * 2:.9f}"]) == 0          # a limit above it: it runs
    capsys.readouterr()
    assert main([*argv, "--max-minutes", f"{estimate / 60 / 2:.9f}"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "npllama gradcheck: error: this gradcheck would take" in err
    assert "more than the limit of" in err and "--max-minutes" in err
    big = build_parser().parse_args(["gradcheck", "--n-layers", "1000"])
    t0 = time.perf_counter()
    with pytest.raises(npllama.NpllamaError, match="would take"):
        gradcheck_command.run(big)
    assert time.perf_counter() - t0 < 5
