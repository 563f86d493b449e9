"""The tokenizer files of a Hugging Face folder, for every tokenizer npllama has.

transformers 5 reads a tokenizer from tokenizer.json (run by Hugging Face's `tokenizers`, which
transformers requires) and tokenizer_config.json. A folder holding only a sentencepiece
tokenizer.model makes it convert the model itself, which needs the `sentencepiece` and `protobuf`
packages (without them it tries tiktoken and fails). So an export writes tokenizer.json too, built
here without protobuf, and transformers then needs nothing beyond itself:

    SentencePieceTokenizer  tokenizer.model (kept, for sentencepiece users), tokenizer.json,
                            tokenizer_config.json
    CharTokenizer           tokenizer.json, tokenizer_config.json
    HFTokenizer (read from a tokenizer.json)   the files it was read from, unchanged
and generation_config_json(tokenizer) gives generation_config.json (its BOS / EOS ids).

Sentencepiece BPE or unigram -> tokenizer.json. The pieces, scores and kinds come from sentencepiece's own
API, the normalizer and trainer settings from the file (spm_proto.py). The file follows the one
transformers 5 builds from a .model itself (SpmConverter.build_tokenizer_from_spm_proto, meant to
"encode like SentencePieceProcessor.encode"), corrected where that one differs from sentencepiece
(trailing '▁', and the leading spaces decode drops), and tokenizer_config.json names the class
PreTrainedTokenizerFast, so that transformers runs it as written (for LlamaTokenizer it would
rebuild the normalizer and pre-tokenizer its own way; transformers 4 knows the class too):

    model          every piece, id for id, byte_fallback as the model's. BPE: merges are every
                   split of a normal piece into two normal pieces, ranked by the piece's score
                   (highest first), then its id -- sentencepiece (bpe_model.cc) repeatedly joins the
                   adjacent pair that makes the highest-scoring piece. Unigram: the pieces with
                   their scores, for the same Viterbi search as unigram_model.cc's
    normalizer     sentencepiece's normalizer (normalizer.cc) as steps: its precompiled character
                   map when it has one (npllama's own reader hands such files to the `tokenizers`
                   package); with remove_extra_whitespaces, leading spaces dropped and runs of
                   spaces made one; ' ' -> '▁'; then trailing '▁'s dropped (a '▁' of the text too,
                   as sentencepiece drops them); with the dummy prefix, a second '▁' before a text
                   that starts with one (Metaspace adds the prefix only when the text does not
                   start with '▁'; sentencepiece always does)
    pre_tokenizer  Metaspace, prepend_scheme "always", split off: the dummy prefix '▁'
    decoder        '▁' -> ' ', byte pieces joined into UTF-8, fused, the leading space dropped
                   (all leading spaces, for models that remove extra whitespace) as
                   sentencepiece's decoder drops it
    added_tokens   the control and unknown pieces (<unk>, <s>, </s>), special
    post_processor <s> before the text (Llama's add_bos_token)

Where this differs from sentencepiece (what transformers does with any sentencepiece model,
beyond what a file can change): a literal "<s>", "</s>" or "<unk>" in the text is its special id
(sentencepiece spells it out), and the text after it gets a dummy prefix of its own; decode leaves
out the unknown piece (sentencepiece prints " ⁇ "), and a run of byte pieces that is not valid
UTF-8 as a whole becomes one U+FFFD per byte (sentencepiece keeps the valid characters in it).
BPE pieces with equal scores (Llama 2's sixteen runs of '▁', all -1e9) are ranked by id, where
sentencepiece takes the leftmost pair; tests/test_hf_export.py checks runs of spaces against
sentencepiece, equal. A unigram model's byte and control pieces can match their own text (a
literal "<0x41>"), which sentencepiece never does.

Refused (the folder is then written with tokenizer.model and no tokenizer.json, and a note says
why): word and char sentencepiece models, user-defined pieces, unused pieces, whitespace as a
suffix, unescaped whitespace, a denormalizer.

CharTokenizer -> a BPE model with the characters as its vocabulary, id for id, and no merges,
normalizer, pre-tokenizer, special tokens or post-processor; the decoder fuses the characters.
"""

from __future__ import annotations

import base64
import json
from typing import NamedTuple

import sentencepiece as spm

from ..errors import NpllamaError
from .char import CharTokenizer
from .sentencepiece import SentencePieceTokenizer
from .spm_proto import BPE, MODEL_TYPE_NAMES, UNIGRAM, read_spec

SPACE = "\u2581"  # sentencepiece's '▁', which stands for ' '
TOKENIZER_CLASS = "PreTrainedTokenizerFast"


class HFTokenizerFiles(NamedTuple):
    """files: {file name: bytes} to write beside config.json; restores: npllama.load gives the
    tokenizer back from these files alone (a CharTokenizer comes back as the HFTokenizer of its
    tokenizer.json: same ids, another class); note: one line when some file could not be written
    (None when every file was)."""
    files: dict
    restores: bool
    note: str | None


