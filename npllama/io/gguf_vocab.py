"""A model's tokenizer as a GGUF vocabulary (the tokenizer.ggml.* keys), and back.

Writing (vocab_metadata), each kind as llama.cpp then runs it exactly (tests/test_gguf_llama_cpp.py):

    SentencePieceTokenizer  tokenizer.ggml.model "llama": the pieces, scores and piece types of
                            the ModelProto (llama.cpp's token types are sentencepiece's), its
                            add_dummy_prefix as add_space_prefix, remove_extra_whitespaces, the
                            unk/bos/eos/pad ids, add_bos_token true: what llama.cpp's
                            convert_hf_to_gguf.py writes for a tokenizer.model. llama.cpp merges
                            pieces by score, as sentencepiece's BPE does.
    CharTokenizer           tokenizer.ggml.model "rwkv": each character a token (its UTF-8, with
                            '\\\\' escaped as llama.cpp's RWKV reader expects), no BOS or EOS. Why
                            not "gpt2" or "llama": llama.cpp gives those kinds a default EOS (id 11,
                            or 2) that a file cannot switch off, so generation would stop at
                            whatever character has that id; its "rwkv" vocabulary has no default
                            specials, and its greedy longest match is exactly one token per
                            character. A character outside the vocabulary becomes llama.cpp's
                            unknown id (none), where npllama raises an error.
    HFTokenizer             (a Llama-family tokenizer.json) tokenizer.ggml.model "llama": the
                            vocabulary in id order, added special tokens as CONTROL, byte pieces
                            as BYTE, and as scores minus the rank of the merge that makes each
                            piece, so llama.cpp's highest-score-first merging follows the merge
                            list (llama.cpp's own converter writes -1000 for every piece).
    no tokenizer            tokenizer.ggml.model "none": llama.cpp then runs token ids only.

A model whose vocabulary is larger than its tokenizer's gets "[PAD<id>]" tokens of type UNUSED
(as llama.cpp's converter pads), since llama.cpp needs one token per embedding row.

Reading (tokenizer_from_gguf) builds an npllama tokenizer from the file's own vocabulary:

    "llama"   the ModelProto of those pieces, scores and types (normalizer "identity", the
              file's add_space_prefix and remove_extra_whitespaces, BPE: merge by score), run
              by sentencepiece as a SentencePieceTokenizer; so a GGUF converted from a
              tokenizer.model encodes as that tokenizer.model does. BOS and EOS are the file's
              ids, else llama.cpp's defaults 1 and 2, when those are control pieces.
    "rwkv"    whose tokens are single characters: a CharTokenizer (what vocab_metadata writes)
    "gpt2"    byte-level BPE (tokens, merges): a tokenizer.json with the pre-tokenizer
              tokenizer.ggml.pre names (llama.cpp's regexes for "default", "gpt-2", "llama-bpe"),
              run by Hugging Face's `tokenizers` package when it is installed
Anything else loads the model without a tokenizer and says why (pass --tokenizer).
"""

from __future__ import annotations

import json

import numpy as np

from ..errors import NpllamaError
from ..tokenizers import CharTokenizer, SentencePieceTokenizer
from ..tokenizers.sentencepiece_proto import (BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED, USER_DEFINED, Normalizer, Piece,
                                              build_model_proto, read_normalizer, read_pieces)
from ..tokenizers.tokenizer_json import HFTokenizer, hf_tokenizer
from .gguf import ARRAY, BOOL, FLOAT32, INT32, STRING, UINT32, get_value

PREFIX = "tokenizer.ggml."
_SPECIALS = {"bos_token_id": "bos_id", "eos_token_id": "eos_id", "unknown_token_id": "unk_id",
             "padding_token_id": "pad_id"}


# ----------------------------------------------------------------------------- writing

def _pad(tokens: list, types: list, scores: list | None, vocab_size: int, pad_text) -> None:
    """Extend the lists to vocab_size with UNUSED padding tokens, in place."""
    if len(tokens) > vocab_size:
        raise NpllamaError(f"the tokenizer has {len(tokens)} tokens but the model only {vocab_size} embedding rows; "
                           "they do not belong together")
    for i in range(len(tokens), vocab_size):
        tokens.append(pad_text(i))
        types.append(UNUSED)
        if scores is not None:
            scores.append(-1000.0)


