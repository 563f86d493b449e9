"""Tokenizers: round trips, pinned Llama 2 ids, stream decoding, JSON round trips.

The pinned ids were read once from sentencepiece itself on Llama 2's tokenizer.model (the first
three prompts are llama2.c test.c's); they are hard-coded so a change in our wrapping shows.
"""

import functools

import numpy as np
import pytest
from hypothesis import given, strategies as st

from npllama.tokenizers import (CharTokenizer, SentencePieceTokenizer, tokenizer_from_json,
                                train_sentencepiece)
from .conftest import data_file

LLAMA2_PINNED = {
    "Hello world": [15043, 3186],
    "Hello, world!": [15043, 29892, 3186, 29991],
    "I believe the meaning of life is": [306, 4658, 278, 6593, 310, 2834, 338],
    "Simply put, the theory of relativity states that ":
        [3439, 17632, 1925, 29892, 278, 6368, 310, 14215, 537, 5922, 393, 29871],
    "A brief message congratulating the team on the launch:\n\n        Hi everyone,\n\n        I just ":
        [319, 11473, 2643, 378, 629, 271, 18099, 278, 3815, 373, 278, 6826, 29901, 13, 13, 4706, 6324,
         14332, 29892, 13, 13, 4706, 306, 925, 29871],
    # leading space: the dummy prefix plus the text's own space -> '▁' then '▁leading'
    " leading space": [29871, 8236, 2913],
    "  two spaces": [259, 1023, 8162],
    # byte fallback: the llama is not in the vocabulary -> <0xF0> <0x9F> <0xA6> <0x99>
    "naïve café – 東京 🦙": [1055, 30085, 345, 274, 28059, 785, 29871, 30591, 30675, 29871, 243, 162, 169, 156],
    "": [],
}

MULTIBYTE_TEXTS = ["😀 emoji 🦙🦙 and 👩‍👩‍👧 family", "日本語のテキスト、中文文本，한국어 텍스트",
                   "naïve café – Ωμέγα ∑ ≠ ∞", "\n\tmixed 🎉 ünïcödé\n 末尾 "]


@functools.lru_cache(maxsize=None)
def _llama2_tokenizer_from(path):
    return SentencePieceTokenizer.from_file(path)


@pytest.fixture
def llama2():
    return _llama2_tokenizer_from(data_file("llama2-tokenizer.model"))


@functools.lru_cache(maxsize=None)
def _trained():
    text = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"
            "First Citizen:\nYou are all resolved rather to die than to famish?\n") * 20
    return train_sentencepiece(text, vocab_size=300)


# ---------------------------------------------------------------- characters

def test_char_tokenizer_sorted_vocabulary_and_round_trip():
    text = "hello world\nHELLO!"
    tok = CharTokenizer.from_text(text)
    assert tok.chars == "".join(sorted(set(text)))
    assert tok.vocab_size == len(set(text))
    assert tok.bos_id is None and tok.eos_id is None
    ids = tok.encode(text)
    assert ids[:2] == [tok.chars.index("h"), tok.chars.index("e")]
    assert tok.decode(ids) == text
    assert tok.decode(np.array(ids, dtype=np.int64)) == text


def test_char_tokenizer_errors_name_the_problem():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ValueError, match=r"'xz'"):
        tok.encode("abxcz")
    with pytest.raises(ValueError, match="outside"):
        tok.decode([0, 3])
    with pytest.raises(ValueError, match="no BOS"):
        tok.encode("a", bos=True)
    with pytest.raises(ValueError, match="distinct"):
        CharTokenizer("aba")


def test_char_stream_and_json():
    tok = CharTokenizer.from_text("ab\ncé😀")
    stream = tok.stream_decoder()
    assert "".join(stream.push(i) for i in tok.encode("é😀\nab")) == "é😀\nab"
    back = tokenizer_from_json(tok.to_json())
    assert isinstance(back, CharTokenizer) and back == tok


# ---------------------------------------------------------------- Llama 2's sentencepiece model

def test_llama2_specials(llama2):
    assert llama2.vocab_size == 32000
    assert (llama2.bos_id, llama2.eos_id, llama2.unk_id) == (1, 2, 0)


@pytest.mark.parametrize("text", list(LLAMA2_PINNED))
def test_llama2_pinned_ids(llama2, text):
    ids = LLAMA2_PINNED[text]
    assert llama2.encode(text) == ids
    assert llama2.encode(text, bos=True) == [1] + ids
    assert llama2.encode(text, bos=True, eos=True) == [1] + ids + [2]
    # decode drops BOS/EOS; the dummy-prefix space is removed, the text's own spaces stay
    assert llama2.decode([1] + ids + [2]) == text


def test_llama2_leading_space_rules(llama2):
    hello, world = LLAMA2_PINNED["Hello world"]
    assert llama2.decode([world]) == "world"           # first piece: the dummy-prefix '▁' goes
    assert llama2.decode([hello, world]) == "Hello world"
    assert llama2.decode([1, world]) == "world"        # BOS does not count as the first piece
    assert llama2.decode([29871, world]) == " world"   # a lone '▁' first, then '▁world'
    assert llama2.decode([13, world]) == "\n world"    # a byte piece counts as the first piece


