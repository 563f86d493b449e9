"""SentencePieceTokenizer: a sentencepiece model (Llama 2's tokenizer.model, or one made by
train_sentencepiece). Encoding and full decoding are sentencepiece's own; the stream decoder
reproduces sentencepiece's decoding rules one id at a time (see _SentencePieceStream) so
streamed text equals decode(ids). Its JSON form embeds the model as base64, so a checkpoint's
safetensors metadata (a str -> str map) can carry it."""

from __future__ import annotations

import base64
import codecs
import io
import json
import os
from pathlib import Path

import sentencepiece as spm

from ..checks import check_int
from ..errors import MissingFileError, NpllamaError
from .tokenizer_json import with_bos_eos


class SentencePieceTokenizer:
    """A sentencepiece model, from a .model file (from_file) or its serialized bytes.

    encode: sentencepiece's own (for Llama 2: a dummy-prefix space, '▁' for spaces, and
    byte fallback <0x..> pieces for characters outside the vocabulary); bos/eos prepend
    bos_id / append eos_id. decode: sentencepiece's own (control ids such as BOS/EOS print
    nothing, the first piece loses its leading '▁', byte pieces are joined and read as UTF-8).
    """

    def __init__(self, model_proto: bytes):
        if not isinstance(model_proto, (bytes, bytearray)) or not model_proto:
            raise NpllamaError("SentencePieceTokenizer needs the bytes of a sentencepiece model (a tokenizer.model "
                               "file's content); use SentencePieceTokenizer.from_file(path) for a path")
        self.model_proto = bytes(model_proto)
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(self.model_proto)
        except (RuntimeError, OSError) as e:
            raise NpllamaError(f"not a valid sentencepiece model ({e}); expected the bytes of a "
                               "tokenizer.model file such as Llama 2's") from None
        sp = self._sp
        self.vocab_size = sp.vocab_size()
        self.bos_id = sp.bos_id() if sp.bos_id() >= 0 else None
        self.eos_id = sp.eos_id() if sp.eos_id() >= 0 else None
        self.unk_id = sp.unk_id() if sp.unk_id() >= 0 else None
        self.pad_id = sp.pad_id() if sp.pad_id() >= 0 else None
        self._surfaces = None  # built on the first stream_decoder() call

    @classmethod
    def from_file(cls, path) -> "SentencePieceTokenizer":
        path = Path(os.fspath(path))
        if not path.is_file():
            raise MissingFileError(f"sentencepiece model {str(path)!r} not found; pass the path of a "
                                    "tokenizer.model file (for Llama 2: the tokenizer.model beside its weights)")
        return cls(path.read_bytes())

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise NpllamaError(f"encode needs a str, got {type(text).__name__}")
        return with_bos_eos(self._sp.encode(text), self, bos, eos, "this sentencepiece model")

    def _check_ids(self, ids) -> list[int]:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise NpllamaError(f"token ids {bad[:10]} are outside [0, {self.vocab_size}) for this sentencepiece model")
        return ids

    def decode(self, ids) -> str:
        return self._sp.decode(self._check_ids(ids))

    def id_to_piece(self, token_id: int) -> str:
        return self._sp.id_to_piece(self._check_ids([token_id])[0])

    def stream_decoder(self) -> "_SentencePieceStream":
        if self._surfaces is None:
            self._surfaces = _piece_surfaces(self._sp)
        return _SentencePieceStream(self)

    def to_json(self) -> str:
        return json.dumps({"type": "sentencepiece",
                           "model_proto_base64": base64.b64encode(self.model_proto).decode("ascii")})

    def __eq__(self, other):
        return isinstance(other, SentencePieceTokenizer) and other.model_proto == self.model_proto

    def __repr__(self):
        return f"SentencePieceTokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id})"


# sentencepiece_processor.cc, Decode: kinds of piece and what each prints.
_CONTROL, _UNKNOWN, _BYTE, _TEXT = range(4)


def _piece_surfaces(sp: spm.SentencePieceProcessor) -> list[tuple[int, bytes, bytes]]:
    """Per id: (kind, surface bytes, surface bytes when it is the first piece of the text).

    The second form applies sentencepiece's "bos whitespace" rule: the first non-control piece
    loses one leading '▁' (the dummy prefix that encode added), when the model adds one (ours and
    Llama 2's both do).
    """
    space = "\u2581"
    # The rule applies only when the model adds the dummy prefix (or strips extra spaces); find
    # out from sentencepiece itself: does a lone '▁word' piece decode without its space?
    strip_first = any(sp.decode([i]) == sp.id_to_piece(i)[1:].replace(space, " ")
                      for i in range(sp.vocab_size())
                      if sp.id_to_piece(i).startswith(space) and len(sp.id_to_piece(i)) > 1
                      and not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i)))
    unk_surface = " \u2047 ".encode()  # sentencepiece's default unk_surface, " ⁇ "
    surfaces = []
    for i in range(sp.vocab_size()):
        if sp.is_control(i):
            surfaces.append((_CONTROL, b"", b""))
        elif sp.is_unknown(i):
            surfaces.append((_UNKNOWN, unk_surface, unk_surface))
        elif sp.is_byte(i):
            byte = bytes([int(sp.id_to_piece(i)[3:5], 16)])  # "<0xE2>" -> b"\xe2"
            surfaces.append((_BYTE, byte, byte))
        else:
            piece = sp.id_to_piece(i)
            first = piece[1:] if strip_first and piece.startswith(space) else piece
            surfaces.append((_TEXT, piece.replace(space, " ").encode(), first.replace(space, " ").encode()))
    return surfaces