def _lists(tokens, scores, types) -> list:
    out = [(PREFIX + "tokens", ARRAY, (STRING, tokens))]
    if scores is not None:
        out.append((PREFIX + "scores", ARRAY, (FLOAT32, scores)))
    return out + [(PREFIX + "token_type", ARRAY, (INT32, types))]


def _specials(ids: dict, add_bos: bool) -> list:
    out = [(PREFIX + key, UINT32, int(ids[attr])) for key, attr in _SPECIALS.items() if ids.get(attr) is not None]
    return out + [(PREFIX + "add_bos_token", BOOL, add_bos), (PREFIX + "add_eos_token", BOOL, False)]


def _sentencepiece_metadata(tokenizer: SentencePieceTokenizer, vocab_size: int) -> list:
    pieces = read_pieces(tokenizer.model_proto)
    norm = read_normalizer(tokenizer.model_proto)
    tokens, scores, types = [p.piece for p in pieces], [p.score for p in pieces], [p.type for p in pieces]
    _pad(tokens, types, scores, vocab_size, lambda i: f"[PAD{i}]")
    ids = {attr: getattr(tokenizer, attr, None) for attr in _SPECIALS.values()}
    return ([(PREFIX + "model", STRING, "llama"), (PREFIX + "pre", STRING, "default")]
            + _lists(tokens, scores, types) + _specials(ids, tokenizer.bos_id is not None)
            + [(PREFIX + "add_space_prefix", BOOL, norm.add_dummy_prefix),
               (PREFIX + "remove_extra_whitespaces", BOOL, norm.remove_extra_whitespaces)])


def rwkv_escape(text: str) -> str:
    """A token as llama.cpp's RWKV vocabulary stores it: a backslash starts an escape there, so
    it is doubled; every other character is itself."""
    return text.replace("\\", "\\\\")


def rwkv_unescape(token: str) -> bytes:
    """llama_unescape_rwkv_token: \\t \\n \\r, \\xHH (lower-case hex digits) and \\c for any other c."""
    out, escaping, hex_left, acc = bytearray(), False, 0, 0
    for c in token.encode("utf-8"):
        if hex_left:
            acc = (acc << 4) + (c - 87 if c >= 97 else c - 48)      # 'a' is 97, '0' is 48
            hex_left -= 1
            if not hex_left:
                out.append(acc & 0xFF)
                acc = 0
        elif escaping:
            escaping = False
            if c == ord("x"):
                hex_left = 2
            else:
                out.append({ord("t"): 9, ord("n"): 10, ord("r"): 13}.get(c, c))
        elif c == ord("\\"):
            escaping = True
        else:
            out.append(c)
    return bytes(out)


def _char_metadata(tokenizer: CharTokenizer, vocab_size: int) -> list:
    tokens = [rwkv_escape(c) for c in tokenizer.chars]
    types = [NORMAL] * len(tokens)
    # \xff never occurs in UTF-8 text, so llama.cpp's longest match can never produce a padding token
    _pad(tokens, types, None, vocab_size, lambda i: f"\\xffpad{i}")
    return [(PREFIX + "model", STRING, "rwkv")] + _lists(tokens, None, types) + _specials({}, False)


