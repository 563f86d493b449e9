"""tokenizer.json reader: a hand-worked small file, transformers 5's own files, errors, fallback.

The small file (SMALL) needs nothing installed; its expected ids are worked out by hand below.
The comparisons need transformers and the two sentencepiece models in NPLLAMA_DATA_DIR; they
build tokenizer.json files the way transformers 5 does -- LlamaTokenizer(vocab, merges) with the
vocabulary read from the .model file and transformers' own generate_merges, which is what
LlamaTokenizer.from_pretrained(folder with tokenizer.model) does through SentencePieceExtractor
(that path also needs protobuf; with protobuf installed both write the same tokenizer.json, byte
for byte) -- then check ids and text against the transformers tokenizer and sentencepiece.
"""

import functools
import json
import sys

import pytest
from hypothesis import given, strategies as st

from npllama.tokenizers.tokenizer_json import (HFTokenizer, LibraryHFTokenizer, TokenizerJSONError,
                                    UnsupportedTokenizerError, hf_tokenizer, tokenizer_from_folder)
from npllama.tokenizers import SentencePieceTokenizer, tokenizer_from_json
from .conftest import data_file

# ---------------------------------------------------------------- a small file, by hand

BYTE_ID = {b: 3 + b for b in range(256)}  # <0x00> .. <0xFF> are ids 3 .. 258, as in Llama 2
SMALL_VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": i for b, i in BYTE_ID.items()},
               "▁": 259, "h": 260, "e": 261, "l": 262, "o": 263, "▁h": 264, "el": 265, "ll": 266, "▁he": 267}
# Rank order matters: "e l" (rank 1) beats "l l" (rank 2) and "▁h e" (rank 3).
SMALL_MERGES = ["▁ h", "e l", "l l", "▁h e"]


def small_json(**changes) -> dict:
    """The legacy Llama 2 layout, with a non-special added token "[x]" (id 268, after the vocabulary)."""
    d = {
        "version": "1.0",
        "added_tokens": [
            *[{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
               "special": True} for i, c in enumerate(["<unk>", "<s>", "</s>"])],
            {"id": 268, "content": "[x]", "single_word": False, "lstrip": True, "rstrip": False, "normalized": False,
             "special": False},
        ],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": None,
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                      {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [], "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True,
                  "vocab": dict(SMALL_VOCAB), "merges": list(SMALL_MERGES)},
    }
    d.update(changes)
    return d


SMALL_CONFIG = {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}

# (text, ids without BOS), worked by hand. "hello" -> "▁hello" -> ▁ h e l l o; rank 0 "▁ h" ->
# ▁h e l l o; the pairs left are (▁h e) rank 3, (e l) 1, (l l) 2: "e l" goes first -> ▁h el l o,
# and no pair of those has a merge.
SMALL_CASES = [
    ("hello", [264, 265, 262, 263]),
    ("hll", [264, 266]),                                   # ▁ h l l -> ▁h l l -> ▁h ll
    ("he", [267]),                                         # ▁h e -> ▁he
    ("hello hll", [264, 265, 262, 263, 264, 266]),         # the space is '▁': two words' worth
    (" he", [259, 267]),                                   # Prepend then Replace: ▁▁he
    ("é", [259, BYTE_ID[0xC3], BYTE_ID[0xA9]]),            # not in the vocabulary: its UTF-8 bytes
    ("h\nh", [264, BYTE_ID[0x0A], 260]),
    ("<s>he</s>", [1, 267, 2]),                            # literal control tokens are the control ids
    ("he [x]", [267, 268]),                                # lstrip: "[x]" takes the space before it
    ("", []),
]


@functools.lru_cache(maxsize=None)
def _small() -> HFTokenizer:
    return HFTokenizer(json.dumps(small_json()), SMALL_CONFIG)


def test_small_ids_by_hand():
    tok = _small()
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos) == (269, 1, 2, True, False)
    for text, ids in SMALL_CASES:
        assert tok.encode(text) == ids, text
        assert tok.encode(text, bos=True, eos=True) == [1] + ids + [2], text


