"""The settings of a sentencepiece model that its Python API does not expose, read from the file.

A sentencepiece .model file is a serialized ModelProto (sentencepiece_model.proto). Its pieces,
scores and most piece kinds are available through sentencepiece's own API; what decides how text
is normalized (NormalizerSpec), which algorithm segments it and whether unknown characters fall
back to bytes (TrainerSpec), and which pieces are user-defined are not. Reading them with the
`protobuf` package is what transformers does, and is the dependency an export must not need, so
this module reads the few fields it needs straight from the protobuf wire format:

    message = (key, value)*     key = varint (field_number << 3 | wire_type)
    wire_type 0: varint         1: 8 bytes      2: varint length, then that many bytes      5: 4 bytes

Fields read (numbers from sentencepiece_model.proto; proto2 defaults where a field is absent):
    ModelProto       1 pieces (repeated SentencePiece), 2 trainer_spec, 3 normalizer_spec,
                     5 denormalizer_spec
    SentencePiece    3 type (1 NORMAL default, 2 UNKNOWN, 3 CONTROL, 4 USER_DEFINED, 5 UNUSED, 6 BYTE)
    TrainerSpec      3 model_type (1 UNIGRAM default, 2 BPE, 3 WORD, 4 CHAR),
                     24 treat_whitespace_as_suffix (false), 35 byte_fallback (false)
    NormalizerSpec   1 name, 2 precompiled_charsmap, 3 add_dummy_prefix (true),
                     4 remove_extra_whitespaces (true), 5 escape_whitespaces (true)
"""

from __future__ import annotations

from typing import NamedTuple

from ..errors import NpllamaError

UNIGRAM, BPE, WORD, CHAR = 1, 2, 3, 4
MODEL_TYPE_NAMES = {UNIGRAM: "unigram", BPE: "bpe", WORD: "word", CHAR: "char"}
USER_DEFINED = 4


class SentencePieceSpec(NamedTuple):
    """What a sentencepiece model does to text besides its vocabulary (see the module docstring)."""
    model_type: int
    byte_fallback: bool
    treat_whitespace_as_suffix: bool
    normalizer_name: str
    precompiled_charsmap: bytes
    add_dummy_prefix: bool
    remove_extra_whitespaces: bool
    escape_whitespaces: bool
    denormalizer_charsmap: bytes
    user_defined_ids: tuple[int, ...]


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise NpllamaError("the sentencepiece model is truncated or corrupt (a varint runs past its end)")
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def _fields(data: bytes):
    """(field number, value) of each field of one message: an int for varints, bytes otherwise."""
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, i = _varint(data, i)
        elif wire_type in (1, 5):
            size = 8 if wire_type == 1 else 4
            value, i = data[i:i + size], i + size
        elif wire_type == 2:
            size, i = _varint(data, i)
            value, i = data[i:i + size], i + size
        else:
            raise NpllamaError(f"the sentencepiece model is corrupt (wire type {wire_type} in field {number})")
        if i > len(data):
            raise NpllamaError("the sentencepiece model is truncated or corrupt (a field runs past its end)")
        yield number, value


def _last(message: bytes, defaults: dict) -> dict:
    """{field number: value} for the fields in `defaults`, the last occurrence winning (proto2);
    each must have its default's kind (a varint for an int, length-delimited for bytes)."""
    found = dict(defaults)
    for number, value in _fields(message):
        if number in found:
            if type(value) is not type(defaults[number]):
                raise NpllamaError(f"the sentencepiece model is corrupt (field {number} has the wrong wire type)")
            found[number] = value
    return found


def _text(value) -> str:
    try:
        return value.decode("utf-8")
    except (AttributeError, UnicodeDecodeError):
        raise NpllamaError("the sentencepiece model is corrupt (a string field is not UTF-8)") from None


def read_spec(model_proto: bytes) -> SentencePieceSpec:
    """The SentencePieceSpec of a serialized sentencepiece model (a .model file's bytes)."""
    trainer, normalizer, denormalizer, user_defined = b"", b"", b"", []
    piece_index = 0
    for number, value in _fields(model_proto):
        if number in (1, 2, 3, 5) and not isinstance(value, bytes):
            raise NpllamaError(f"the sentencepiece model is corrupt (field {number} is not a message)")
        if number == 1:
            if _last(value, {3: 1})[3] == USER_DEFINED:
                user_defined.append(piece_index)
            piece_index += 1
        elif number == 2:
            trainer = value
        elif number == 3:
            normalizer = value
        elif number == 5:
            denormalizer = value
    t = _last(trainer, {3: UNIGRAM, 24: 0, 35: 0})
    n = _last(normalizer, {1: b"", 2: b"", 3: 1, 4: 1, 5: 1})
    return SentencePieceSpec(
        model_type=t[3], byte_fallback=bool(t[35]), treat_whitespace_as_suffix=bool(t[24]),
        normalizer_name=_text(n[1]), precompiled_charsmap=bytes(n[2]), add_dummy_prefix=bool(n[3]),
        remove_extra_whitespaces=bool(n[4]), escape_whitespaces=bool(n[5]),
        denormalizer_charsmap=bytes(_last(denormalizer, {2: b""})[2]), user_defined_ids=tuple(user_defined))