def _json_bytes(d: dict) -> bytes:
    return (json.dumps(d, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def hf_tokenizer_files(tokenizer, model_max_length: int | None = None) -> HFTokenizerFiles:
    """The tokenizer files of a Hugging Face folder for `tokenizer` (see the module docstring).

    model_max_length goes into tokenizer_config.json (the model's context length), so transformers
    knows how long an input may be. No tokenizer: no files, and a note saying so.
    """
    if tokenizer is None:
        return HFTokenizerFiles({}, False, "the model has no tokenizer, so the folder holds no tokenizer files "
                                           "(export with --tokenizer to add one)")
    if hasattr(tokenizer, "hf_files"):     # read from a tokenizer.json: written back as it was read
        return HFTokenizerFiles({name: text.encode("utf-8") for name, text in tokenizer.hf_files().items()},
                                True, None)
    if isinstance(tokenizer, SentencePieceTokenizer):
        files = {"tokenizer.model": tokenizer.model_proto}
        try:
            tokenizer_json = sentencepiece_tokenizer_json(tokenizer)
        except InexactTokenizerError as e:
            return HFTokenizerFiles(files, True, f"tokenizer.json not written: {e}; transformers reads "
                                                 "tokenizer.model only with the sentencepiece and protobuf packages")
    elif isinstance(tokenizer, CharTokenizer):
        files, tokenizer_json = {}, char_tokenizer_json(tokenizer)
    else:
        return HFTokenizerFiles({}, False, f"no Hugging Face files for a {type(tokenizer).__name__}, so the "
                                           "folder holds no tokenizer files")
    files["tokenizer.json"] = _json_bytes(tokenizer_json)
    files["tokenizer_config.json"] = _json_bytes(_tokenizer_config(tokenizer_json, tokenizer, model_max_length))
    return HFTokenizerFiles(files, "tokenizer.model" in files, None)


def generation_config_json(tokenizer) -> dict:
    """generation_config.json: the BOS / EOS ids generate() starts from and stops at (none when the
    tokenizer has none, as a CharTokenizer)."""
    d = {}
    for key in ("bos", "eos"):
        token_id = getattr(tokenizer, f"{key}_id", None)
        if token_id is not None:
            d[f"{key}_token_id"] = int(token_id)
    return d


# ---------------------------------------------------------------- tokenizer_config.json

def _tokenizer_config(tokenizer_json: dict, tokenizer, model_max_length: int | None) -> dict:
    """tokenizer_config.json: the class that runs tokenizer.json as written, the special tokens by
    name, and add_bos_token (what tokenizer(text) puts first) for transformers 5."""
    names = {t["id"]: t["content"] for t in tokenizer_json["added_tokens"]}
    bos, eos = getattr(tokenizer, "bos_id", None), getattr(tokenizer, "eos_id", None)
    unk = getattr(tokenizer, "unk_id", None)
    config = {
        "tokenizer_class": TOKENIZER_CLASS,
        "bos_token": names.get(bos), "eos_token": names.get(eos), "unk_token": names.get(unk), "pad_token": None,
        "add_bos_token": bos is not None, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {str(t["id"]): {k: v for k, v in t.items() if k != "id"}
                                 for t in tokenizer_json["added_tokens"]},
    }
    if model_max_length is not None:
        config["model_max_length"] = int(model_max_length)
    return config


# ---------------------------------------------------------------- sentencepiece

class InexactTokenizerError(NpllamaError):
    """A sentencepiece model whose encoding no tokenizer.json written here would reproduce."""


def _replace(pattern: dict, content: str) -> dict:
    return {"type": "Replace", "pattern": pattern, "content": content}


def sentencepiece_tokenizer_json(tokenizer: SentencePieceTokenizer) -> dict:
    """The tokenizer.json dict of a sentencepiece BPE or unigram model (see the module docstring);
    raises InexactTokenizerError, naming every reason, for a model it would not encode exactly."""
    spec = read_spec(tokenizer.model_proto)
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(tokenizer.model_proto)
    n = sp.vocab_size()
    pieces = [sp.id_to_piece(i) for i in range(n)]
    problems = []
    if spec.model_type not in (BPE, UNIGRAM):
        problems.append(f"it is a {MODEL_TYPE_NAMES.get(spec.model_type, spec.model_type)} sentencepiece model "
                        "(BPE and unigram models are converted)")
    if spec.user_defined_ids:
        problems.append(f"it has {len(spec.user_defined_ids)} user-defined pieces")
    if spec.treat_whitespace_as_suffix or not spec.escape_whitespaces:
        problems.append("it does not mark whitespace with a leading '▁'")
    if spec.denormalizer_charsmap:
        problems.append("it has a denormalizer")
    unused = sum(sp.is_unused(i) for i in range(n))
    if unused:
        problems.append(f"it has {unused} unused pieces")
    if problems:
        raise InexactTokenizerError("; ".join(problems))

    specials = [i for i in range(n) if sp.is_control(i) or sp.is_unknown(i)]
    if spec.model_type == BPE:
        model = {"type": "BPE", "dropout": None, "unk_token": None if tokenizer.unk_id is None else pieces[tokenizer.unk_id],
                 "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                 "byte_fallback": spec.byte_fallback, "ignore_merges": False,
                 "vocab": {piece: i for i, piece in enumerate(pieces)}, "merges": _merges(sp, pieces)}
    else:  # the Viterbi search of unigram_model.cc, which models/unigram runs over the same scores
        model = {"type": "Unigram", "unk_id": tokenizer.unk_id, "byte_fallback": spec.byte_fallback,
                 "vocab": [[piece, sp.get_score(i)] for i, piece in enumerate(pieces)]}
    bos = tokenizer.bos_id
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": i, "content": pieces[i], "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i in specials],
        "normalizer": _normalizer(spec),
        "pre_tokenizer": ({"type": "Metaspace", "replacement": SPACE, "prepend_scheme": "always", "split": False}
                          if spec.add_dummy_prefix else None),
        "post_processor": None if bos is None else _bos_template(pieces[bos], bos),
        "decoder": _decoder(spec, pieces),
        "model": model,
    }