def _hf_metadata(tokenizer: HFTokenizer, vocab_size: int) -> list:
    d = json.loads(tokenizer.hf_files()["tokenizer.json"])
    model = d["model"]
    token_of = {i: t for t, i in model["vocab"].items()}
    specials, user = {}, {}
    for e in d.get("added_tokens", []):
        token_id = tokenizer.token_to_id(e["content"])
        (specials if e.get("special") else user)[token_id] = e["content"]
        token_of[token_id] = e["content"]
    gaps = [i for i in range(max(token_of) + 1) if i not in token_of]
    if gaps:
        raise NpllamaError(f"the tokenizer.json vocabulary has no tokens for ids {gaps[:10]}; GGUF needs one per id")
    rank = {}
    for r, merge in enumerate(m for m in model.get("merges", []) if not (isinstance(m, str) and m.startswith("#"))):
        a, b = merge.split(" ") if isinstance(merge, str) else merge
        rank.setdefault(a + b, r)
    byte_fallback = bool(model.get("byte_fallback"))
    tokens, scores, types = [], [], []
    for i in range(len(token_of)):
        t = token_of[i]
        tokens.append(t)
        kind = (CONTROL if i in specials else USER_DEFINED if i in user else UNKNOWN if t == model.get("unk_token")
                else BYTE if byte_fallback and len(t) == 6 and t.startswith("<0x") and t.endswith(">") else NORMAL)
        types.append(kind)
        # pieces no merge makes (single characters, specials) are never a pair's concatenation in
        # BPE; give them the lowest score so llama.cpp forms them last if at all
        scores.append(-float(rank[t]) if t in rank else (0.0 if len(t) == 1 or kind != NORMAL else -1e9))
    _pad(tokens, types, scores, vocab_size, lambda i: f"[PAD{i}]")
    ids = {"bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id,
           "unk_id": model["vocab"].get(model.get("unk_token")) if model.get("unk_token") else None}
    return ([(PREFIX + "model", STRING, "llama"), (PREFIX + "pre", STRING, "default")]
            + _lists(tokens, scores, types) + _specials(ids, tokenizer.add_bos)
            + [(PREFIX + "add_space_prefix", BOOL, True)])


def vocab_metadata(tokenizer, vocab_size: int) -> list:
    """The tokenizer.ggml.* entries ([(key, value type, value)]) for `tokenizer` and a model with
    vocab_size embedding rows (module docstring)."""
    if tokenizer is None:
        return [(PREFIX + "model", STRING, "none")]
    if isinstance(tokenizer, SentencePieceTokenizer):
        return _sentencepiece_metadata(tokenizer, vocab_size)
    if isinstance(tokenizer, CharTokenizer):
        return _char_metadata(tokenizer, vocab_size)
    if isinstance(tokenizer, HFTokenizer):
        return _hf_metadata(tokenizer, vocab_size)
    raise NpllamaError(f"a {type(tokenizer).__name__} cannot be written into a GGUF file (npllama writes "
                       "sentencepiece models, character tokenizers and Llama-family tokenizer.json files)")


# ----------------------------------------------------------------------------- reading

# llama.cpp's llm_tokenizer_bpe regexes for the pre-tokenizers npllama runs through `tokenizers`
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_PRE_REGEXES = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
    "gpt-2": [_GPT2],
    "llama-bpe": [r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
                  r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
}
_PRE_ALIASES = {"llama3": "llama-bpe", "llama-v3": "llama-bpe"}


def _special_ids(metadata: dict, source, n_tokens: int) -> dict:
    ids = {}
    for key, attr in _SPECIALS.items():
        value = get_value(metadata, PREFIX + key, "int", source, None)
        ids[attr] = value if value is not None and 0 <= value < n_tokens else None
    return ids


def _sentencepiece_from_gguf(metadata, source, tokens, types) -> SentencePieceTokenizer:
    scores = get_value(metadata, PREFIX + "scores", "floats", source, np.zeros(len(tokens)))
    if len(scores) < len(tokens):
        raise NpllamaError(f"{len(scores)} scores for {len(tokens)} tokens")
    ids = _special_ids(metadata, source, len(tokens))
    for attr, default in (("bos_id", 1), ("eos_id", 2)):     # llama.cpp's defaults for a "llama" vocabulary
        if PREFIX + {v: k for k, v in _SPECIALS.items()}[attr] not in metadata and default < len(tokens):
            ids[attr] = default
    if ids["unk_id"] is None:
        unknown = [i for i, t in enumerate(types) if t == UNKNOWN]
        ids["unk_id"] = unknown[0] if unknown else None
    known = {NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE}
    pieces = [Piece(t, s, k if k in known else NORMAL)
              for t, s, k in zip(tokens, np.asarray(scores, np.float64).tolist(), np.asarray(types).tolist())]
    for attr in ("bos_id", "eos_id", "pad_id"):     # sentencepiece requires its specials to be control pieces
        if ids[attr] is not None and pieces[ids[attr]].type != CONTROL:
            ids[attr] = None
    normalizer = Normalizer("identity", get_value(metadata, PREFIX + "add_space_prefix", "bool", source, True),
                            get_value(metadata, PREFIX + "remove_extra_whitespaces", "bool", source, False), True)
    byte_fallback = sum(p.type == BYTE for p in pieces) == 256
    proto = build_model_proto(pieces, unk_id=ids["unk_id"], bos_id=ids["bos_id"], eos_id=ids["eos_id"],
                              pad_id=ids["pad_id"], byte_fallback=byte_fallback, normalizer=normalizer)
    return SentencePieceTokenizer(proto)


