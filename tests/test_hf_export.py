"""Hugging Face tokenizer files for every tokenizer npllama has (npllama/tokenizers/hf_export.py).

Without transformers: the sentencepiece settings read from the file, the tokenizer.json of each
kind read back by npllama's own reader (ids and text equal npllama's tokenizer), what save writes,
and what it refuses. tests/test_hf_export_transformers.py runs the same folders in transformers.
"""

import functools
import importlib.util
import io
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
from hypothesis import given, strategies as st

import npllama
from npllama.errors import NpllamaError
from npllama.tokenizers import CharTokenizer, SentencePieceTokenizer, train_sentencepiece
from npllama.tokenizers.hf_export import (InexactTokenizerError, generation_config_json, hf_tokenizer_files,
                                          sentencepiece_tokenizer_json)
from npllama.tokenizers.spm_proto import BPE, read_spec
from npllama.tokenizers.tokenizer_json import HFTokenizer
from .conftest import data_file

TOOL = Path(__file__).resolve().parent.parent / "tools" / "check_hf_export.py"


def _tool():
    spec = importlib.util.spec_from_file_location("check_hf_export", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_hf_export = _tool()


@functools.lru_cache(maxsize=None)
def _shakespeare() -> str:
    return data_file("tinyshakespeare.txt").read_text(encoding="utf-8")


@functools.lru_cache(maxsize=None)
def _tokenizer(kind: str):
    if kind == "llama2":
        return SentencePieceTokenizer.from_file(data_file("llama2-tokenizer.model"))
    if kind == "tok512":
        return SentencePieceTokenizer.from_file(data_file("tok512.model"))
    if kind == "bpe":
        return train_sentencepiece(_shakespeare()[:100_000], 400)
    if kind == "unigram":
        return check_hf_export.train_unigram(_shakespeare()[:100_000], 600)
    return CharTokenizer.from_text(_shakespeare())


KINDS = ["llama2", "tok512", "bpe", "unigram", "char"]


def _texts(kind):
    lines = check_hf_export.tinyshakespeare_lines(_shakespeare())
    return lines + (check_hf_export.ODD_TEXTS if kind != "char" else [])


@functools.lru_cache(maxsize=None)
def _files(kind: str) -> dict:
    return hf_tokenizer_files(_tokenizer(kind), 256).files


@functools.lru_cache(maxsize=None)
def _reader(kind: str) -> HFTokenizer:
    return HFTokenizer(_files(kind)["tokenizer.json"], _files(kind)["tokenizer_config.json"])


# ---------------------------------------------------------------- the settings in a .model file

def test_the_settings_of_the_shipped_sentencepiece_models():
    tok512 = read_spec(data_file("tok512.model").read_bytes())
    llama2 = read_spec(data_file("llama2-tokenizer.model").read_bytes())
    assert (tok512.model_type, llama2.model_type) == (BPE, BPE)
    assert tok512.byte_fallback and llama2.byte_fallback
    assert tok512.normalizer_name == llama2.normalizer_name == "identity"
    assert tok512.precompiled_charsmap == llama2.precompiled_charsmap == b""
    assert tok512.add_dummy_prefix and llama2.add_dummy_prefix
    # the one difference that matters: tok512 leaves the proto2 default on, Llama 2 turns it off
    assert tok512.remove_extra_whitespaces and not llama2.remove_extra_whitespaces
    assert tok512.user_defined_ids == llama2.user_defined_ids == ()


def test_settings_agree_with_what_sentencepiece_does():
    """remove_extra_whitespaces as read from the file is what sentencepiece's normalizer does."""
    for name in ("tok512.model", "llama2-tokenizer.model"):
        proto = data_file(name).read_bytes()
        sp = spm.SentencePieceProcessor()
        sp.LoadFromSerializedProto(proto)
        assert (sp.normalize("a  b ") == "\u2581a\u2581b") == read_spec(proto).remove_extra_whitespaces, name


@pytest.mark.parametrize("data", [b"\x0a\xff\x01", b"\x0a", b"\x80", b"\x0f", b"\x08\x01",
                                  b"\x1a\x02\x12\x05"])
def test_a_corrupt_model_is_one_npllama_error(data):
    with pytest.raises(NpllamaError, match="sentencepiece model is (truncated or )?corrupt"):
        read_spec(data)


@given(st.binary(max_size=64) | st.builds(lambda cut: data_file("tok512.model").read_bytes()[:cut],
                                          st.integers(0, 8000)))
def test_any_bytes_give_settings_or_one_npllama_error(data):
    """Truncated models and noise: the settings, or an NpllamaError; never another exception."""
    try:
        read_spec(data)
    except NpllamaError as e:
        assert "\n" not in str(e)


# ---------------------------------------------------------------- npllama's reader reads it back

@pytest.mark.parametrize("kind", KINDS)
def test_npllama_reads_back_the_tokenizer_json_with_the_same_ids(kind):
    tokenizer, reader = _tokenizer(kind), _reader(kind)
    assert (reader.bos_id, reader.eos_id, reader.vocab_size) == (tokenizer.bos_id, tokenizer.eos_id, tokenizer.vocab_size)
    assert reader.add_bos == (tokenizer.bos_id is not None) and not reader.add_eos
    for text in _texts(kind):
        ids = tokenizer.encode(text)
        assert reader.encode(text) == ids, text
        assert reader.decode(ids) == tokenizer.decode(ids), text


@pytest.mark.parametrize("kind", ["llama2", "tok512", "bpe", "unigram"])
def test_spacing_and_characters_outside_the_vocabulary_equal_sentencepiece(kind):
    """Runs of spaces (Llama 2 ranks its sixteen '▁' runs, all scored -1e9, by id where sentencepiece
    takes the leftmost pair), spaces at either end, a literal '▁' (which sentencepiece treats as a
    space at the end of a text that removes extra whitespace), bytes; encode, then decode."""
    tokenizer, reader = _tokenizer(kind), _reader(kind)
    texts = [" " * k for k in range(40)] + ["a" + " " * k + "b" for k in range(40)]
    texts += [" " * k + "the king" + " " * k for k in range(20)] + ["x\n" + " " * k + "\ty" for k in range(20)]
    texts += ["\u2581", "kh\u2581", "\u2581, i   abh ", " \u2581x", "a\u2581\u2581b", "\u2581\u2581\u2581 \u2581",
              "\U0001f999 llama \u00e9\u00e8 \u6771\u4eac", "\x00\x01\x7f"]
    for text in texts:
        ids = tokenizer.encode(text)
        assert reader.encode(text) == ids, repr(text)
        assert reader.decode(ids) == tokenizer.decode(ids), repr(text)
        stream = reader.stream_decoder()
        assert "".join(stream.push(i) for i in ids) + stream.flush() == tokenizer.decode(ids), repr(text)


def test_the_tokenizers_library_runs_the_files_as_npllama_does():
    """The same files in Hugging Face's own `tokenizers` (what transformers runs), where installed."""
    tokenizers = pytest.importorskip("tokenizers", reason="Hugging Face's tokenizers package is not installed")
    for kind in KINDS:
        tokenizer = _tokenizer(kind)
        library = tokenizers.Tokenizer.from_str(_files(kind)["tokenizer.json"].decode("utf-8"))
        for text in _texts(kind)[::5] + ([" " * 20, "a  b", "\u2581x "] if kind != "char" else []):
            ids = tokenizer.encode(text)
            assert library.encode(text, add_special_tokens=False).ids == ids, (kind, text)
            assert library.decode(ids, skip_special_tokens=True) == tokenizer.decode(ids), (kind, text)


def _trained(**options) -> SentencePieceTokenizer:
    model = io.BytesIO()
    lines = [line for line in _shakespeare()[:60_000].split("\n") if line]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, model_type="bpe", vocab_size=400,
                                   character_coverage=0.99, minloglevel=2, num_threads=1, **options)
    return SentencePieceTokenizer(model.getvalue())


