"""Hostile text: JSON nested past reason, regexes that backtrack without bound, errors with no message.

Each input here once ended in a RecursionError traceback, a hang, or an empty error line
(docs/faults.md "Files are never lost"). Now: a clear error or warning naming the file, fast.
"""

import io
import json
import subprocess
import time

import numpy as np
import pytest
from hypothesis import given, strategies as st

import npllama
from npllama import cli
from npllama.checks import MAX_JSON_DEPTH, json_depth, parse_json
from npllama.errors import NpllamaError
from npllama.io import CheckpointError
from npllama.io.safetensors import read_safetensors, write_safetensors_atomic
from npllama.tokenizers import tokenizer_from_file
from npllama.tokenizers.regex_safety import UnboundedRegexError, check_regex
from npllama.tokenizers.tokenizer_json import HFTokenizer, LibraryHFTokenizer, TokenizerJSONError, hf_tokenizer
from npllama.train import train
from npllama.train.checkpoint import load_train_state
from npllama.train.lock import RunLock

from .conftest import tiny_cfg
from .test_faults import NPLLAMA, no_traceback
from .test_tokenizer_json import SMALL_CONFIG, small_json

DEEP = "[" * 100_000 + "]" * 100_000        # a tokenizer.json as in the report: 100,000 levels


def tiny_model():
    return npllama.Llama(npllama.LlamaConfig(dim=16, n_layers=1, n_heads=2, vocab_size=300, multiple_of=8,
                                             max_seq_len=32), seed=0)


# ----------------------------------------------------------------------------- bounded JSON

def _reference_depth(obj) -> int:
    stack, deepest = [(obj, 0)], 0
    while stack:
        o, d = stack.pop()
        if isinstance(o, (list, dict)):
            deepest = max(deepest, d + 1)
            stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return deepest


_json = st.recursive(st.none() | st.integers() | st.text(st.sampled_from('ab"\\[]{}\n')),
                     lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text('a"[{\\'), kids, max_size=3),
                     max_leaves=30)


@given(_json)
def test_json_depth_counts_only_brackets_outside_strings(obj):
    assert json_depth(json.dumps(obj)) == _reference_depth(obj)
    assert json_depth(json.dumps(obj, ensure_ascii=False, indent=1)) == _reference_depth(obj)