def _replace_per_byte(error: UnicodeDecodeError):
    # sentencepiece prints one U+FFFD for every byte that does not start a valid UTF-8
    # character; Python's "replace" prints one per maximal invalid run, so count bytes here.
    return "\ufffd" * (error.end - error.start), error.end


codecs.register_error("npllama_replace_per_byte", _replace_per_byte)


class _SentencePieceStream:
    """Incremental sentencepiece decoding: push(id) returns the newly completed text.

    Rules (sentencepiece_processor.cc, Decode):
    - control ids (<s>, </s>) print nothing and leave the "start of text" state alone, but
      like any non-byte piece they end a run of byte pieces;
    - the first other piece drops one leading '▁'; every '▁' prints as a space;
    - a run of byte pieces <0xNN> is read as UTF-8; a byte that cannot start a valid
      character prints U+FFFD. Bytes of a character not yet complete are held back until
      the piece that completes it arrives (or a non-byte piece or flush() ends the run),
      so a multi-byte character is never split between two pushes.
    Concatenating every push() and a final flush() equals decode(ids).
    """

    def __init__(self, tokenizer: SentencePieceTokenizer):
        self._tokenizer = tokenizer
        self._surfaces = tokenizer._surfaces
        self._at_start = True
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="npllama_replace_per_byte")

    def push(self, token_id: int) -> str:
        token_id = self._tokenizer._check_ids([token_id])[0]
        kind, surface, first_surface = self._surfaces[token_id]
        if kind == _CONTROL:
            return self.flush()  # prints nothing itself, but ends a byte run
        if self._at_start:
            self._at_start = False
            surface = first_surface
        if kind == _BYTE:
            return self._utf8.decode(surface)
        # A non-byte piece ends any byte run: incomplete bytes become U+FFFD, as in sentencepiece.
        return self.flush() + surface.decode("utf-8")

    def flush(self) -> str:
        """Text held back for an unfinished byte sequence (as U+FFFD per byte); call at the end."""
        return self._utf8.decode(b"", final=True)


def train_sentencepiece(text: str, vocab_size: int, seed: int = 0) -> SentencePieceTokenizer:
    """A BPE sentencepiece model trained on `text` in memory (no files written).

    Settings, chosen so that every text round-trips through encode/decode:
      model_type=bpe, byte_fallback=True (no character is unknown: those outside the vocabulary
      become <0xNN> byte pieces, as in Llama 2), normalization_rule_name=identity and
      remove_extra_whitespaces=False (text is not rewritten), the dummy prefix on,
      ids unk=0, bos=1, eos=2 (Llama 2's), character_coverage=1.0 (every character of `text`
      gets a piece), one line of `text` per training sentence, one thread.
    BPE merges are deterministic given the text; `seed` seeds sentencepiece's generator,
    which these settings (no sentence sampling, no shuffling) do not consume.
    """
    if not isinstance(text, str) or not text.strip():
        raise NpllamaError("train_sentencepiece needs non-empty text")
    check_int("vocab_size", vocab_size, 1)
    lines = [line for line in text.split("\n") if line]
    n_chars = len(set("".join(lines)))
    minimum = 3 + 256 + n_chars + 1  # specials, bytes, every character, the '▁'
    if vocab_size < minimum:
        raise NpllamaError(
            f"vocab_size={vocab_size} is too small for this text: it needs at least {minimum} "
            f"(3 special tokens + 256 byte-fallback tokens + {n_chars} distinct characters + '▁'); "
            "raise vocab_size or use a CharTokenizer")
    longest = max(len(line.encode()) for line in lines)
    model = io.BytesIO()
    spm.set_random_generator_seed(seed)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=model, model_type="bpe",
            vocab_size=vocab_size, byte_fallback=True, character_coverage=1.0,
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            add_dummy_prefix=True, allow_whitespace_only_pieces=True, split_digits=False,
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            input_sentence_size=0, shuffle_input_sentence=False,
            max_sentence_length=max(4192, longest + 1), num_threads=1, minloglevel=2)
    except RuntimeError as e:
        raise NpllamaError(f"sentencepiece could not train a {vocab_size}-token model on this text: {e}; "
                           "a smaller vocab_size or more text usually fixes it") from None
    return SentencePieceTokenizer(model.getvalue())