def test_small_decode_by_hand():
    tok = _small()
    assert tok.decode([1, 264, 265, 262, 263, 2]) == "hello"    # control ids print nothing; one leading space goes
    assert tok.decode([259, 267]) == " he"
    assert tok.decode([BYTE_ID[0xC3], BYTE_ID[0xA9]]) == "é"
    assert tok.decode([BYTE_ID[0xC3]]) == "\ufffd"                # an unfinished byte run
    assert tok.decode([BYTE_ID[0xC3], 260, BYTE_ID[0xA9]]) == "\ufffdh\ufffd"
    # The library leaves special ids out before decoding, so a byte run continues across them;
    # and a run that is not valid UTF-8 as a whole prints U+FFFD for every byte.
    assert tok.decode([BYTE_ID[0xC3], 2, BYTE_ID[0xA9]]) == "é"
    assert tok.decode([BYTE_ID[0x41], BYTE_ID[0xC3]]) == "\ufffd\ufffd"
    assert tok.decode([0]) == ""                                  # <unk> is special: left out
    assert tok.decode([267, 268]) == "he[x]"                      # a non-special added token prints


def test_small_stream_waits_for_whole_byte_runs():
    tok = _small()
    stream = tok.stream_decoder()
    out = [stream.push(i) for i in [1, 264, BYTE_ID[0xC3], BYTE_ID[0xA9], 2, 260]] + [stream.flush()]
    assert out == ["", "h", "", "", "", "éh", ""]
    assert "".join(out) == tok.decode([1, 264, BYTE_ID[0xC3], BYTE_ID[0xA9], 2, 260])


_small_ids = st.lists(st.one_of(st.integers(0, 268), st.sampled_from([BYTE_ID[0xC3], BYTE_ID[0xA9], 259, 264])),
                      max_size=12)
# '▁' decodes as ' ', and '<', '[' could spell an added token; everything else round-trips.
_text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"], exclude_characters="\u2581<["), max_size=40)


@given(ids=_small_ids)
def test_small_stream_equals_decode(ids):
    tok = _small()
    stream = tok.stream_decoder()
    assert "".join(stream.push(i) for i in ids) + stream.flush() == tok.decode(ids)


@given(text=_text)
def test_small_round_trip(text):
    tok = _small()
    ids = tok.encode(text, bos=True, eos=True)
    assert tok.decode(ids) == text
    stream = tok.stream_decoder()
    assert "".join(stream.push(i) for i in ids) + stream.flush() == text


@given(text=st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40), ids=_small_ids)
def test_small_equals_the_tokenizers_library(text, ids):
    """Any text, '▁' and added tokens included, against Hugging Face's own implementation."""
    tokenizers = pytest.importorskip("tokenizers", reason="the `tokenizers` package is not installed")
    lib = tokenizers.Tokenizer.from_str(json.dumps(small_json()))
    tok = _small()
    assert tok.encode(text) == lib.encode(text, add_special_tokens=False).ids
    assert tok.encode(text, bos=True) == lib.encode(text).ids
    assert tok.decode(ids) == lib.decode(ids, skip_special_tokens=True)


