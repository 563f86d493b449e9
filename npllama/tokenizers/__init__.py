"""Tokenizers: text <-> token ids, behind one small API.

Three kinds, all with
    .vocab_size, .bos_id, .eos_id (None when the tokenizer has none)
    .encode(text, bos=False, eos=False) -> list[int]
    .decode(ids) -> str
    .stream_decoder() -> an object whose .push(id) -> str returns the text that id completes
    .to_json() -> str, read back by tokenizer_from_json(text)

CharTokenizer      one id per character, ids in sorted character order (nanoGPT's
                   shakespeare_char prepare.py: chars = sorted(set(text))). No BOS/EOS.
SentencePieceTokenizer
                   a sentencepiece model (Llama 2's tokenizer.model, or one made by
                   train_sentencepiece). Encoding and full decoding are sentencepiece's own;
                   the stream decoder reproduces sentencepiece's decoding rules one id at a
                   time (see _SentencePieceStream) so streamed text equals decode(ids).

HFTokenizer        a Hugging Face tokenizer.json, run in pure Python (tokenizer_json.py).

Files: char.py, sentencepiece.py, tokenizer_json.py (and regex_safety.py, which checks a
tokenizer.json's regexes for unbounded backtracking); this module reads any of them from JSON
or a path. hf_export.py writes each as the tokenizer files of a Hugging Face folder
(tokenizer.json built from a sentencepiece model with spm_proto.py's reading of its settings,
no protobuf). The JSON form embeds a sentencepiece model as base64 so a checkpoint's safetensors metadata
(a str -> str map) can carry its tokenizer.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path

from ..checks import parse_json
from ..errors import MissingFileError, NpllamaError
from .char import CharTokenizer
from .sentencepiece import SentencePieceTokenizer, train_sentencepiece
from .tokenizer_json import from_json_dict, hf_tokenizer, tokenizer_from_folder

__all__ = ["CharTokenizer", "SentencePieceTokenizer", "train_sentencepiece", "tokenizer_from_json",
           "tokenizer_from_file", "tokenizer_from_folder"]


def tokenizer_from_json(text: str):
    """Rebuild a tokenizer from its to_json() text (as stored in checkpoint metadata)."""
    d = parse_json(text, "tokenizer JSON")
    kind = d.get("type") if isinstance(d, dict) else None
    if kind == "char" and isinstance(d.get("chars"), str):
        return CharTokenizer(d["chars"])
    if kind == "sentencepiece" and isinstance(d.get("model_proto_base64"), str):
        try:
            proto = base64.b64decode(d["model_proto_base64"], validate=True)
        except ValueError as e:
            raise NpllamaError(f"tokenizer JSON holds a corrupt base64 sentencepiece model: {e}") from None
        return SentencePieceTokenizer(proto)
    if kind == "hf_tokenizer_json":
        return from_json_dict(d)
    raise NpllamaError('tokenizer JSON must be {"type": "char", "chars": ...}, '
                       '{"type": "sentencepiece", "model_proto_base64": ...} or '
                       '{"type": "hf_tokenizer_json", "tokenizer_json": ...}; got '
                       f"{(text[:80] + '...') if len(text) > 80 else text!r}")


def tokenizer_from_file(path):
    """The tokenizer stored at path: a sentencepiece .model file, a Hugging Face tokenizer.json
    (its tokenizer_config.json beside it is read too), or a folder holding either."""
    path = Path(os.fspath(path))
    if path.is_dir():
        if (path / "tokenizer.model").is_file():
            return SentencePieceTokenizer.from_file(path / "tokenizer.model")
        tokenizer, problem = tokenizer_from_folder(path)
        if tokenizer is None:
            raise NpllamaError(problem or f"{path} holds no tokenizer.model or tokenizer.json")
        return tokenizer
    if not path.is_file():
        raise MissingFileError(f"tokenizer {str(path)!r} not found; pass a sentencepiece .model file, a "
                                "Hugging Face tokenizer.json, or a folder holding one")
    if path.suffix == ".json":
        config = path.parent / "tokenizer_config.json"
        return hf_tokenizer(path.read_text(encoding="utf-8"),
                            config.read_text(encoding="utf-8") if config.is_file() else None)
    return SentencePieceTokenizer.from_file(path)