OTHER_SETTINGS = {
    "nmt_nfkc, no byte fallback": dict(normalization_rule_name="nmt_nfkc", byte_fallback=False),
    "nfkc, no dummy prefix": dict(normalization_rule_name="nfkc", byte_fallback=True, add_dummy_prefix=False),
    "identity, no BOS, a pad piece": dict(normalization_rule_name="identity", byte_fallback=False,
                                          remove_extra_whitespaces=False, bos_id=-1, pad_id=3),
}


@pytest.mark.parametrize("options", OTHER_SETTINGS.values(), ids=OTHER_SETTINGS.keys())
def test_other_sentencepiece_settings_encode_as_sentencepiece(options):
    """A normalizer with a character map (run by the `tokenizers` package: npllama's reader hands
    such files to it), no dummy prefix, no byte fallback, no BOS. Decoding equals sentencepiece's
    except that <unk> prints nothing (sentencepiece: ' ⁇ '), as transformers' Llama files do."""
    tokenizers = pytest.importorskip("tokenizers", reason="Hugging Face's tokenizers package is not installed")
    from npllama.tokenizers.tokenizer_json import hf_tokenizer
    tokenizer = _trained(**options)
    files = hf_tokenizer_files(tokenizer).files
    library = tokenizers.Tokenizer.from_str(files["tokenizer.json"].decode("utf-8"))
    ours = hf_tokenizer(files["tokenizer.json"], files["tokenizer_config.json"])
    assert (ours.bos_id, ours.add_bos) == (tokenizer.bos_id, tokenizer.bos_id is not None)
    texts = _texts("llama2")[::2] + ["\u2581 x", "full\uff46\uff55\u3000width \ufb01 \u2460", "A\u030a \u00c5"]
    for text in texts:
        ids = tokenizer.encode(text)
        assert library.encode(text, add_special_tokens=False).ids == ids == ours.encode(text), repr(text)
        # sentencepiece's text without its ' ⁇ ' surfaces; where that leaves a leading space (an
        # <unk> first), the decoder strips it too, so those are not compared
        expected = tokenizer.decode(ids).replace(" \u2047 ", "")
        if tokenizer.unk_id not in ids or not expected.startswith(" "):
            assert library.decode(ids, skip_special_tokens=True) == ours.decode(ids) == expected, repr(text)