@pytest.mark.parametrize("text", [DEEP, "[" * 20_000, '{"a":' * 5000 + "1" + "}" * 5000, '"' + '\\"' * 50_000])
def test_parse_json_refuses_deep_or_broken_text_without_recursing(text):
    start = time.perf_counter()
    with pytest.raises(NpllamaError, match="nests JSON|not valid JSON"):
        parse_json(text, "x.json")
    assert time.perf_counter() - start < 2.0
    assert parse_json("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH, "x.json") is not None


def _folder_with_tokenizer_json(tmp_path, text):
    folder = npllama.save(tiny_model(), tmp_path / "hf", format="hf")
    (folder / "tokenizer.json").write_text(text)
    return folder


def test_a_deep_tokenizer_json_through_load_generate_and_tokenizer(tmp_path):
    folder = _folder_with_tokenizer_json(tmp_path, DEEP)
    with pytest.warns(UserWarning, match="nests JSON 100000 levels deep"):
        assert npllama.load(folder).tokenizer is None                   # the model loads; its tokenizer is refused
    deep_file = tmp_path / "tokenizer.json"
    deep_file.write_text(DEEP)
    weights = npllama.save(tiny_model(), tmp_path / "m.safetensors", format="meta")
    for argv in (["-m", str(folder), "-p", "hi"], ["-m", str(weights), "--tokenizer", str(deep_file), "-p", "hi"],
                 ["-m", str(weights), "--tokenizer", str(folder), "-p", "hi"]):
        run = subprocess.run([*NPLLAMA, "generate", *argv, "-n", "2"], capture_output=True, text=True, timeout=120)
        assert run.returncode == 1 and no_traceback(run.stderr) and "Recursion" not in run.stderr, run.stderr
        assert "nests JSON 100000 levels deep" in run.stderr
        assert run.stderr.strip().splitlines()[-1].startswith("npllama generate: error: ")


def test_a_deep_metrics_line_is_left_out_of_the_plot(text_file, tmp_path):
    out = tmp_path / "run"
    train(tiny_cfg(text_file, out, max_steps=4, eval_interval=2), out=io.StringIO())
    with open(out / "metrics.jsonl", "a") as f:
        f.write("[" * 20_000 + "\n" + '{"kind": "train", "step": "x", "loss": 1}\n' + '["a list"]\n')
    run = subprocess.run([*NPLLAMA, "plot", str(out)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and no_traceback(run.stderr), run.stderr
    assert "left out 3 damaged line(s)" in run.stderr and "loss" in run.stdout


def test_deep_json_in_every_file_npllama_reads_is_a_clear_error(text_file, tmp_path):
    folder = npllama.save(tiny_model(), tmp_path / "hf", format="hf")
    (folder / "config.json").write_text(DEEP)
    with pytest.raises(CheckpointError, match="config.json nests JSON"):
        npllama.load(folder)
    header = b"[" * 50_000 + b"]" * 50_000
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(CheckpointError, match="header.*nests JSON"):
        read_safetensors(bad)
    out = tmp_path / "run"
    train(tiny_cfg(text_file, out, max_steps=2, eval_interval=2), out=io.StringIO())
    (out / "train.lock").write_text(DEEP)                              # a damaged lock file: taken over
    with RunLock(out) as lock:
        assert lock.previous is None
    readers = {"npllama_train_state": load_train_state, "npllama_config": npllama.load,
               "npllama_tokenizer": npllama.load, "npllama_lora": npllama.load}
    for key, read in readers.items():
        tensors, metadata = read_safetensors(out / "ckpt.safetensors")
        metadata[key] = DEEP
        write_safetensors_atomic(tmp_path / "deep.safetensors", tensors, metadata)
        with pytest.raises(NpllamaError, match="nests JSON"):
            read(tmp_path / "deep.safetensors")


# ----------------------------------------------------------------------------- regexes

# What tokenizer.json files of the families npllama meets carry: GPT-2 and Llama 3 / Qwen 2
# pre-tokenizer Splits, DeepSeek-style pieces, and the Llama / Mistral normalizers.
REAL_PATTERNS = [
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"[\r\n]", r"\s?[!-/:-~！-／：-～‘-‟　-。]+", r"\s+$", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}+",
    r"\A +| +\z", r" {2,}", r"\A▁", r"(?:\r?\n)+", r"(?:[a-z]+ )+",
]
UNBOUNDED = [r"(?:a+)+$", r"(a+)+", r"(a|a)*", r"(a|aa)*c", r"(a*)*b", r"(a?)+", r"(?: ?[a-z]+)+$", r"a*a*a*c",
             r"(\w+\s?)+$", r"(.*a){20}", r"(a)\1", r"(?:\p{L}|[a-z])+$", r"(x+x+)+y", "(" * 200 + "a" + ")" * 200]


@pytest.mark.parametrize("pattern", REAL_PATTERNS)
def test_real_tokenizer_patterns_pass(pattern):
    check_regex(pattern, "pre_tokenizer Split")


@pytest.mark.parametrize("pattern", UNBOUNDED)
def test_patterns_that_backtrack_without_bound_are_refused(pattern):
    with pytest.raises(UnboundedRegexError, match="could make encoding hang"):
        check_regex(pattern, "normalizer Replace")


def _replace(pattern):
    return {"type": "Replace", "pattern": {"Regex": pattern}, "content": ""}


def test_an_exponential_normalizer_is_refused_at_load_on_both_engines(tmp_path, capsys):
    text = "hello " + "a" * 40 + "c"
    start = time.perf_counter()
    pure = json.dumps(small_json(normalizer=_replace("(?:a+)+$")))
    with pytest.raises(UnboundedRegexError, match=r"normalizer Replace regex '\(\?:a\+\)\+\$'"):
        hf_tokenizer(pure)
    library = json.dumps(small_json(pre_tokenizer={"type": "Split", "pattern": {"Regex": "(?:a+)+$"},
                                                   "behavior": "Isolated", "invert": False}))
    with pytest.raises(UnboundedRegexError, match="pre_tokenizer Split"):
        hf_tokenizer(library)
    path = tmp_path / "tokenizer.json"
    path.write_text(pure)
    weights = npllama.save(tiny_model(), tmp_path / "m.safetensors", format="meta")
    assert cli.main(["generate", "-m", str(weights), "--tokenizer", str(path), "-p", text, "-n", "1"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "could make encoding hang" in err
    assert time.perf_counter() - start < 5.0
    # the real patterns still run, and fast, on the text that hung
    tokenizers = pytest.importorskip("tokenizers", reason="the `tokenizers` package is not installed")
    del tokenizers
    gpt4 = small_json(pre_tokenizer={"type": "Split", "pattern": {"Regex": REAL_PATTERNS[1]}, "behavior": "Isolated",
                                     "invert": False})
    tok = hf_tokenizer(json.dumps(gpt4), json.dumps(SMALL_CONFIG))
    assert isinstance(tok, LibraryHFTokenizer) and tok.decode(tok.encode(text))
    assert isinstance(hf_tokenizer(json.dumps(small_json(normalizer=_replace(" {2,}")))), HFTokenizer)


def test_a_panic_of_the_tokenizers_library_is_an_error(capfd):
    """A pattern this reader cannot parse (a POSIX bracket) is left to Oniguruma, whose retry limit
    then panics in Rust: a TokenizerJSONError, not pyo3's PanicException (a BaseException)."""
    pytest.importorskip("tokenizers", reason="the `tokenizers` package is not installed")
    split = {"type": "Split", "pattern": {"Regex": "([[:alpha:]]|a)+$"}, "behavior": "Isolated", "invert": False}
    tok = hf_tokenizer(json.dumps(small_json(pre_tokenizer=split)))
    with pytest.raises(TokenizerJSONError, match="the `tokenizers` package failed"):
        tok.encode("a" * 200 + "!")
    capfd.readouterr()                                   # Rust's own panic report went to stderr


# ----------------------------------------------------------------------------- every error line says something

@pytest.mark.parametrize("error,needle", [(MemoryError(), "out of memory (MemoryError with no message)"),
                                          (ValueError(), "ValueError with no message"),
                                          (ValueError("  "), "ValueError with no message"),
                                          (OSError(), "OSError with no message")])
def test_an_error_without_a_message_still_names_itself(error, needle, monkeypatch, capsys):
    from npllama.cli import gradcheck as gradcheck_cli

    def fail(args):
        raise error
    monkeypatch.setattr(gradcheck_cli, "run", fail)
    parser = cli.build_parser
    monkeypatch.setattr(cli, "build_parser", lambda: _with_func(parser(), fail))
    assert cli.main(["gradcheck"]) == 1
    line = capsys.readouterr().err
    assert line.startswith("npllama gradcheck: error: ") and needle in line and line.count("\n") == 1


def _with_func(parser, func):
    for action in parser._subparsers._group_actions:
        for sub in action.choices.values():
            sub.set_defaults(func=func)
    return parser


def test_a_tokenizer_json_round_trip_still_works(tmp_path):
    """The checks add no refusal to an ordinary file: the small Llama layout round-trips."""
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(small_json()))
    tok = tokenizer_from_file(path)
    assert tok.decode(tok.encode("hello hll")) == "hello hll"
    assert np.array_equal(tok.encode("hello"), HFTokenizer(json.dumps(small_json())).encode("hello"))
