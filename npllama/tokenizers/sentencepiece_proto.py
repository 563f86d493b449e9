"""sentencepiece's ModelProto (a tokenizer.model file), read and written at the protobuf wire level.

GGUF stores a sentencepiece vocabulary as lists (pieces, scores, types) plus a few flags, not as
a tokenizer.model; building the ModelProto from those lists gives a SentencePieceTokenizer that
encodes as sentencepiece itself does, so no second implementation of its BPE is needed. protobuf
is not a dependency, and only these fields are touched (sentencepiece_model.proto):

    ModelProto      1 pieces (repeated SentencePiece), 2 trainer_spec, 3 normalizer_spec
    SentencePiece   1 piece (string), 2 score (float), 3 type (enum: NORMAL 1, UNKNOWN 2,
                    CONTROL 3, USER_DEFINED 4, UNUSED 5, BYTE 6; the numbers GGUF's
                    tokenizer.ggml.token_type uses too)
    TrainerSpec     3 model_type (UNIGRAM 1, BPE 2), 4 vocab_size, 35 byte_fallback,
                    40..43 unk_id, bos_id, eos_id, pad_id; 45..48 unk_piece, bos_piece,
                    eos_piece, pad_piece
    NormalizerSpec  1 name, 3 add_dummy_prefix, 4 remove_extra_whitespaces, 5 escape_whitespaces
                    (the three flags default to true when absent)

Wire format: each field is a varint key (field number << 3 | wire type) and a value: wire type 0
a varint, 1 eight bytes, 2 a varint length and that many bytes, 5 four bytes.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from ..errors import NpllamaError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
UNIGRAM, BPE = 1, 2


class Piece(NamedTuple):
    piece: str
    score: float
    type: int


class Normalizer(NamedTuple):
    """The NormalizerSpec flags that decide how text is prepared before the pieces are matched."""
    name: str = ""
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True
    escape_whitespaces: bool = True


def _varint(n: int) -> bytes:
    if 0 <= n < 128:
        return _SMALL[n]
    if n < 0:
        n += 1 << 64            # protobuf writes negative int32 as ten-byte two's complement
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


_SMALL = [bytes([n]) for n in range(128)]


def _field(number: int, wire: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire) + payload


def _bytes_field(number: int, data: bytes) -> bytes:
    return _field(number, 2, _varint(len(data)) + data)


def _int_field(number: int, value: int) -> bytes:
    return _field(number, 0, _varint(int(value)))


def build_model_proto(pieces, *, model_type: int = BPE, unk_id: int | None = None, bos_id: int | None = None,
                      eos_id: int | None = None, pad_id: int | None = None, byte_fallback: bool = False,
                      normalizer: Normalizer = Normalizer("identity")) -> bytes:
    """The serialized ModelProto of `pieces` ([Piece] in id order) and these settings; an id that
    is None is written as -1 (sentencepiece's "none")."""
    out = []
    score_key, type_key = _varint(2 << 3 | 5), _varint(3 << 3 | 0)
    for p in pieces:
        body = b"".join((_bytes_field(1, p.piece.encode("utf-8")), score_key, struct.pack("<f", p.score),
                         type_key, _varint(p.type)))
        out.append(_bytes_field(1, body))
    names = {40: unk_id, 41: bos_id, 42: eos_id, 43: pad_id}
    trainer = _int_field(3, model_type) + _int_field(4, len(pieces)) + _int_field(35, bool(byte_fallback))
    for number, token_id in names.items():
        trainer += _int_field(number, -1 if token_id is None else token_id)
        if token_id is not None:            # the piece names sentencepiece looks the ids up by
            trainer += _bytes_field(number + 5, pieces[token_id].piece.encode("utf-8"))
    out.append(_bytes_field(2, trainer))
    norm = (_bytes_field(1, normalizer.name.encode("utf-8")) + _int_field(3, normalizer.add_dummy_prefix)
            + _int_field(4, normalizer.remove_extra_whitespaces) + _int_field(5, normalizer.escape_whitespaces))
    out.append(_bytes_field(3, norm))
    return b"".join(out)


def _fields(data: bytes, what: str):
    """(field number, wire type, value) of each field of a message: an int for wire types 0, 1
    and 5 (the raw bits), bytes for 2."""
    pos, n = 0, len(data)

    def varint():
        nonlocal pos
        value = shift = 0
        while True:
            if pos >= n or shift > 63:
                raise NpllamaError(f"{what}: a varint runs past the end; not a valid sentencepiece model")
            byte = data[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value

    while pos < n:
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            value = varint()
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            if pos + size > n:
                raise NpllamaError(f"{what}: field {number} runs past the end; not a valid sentencepiece model")
            value = int.from_bytes(data[pos:pos + size], "little")
            pos += size
        elif wire == 2:
            size = varint()
            if pos + size > n:
                raise NpllamaError(f"{what}: field {number} runs past the end; not a valid sentencepiece model")
            value = data[pos:pos + size]
            pos += size
        else:
            raise NpllamaError(f"{what}: wire type {wire}; not a valid sentencepiece model")
        yield number, wire, value


def read_normalizer(model_proto: bytes) -> Normalizer:
    """The NormalizerSpec of a serialized ModelProto (absent flags take their defaults)."""
    found = {}
    for number, wire, value in _fields(model_proto, "ModelProto"):
        if number == 3 and wire == 2:
            for sub, sub_wire, sub_value in _fields(value, "NormalizerSpec"):
                if sub == 1 and sub_wire == 2:
                    found["name"] = bytes(sub_value).decode("utf-8", errors="replace")
                elif sub in (3, 4, 5) and sub_wire == 0:
                    found[Normalizer._fields[sub - 2]] = bool(sub_value)
    return Normalizer(**found)


def read_pieces(model_proto: bytes) -> list[Piece]:
    """The pieces of a serialized ModelProto, in id order (absent scores are 0, absent types NORMAL)."""
    pieces = []
    for number, wire, value in _fields(model_proto, "ModelProto"):
        if number == 1 and wire == 2:
            found = {"piece": "", "score": 0.0, "type": NORMAL}
            for sub, sub_wire, sub_value in _fields(value, "SentencePiece"):
                if sub == 1 and sub_wire == 2:
                    found["piece"] = bytes(sub_value).decode("utf-8", errors="replace")
                elif sub == 2 and sub_wire == 5:
                    found["score"] = struct.unpack("<f", sub_value.to_bytes(4, "little"))[0]
                elif sub == 3 and sub_wire == 0:
                    found["type"] = sub_value
            pieces.append(Piece(**found))
    return pieces