def test_small_variants_equal_the_tokenizers_library():
    """Merges as pairs, Metaspace pre-tokenizers (each scheme, split or not), normalized and
    rstrip added tokens, regex normalizers, a Metaspace decoder, no unk with and without fuse."""
    tokenizers = pytest.importorskip("tokenizers", reason="the `tokenizers` package is not installed")
    def metaspace(scheme, split):
        return {"type": "Metaspace", "replacement": "▁", "prepend_scheme": scheme, "split": split}
    strip_ends = {"type": "Replace", "pattern": {"Regex": "\\A +| +\\z"}, "content": ""}
    collapse = {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "}
    variants = [
        dict(model={**small_json()["model"], "merges": [m.split(" ") for m in SMALL_MERGES]}),
        *[dict(normalizer=None, pre_tokenizer=metaspace(scheme, split))
          for scheme in ("always", "first", "never") for split in (False, True)],
        dict(normalizer={"type": "Sequence", "normalizers": [strip_ends, collapse]},
             pre_tokenizer=metaspace("first", False)),
        dict(normalizer={"type": "Strip", "strip_left": True, "strip_right": False},
             pre_tokenizer=metaspace("first", True)),
        dict(added_tokens=[{"id": 268, "content": "l▁", "single_word": False, "lstrip": False, "rstrip": True,
                            "normalized": True, "special": False}]),
        dict(decoder={"type": "Sequence", "decoders": [{"type": "ByteFallback"}, metaspace("always", True)]}),
        dict(model={**small_json()["model"], "byte_fallback": False, "fuse_unk": False}),
        dict(model={**small_json()["model"], "byte_fallback": False, "unk_token": None}),
        dict(model={**small_json()["model"], "ignore_merges": True}, normalizer=None,
             pre_tokenizer=metaspace("always", True)),
    ]
    texts = ["hello hll", "  he  llo ", " é\n hé", "<s>he</s>he", "he [x] l  hel▁lo", "", "   ", "\x00😀 ll",
             "lél"]
    for changes in variants:
        d = small_json(**changes)
        tok, lib = HFTokenizer(json.dumps(d)), tokenizers.Tokenizer.from_str(json.dumps(d))
        for text in texts:
            ids = lib.encode(text, add_special_tokens=False).ids
            assert tok.encode(text) == ids, (changes, text)
            more = ids + [BYTE_ID[0xE2], 1, 264]
            assert tok.decode(more) == lib.decode(more, skip_special_tokens=True), (changes, text)
            stream = tok.stream_decoder()
            assert "".join(stream.push(i) for i in ids) + stream.flush() == tok.decode(ids), (changes, text)


def test_unknown_characters_by_hand():
    no_bytes = small_json(model={**small_json()["model"], "byte_fallback": False})
    tok = HFTokenizer(json.dumps(no_bytes))
    assert tok.encode("héé😀l") == [264, 0, 262]             # fuse_unk: one <unk> for the run
    no_bytes["model"]["fuse_unk"] = False
    assert HFTokenizer(json.dumps(no_bytes)).encode("héé😀l") == [264, 0, 0, 0, 262]
    no_bytes["model"]["unk_token"] = None                     # no <unk> either: the character is dropped,
    assert HFTokenizer(json.dumps(no_bytes)).encode("lél") == [259, 266]  # and l, l meet: ▁ ll


def test_json_round_trip_and_files():
    tok = _small()
    back = tokenizer_from_json(tok.to_json())
    assert isinstance(back, HFTokenizer) and back == tok
    assert back.encode("hello [x]", bos=True) == tok.encode("hello [x]", bos=True)
    assert json.loads(tok.to_json())["type"] == "hf_tokenizer_json"
    files = tok.hf_files()
    assert json.loads(files["tokenizer.json"]) == small_json()
    assert json.loads(files["tokenizer_config.json"]) == SMALL_CONFIG
    assert HFTokenizer(json.dumps(small_json())) != tok      # no config: not the same tokenizer


def test_folder_and_loader_function(tmp_path):
    assert tokenizer_from_folder(tmp_path) == (None, None)   # no tokenizer.json: nothing to say
    (tmp_path / "tokenizer.json").write_text(json.dumps(small_json()), encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(SMALL_CONFIG), encoding="utf-8")
    tok, warning = tokenizer_from_folder(tmp_path)
    assert warning is None and tok == _small() and HFTokenizer.from_folder(tmp_path) == tok
    (tmp_path / "tokenizer.json").write_text('{"model": ', encoding="utf-8")
    tok, warning = tokenizer_from_folder(tmp_path)
    assert tok is None and "not valid JSON" in warning and "--tokenizer" in warning


def test_bos_eos_settings():
    d = json.dumps(small_json())
    # No config: BOS from the post-processor template, no EOS known.
    tok = HFTokenizer(d)
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos) == (1, None, True, False)
    with pytest.raises(ValueError, match="no EOS"):
        tok.encode("he", eos=True)
    # Explicit flags in the config replace the template (transformers 5's update_post_processor).
    tok = HFTokenizer(d, {"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>",
                          "add_bos_token": False, "add_eos_token": True})
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos) == (1, 2, False, True)
    tok = HFTokenizer(json.dumps(small_json(post_processor=None)), {"bos_token": None})
    assert (tok.bos_id, tok.add_bos) == (None, False)
    with pytest.raises(ValueError, match="no BOS"):
        tok.encode("he", bos=True)


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("make, match", [
    (lambda: "not json", "not valid JSON"),
    (lambda: "[1, 2]", "JSON object"),
    (lambda: json.dumps({"version": "1.0"}), "no 'model'"),
    (lambda: json.dumps(small_json(model={**small_json()["model"], "merges": ["▁ h", "q h"]})), "merge 1 .*'q'"),
    (lambda: json.dumps(small_json(model={**small_json()["model"], "merges": ["h o"]})), "'ho'"),
    (lambda: json.dumps(small_json(model={**small_json()["model"], "merges": ["▁ h e"]})), "exactly two"),
    (lambda: json.dumps(small_json(model={**small_json()["model"], "merges": [7]})), "merge 0"),
    (lambda: json.dumps(small_json(model={**small_json()["model"], "vocab": {"a": 0, "b": 0}})), "id 0"),
    (lambda: json.dumps(small_json(model={**small_json()["model"], "vocab": {"a": -1}})), "non-negative"),
    (lambda: json.dumps(small_json(model={**small_json()["model"], "vocab": []})), "model.vocab"),
    (lambda: json.dumps(small_json(added_tokens={"a": 1})), "added_tokens"),
    (lambda: json.dumps(small_json(normalizer={"type": "Replace", "pattern": {"String": " "}})), "content"),
    (lambda: json.dumps(small_json(post_processor={"type": "TemplateProcessing", "special_tokens": {},
                                                   "single": [{"SpecialToken": {"id": "<x>"}}]})), "<x>"),
])
def test_malformed_files_raise_value_errors(make, match):
    with pytest.raises(TokenizerJSONError, match=match):
        HFTokenizer(make())