# ---------------------------------------------------------------- the files

def test_the_files_of_each_kind():
    sp = hf_tokenizer_files(_tokenizer("tok512"), 512)
    assert set(sp.files) == {"tokenizer.model", "tokenizer.json", "tokenizer_config.json"} and sp.restores
    assert sp.files["tokenizer.model"] == data_file("tok512.model").read_bytes() and sp.note is None
    config = json.loads(sp.files["tokenizer_config.json"])
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"      # runs tokenizer.json as written
    assert (config["bos_token"], config["eos_token"], config["unk_token"]) == ("<s>", "</s>", "<unk>")
    assert config["add_bos_token"] is True and config["add_eos_token"] is False
    assert config["model_max_length"] == 512 and config["clean_up_tokenization_spaces"] is False
    assert generation_config_json(_tokenizer("tok512")) == {"bos_token_id": 1, "eos_token_id": 2}

    char = hf_tokenizer_files(_tokenizer("char"))
    assert set(char.files) == {"tokenizer.json", "tokenizer_config.json"} and not char.restores
    tokenizer_json = json.loads(char.files["tokenizer.json"])
    assert tokenizer_json["model"]["vocab"] == {c: i for i, c in enumerate(_tokenizer("char").chars)}
    assert tokenizer_json["model"]["merges"] == [] and tokenizer_json["added_tokens"] == []
    assert generation_config_json(_tokenizer("char")) == {}

    none = hf_tokenizer_files(None)
    assert none.files == {} and "no tokenizer" in none.note


def _small_model(vocab_size, seed=0):
    cfg = npllama.LlamaConfig(dim=16, n_layers=1, n_heads=2, vocab_size=vocab_size, multiple_of=8, max_seq_len=64)
    return npllama.Llama(cfg, seed=seed)


def _with_user_defined_pieces() -> SentencePieceTokenizer:
    model = io.BytesIO()
    text = "the king of all that lies beneath heaven and earth\nmy lord good night sweet prince\n" * 30
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text.split("\n")), model_writer=model, model_type="bpe",
                                   vocab_size=60, user_defined_symbols=["<sep>", "king"], minloglevel=2, num_threads=1)
    return SentencePieceTokenizer(model.getvalue())