def _merges(sp: spm.SentencePieceProcessor, pieces: list[str]) -> list[list[str]]:
    """Every split of a normal piece into two normal pieces, the highest-scoring piece's first,
    then by id."""
    normal = {pieces[i]: i for i in range(len(pieces)) if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i))}
    ranked = []
    for piece, i in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-sp.get_score(i), i, left, right))
    return [[left, right] for _, _, left, right in sorted(ranked)]


def _normalizer(spec) -> dict:
    """sentencepiece's normalizer (normalizer.cc) as tokenizers' normalizer steps."""
    steps = []
    if spec.precompiled_charsmap:
        steps.append({"type": "Precompiled",
                      "precompiled_charsmap": base64.b64encode(spec.precompiled_charsmap).decode("ascii")})
    if spec.remove_extra_whitespaces:  # only ' ' counts: sentencepiece leaves newlines and tabs alone
        steps += [_replace({"Regex": r"\A +"}, ""), _replace({"Regex": " {2,}"}, " ")]
    steps.append(_replace({"String": " "}, SPACE))
    if spec.remove_extra_whitespaces:  # at the end, after ' ' -> '▁': a '▁' in the text goes too
        steps.append(_replace({"Regex": rf"{SPACE}+\z"}, ""))
    if spec.add_dummy_prefix:
        steps.append(_replace({"Regex": rf"\A{SPACE}"}, SPACE * 2))
    return {"type": "Sequence", "normalizers": steps}


def _decoder(spec, pieces: list[str]) -> dict:
    """sentencepiece's decoder (sentencepiece_processor.cc, Decode) as tokenizers' decoder steps."""
    steps = [_replace({"String": SPACE}, " ")]
    if spec.byte_fallback:
        steps.append({"type": "ByteFallback"})
    steps.append({"type": "Fuse"})
    if spec.add_dummy_prefix or spec.remove_extra_whitespaces:
        steps.append({"type": "Strip", "content": " ", "start": _leading_spaces_dropped(spec, pieces), "stop": 0})
    return {"type": "Sequence", "decoders": steps}


def _leading_spaces_dropped(spec, pieces: list[str]) -> int:
    """How many leading spaces decode drops. sentencepiece's decoder (sentencepiece_processor.cc,
    Decode; with add_dummy_prefix or remove_extra_whitespaces) takes one '▁' off the first piece;
    with remove_extra_whitespaces it goes on, one '▁' off each next piece, while the text so far
    is empty. Unless a piece starts with two '▁', that drops every leading space (2**30 of them
    stands for all); with such pieces it is not a count of spaces, and one is what the ids encode
    gives need (they start with a whitespace-only piece only for a text holding a '▁')."""
    if spec.remove_extra_whitespaces and not any(p.startswith(SPACE * 2) for p in pieces):
        return 1 << 30
    return 1


def _bos_template(name: str, token_id: int) -> dict:
    """TemplateProcessing that puts BOS before each text (LlamaConverter's post-processor)."""
    bos = {"SpecialToken": {"id": name, "type_id": 0}}
    return {"type": "TemplateProcessing",
            "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": name, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {name: {"id": name, "ids": [token_id], "tokens": [name]}}}


# ---------------------------------------------------------------- characters

def char_tokenizer_json(tokenizer: CharTokenizer) -> dict:
    """The tokenizer.json dict of a CharTokenizer: each character its own id, decoded by concatenation."""
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {"type": "Fuse"},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {c: i for i, c in enumerate(tokenizer.chars)}, "merges": []},
    }