@pytest.mark.parametrize("changes, match", [
    (dict(model={"type": "WordPiece", "vocab": {"a": 0}, "unk_token": "a"}), "model type 'WordPiece'"),
    (dict(normalizer={"type": "NFKC"}), "normalizer 'NFKC'"),
    (dict(normalizer={"type": "Replace", "pattern": {"Regex": "\\d+"}, "content": ""}), "escape \\\\d"),
    (dict(normalizer={"type": "Replace", "pattern": {"Regex": " *"}, "content": ""}), "empty string"),
    (dict(pre_tokenizer={"type": "ByteLevel", "add_prefix_space": False}), "pre_tokenizer 'ByteLevel'"),
    (dict(decoder={"type": "ByteLevel"}), "decoder 'ByteLevel'"),
    (dict(decoder=None), "missing decoder"),
    (dict(decoder={"type": "Sequence", "decoders": [{"type": "Fuse"}, {"type": "ByteFallback"}]}), "after Fuse"),
    (dict(model={**small_json()["model"], "dropout": 0.1}), "dropout"),
    (dict(post_processor={"type": "BertProcessing", "sep": ["</s>", 2], "cls": ["<s>", 1]}), "BertProcessing"),
    (dict(added_tokens=[{"id": 268, "content": "[x]", "single_word": True, "special": False}]), "single_word"),
])
def test_unsupported_pieces_are_named(changes, match):
    with pytest.raises(UnsupportedTokenizerError, match=match) as info:
        HFTokenizer(json.dumps(small_json(**changes)))
    assert "pip install tokenizers" in str(info.value)


def test_decode_and_encode_errors():
    tok = _small()
    for bad in ([269], [-1], ["x"]):
        with pytest.raises(ValueError, match="token id"):
            tok.decode(bad)
        with pytest.raises(ValueError, match="token id"):
            tok.stream_decoder().push(bad[0])
    gappy = HFTokenizer(json.dumps(small_json(model={**small_json()["model"], "vocab": {**SMALL_VOCAB, "x": 300}})))
    with pytest.raises(ValueError, match="gaps"):
        gappy.decode([280])
    with pytest.raises(ValueError, match="surrogate"):
        tok.encode("a\ud800")
    with pytest.raises(ValueError, match="str"):
        tok.encode(b"he")
    with pytest.raises(TokenizerJSONError, match="not a token"):
        HFTokenizer(json.dumps(small_json()), {"bos_token": "<bos>"})
    with pytest.raises(TokenizerJSONError, match="adds ids"):
        HFTokenizer(json.dumps(small_json()), {"bos_token": "</s>"})   # the template puts <s> first
    with pytest.raises(ValueError, match="hf_tokenizer_json"):
        tokenizer_from_json('{"type": "hf_tokenizer_json"}')


