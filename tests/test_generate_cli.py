"""`npllama generate` end to end on tiny saved models (in-process, through npllama.cli.main)."""

import pytest

import npllama
from npllama import cli
from npllama.cli import generate as cli_generate
from npllama.cli.generate import StopStrings
from npllama.generate import generate
from npllama.tokenizers import CharTokenizer, train_sentencepiece

from .conftest import data_file

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\nAll:\nSpeak, speak.\n"


def _save(tmp_path, tokenizer, name="m.safetensors", vocab_size=None, **cfg):
    config = npllama.LlamaConfig(dim=16, n_layers=2, n_heads=2, multiple_of=8, max_seq_len=64,
                                 vocab_size=vocab_size or tokenizer.vocab_size, **cfg)
    model = npllama.Llama(config, seed=0)
    model.tokenizer = tokenizer
    path = tmp_path / name
    npllama.save(model, path, format="meta")
    return path, model


@pytest.fixture
def char_model(tmp_path):
    return _save(tmp_path, CharTokenizer.from_text(TEXT))


def run(capsys, *argv):
    code = cli.main(["generate", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_greedy_output_is_prompt_plus_generate(capsys, char_model):
    path, model = char_model
    tok = model.tokenizer
    code, out, err = run(capsys, "-m", path, "-p", "Speak", "-n", 30, "--temp", 0)
    assert code == 0
    expected = "Speak" + tok.decode(generate(model, tok.encode("Speak"), 30))
    assert out == expected + "\n"
    assert "30 tokens" in err and "tokens/s" in err


def test_seeded_sampling_reproduces_and_flags_change_it(capsys, char_model):
    path, model = char_model
    args = ["-m", path, "-p", "All:", "-n", 40, "--temperature", 1.0, "--top-k", 0, "--top-p", 1.0,
            "--min-p", 0, "-s", 3]
    a = run(capsys, *args)[1]
    assert a == run(capsys, *args)[1]
    tok = model.tokenizer
    assert a == "All:" + tok.decode(generate(model, tok.encode("All:"), 40, temperature=1.0, seed=3)) + "\n"
    assert a != run(capsys, *args[:-1], 4)[1]
    assert run(capsys, *args, "--repeat-penalty", 2.0)[1] == \
        "All:" + tok.decode(generate(model, tok.encode("All:"), 40, temperature=1.0, seed=3,
                                     repetition_penalty=2.0)) + "\n"


def test_stop_string_cuts_the_output_before_it(capsys, char_model):
    path, model = char_model
    tok = model.tokenizer
    full = tok.decode(generate(model, tok.encode("Speak"), 40))
    stop = full[10:12]
    code, out, _ = run(capsys, "-m", path, "-p", "Speak", "-n", 40, "--temp", 0, "--stop", stop, "--stop", "@@")
    assert code == 0 and out == "Speak" + full[:full.index(stop)] + "\n"


def test_stop_strings_hold_back_possible_prefixes():
    s = StopStrings(["END", "xy"])
    assert s.feed("abcE") == "abc"        # "E" may start "END"
    assert s.feed("N") == ""
    assert s.feed("Dzz") == "" and s.stopped
    s = StopStrings(["END"])
    assert s.feed("aEN") == "a" and s.feed("Xb") == "ENXb" and not s.stopped
    assert s.feed("E") == "" and s.flush() == "E"


def test_sentencepiece_model_streams_text_and_stops_at_eos(capsys, tmp_path):
    tok = train_sentencepiece(TEXT * 5, vocab_size=300)
    path, model = _save(tmp_path, tok)
    code, out, _ = run(capsys, "-m", path, "-p", "Before we", "-n", 20, "--temp", 0)
    ids = tok.encode("Before we", bos=True)
    assert code == 0 and out == tok.decode(ids + generate(model, ids, 20).tolist()) + "\n"
    # a model whose every step prefers EOS: all blocks off, equal embeddings, output row eos alone
    for name, a in model.params.items():
        if name.startswith("layers."):
            a[...] = 0
    model.params["tok_embeddings.weight"][:] = 1.0
    model.params["output.weight"][:] = 0.0
    model.params["output.weight"][tok.eos_id] = 1.0
    npllama.save(model, path, format="meta")
    code, out, err = run(capsys, "-m", path, "-p", "Before we", "--temp", 0)
    assert code == 0 and out == "Before we\n" and "no tokens" in err


def test_prompt_ids_without_a_tokenizer(capsys, tmp_path, char_model):
    _, model = char_model
    model.tokenizer = None
    path = tmp_path / "bare.safetensors"
    npllama.save(model, path, format="meta")
    code, out, _ = run(capsys, "-m", path, "--prompt-ids", "1,2,3", "-n", 6, "--temp", 0)
    assert code == 0 and out.split() == list(map(str, [1, 2, 3, *generate(model, [1, 2, 3], 6).tolist()]))
    code, _, err = run(capsys, "-m", path, "-p", "hello")
    assert code == 1 and "--prompt-ids" in err


def test_sliding_window_and_length_error(capsys, char_model):
    path, _ = char_model
    code, _, err = run(capsys, "-m", path, "-p", "Speak", "-n", 100)
    assert code == 1 and "max_seq_len=64" in err and "--sliding-window" in err
    code, out, err = run(capsys, "-m", path, "-p", "Speak", "-n", 100, "--sliding-window", "-s", 1)
    assert code == 0 and "100 tokens" in err


def test_generates_to_the_very_end_of_the_context(capsys, char_model):
    """Prompt p: the CLI gives max_seq_len - p + 1 new tokens by default (the last one sampled at the
    final position, never fed back, as llama2.c's run.c), accepts -n up to that and refuses one more."""
    path, model = char_model
    tok = model.tokenizer
    ids = tok.encode("Speak")
    n = 64 - len(ids) + 1
    expected = "Speak" + tok.decode(generate(model, ids, n)) + "\n"
    code, out, err = run(capsys, "-m", path, "-p", "Speak", "--temp", 0)
    assert code == 0 and out == expected and f"{n} tokens" in err
    code, out, _ = run(capsys, "-m", path, "-p", "Speak", "--temp", 0, "-n", n)
    assert code == 0 and out == expected
    code, _, err = run(capsys, "-m", path, "-p", "Speak", "--temp", 0, "-n", n + 1)
    assert code == 1 and f"at most {n} new tokens" in err and "--sliding-window" in err


def test_errors_name_the_problem(capsys, tmp_path, monkeypatch, char_model):
    path, _ = char_model
    code, _, err = run(capsys, "-m", tmp_path / "nope.safetensors")
    assert code == 1 and "nope.safetensors" in err
    monkeypatch.setattr(cli_generate, "DEFAULT_MODEL", tmp_path / "weights" / "shakespeare-char.safetensors")
    code, _, err = run(capsys, "-p", "hi")
    assert code == 1 and "shakespeare-char.safetensors" in err and "reinstall npllama" in err and "--model" in err
    code, _, err = run(capsys, "-m", path, "-p", "Speak!?#")
    assert code == 1 and "'!#?'" in err
    code, _, err = run(capsys, "-m", path, "--prompt-ids", "1,99")
    assert code == 1 and "99" in err
    for bad in (["--top-p", "0"], ["--temp", "-1"], ["-n", "x"], ["--prompt-ids", "a,b"], ["--min-p", "2"]):
        with pytest.raises(SystemExit) as e:
            cli.main(["generate", "-m", str(path), *bad])
        assert e.value.code == 2


def test_tokenizer_flag_checks_the_vocabulary(capsys, char_model):
    path, _ = char_model
    code, _, err = run(capsys, "-m", path, "--tokenizer", data_file("llama2-tokenizer.model"), "-p", "hi")
    assert code == 1 and "32000" in err


def test_registered_in_the_npllama_command(capsys, char_model):
    from npllama import cli
    path, _ = char_model
    assert cli.main(["generate", "-m", str(path), "-p", "All", "-n", "5", "--temp", "0"]) == 0
    assert capsys.readouterr().out.startswith("All")


def test_stop_flag_understands_backslash_escapes(capsys, char_model):
    path, model = char_model
    tok = model.tokenizer
    full = tok.decode(generate(model, tok.encode("All:"), 50, temperature=1.0, seed=0))
    assert "\n" in full[1:]   # this seed does write a newline, after the first character
    code, out, _ = run(capsys, "-m", path, "-p", "All:", "-n", 50, "--temp", 1, "--top-k", 0, "--top-p", 1,
                       "--min-p", 0, "-s", 0, "--stop", "\\n")
    assert code == 0 and out == "All:" + full[:full.index("\n")] + "\n"
    assert cli_generate._unescape(r"a\n\tb\\n\x") == "a\n\tb\\n\\x"
