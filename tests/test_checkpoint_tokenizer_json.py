"""Hugging Face folders whose tokenizer is tokenizer.json (what transformers 5 writes): load and save."""

import json
import warnings

import numpy as np
import pytest

import npllama
from npllama.tokenizers.tokenizer_json import HFTokenizer
from npllama.tokenizers import tokenizer_from_file

from .test_tokenizer_json import SMALL_CONFIG, small_json


def small_model():
    tokenizer = HFTokenizer(json.dumps(small_json()), SMALL_CONFIG)
    cfg = npllama.LlamaConfig(dim=8, n_layers=1, n_heads=2, vocab_size=tokenizer.vocab_size, multiple_of=8,
                              max_seq_len=16)
    model = npllama.Llama(cfg, seed=0)
    model.tokenizer = tokenizer
    return model


def test_a_folder_with_tokenizer_json_loads_its_tokenizer_and_saves_it_back(tmp_path):
    model = small_model()
    folder = npllama.save(model, tmp_path / "hf", format="hf")
    assert (folder / "tokenizer.json").read_text() == model.tokenizer.hf_files()["tokenizer.json"]
    assert json.loads((folder / "tokenizer_config.json").read_text()) == SMALL_CONFIG
    assert not (folder / "tokenizer.model").exists()
    loaded = npllama.load(folder)
    assert isinstance(loaded.tokenizer, HFTokenizer) and loaded.tokenizer == model.tokenizer
    assert loaded.tokenizer.encode("hello", bos=True) == [1, 264, 265, 262, 263]
    ids = loaded.generate(loaded.tokenizer.encode("he", bos=True), max_new_tokens=3)
    assert len(ids) == 3
    # the metadata does not carry a second copy of the tokenizer
    from npllama.io.safetensors import read_safetensors_header
    assert "npllama_tokenizer" not in read_safetensors_header(folder / "model.safetensors")[1]


def test_meta_format_carries_the_tokenizer_json_in_its_metadata(tmp_path):
    model = small_model()
    path = npllama.save(model, tmp_path / "m.safetensors", format="meta")
    assert npllama.load(path).tokenizer == model.tokenizer


def test_an_unusable_tokenizer_json_is_a_warning_naming_the_fix(tmp_path):
    folder = npllama.save(small_model(), tmp_path / "hf", format="hf")
    (folder / "tokenizer.json").write_text(json.dumps({**small_json(), "model": {"type": "WordLevel"}}))
    with pytest.warns(UserWarning, match="tokenizer.json.*--tokenizer"):
        loaded = npllama.load(folder)
    assert loaded.tokenizer is None and np.isfinite(loaded.forward([1, 2])).all()


def test_a_folder_without_any_tokenizer_loads_silently(tmp_path):
    folder = npllama.save(small_model(), tmp_path / "hf", format="hf")
    (folder / "tokenizer.json").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert npllama.load(folder).tokenizer is None


def test_tokenizer_from_file_reads_every_kind(tmp_path):
    folder = npllama.save(small_model(), tmp_path / "hf", format="hf")
    expected = small_model().tokenizer
    assert tokenizer_from_file(folder) == expected
    assert tokenizer_from_file(folder / "tokenizer.json") == expected
    with pytest.raises(FileNotFoundError, match="not found"):
        tokenizer_from_file(tmp_path / "nope.model")
    with pytest.raises(ValueError, match="no tokenizer"):
        tokenizer_from_file(tmp_path)


def test_generate_takes_a_tokenizer_json_through_the_tokenizer_flag(tmp_path, capsys):
    from npllama.cli import main
    model = small_model()
    folder = npllama.save(model, tmp_path / "hf", format="hf")
    model.tokenizer = None
    bare = npllama.save(model, tmp_path / "bare.safetensors", format="meta")
    assert main(["generate", "-m", str(bare), "--tokenizer", str(folder / "tokenizer.json"), "-p", "hello",
                 "-n", "3", "--temp", "0"]) == 0
    assert capsys.readouterr().out.startswith("hello")