# ---------------------------------------------------------------- the `tokenizers` fallback

def _byte_level_json() -> str:
    """A byte-level BPE file (GPT-2 style), which only the `tokenizers` package can run."""
    tokenizers = pytest.importorskip("tokenizers", reason="the `tokenizers` package is not installed")
    from tokenizers import decoders, models, pre_tokenizers, processors
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    vocab.update({"he": 256, "ll": 257, "Ġh": 258})
    lib = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[("h", "e"), ("l", "l"), ("Ġ", "h")]))
    lib.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    lib.decoder = decoders.ByteLevel()
    lib.add_special_tokens(["<|bos|>", "<|eos|>"])
    lib.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 259)])
    return lib.to_str()


@given(text=st.text(st.characters(codec="utf-8", exclude_categories=["Cs"], exclude_characters="<"), max_size=30))
def test_fallback_through_the_tokenizers_library(text):
    tokenizers = pytest.importorskip("tokenizers", reason="the `tokenizers` package is not installed")
    d = _byte_level_json()
    tok = hf_tokenizer(d, {"eos_token": "<|eos|>"})
    assert isinstance(tok, LibraryHFTokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos) == (261, 259, 260, True, False)
    lib = tokenizers.Tokenizer.from_str(d)
    ids = tok.encode(text, bos=True, eos=True)
    assert ids == lib.encode(text).ids + [260]
    assert tok.decode(ids) == text
    stream = tok.stream_decoder()
    assert "".join(stream.push(i) for i in ids) + stream.flush() == text
    assert tokenizer_from_json(tok.to_json()) == tok


def test_without_the_library_unsupported_files_say_what_to_install(tmp_path, monkeypatch):
    d = _byte_level_json()
    (tmp_path / "tokenizer.json").write_text(d, encoding="utf-8")
    assert isinstance(tokenizer_from_folder(tmp_path)[0], LibraryHFTokenizer)
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers now fails
    with pytest.raises(UnsupportedTokenizerError, match="pre_tokenizer 'ByteLevel'.*pip install tokenizers"):
        hf_tokenizer(d)
    tok, warning = tokenizer_from_folder(tmp_path)
    assert tok is None and "ByteLevel" in warning and "--tokenizer" in warning and "install" in warning


# ---------------------------------------------------------------- transformers 5's own files

SHAKESPEARE_CHARS = 50_000  # a passage with no double spaces, where sentencepiece agrees too

# Texts on which every file below gives sentencepiece's ids: no leading, trailing or repeated
# spaces, no literal control tokens, no '▁'.
SAME_AS_SENTENCEPIECE = [
    "Hello world", "Hello, world! How are you?", "tab\tseparated\ttext", "\ttab first", "line one\nline two",
    "a\nb", "\n\n", "\nleading newline", "trailing newline\n", "naïve café résumé", "Straße über Größe",
    "日本語のテキスト", "中文文本测试", "العربية نص", "emoji 😀 and 🦙", "family 👩‍👩‍👧 ZWJ",
    "flag 🇫🇷 and skin 👍🏽", "rare 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and \x00 control \x7f",
    "ROMEO:\nBut, soft! what light through yonder window breaks?",
    "1234567890 3.14159", "",
]
TEXTS = SAME_AS_SENTENCEPIECE + [
    " leading space", "  two leading", "trailing space ", "multiple   spaces  here", "para one\n\n  indented para",
    "<s>starts with bos", "ends with eos</s>", "middle <s> and </s> and <unk> tokens", " ", "   ", "x▁y",
]

