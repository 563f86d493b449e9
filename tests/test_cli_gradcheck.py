import npllama
from npllama.cli import main


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