def test_a_model_it_cannot_convert_exactly_is_refused_naming_why(tmp_path):
    tokenizer = _with_user_defined_pieces()
    with pytest.raises(InexactTokenizerError, match="it has 2 user-defined pieces"):
        sentencepiece_tokenizer_json(tokenizer)
    model = _small_model(tokenizer.vocab_size)
    model.tokenizer = tokenizer
    with pytest.warns(UserWarning, match="tokenizer.json not written: it has 2 user-defined pieces") as caught:
        folder = npllama.save(model, tmp_path / "hf")
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    assert {p.name for p in folder.iterdir()} == {"model.safetensors", "config.json", "generation_config.json",
                                                  "tokenizer.model"}
    assert npllama.load(folder).tokenizer == tokenizer           # still loads, from tokenizer.model


# ---------------------------------------------------------------- save and load

def test_a_sentencepiece_export_loads_back_from_tokenizer_json_alone(tmp_path):
    tokenizer = _tokenizer("tok512")
    model = _small_model(512)
    model.tokenizer = tokenizer
    folder = npllama.save(model, tmp_path / "hf")
    assert {p.name for p in folder.iterdir()} == {"model.safetensors", "config.json", "generation_config.json",
                                                  "tokenizer.model", "tokenizer.json", "tokenizer_config.json"}
    assert json.loads((folder / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2}
    assert npllama.load(folder).tokenizer == tokenizer        # tokenizer.model first
    (folder / "tokenizer.model").unlink()
    back = npllama.load(folder).tokenizer
    assert isinstance(back, HFTokenizer)
    for text in _texts("tok512")[:50]:
        assert back.encode(text, bos=True) == tokenizer.encode(text, bos=True)
    prompt = tokenizer.encode("Once upon a time", bos=True)
    assert model.generate(prompt, 8).tolist() == npllama.load(folder).generate(back.encode("Once upon a time", bos=True), 8).tolist()


def test_a_char_export_keeps_its_char_tokenizer_and_writes_tokenizer_json(tmp_path):
    model = npllama.load(check_hf_export.ROOT / "weights" / "shakespeare-char.safetensors")
    folder = npllama.save(model, tmp_path / "hf")
    assert npllama.load(folder).tokenizer == model.tokenizer  # from the metadata, a CharTokenizer
    reader = HFTokenizer.from_folder(folder)
    assert reader.encode("ROMEO:\nO, she doth teach") == model.tokenizer.encode("ROMEO:\nO, she doth teach")


def test_a_model_without_tokenizer_gets_config_and_generation_config_and_a_note(tmp_path, capsys):
    source = npllama.save(_small_model(32), tmp_path / "bare.safetensors", format="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("error")              # save itself says nothing: a bare model is no fault
        folder = npllama.save(npllama.load(source), tmp_path / "api")
    assert {p.name for p in folder.iterdir()} == {"model.safetensors", "config.json", "generation_config.json"}
    from npllama.cli import main
    assert main(["export", "-m", str(source), "-o", str(tmp_path / "cli")]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "no tokenizer" in line]
    assert len(notes) == 1 and "--tokenizer" in notes[0]
    assert {p.name for p in (tmp_path / "cli").iterdir()} == {"model.safetensors", "config.json",
                                                              "generation_config.json"}


def test_export_with_a_tokenizer_flag_writes_its_tokenizer_json(tmp_path):
    from npllama.cli import main
    out = tmp_path / "stories"
    assert main(["export", "-m", str(data_file("stories260K.bin")), "--tokenizer", str(data_file("tok512.model")),
                 "-o", str(out)]) == 0
    reader = HFTokenizer.from_folder(out)
    assert reader.encode("Once upon a time", bos=True) == [1, 403, 407, 261, 378]
    assert np.array_equal(npllama.load(out).params["tok_embeddings.weight"],
                          npllama.load(data_file("stories260K.bin")).params["tok_embeddings.weight"])