# The normalizers transformers 5.24 writes when AutoTokenizer converts each .model (with
# protobuf installed, no tokenizer class: TokenizersBackend); they follow each model's
# sentencepiece normalizer spec: tok512 strips and collapses spaces, Llama 2 does not.
_R = lambda pattern, content, kind="Regex": {"type": "Replace", "pattern": {kind: pattern}, "content": content}
BACKEND_NORMALIZERS = {
    "llama2-tokenizer.model": [_R(" ", "▁", "String")],
    "tok512.model": [_R("\\A +| +\\z", ""), _R(" {2,}", " "), _R(" ", "▁", "String")],
}


def _metaspace(scheme):
    return {"type": "Metaspace", "replacement": "▁", "prepend_scheme": scheme, "split": False}


def _rewrite(d: dict, model: str, variant: str) -> dict:
    """transformers 5's LlamaTokenizer file -> the other layouts real folders carry."""
    if variant == "legacy-file":  # the Llama 2 hub file (written by tokenizers < 0.14)
        prepend = {"type": "Prepend", "prepend": "▁"}
        d.update(normalizer={"type": "Sequence", "normalizers": [prepend, _R(" ", "▁", "String")]},
                 pre_tokenizer=None, model={**d["model"], "unk_token": "<unk>"})
    elif variant == "backend":    # AutoTokenizer, legacy (the default): a second '▁' for a leading space
        d.update(normalizer={"type": "Sequence", "normalizers": BACKEND_NORMALIZERS[model] + [_R("\\A▁", "▁▁")]},
                 pre_tokenizer={"type": "Sequence", "pretokenizers": [_metaspace("always")]})
    elif variant == "backend-first":  # AutoTokenizer with legacy=False
        d.update(normalizer={"type": "Sequence", "normalizers": BACKEND_NORMALIZERS[model]},
                 pre_tokenizer={"type": "Sequence", "pretokenizers": [_metaspace("first")]})
    return d


