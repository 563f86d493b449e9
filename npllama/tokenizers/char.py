"""CharTokenizer: one id per character, ids in sorted character order (nanoGPT's shakespeare_char
prepare.py: chars = sorted(set(text))). No BOS/EOS."""

from __future__ import annotations

import json

from ..errors import NpllamaError


class CharTokenizer:
    """Characters as tokens: id i is the i-th character of `chars` (sorted, distinct)."""

    bos_id = None
    eos_id = None

    def __init__(self, chars: str):
        if not isinstance(chars, str) or not chars:
            raise NpllamaError("CharTokenizer needs a non-empty string of distinct characters, "
                               f"got {chars!r}; build one from text with CharTokenizer.from_text(text)")
        if len(set(chars)) != len(chars):
            repeated = sorted({c for c in chars if chars.count(c) > 1})
            raise NpllamaError(f"CharTokenizer characters must be distinct; repeated: {repeated!r}")
        self.chars = chars
        self._stoi = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        """The vocabulary of `text`: its distinct characters in sorted (code point) order."""
        if not isinstance(text, str) or not text:
            raise NpllamaError("CharTokenizer.from_text needs non-empty text")
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        if bos or eos:
            raise NpllamaError("a CharTokenizer has no BOS/EOS tokens; call encode(text) without bos/eos")
        try:
            return [self._stoi[c] for c in text]
        except KeyError:
            unknown = sorted(set(text) - set(self._stoi))
            raise NpllamaError(
                f"text has {len(unknown)} character(s) outside this tokenizer's vocabulary: "
                f"{''.join(unknown)!r} (codes {[hex(ord(c)) for c in unknown[:10]]}); "
                f"the vocabulary is {self.chars!r}") from None

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < len(self.chars)]
        if bad:
            raise NpllamaError(f"token ids {bad[:10]} are outside [0, {len(self.chars)}) for this CharTokenizer")
        return "".join(self.chars[i] for i in ids)

    def stream_decoder(self) -> "_CharStream":
        return _CharStream(self)

    def to_json(self) -> str:
        return json.dumps({"type": "char", "chars": self.chars})

    def __eq__(self, other):
        return isinstance(other, CharTokenizer) and other.chars == self.chars

    def __repr__(self):
        return f"CharTokenizer(vocab_size={self.vocab_size})"


class _CharStream:
    def __init__(self, tokenizer: CharTokenizer):
        self._tokenizer = tokenizer

    def push(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id])

    def flush(self) -> str:
        return ""