def _char_from_gguf(tokens, types) -> CharTokenizer:
    chars, padding = [], False
    for token, kind in zip(tokens, types):
        try:
            text = rwkv_unescape(token).decode("utf-8")
        except UnicodeDecodeError:
            text = None
        if kind == UNUSED and text is None:      # vocab_metadata's padding, after the characters
            padding = True
            continue
        if text is None or len(text) != 1 or padding:
            raise NpllamaError("its RWKV vocabulary is not one character per token, which is the only kind "
                               "npllama runs (as a character tokenizer)")
        chars.append(text)
    return CharTokenizer("".join(chars))


def _gpt2_from_gguf(metadata, source, tokens, types):
    pre = get_value(metadata, PREFIX + "pre", "str", source, "default")
    regexes = _PRE_REGEXES.get(_PRE_ALIASES.get(pre, pre))
    if regexes is None:
        raise NpllamaError(f"its pre-tokenizer {pre!r} is not one npllama runs (known: {sorted(_PRE_REGEXES)})")
    merges = get_value(metadata, PREFIX + "merges", "strings", source, [])
    ids = _special_ids(metadata, source, len(tokens))
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": int(k) == CONTROL} for i, (t, k) in enumerate(zip(tokens, types))
             if int(k) in (CONTROL, USER_DEFINED)]
    splits = [{"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False} for r in regexes]
    tokenizer_json = {
        "version": "1.0", "added_tokens": added, "normalizer": None, "post_processor": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": splits + [
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": _PRE_ALIASES.get(pre, pre) == "llama-bpe",
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": list(merges)},
    }
    config = {"bos_token": tokens[ids["bos_id"]] if ids["bos_id"] is not None else None,
              "eos_token": tokens[ids["eos_id"]] if ids["eos_id"] is not None else None,
              "add_bos_token": get_value(metadata, PREFIX + "add_bos_token", "bool", source,
                                         _PRE_ALIASES.get(pre, pre) == "llama-bpe"),
              "add_eos_token": get_value(metadata, PREFIX + "add_eos_token", "bool", source, False)}
    return hf_tokenizer(json.dumps(tokenizer_json), json.dumps(config))


def tokenizer_from_gguf(metadata: dict, source) -> tuple[object, str | None]:
    """(tokenizer, None), or (None, why not) when the file's vocabulary cannot be run (module docstring)."""
    kind = get_value(metadata, PREFIX + "model", "str", source, None)
    if kind is None or kind in ("none", "no_vocab"):
        return None, None
    tokens = get_value(metadata, PREFIX + "tokens", "strings", source, None)
    if not tokens:
        return None, f"{source}: tokenizer.ggml.model is {kind!r} but there is no token list"
    types = get_value(metadata, PREFIX + "token_type", "ints", source, np.full(len(tokens), NORMAL))
    if len(types) < len(tokens):
        return None, f"{source}: {len(types)} token types for {len(tokens)} tokens"
    try:
        if kind == "llama":
            return _sentencepiece_from_gguf(metadata, source, tokens, types), None
        if kind == "rwkv":
            return _char_from_gguf(tokens, types), None
        if kind == "gpt2":
            return _gpt2_from_gguf(metadata, source, tokens, types), None
    except NpllamaError as e:
        return None, f"{source}: cannot run the file's {kind!r} tokenizer: {str(e).removeprefix(f'{source}: ')}"
    return None, f"{source}: tokenizer.ggml.model {kind!r} is not a kind npllama runs (llama, gpt2, rwkv)"