def _make(model: str, variant: str, folder):
    """(our tokenizer, transformers' tokenizer) for one .model file and one file layout.

    "llama", "llama-legacy": what LlamaTokenizer(..., add_bos_token=True[, legacy=True])
    writes, compared with that tokenizer. The others are rewrites of it (_rewrite), compared
    with transformers loading the folder as a plain tokenizers file (tokenizer_class
    TokenizersBackend runs the file as written).
    """
    import sentencepiece
    import transformers
    from transformers.tokenization_utils_base import generate_merges
    sp = sentencepiece.SentencePieceProcessor(model_file=str(data_file(model)))
    vocab = {sp.id_to_piece(i): i for i in range(sp.vocab_size())}
    theirs = transformers.LlamaTokenizer(vocab=vocab, merges=generate_merges(vocab), add_bos_token=True,
                                         legacy=variant == "llama-legacy")
    theirs.save_pretrained(folder)
    if variant not in ("llama", "llama-legacy"):
        path = folder / "tokenizer.json"
        path.write_text(json.dumps(_rewrite(json.loads(path.read_text(encoding="utf-8")), model, variant),
                                   ensure_ascii=False), encoding="utf-8")
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        config["tokenizer_class"] = "TokenizersBackend"
        (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
        theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    return HFTokenizer.from_folder(folder), theirs


@pytest.fixture(scope="session")
def build(tmp_path_factory):
    """build(model, variant) -> (ours, theirs), each made once per session."""
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[torch]')")
    made = {}

    def get(model, variant):
        data_file(model)
        if (model, variant) not in made:
            made[model, variant] = _make(model, variant, tmp_path_factory.mktemp(f"{model.split('.')[0]}-{variant}"))
        return made[model, variant]
    return get


MODELS = ["llama2-tokenizer.model", "tok512.model"]
VARIANTS = ["llama", "llama-legacy", "legacy-file", "backend", "backend-first"]


@pytest.fixture(params=[(m, v) for m in MODELS for v in VARIANTS], ids=lambda p: f"{p[0].split('.')[0]}-{p[1]}")
def made(request, build):
    model, variant = request.param
    return (model, *build(model, variant))


def _texts():
    shakespeare = data_file("tinyshakespeare.txt").read_text(encoding="utf-8")[:SHAKESPEARE_CHARS]
    assert "  " not in shakespeare
    return TEXTS + [shakespeare]


def test_ids_and_text_equal_transformers(made):
    _, ours, theirs = made
    assert ours.add_bos and not ours.add_eos
    assert (ours.vocab_size, ours.bos_id, ours.eos_id) == (len(theirs), theirs.bos_token_id, theirs.eos_token_id)
    for text in _texts():
        ids = theirs(text)["input_ids"]
        assert ours.encode(text, bos=True) == ids, text[:40]
        assert ours.encode(text) == theirs(text, add_special_tokens=False)["input_ids"], text[:40]
        ids = ids + [ours.eos_id]
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text[:40]
        stream = ours.stream_decoder()
        pieces = [stream.push(i) for i in ids] + [stream.flush()]
        assert "".join(pieces) == ours.decode(ids), text[:40]
        for piece in pieces:  # never half a character
            assert "\ufffd" not in piece


def test_control_ids_and_bytes_decode_like_transformers(made):
    _, ours, theirs = made
    # <s> <unk> </s>, a llama split by </s>, a stray byte, '\n', '▁▁', a text piece, an unfinished byte
    ids = [1, 0, 2, 3 + 0xF0, 3 + 0x9F, 2, 3 + 0xA6, 3 + 0x99, 3 + 0xFF, 3 + 0x0A, 259, 300, 3 + 0xE2]
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


def test_sentencepiece_agrees_where_documented(made):
    model, ours, _ = made
    sp = SentencePieceTokenizer.from_file(data_file(model))
    for text in SAME_AS_SENTENCEPIECE + _texts()[-1:]:
        ids = sp.encode(text, bos=True, eos=True)
        assert ours.encode(text, bos=True, eos=True) == ids, text[:40]
        assert ours.decode(ids) == sp.decode(ids) == text


def test_where_transformers_and_sentencepiece_differ(build):
    """Llama 2, the file transformers 5 writes: the documented differences, pinned."""
    ours, _ = build("llama2-tokenizer.model", "llama")
    sp = SentencePieceTokenizer.from_file(data_file("llama2-tokenizer.model"))
    cases = {  # text: (ours, sentencepiece)
        # Metaspace "first" gives a leading space no '▁' of its own (and decode drops it)
        " leading space": ([8236, 2913], [29871, 8236, 2913]),
        # merges ranked by vocabulary order (transformers' generate_merges), not by sentencepiece's
        # scores, which rank '▁▁' (score -1e9) last: a run of spaces before a word splits otherwise
        "multiple   spaces  here": ([2999, 259, 8162, 259, 4150], [2999, 259, 8162, 29871, 1244]),
        # a literal "<s>" is the control id; sentencepiece spells it out
        "<s>starts": ([1, 27382], [529, 29879, 29958, 27382]),
    }
    for text, (mine, theirs) in cases.items():
        assert (ours.encode(text), sp.encode(text)) == (mine, theirs), text
    assert (ours.decode([0]), sp.decode([0])) == ("", " \u2047 ")  # <unk>: left out vs sentencepiece's " ⁇ "


def test_all_of_tinyshakespeare_equals_transformers(build):
    ours, theirs = build("llama2-tokenizer.model", "llama")
    text = data_file("tinyshakespeare.txt").read_text(encoding="utf-8")
    ids = ours.encode(text, bos=True)
    assert ids == theirs(text)["input_ids"]
    assert ours.decode(ids) == text
    assert tokenizer_from_json(ours.to_json()) == ours   # what a checkpoint's metadata carries


@given(text=_text, ids=st.lists(st.one_of(st.integers(0, 300), st.sampled_from([13, 29871, 259, 3186, 30919])),
                                max_size=12))
def test_llama_round_trip_and_stream(build, text, ids):
    """decode(encode(text)) gives the text back, less the one leading space Metaspace "first" drops."""
    tok, _ = build("llama2-tokenizer.model", "llama")
    assert tok.decode(tok.encode(text, bos=True)) == (text[1:] if text.startswith(" ") else text)
    stream = tok.stream_decoder()
    assert "".join(stream.push(i) for i in ids) + stream.flush() == tok.decode(ids)