def test_llama2_stream_decoding_is_full_decoding(llama2):
    for text in MULTIBYTE_TEXTS + list(LLAMA2_PINNED):
        ids = llama2.encode(text, bos=True)
        stream = llama2.stream_decoder()
        pieces = [stream.push(i) for i in ids] + [stream.flush()]
        assert "".join(pieces) == llama2.decode(ids) == text
        for piece in pieces:  # never half a character: each piece is whole UTF-8 text
            assert "\ufffd" not in piece and "\udcff" not in piece
            piece.encode("utf-8")


def test_llama2_stream_holds_back_partial_characters(llama2):
    ids = llama2.encode("🦙!")
    assert [llama2.id_to_piece(i) for i in ids[1:5]] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]
    stream = llama2.stream_decoder()
    out = [stream.push(i) for i in ids]
    assert out[:4] == ["", "", "", ""] and out[4] == "🦙"


# Byte pieces (3..258) and a few text pieces, including the lone '▁' (29871), control ids and <unk>.
_llama_ids = st.lists(st.one_of(st.integers(3, 258), st.sampled_from([0, 1, 2, 13, 29871, 3186, 30919, 259])),
                      max_size=12)


@given(ids=_llama_ids)
def test_llama2_stream_equals_decode_on_any_ids(ids):
    """Any id sequence, including invalid UTF-8 from byte pieces: the stream matches sentencepiece."""
    tok = _llama2_tokenizer_from(data_file("llama2-tokenizer.model"))
    stream = tok.stream_decoder()
    streamed = "".join(stream.push(i) for i in ids) + stream.flush()
    assert streamed == tok.decode(ids)


def test_llama2_errors(llama2, tmp_path):
    with pytest.raises(ValueError, match="outside"):
        llama2.decode([32000])
    with pytest.raises(ValueError, match="outside"):
        llama2.stream_decoder().push(-1)
    with pytest.raises(FileNotFoundError, match="nope.model"):
        SentencePieceTokenizer.from_file(tmp_path / "nope.model")
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"this is not a protobuf")
    with pytest.raises(ValueError, match="sentencepiece"):
        SentencePieceTokenizer.from_file(bad)


def test_llama2_json_round_trip(llama2):
    back = tokenizer_from_json(llama2.to_json())
    assert isinstance(back, SentencePieceTokenizer) and back == llama2
    text = MULTIBYTE_TEXTS[0]
    assert back.encode(text, bos=True) == llama2.encode(text, bos=True)


# ---------------------------------------------------------------- trained sentencepiece models

def test_train_sentencepiece_is_deterministic_and_sized():
    text = "the quick brown fox jumps over the lazy dog\n" * 30 + "pack my box with five dozen liquor jugs\n" * 30
    a = train_sentencepiece(text, vocab_size=320, seed=0)
    b = train_sentencepiece(text, vocab_size=320, seed=0)
    assert a.model_proto == b.model_proto
    assert a.vocab_size == 320 and (a.bos_id, a.eos_id, a.unk_id) == (1, 2, 0)
    ids = a.encode("the quick brown fox")
    assert len(ids) < len("the quick brown fox") / 2  # merges learned: fewer pieces than characters


@given(text=st.text(st.characters(codec="utf-8", exclude_categories=["Cs"], exclude_characters="\u2581"),
                    max_size=40))
def test_trained_round_trip_any_text(text):
    """Byte fallback and identity normalization: any text, unseen characters included, round-trips.

    Except U+2581 '▁' itself, which is sentencepiece's own space symbol and decodes as ' '
    (so it does in Llama 2's tokenizer).
    """
    tok = _trained()
    ids = tok.encode(text, bos=True, eos=True)
    assert 0 <= min(ids) and max(ids) < tok.vocab_size
    assert tok.decode(ids) == text
    stream = tok.stream_decoder()
    assert "".join(stream.push(i) for i in ids) + stream.flush() == text


def test_train_sentencepiece_errors():
    with pytest.raises(ValueError, match="too small"):
        train_sentencepiece("abcdefg\n" * 10, vocab_size=100)
    with pytest.raises(ValueError, match="non-empty"):
        train_sentencepiece("", vocab_size=300)
    with pytest.raises(ValueError, match="vocab_size"):
        train_sentencepiece("abc", vocab_size=0)


def test_tokenizer_from_json_rejects_garbage():
    for bad in ["not json", '{"type": "bpe"}', '{"type": "sentencepiece", "model_proto_base64": "!!"}', "[1, 2]"]:
        with pytest.raises(ValueError, match="tokenizer JSON|sentencepiece"):
            tokenizer_from_json(bad)
    trained = _trained()
    assert tokenizer_from_json(trained.to_json()) == trained
