"""The folders `npllama export` writes, in transformers (issue 20): AutoTokenizer encodes and decodes
as npllama does, and pipeline("text-generation") generates greedily what `npllama generate --temp 0`
generates, for each kind of tokenizer. tools/check_hf_export.py holds the checks; .ci/run also
runs them in a fresh venv holding only torch and transformers."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import DATA_DIR_VAR, data_file
from .test_hf_export import KINDS, TOOL, check_hf_export

pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[torch]')")
pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[torch]')")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """One exported folder per kind of tokenizer, and what npllama makes of them (expected.json)."""
    for name in ("tinyshakespeare.txt", "llama2-tokenizer.model", "stories260K.bin", "tok512.model"):
        data_file(name)
    out = tmp_path_factory.mktemp("hf-export")
    path = check_hf_export.export(out, Path(os.environ[DATA_DIR_VAR]))
    return out, {case["name"]: case for case in json.loads(path.read_text(encoding="utf-8"))["cases"]}


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_transformers_encodes_decodes_and_generates_as_npllama(exported, kind):
    out, cases = exported
    assert check_hf_export.check_case(cases[kind], out / kind) == []


@pytest.mark.slow
def test_transformers_needs_neither_sentencepiece_nor_protobuf_nor_tiktoken(exported):
    """The check again in a process where those (and npllama) cannot be imported (CI checks every
    folder in a fresh venv; here the Llama 2 one, the largest tokenizer.json, is enough)."""
    out, _ = exported
    run = subprocess.run([sys.executable, str(TOOL), "check", str(out), "--hide", "--only", "llama2"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "not importable: sentencepiece, google.protobuf, tiktoken, npllama" in run.stdout
    assert "1 of 1 folders pass" in run.stdout


def test_the_checker_refuses_an_environment_that_has_them(tmp_path, capsys):
    assert check_hf_export.main(["check", str(tmp_path)]) == 1
    assert "can be imported here" in capsys.readouterr().err
