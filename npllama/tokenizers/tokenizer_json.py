"""Hugging Face tokenizer.json files for Llama-family BPE (and sentencepiece unigram) tokenizers,
read in pure Python.

transformers 5 saves a tokenizer as tokenizer.json + tokenizer_config.json, with no
tokenizer.model for SentencePieceTokenizer to read. HFTokenizer reads those two files and
encodes and decodes as Hugging Face's `tokenizers` library runs them; that library's Rust
source (tokenizers/src/...) is the reference, cited at each step. Same API as the tokenizers in
npllama/tokenizers.py: .vocab_size, .bos_id, .eos_id, .encode, .decode, .stream_decoder(),
.to_json().

Encoding (tokenizer/mod.rs encode_single_sequence, added_vocabulary.rs extract_and_normalize):
  1. added tokens with normalized=false (<s>, </s>, <unk>, ...) are cut out of the raw text, the
     longest match at the leftmost position first, so a literal "<s>" in the text is id 1;
  2. the normalizer runs on each remaining piece, then added tokens with normalized=true are cut
     out of the normalized text;
  3. the pre-tokenizer cuts each piece into words (Metaspace: ' ' -> '▁', maybe a leading '▁',
     maybe a cut before every '▁');
  4. BPE runs on each word (models/bpe/model.rs merge_word, word.rs merge_all): one symbol per
     character -- the character's own vocabulary id, else with byte_fallback its UTF-8 bytes as
     <0xNN> pieces, else unk_token (consecutive unknowns fused into one when fuse_unk) -- then,
     repeatedly, the adjacent pair whose merge has the lowest rank (its index in "merges";
     the leftmost on ties) is joined, until no adjacent pair has a merge. (A Unigram model
     instead cuts the word where its piece scores sum highest: _Unigram.)
  5. The post-processor (BOS/EOS) is not applied; see "BOS and EOS" below.
Decoding (tokenizer/mod.rs decode): ids -> token strings, special added tokens left out (decode
prints no control tokens: transformers' decode(ids, skip_special_tokens=True)), then the decoder
chain over the list of strings, joined.

Supported pieces; anything else raises UnsupportedTokenizerError naming it:
  model           BPE: vocab, merges ("a b" strings or [a, b] pairs), byte_fallback, unk_token,
                  fuse_unk, ignore_merges; dropout null or 0; no subword prefix or word suffix.
                  Unigram: vocab ([piece, score] pairs), unk_id, byte_fallback (_Unigram)
  normalizer      null, Sequence, Prepend, Replace (a String, or a Regex in the subset that
                  Python's re reads the same way: see _python_regex), Strip
  pre_tokenizer   null, Sequence, Metaspace (replacement, prepend_scheme always/first/never, split)
  decoder         Replace, ByteFallback, Fuse, Strip, Metaspace, in a Sequence; ByteFallback before
                  Fuse, and after Fuse only Strip with stop=0 (so text can be streamed exactly)
  post_processor  null, or TemplateProcessing that puts only BOS before and/or EOS after the text
  added_tokens    special or not, normalized or not, lstrip/rstrip; not single_word
That covers the legacy Llama 2 file (normalizer Sequence[Prepend('▁'), Replace(' ', '▁')], no
pre-tokenizer, decoder Sequence[Replace('▁', ' '), ByteFallback, Fuse, Strip(' ', 1, 0)]) and what
transformers 5 writes from a sentencepiece model: LlamaTokenizer (no normalizer, Metaspace with
prepend_scheme "first" and split=false, the same decoder) and TokenizersBackend (AutoTokenizer
without a tokenizer class: Replace normalizers, some with regexes such as "\\A▁", and Metaspace
"always"). For any other file, hf_tokenizer() falls back to the `tokenizers` package when it
is installed (LibraryHFTokenizer); the pure-Python path is the one that handles Llama files.

BOS and EOS: encode(text) is transformers' tokenizer(text, add_special_tokens=False); bos=True
puts bos_id first, eos=True puts eos_id last. add_bos / add_eos say what tokenizer(text) adds by
default, so encode(text, bos=tok.add_bos, eos=tok.add_eos) == tokenizer(text)["input_ids"]. As in
transformers 5 (tokenization_utils_tokenizers.py), tokenizer_config.json's add_bos_token /
add_eos_token decide when either is present, else the file's post-processor template does.
bos_token / eos_token come from tokenizer_config.json, else from the template.

Where the files transformers 5 writes differ from sentencepiece on the same tokenizer.model
(we follow the tokenizer.json; tests/test_tokenizer_json.py pins these):
  - a literal "<s>", "</s>" or "<unk>" in the text is the control id; sentencepiece spells it out;
  - LlamaTokenizer's file (Metaspace "first"): text that starts with a space gets no '▁' of its
    own (" Hello" is [15043], sentencepiece [29871, 15043], so decode(encode(" x")) is "x"), and
    text right after an added token gets none ("<s>Hello" is [1, 10994], not [1, 15043]);
  - transformers ranks merges in vocabulary order (generate_merges), sentencepiece by piece
    score, which puts whitespace pieces such as '▁▁' (score -1e9) last: a run of spaces before a
    word splits differently ("a  here" ends [259, 4150] '▁▁' 'here', not [29871, 1244] '▁' '▁here');
  - LlamaTokenizer's file has no normalizer, so a model trained with remove_extra_whitespaces
    (tok512) keeps leading, trailing and repeated spaces that sentencepiece removes (the
    TokenizersBackend file keeps that normalizer, as Replace regexes);
  - decode prints nothing for <unk> (sentencepiece " ⁇ "), turns every byte of a byte run that
    is not valid UTF-8 as a whole into U+FFFD, and joins byte runs across left-out control ids.
One more difference is transformers 5's, not ours: when tokenizer_config.json names
LlamaTokenizer, transformers 5 keeps only the vocab and merges of tokenizer.json and rebuilds
the rest (Metaspace "first", or "always" with legacy=true), so for an older file with the legacy
normalizer it does not run the file as written; we run the file as written, as `tokenizers`
and transformers 4 do.

Speed: a word (for Llama files, a whole piece of text between added tokens) is cut into chunks
BPE can handle one at a time, at places no merge can ever cross (_BPE.tokenize says why that
is exact); each chunk's ids are cached.
"""

from __future__ import annotations

import heapq
import importlib
import json
import os
import re
from pathlib import Path

from ..checks import parse_json
from ..errors import MissingFileError, NpllamaError
from .regex_safety import UnboundedRegexError, check_tokenizer_regexes


class TokenizerJSONError(NpllamaError):
    """A tokenizer.json or tokenizer_config.json that cannot be read as written."""


class UnsupportedTokenizerError(TokenizerJSONError):
    """A valid tokenizer.json that uses a piece the pure-Python reader does not implement."""


_INSTALL_HINT = ("npllama reads Llama-family BPE files itself; for other tokenizers install Hugging Face's "
                 "`tokenizers` package (pip install tokenizers), which npllama then uses")


def _unsupported(what: str) -> UnsupportedTokenizerError:
    return UnsupportedTokenizerError(f"tokenizer.json: {what} is not supported; {_INSTALL_HINT}")


# Unicode White_Space, what Rust's char::is_whitespace and the regex crate's \s match; Python's
# str.isspace() also counts U+001C..U+001F, so the set is spelled out.
_WHITE_SPACE = ("\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007"
                "\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000")


def _python_regex(pattern, where: str) -> re.Pattern:
    """A tokenizer.json regex (Oniguruma, Ruby syntax) as a Python pattern, or Unsupported.

    Accepted: literal characters, escaped punctuation, \\n \\t \\r, \\A (start of text), \\z (end of
    text; Python spells it \\Z), classes, groups (?:...), quantifiers and alternation, with ^ and $
    at line ends as in Ruby (re.MULTILINE). Escapes whose meaning differs between the two engines
    (\\d \\w \\s \\b \\h \\p{...}, Oniguruma's \\Z), other (?...) groups, nested classes and
    patterns that match the empty string are refused rather than guessed at.
    """
    if not isinstance(pattern, str) or not pattern:
        raise TokenizerJSONError(f"tokenizer.json: {where} has an empty or non-string regex {pattern!r}")
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            n = pattern[i + 1]
            if n == "z":
                out.append(r"\Z")
            elif n in "Antr" or not n.isalnum():
                out.append(c + n)
            else:
                raise _unsupported(f"{where} regex {pattern!r} (escape \\{n})")
            i += 2
            continue
        if (c == "(" and pattern[i + 1:i + 2] == "?" and pattern[i + 2:i + 3] != ":") \
                or pattern[i:i + 2] in ("[[", "[:", "&&") or c == "\\":
            raise _unsupported(f"{where} regex {pattern!r}")
        out.append(c)
        i += 1
    try:
        compiled = re.compile("".join(out), re.MULTILINE)
    except re.error as e:
        raise _unsupported(f"{where} regex {pattern!r} ({e})") from None
    if compiled.search("") is not None:
        raise _unsupported(f"{where} regex {pattern!r}, which matches the empty string")
    return compiled


class _Replace:
    """Replace (normalizers/replace.rs, also a decoder): every match of a pattern -> content.

    The pattern is {"String": s} (literal) or {"Regex": r}.
    """

    def __init__(self, step: dict, where: str):
        p, self.content = step.get("pattern"), step.get("content")
        if not isinstance(self.content, str):
            raise TokenizerJSONError(f"tokenizer.json: {where} needs a string 'content', got {self.content!r}")
        if isinstance(p, dict) and isinstance(p.get("String"), str) and p["String"]:
            self.literal, self.regex = p["String"], re.compile(re.escape(p["String"]))
        elif isinstance(p, dict) and "Regex" in p:
            self.literal, self.regex = None, _python_regex(p["Regex"], where)
        else:
            raise TokenizerJSONError(f"tokenizer.json: {where} needs a pattern {{'String': ...}} or "
                                     f"{{'Regex': ...}}, got {p!r}")

    def __call__(self, s: str) -> str:
        if self.literal is not None:
            return s.replace(self.literal, self.content)
        return self.regex.sub(lambda m: self.content, s)

    def tracked(self, s: str, origins: list[int]) -> tuple[str, list[int]]:
        """The same, with the original offset each output character comes from:
        NormalizedString::replace aligns every character of `content` with the match's last."""
        out, out_origins, last = [], [], 0
        for m in self.regex.finditer(s):
            start, end = m.span()
            out += (s[last:start], self.content)
            out_origins += origins[last:start] + [origins[end - 1]] * len(self.content)
            last = end
        return "".join(out) + s[last:], out_origins + origins[last:]


def _char(step: dict, key: str, where: str) -> str:
    value = step.get(key)
    if not isinstance(value, str) or len(value) != 1:
        raise TokenizerJSONError(f"tokenizer.json: {where} needs one character in {key!r}, got {value!r}")
    return value


def _steps(node, kind: str, list_key: str) -> list[dict]:
    """A normalizer / pre-tokenizer / decoder node flattened into its list of steps (null -> [])."""
    if node is None:
        return []
    if not isinstance(node, dict) or not isinstance(node.get("type"), str):
        raise TokenizerJSONError(f"tokenizer.json: {kind} must be null or an object with a 'type', got {node!r:.80}")
    if node["type"] == "Sequence":
        children = node.get(list_key)
        if not isinstance(children, list):
            raise TokenizerJSONError(f"tokenizer.json: {kind} Sequence needs a list {list_key!r}")
        return [s for child in children for s in _steps(child, kind, list_key)]
    return [node]


def _prepend_scheme(step: dict, where: str) -> str:
    # pre_tokenizers/metaspace.rs: prepend_scheme defaults to "always"; files older than
    # tokenizers 0.14 say add_prefix_space instead.
    scheme = step.get("prepend_scheme", "never" if step.get("add_prefix_space") is False else "always")
    if scheme not in ("always", "first", "never"):
        raise TokenizerJSONError(f"tokenizer.json: {where} prepend_scheme {scheme!r}; expected always, first or never")
    return scheme


# ---------------------------------------------------------------- normalizer and pre-tokenizer

def _compile_normalizer(node) -> list:
    """Each step (normalizers/*.rs) as f(text, origins) -> (text, origins).

    origins, when not None, holds for each character the offset in the original text of the
    character it comes from (the start of its NormalizedString alignment): Metaspace's "first"
    scheme asks whether a piece starts at offset 0, which a normalizer that deletes leading
    characters changes.
    """
    funcs = []
    for step in _steps(node, "normalizer", "normalizers"):
        kind = step["type"]
        if kind == "Replace":
            replace = _Replace(step, "normalizer Replace")
            funcs.append(lambda s, o, r=replace: (r(s), None) if o is None else r.tracked(s, o))
        elif kind == "Prepend":
            prefix = step.get("prepend")
            if not isinstance(prefix, str):
                raise TokenizerJSONError("tokenizer.json: normalizer Prepend needs a string 'prepend'")
            # prepend.rs: not to an empty piece; the new characters share the first one's alignment
            funcs.append(lambda s, o, p=prefix: (s, o) if not s else
                         (p + s, None if o is None else [o[0]] * len(p) + o))
        elif kind == "Strip":  # normalizers/strip.rs: trim whitespace at either end
            left = _WHITE_SPACE if step.get("strip_left", True) else ""
            right = _WHITE_SPACE if step.get("strip_right", True) else ""

            def strip(s, o, left=left, right=right):
                a = len(s) - len(s.lstrip(left))
                b = max(a, len(s.rstrip(right)))
                return s[a:b], None if o is None else o[a:b]
            funcs.append(strip)
        else:
            raise _unsupported(f"normalizer {kind!r}")
    return funcs


def _compile_pre_tokenizer(node) -> tuple[str, str, bool] | None:
    """The Metaspace step as (replacement, prepend_scheme, split), or None."""
    steps = _steps(node, "pre_tokenizer", "pretokenizers")
    for step in steps:
        if step["type"] != "Metaspace":
            raise _unsupported(f"pre_tokenizer {step['type']!r}")
    if len(steps) > 1:
        raise _unsupported("more than one pre_tokenizer Metaspace")
    if not steps:
        return None
    return (_char(steps[0], "replacement", "pre_tokenizer Metaspace"),
            _prepend_scheme(steps[0], "pre_tokenizer Metaspace"),
            bool(steps[0].get("split", True)))  # metaspace.rs: split defaults to true


# ---------------------------------------------------------------- added tokens

class _AddedTokens:
    """added_vocabulary.rs: ids, the special set, and the leftmost-longest split of a text."""

    def __init__(self, entries, vocab: dict, normalize):
        if not isinstance(entries, list):
            raise TokenizerJSONError(f"tokenizer.json: added_tokens must be a list, got {type(entries).__name__}")
        self.id_of = {}          # content -> id
        self.token_of = {}       # id -> the string decode sees (the normalized form for normalized tokens)
        self.special = set()     # contents of special tokens, which decode leaves out
        raw, normalized = [], []
        # added_vocabulary.rs add_tokens: an id from the vocabulary when the content is there,
        # else the next id after the model's vocabulary, in file order (the file's own "id" is
        # only compared, with a warning, by serialization.rs).
        next_id = len(vocab)
        for e in entries:
            if not isinstance(e, dict) or not isinstance(e.get("content"), str):
                raise TokenizerJSONError(f"tokenizer.json: each added token needs a string 'content', got {e!r:.80}")
            content = e["content"]
            if not content:
                continue  # add_tokens ignores empty tokens
            if content in self.id_of:
                raise TokenizerJSONError(f"tokenizer.json: added token {content!r} is listed twice")
            if e.get("single_word"):
                raise _unsupported(f"added token {content!r} with single_word=true")
            token_id = vocab.get(content)
            if token_id is None:
                token_id, next_id = next_id, next_id + 1
            self.id_of[content] = token_id
            is_normalized = bool(e.get("normalized", not e.get("special", False)))
            form = normalize(content) if is_normalized else content
            self.token_of[token_id] = form
            if e.get("special"):
                self.special.add(content)
            entry = (form, token_id, bool(e.get("lstrip")), bool(e.get("rstrip")))
            (normalized if is_normalized else raw).append(entry)
        self._raw = self._matcher(raw)
        self._normalized = self._matcher(normalized)

    @staticmethod
    def _matcher(tokens):
        if not any(form for form, *_ in tokens):
            return None
        # An alternation tried longest first finds, at the leftmost position that matches, the
        # longest token: the Aho-Corasick MatchKind::LeftmostLongest the library builds.
        by_form = {form: (token_id, lstrip, rstrip) for form, token_id, lstrip, rstrip in tokens if form}
        regex = re.compile("|".join(re.escape(f) for f in sorted(by_form, key=len, reverse=True)))
        return regex, by_form

    def split(self, text: str, normalized: bool) -> list[tuple[int, int, int | None]]:
        """find_matches: (start, stop, id or None for plain text) covering `text`."""
        matcher = self._normalized if normalized else self._raw
        if matcher is None:
            return [(0, len(text), None)]
        regex, by_form = matcher
        splits, offset = [], 0
        for m in regex.finditer(text):
            start, stop = m.span()
            token_id, lstrip, rstrip = by_form[m.group()]
            if lstrip:  # absorb the whitespace before it, but not text an earlier match took
                while start > offset and text[start - 1] in _WHITE_SPACE:
                    start -= 1
            if rstrip:
                while stop < len(text) and text[stop] in _WHITE_SPACE:
                    stop += 1
            if offset < start:
                splits.append((offset, start, None))
            splits.append((start, stop, token_id))
            offset = stop
        if offset != len(text):
            splits.append((offset, len(text), None))
        return splits


# ---------------------------------------------------------------- BPE

_PLAIN, _BYTES, _UNK, _DROP = range(4)  # how merge_word turns one character into symbols


def _utf8(c: str) -> bytes:
    try:
        return c.encode("utf-8")
    except UnicodeEncodeError:
        raise NpllamaError(f"the text holds a lone surrogate {c!r}, which is not Unicode text") from None


class _BPE:
    """models/bpe: the vocabulary, the merge table, and word -> ids."""

    _CACHE_LIMIT = 1 << 16

    def __init__(self, model: dict):
        for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
            if model.get(key):
                raise _unsupported(f"BPE {key}={model[key]!r}")
        vocab = model.get("vocab")
        if not isinstance(vocab, dict) or not vocab:
            raise TokenizerJSONError("tokenizer.json: model.vocab must be a non-empty object mapping tokens to ids")
        bad = [(t, i) for t, i in vocab.items() if isinstance(i, bool) or not isinstance(i, int) or i < 0]
        if bad:
            raise TokenizerJSONError("tokenizer.json: model.vocab ids must be non-negative integers; "
                                     f"first bad entry {bad[0]!r}")
        self.id_to_token = {}
        for token, token_id in vocab.items():
            if token_id in self.id_to_token:
                raise TokenizerJSONError(f"tokenizer.json: model.vocab gives id {token_id} to both "
                                         f"{self.id_to_token[token_id]!r} and {token!r}")
            self.id_to_token[token_id] = token
        self.vocab = vocab
        self.size = max(self.id_to_token) + 1
        self.byte_fallback = bool(model.get("byte_fallback", False))
        self.fuse_unk = bool(model.get("fuse_unk", False))
        self.ignore_merges = bool(model.get("ignore_merges", False))
        self.unk_token = model.get("unk_token")
        if self.unk_token is not None and not isinstance(self.unk_token, str):
            raise TokenizerJSONError(f"tokenizer.json: model.unk_token must be a string or null, "
                                     f"got {self.unk_token!r}")
        self._merges = self._merge_table(model.get("merges"))
        self._in_merges = {key // self.size for key in self._merges} | {key % self.size for key in self._merges}
        # Every two-character substring of a multi-character piece: the places a symbol can span.
        self._pairs = {t[i:i + 2] for t in vocab if len(t) > 1 for i in range(len(t) - 1)}
        self._chars = {}   # character -> (kind, symbol ids, inert)
        self._cache = {}   # chunk -> ids

    def _merge_table(self, merges) -> dict[int, tuple[int, int]]:
        """{a_id * size + b_id: (rank, merged id)}, as model.rs builds its MergeMap."""
        if not isinstance(merges, list):
            raise TokenizerJSONError("tokenizer.json: model.merges must be a list of \"a b\" strings or [a, b] pairs")
        table, vocab, rank = {}, self.vocab, 0
        for merge in merges:
            if isinstance(merge, str):
                if merge.startswith("#version"):  # convert_merges_to_hashmap skips it and does not count it
                    continue
                parts = merge.split(" ")
            elif isinstance(merge, list) and all(isinstance(p, str) for p in merge):
                parts = merge
            else:
                raise TokenizerJSONError(f"tokenizer.json: merge {rank} is {merge!r}; "
                                         "expected \"a b\" or [\"a\", \"b\"]")
            if len(parts) != 2:
                raise TokenizerJSONError(f"tokenizer.json: merge {rank} is {merge!r}; it must name exactly two tokens")
            a, b = parts
            for token in (a, b, a + b):
                if token not in vocab:
                    raise TokenizerJSONError(f"tokenizer.json: merge {rank} ({a!r} + {b!r}) needs {token!r}, "
                                             "which is not in model.vocab")
            # A pair listed twice keeps its last rank: the map is built in file order.
            table[vocab[a] * self.size + vocab[b]] = (rank, vocab[a + b])
            rank += 1
        return table

    def _describe(self, c: str) -> tuple[int, tuple[int, ...], bool]:
        """merge_word's symbols for one character, and whether no merge ever involves them."""
        if c in self.vocab:
            kind, ids = _PLAIN, (self.vocab[c],)
        elif self.byte_fallback and all(f"<0x{b:02X}>" in self.vocab for b in _utf8(c)):
            kind, ids = _BYTES, tuple(self.vocab[f"<0x{b:02X}>"] for b in _utf8(c))
        elif self.unk_token is not None:
            if self.unk_token not in self.vocab:
                raise TokenizerJSONError(f"tokenizer.json: model.unk_token {self.unk_token!r} is not in model.vocab, "
                                         f"and the text has a character ({c!r}) that needs it")
            kind, ids = _UNK, (self.vocab[self.unk_token],)
        else:
            kind, ids = _DROP, ()  # no vocabulary id, no bytes, no unk: merge_word drops it
        # A dropped character is not inert: its neighbours' symbols meet across it.
        info = (kind, ids, kind != _DROP and not any(i in self._in_merges for i in ids))
        self._chars[c] = info
        return info

    def tokenize(self, word: str) -> list[int]:
        """Ids of one pre-tokenized word.

        The word is cut into chunks that are merged separately; that gives the ids BPE gives for
        the whole word. Proof: a merge joins two neighbouring symbols into the symbol of the
        vocabulary piece a + b, so a symbol covers consecutive characters, and if those are
        _PLAIN (each its own one-character piece) its piece's text is theirs, concatenated. So
        the only symbols that can cover both characters x and y at a cut are (1) one whose
        piece contains the two-character text xy, or (2) one grown from x's or y's own symbols.
        No such symbol exists if no vocabulary piece contains xy (both _PLAIN), or if x's or y's
        symbols appear in no merge pair ("inert": such a symbol is never joined to anything).
        Then no merge pair ever straddles the cut, so no heap entry does either; the entries of
        each side are popped in the same relative order (rank, then position) whether the
        sides run together or apart, and whether an entry is still valid depends only on the
        two symbols it joins. Finally merge_word's pending-unknown state must be empty at the
        cut (between an unknown character and the next _PLAIN one, unknowns are fused and
        byte symbols go ahead of the unknown), so a chunk ends only where it is.
        For Llama files, ' ' is '▁' and no piece has '▁' after another character except runs
        of '▁', so chunks are words with their leading '▁'; '\\n' is a byte symbol, inert.
        """
        if not word:
            return []
        if self.ignore_merges and word in self.vocab:
            return [self.vocab[word]]
        chars, pairs = self._chars, self._pairs
        out, start = [], 0
        prev_kind, prev_inert, pending_unk = _DROP, True, False
        for i, c in enumerate(word):
            kind, _, inert = chars.get(c) or self._describe(c)
            if i and not pending_unk and (inert or prev_inert or (
                    kind == _PLAIN and prev_kind == _PLAIN and word[i - 1:i + 1] not in pairs)):
                out += self._chunk(word[start:i])
                start = i
            if kind == _UNK:
                pending_unk = True
            elif kind == _PLAIN:
                pending_unk = False
            prev_kind, prev_inert = kind, inert
        out += self._chunk(word[start:])
        return out

    def _chunk(self, chunk: str) -> list[int]:
        ids = self._cache.get(chunk)
        if ids is None:
            if len(self._cache) >= self._CACHE_LIMIT:
                self._cache.clear()
            ids = self._cache[chunk] = self._merge(self._symbols(chunk))
        return ids

    def _symbols(self, chunk: str) -> list[int]:
        """merge_word's first loop: the symbols before any merge."""
        symbols, unk = [], None
        for c in chunk:
            kind, ids, _ = self._chars.get(c) or self._describe(c)
            if kind == _PLAIN:
                if unk is not None:
                    symbols.append(unk)
                    unk = None
                symbols.append(ids[0])
            elif kind == _BYTES:
                symbols.extend(ids)  # byte symbols do not flush a pending unknown (model.rs)
            elif kind == _UNK:
                if unk is not None and not self.fuse_unk:
                    symbols.append(unk)
                unk = ids[0]
        if unk is not None:
            symbols.append(unk)
        return symbols

    def _merge(self, symbols: list[int]) -> list[int]:
        """word.rs merge_all: pop the lowest (rank, position) merge; skip entries gone stale."""
        n = len(symbols)
        if n < 2:
            return symbols
        merges, size = self._merges, self.size
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        alive = [True] * n
        heap = []
        for i in range(n - 1):
            m = merges.get(symbols[i] * size + symbols[i + 1])
            if m is not None:
                heap.append((m[0], i, m[1]))
        heapq.heapify(heap)
        while heap:
            _, pos, new = heapq.heappop(heap)
            right = nxt[pos]
            if not alive[pos] or right == -1:
                continue
            m = merges.get(symbols[pos] * size + symbols[right])
            if m is None or m[1] != new:  # the pair changed since the entry was pushed
                continue
            symbols[pos] = new
            alive[right] = False
            after = nxt[pos] = nxt[right]
            if after != -1:
                prv[after] = pos
            before = prv[pos]
            if before != -1:
                m = merges.get(symbols[before] * size + new)
                if m is not None:
                    heapq.heappush(heap, (m[0], before, m[1]))
            if after != -1:
                m = merges.get(new * size + symbols[after])
                if m is not None:
                    heapq.heappush(heap, (m[0], pos, m[1]))
        return [s for s, a in zip(symbols, alive) if a]


class _Unigram:
    """models/unigram (model.rs encode_optimized and tokenize, which follow sentencepiece's
    unigram_model.cc): a word is cut into the pieces whose scores sum highest (Viterbi).

    Going through the word's characters in order, every piece that starts at the current
    position extends the best path that ends there; a path ending at a later position is replaced
    only by a strictly better one (so on ties the piece starting first wins). A character that is
    no piece by itself also gets the unknown id, scored min_score - 10. Back from the end, runs of
    unknown characters are fused into one string; a string that is not a piece becomes its
    UTF-8 bytes as <0xNN> pieces (byte_fallback) or the unknown id.
    """

    _UNK_PENALTY = 10.0

    def __init__(self, model: dict):
        vocab = model.get("vocab")
        if not isinstance(vocab, list) or not vocab or not all(
                isinstance(e, list) and len(e) == 2 and isinstance(e[0], str)
                and isinstance(e[1], (int, float)) and not isinstance(e[1], bool) for e in vocab):
            raise TokenizerJSONError("tokenizer.json: a Unigram model.vocab must be a non-empty list of "
                                     "[piece, score] pairs")
        self.vocab, self.id_to_token, self.scores = {}, {}, []
        for token_id, (piece, score) in enumerate(vocab):
            if piece in self.vocab:
                raise TokenizerJSONError(f"tokenizer.json: Unigram piece {piece!r} is listed twice")
            self.vocab[piece], self.id_to_token[token_id] = token_id, piece
            self.scores.append(float(score))
        self.size = len(vocab)
        self.unk_id = model.get("unk_id")
        if self.unk_id is not None and (isinstance(self.unk_id, bool) or not isinstance(self.unk_id, int)
                                        or not 0 <= self.unk_id < self.size):
            raise TokenizerJSONError(f"tokenizer.json: Unigram unk_id {self.unk_id!r} is not an id of its vocab")
        self.byte_fallback = bool(model.get("byte_fallback", False))
        self._unk_score = min(self.scores) - self._UNK_PENALTY
        self._longest = max(len(piece) for piece in self.vocab)
        self._cache = {}

    def tokenize(self, word: str) -> list[int]:
        """Ids of one pre-tokenized word."""
        ids = self._cache.get(word)
        if ids is None:
            if len(self._cache) >= _BPE._CACHE_LIMIT:
                self._cache.clear()
            ids = self._cache[word] = [i for s in self._segment(word) for i in self._ids(s)]
        return ids

    def _segment(self, word: str) -> list[str]:
        n = len(word)
        score, start_of, id_of = [0.0] * (n + 1), [None] * (n + 1), [0] * (n + 1)
        for start in range(n):
            base, single = score[start], False
            for end in range(start + 1, min(n, start + self._longest) + 1):
                token_id = self.vocab.get(word[start:end])
                if token_id is None:
                    continue
                candidate = self.scores[token_id] + base
                if start_of[end] is None or candidate > score[end]:
                    score[end], start_of[end], id_of[end] = candidate, start, token_id
                single = single or end == start + 1
            if not single:
                if self.unk_id is None:
                    raise NpllamaError(f"the text holds {word[start]!r}, which this tokenizer.json's Unigram "
                                       "vocabulary lacks, and the model has no unk_id")
                candidate = self._unk_score + base
                if start_of[start + 1] is None or candidate > score[start + 1]:
                    score[start + 1], start_of[start + 1], id_of[start + 1] = candidate, start, self.unk_id
        strings, unknown, end = [], [], n
        while end > 0:
            start = start_of[end]
            if id_of[end] == self.unk_id:
                unknown.append(word[start:end])
            else:
                if unknown:
                    strings.append("".join(reversed(unknown)))
                    unknown = []
                strings.append(self.id_to_token[id_of[end]])
            end = start
        if unknown:
            strings.append("".join(reversed(unknown)))
        return strings[::-1]

    def _ids(self, string: str) -> list[int]:
        token_id = self.vocab.get(string)
        if token_id is not None:
            return [token_id]
        if self.byte_fallback:
            pieces = [f"<0x{b:02X}>" for b in _utf8(string)]
            if all(p in self.vocab for p in pieces):
                return [self.vocab[p] for p in pieces]
        return [self.unk_id]


# ---------------------------------------------------------------- decoder

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class _Decoder:
    """decoders/*.rs as: per-token steps, ByteFallback, per-token steps, Fuse, leading Strips.

    decode_chain passes a list of strings through each step. Every step but ByteFallback and
    Fuse maps each string on its own (Metaspace also looks at whether it is the first); Fuse
    joins the list, so steps after it see the whole text. Keeping ByteFallback before Fuse and
    only stop=0 Strips after it means a text can be decoded in pieces cut between tokens that
    are not both byte pieces, given whether the piece is the first and how many leading
    characters the Strips may still remove: what _Stream relies on.
    """

    def __init__(self, node):
        self.before, self.after, self.strips = [], [], []  # before / after ByteFallback; after Fuse
        self.byte_fallback = fused = False
        steps = _steps(node, "decoder", "decoders")
        if not steps:
            raise _unsupported("a missing decoder (the library would join tokens with spaces)")
        for step in steps:
            kind = step["type"]
            if fused and not (kind == "Strip" and step.get("stop", 0) == 0):
                raise _unsupported(f"decoder step {kind!r} after Fuse (only Strip with stop=0 can follow Fuse)")
            if kind == "ByteFallback":
                if self.byte_fallback:
                    raise _unsupported("a second decoder ByteFallback")
                self.byte_fallback = True
            elif kind == "Fuse":
                fused = True
            elif kind == "Strip":
                content = _char(step, "content", "decoder Strip")
                start, stop = step.get("start", 0), step.get("stop", 0)
                if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (start, stop)):
                    raise TokenizerJSONError("tokenizer.json: decoder Strip needs counts start/stop >= 0, "
                                             f"got {start!r}, {stop!r}")
                if fused:
                    self.strips.append((content, start))
                else:
                    self._per_token(self._strip(content, start, stop))
            elif kind == "Replace":
                replace = _Replace(step, "decoder Replace")
                self._per_token(lambda t, first, replace=replace: replace(t))
            elif kind == "Metaspace":
                repl = _char(step, "replacement", "decoder Metaspace")
                scheme = _prepend_scheme(step, "decoder Metaspace")
                # metaspace.rs decode_chain: in the first token every replacement character goes
                # (unless prepend_scheme is never); elsewhere each becomes a space.
                self._per_token(lambda t, first, repl=repl, drop=scheme != "never":
                                t.replace(repl, "" if first and drop else " "))
            else:
                raise _unsupported(f"decoder {kind!r}")

    def _per_token(self, f):
        (self.after if self.byte_fallback else self.before).append(f)

    @staticmethod
    def _strip(content, start, stop):
        def strip(t, first):  # strip.rs: up to `start` leading and `stop` trailing `content`
            a = 0
            while a < min(start, len(t)) and t[a] == content:
                a += 1
            b = len(t)
            while len(t) - b < stop and b > a and t[b - 1] == content:
                b -= 1
            return t[a:b]
        return strip

    def stage(self, token: str, first: bool) -> str:
        """A token as ByteFallback sees it."""
        for f in self.before:
            token = f(token, first)
        return token

    def is_byte(self, token: str, first: bool) -> bool:
        return self.byte_fallback and _BYTE_PIECE.fullmatch(self.stage(token, first)) is not None

    def decode(self, tokens: list[str], first: bool, budgets: list[int]) -> str:
        """The text of `tokens`; `first`: they start the text; `budgets`: what the Strips after
        Fuse may still remove (updated in place)."""
        tokens = [self.stage(t, first and i == 0) for i, t in enumerate(tokens)]
        if self.byte_fallback:
            tokens = self._fuse_bytes(tokens)
        for f in self.after:
            tokens = [f(t, first and i == 0) for i, t in enumerate(tokens)]
        text = "".join(tokens)
        for k, (content, _) in enumerate(self.strips):
            removed = 0
            while removed < min(budgets[k], len(text)) and text[removed] == content:
                removed += 1
            text = text[removed:]
            budgets[k] = 0 if text else budgets[k] - removed
        return text

    @staticmethod
    def _fuse_bytes(tokens: list[str]) -> list[str]:
        """byte_fallback.rs: a run of <0xNN> pieces becomes its UTF-8 text, or one U+FFFD per
        byte when the run as a whole is not valid UTF-8."""
        out, run = [], bytearray()
        for t in tokens + [None]:
            m = _BYTE_PIECE.fullmatch(t) if t is not None else None
            if m:
                run.append(int(m.group(1), 16))
                continue
            if run:
                try:
                    out.append(run.decode("utf-8"))
                except UnicodeDecodeError:
                    out.extend("\ufffd" * len(run))
                run = bytearray()
            if t is not None:
                out.append(t)
        return out


# ---------------------------------------------------------------- the shared surface

def _load_json(text, what: str) -> dict:
    if isinstance(text, dict):
        return text
    if not isinstance(text, (str, bytes, bytearray)):
        raise TokenizerJSONError(f"{what} must be JSON text or a dict, got {type(text).__name__}")
    d = parse_json(text, what, TokenizerJSONError)
    if not isinstance(d, dict):
        raise TokenizerJSONError(f"{what} must hold a JSON object, got {type(d).__name__}")
    return d


def _text(value) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", errors="replace")
    return json.dumps(value, ensure_ascii=False)


def _token_name(value, key: str) -> str | None:
    """tokenizer_config.json writes a special token as "<s>" or {"content": "<s>", ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise TokenizerJSONError(f"tokenizer_config.json: {key} must be a string, an object with 'content', or null")
    return value


def _template_ids(node) -> tuple[list[int], list[int]]:
    """The ids a post-processor puts before and after a single text (processors/template.rs)."""
    processors = _steps(node, "post_processor", "processors")
    for p in processors:
        if p["type"] not in ("TemplateProcessing", "ByteLevel"):  # ByteLevel only adjusts offsets
            raise _unsupported(f"post_processor {p['type']!r}")
    templates = [p for p in processors if p["type"] == "TemplateProcessing"]
    if len(templates) > 1:
        raise _unsupported("more than one post_processor TemplateProcessing")
    before, after = [], []
    if not templates:
        return before, after
    single, specials = templates[0].get("single"), templates[0].get("special_tokens", {})
    if not isinstance(single, list) or not isinstance(specials, dict):
        raise TokenizerJSONError("tokenizer.json: TemplateProcessing needs a list 'single' "
                                 "and an object 'special_tokens'")
    side = before
    for piece in single:
        if isinstance(piece, dict) and "Sequence" in piece:
            side = after
            continue
        name = piece.get("SpecialToken", {}).get("id") if isinstance(piece, dict) else None
        entry = specials.get(name) if isinstance(name, str) else None
        ids = entry.get("ids") if isinstance(entry, dict) else None
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise TokenizerJSONError(f"tokenizer.json: TemplateProcessing piece {piece!r:.80} names no special token "
                                     "with ids in 'special_tokens'")
        side.extend(ids)
    return before, after


class _HFTokenizerBase:
    """What both readers share: the two files, BOS/EOS settings, JSON and folder round trips."""

    def __init__(self, tokenizer_json, tokenizer_config=None):
        self._json = _load_json(tokenizer_json, "tokenizer.json")
        check_tokenizer_regexes(self._json)     # before any text meets them, whichever engine runs them
        self._json_text = _text(tokenizer_json)
        self._config = {} if tokenizer_config is None else _load_json(tokenizer_config, "tokenizer_config.json")
        self._config_text = _text(tokenizer_config)

    def _resolve_specials(self, token_to_id):
        """bos_id, eos_id, add_bos, add_eos from the config and the post-processor template."""
        config = self._config
        before, after = _template_ids(self._json.get("post_processor"))
        found = {}
        for key, side in (("bos_token", before), ("eos_token", after)):
            if key in config:
                name = _token_name(config[key], key)
                found[key] = None if name is None else token_to_id(name)
                if name is not None and found[key] is None:
                    raise TokenizerJSONError(f"tokenizer_config.json: {key} {name!r} is not a token of tokenizer.json")
            else:  # no config entry: the template's one token before / after the text
                found[key] = side[0] if len(side) == 1 else None
        self.bos_id, self.eos_id = found["bos_token"], found["eos_token"]
        if "add_bos_token" in config or "add_eos_token" in config:
            # transformers 5 then rebuilds the template from these flags (update_post_processor)
            before = [self.bos_id] if config.get("add_bos_token") and self.bos_id is not None else []
            after = [self.eos_id] if config.get("add_eos_token") and self.eos_id is not None else []
        for ids, own, what in ((before, self.bos_id, "BOS"), (after, self.eos_id, "EOS")):
            if ids and ids != [own]:
                raise TokenizerJSONError(f"tokenizer.json: the post_processor adds ids {ids}, but encode can add only "
                                         f"{what} (id {own}) there")
        self.add_bos, self.add_eos = bool(before), bool(after)

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise NpllamaError(f"encode needs a str, got {type(text).__name__}")
        return with_bos_eos(self._encode(text), self, bos, eos, "this tokenizer.json")

    def hf_files(self) -> dict[str, str]:
        """{file name: text} to write into a Hugging Face folder: the files this was read from."""
        files = {"tokenizer.json": self._json_text}
        if self._config_text is not None:
            files["tokenizer_config.json"] = self._config_text
        return files

    def to_json(self) -> str:
        return json.dumps({"type": "hf_tokenizer_json", "tokenizer_json": self._json_text,
                           "tokenizer_config_json": self._config_text}, ensure_ascii=False)

    def __eq__(self, other):
        return (type(other) is type(self) and other._json_text == self._json_text
                and other._config_text == self._config_text)

    def __repr__(self):
        return (f"{type(self).__name__}(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id}, "
                f"add_bos={self.add_bos}, add_eos={self.add_eos})")


def with_bos_eos(ids: list[int], tokenizer, bos: bool, eos: bool, what: str) -> list[int]:
    """ids with tokenizer.bos_id before them and tokenizer.eos_id after, as asked; an error naming
    `what` when the tokenizer has no such token."""
    for wanted, name in ((bos, "bos"), (eos, "eos")):
        if wanted and getattr(tokenizer, f"{name}_id") is None:
            raise NpllamaError(f"{what} has no {name.upper()} token; encode without {name}=True")
    return [tokenizer.bos_id] * bool(bos) + ids + [tokenizer.eos_id] * bool(eos)


class HFTokenizer(_HFTokenizerBase):
    """A Llama-family BPE or Unigram tokenizer.json (plus its tokenizer_config.json), run in pure Python.

    HFTokenizer(tokenizer_json, tokenizer_config=None): each the file's text (or bytes) or its
    parsed dict. Raises TokenizerJSONError for a malformed file, UnsupportedTokenizerError for
    a piece this reader does not implement (see the module docstring).
    """

    def __init__(self, tokenizer_json, tokenizer_config=None):
        super().__init__(tokenizer_json, tokenizer_config)
        d = self._json
        model = d.get("model")
        if not isinstance(model, dict):
            raise TokenizerJSONError("tokenizer.json has no 'model' object; it is not a tokenizers file")
        kind = model.get("type", "BPE")
        if kind not in ("BPE", "Unigram"):
            raise _unsupported(f"model type {kind!r} (only BPE and Unigram)")
        self._normalizers = _compile_normalizer(d.get("normalizer"))
        self._pre = _compile_pre_tokenizer(d.get("pre_tokenizer"))
        self._model = _BPE(model) if kind == "BPE" else _Unigram(model)
        self._added = _AddedTokens(d.get("added_tokens", []), self._model.vocab, lambda s: self._normalize(s)[0])
        self._decoder = _Decoder(d.get("decoder"))
        self.vocab_size = max([self._model.size] + [i + 1 for i in self._added.token_of])
        self._resolve_specials(self.token_to_id)

    @classmethod
    def from_folder(cls, folder) -> "HFTokenizer":
        """Read folder/tokenizer.json and, when present, folder/tokenizer_config.json."""
        return cls(*_read_folder(folder))

    def token_to_id(self, token: str) -> int | None:
        return self._added.id_of.get(token, self._model.vocab.get(token))

    def _normalize(self, s: str, origins: list[int] | None = None) -> tuple[str, list[int] | None]:
        for f in self._normalizers:
            s, origins = f(s, origins)
        return s, origins

    def _encode(self, text: str) -> list[int]:
        ids = []
        # Track origins only where Metaspace's "first" needs them: in the piece at offset 0.
        track = self._pre is not None and self._pre[1] == "first" and bool(self._normalizers)
        for start, stop, token_id in self._added.split(text, normalized=False):
            if token_id is not None:
                ids.append(token_id)
                continue
            origins = list(range(stop)) if track and start == 0 else None
            normalized, origins = self._normalize(text[start:stop], origins)
            for a, b, sub_id in self._added.split(normalized, normalized=True):
                if sub_id is not None:
                    ids.append(sub_id)
                    continue
                if a == b:  # pre_tokenizer.rs split drops empty pieces
                    continue
                at_start = start == 0 and (a if origins is None else origins[a]) == 0
                for word in self._pre_tokenize(normalized[a:b], at_start):
                    ids += self._model.tokenize(word)
        return ids

    def _pre_tokenize(self, piece: str, at_start: bool) -> list[str]:
        """metaspace.rs pre_tokenize; at_start: the piece begins at offset 0 of the original text."""
        if self._pre is None:
            return [piece]
        repl, scheme, split = self._pre
        piece = piece.replace(" ", repl)
        if (scheme == "always" or (scheme == "first" and at_start)) and not piece.startswith(repl):
            piece = repl + piece
        if not split:
            return [piece]
        return [p for p in re.split(f"(?={re.escape(repl)})", piece) if p]  # cut before each (MergedWithNext)

    def _token(self, token_id) -> str | None:
        """The string decode passes to the decoder, or None for a special token (left out)."""
        token_id = _check_id(token_id, self.vocab_size)
        token = self._added.token_of.get(token_id)
        if token is None:
            token = self._model.id_to_token.get(token_id)
            if token is None:
                raise NpllamaError(f"token id {token_id} is not in this tokenizer.json (its vocabulary has gaps)")
        return None if token in self._added.special else token

    def decode(self, ids) -> str:
        tokens = [t for t in map(self._token, ids) if t is not None]
        return self._decoder.decode(tokens, True, [n for _, n in self._decoder.strips])

    def stream_decoder(self) -> "_Stream":
        return _Stream(self)


def _check_id(token_id, vocab_size: int) -> int:
    try:
        i = int(token_id)
    except (TypeError, ValueError):
        raise NpllamaError(f"token id {token_id!r} is not an integer") from None
    if not 0 <= i < vocab_size:
        raise NpllamaError(f"token id {i} is outside [0, {vocab_size}) for this tokenizer.json")
    return i


class _Stream:
    """Incremental decoding: push(id) returns the text that id completes; flush() the rest.

    Tokens wait in a window that is decoded when a token arrives that is not a byte piece: the
    decoder's steps are per token except byte runs, the first token and the leading Strips
    after Fuse (see _Decoder), so a cut after a non-byte token changes nothing. A byte run is
    held until it ends (a non-byte token or flush()), because the library turns a whole run
    into U+FFFD when any of it is invalid UTF-8; a multi-byte character therefore never comes
    out in halves. Special ids are left out, as decode leaves them out before the decoder runs
    (so they neither print nor end a byte run). Every push() and the final flush() concatenated
    equal decode(ids).
    """

    def __init__(self, tokenizer: HFTokenizer):
        self._tokenizer = tokenizer
        self._decoder = tokenizer._decoder
        self._window = []
        self._first = True
        self._budgets = [n for _, n in self._decoder.strips]

    def push(self, token_id: int) -> str:
        token = self._tokenizer._token(token_id)
        if token is None:
            return ""
        self._window.append(token)
        if self._decoder.is_byte(token, self._first and len(self._window) == 1):
            return ""
        return self.flush()

    def flush(self) -> str:
        if not self._window:
            return ""
        text = self._decoder.decode(self._window, self._first, self._budgets)
        self._window, self._first = [], False
        return text


# ---------------------------------------------------------------- the `tokenizers` fallback

def _library_call(run):
    """run(), with a panic of the `tokenizers` library (its Rust code gave up: e.g. a regex past
    Oniguruma's retry limit) as a TokenizerJSONError instead of pyo3's BaseException."""
    try:
        return run()
    except BaseException as e:
        if type(e).__name__ != "PanicException":
            raise
        raise TokenizerJSONError(f"the `tokenizers` package failed on this tokenizer.json: "
                                 f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


class LibraryHFTokenizer(_HFTokenizerBase):
    """Any tokenizer.json, run by Hugging Face's `tokenizers` package (an optional dependency).

    hf_tokenizer() uses it only for files HFTokenizer does not support (WordPiece, Unigram,
    byte-level BPE, ...). Same API and BOS/EOS rules as HFTokenizer.
    """

    def __init__(self, tokenizer_json, tokenizer_config=None):
        super().__init__(tokenizer_json, tokenizer_config)
        try:
            import tokenizers
        except ImportError:
            raise UnsupportedTokenizerError("LibraryHFTokenizer needs Hugging Face's `tokenizers` package "
                                            "(pip install tokenizers)") from None
        try:
            self._tok = tokenizers.Tokenizer.from_str(self._json_text)
        except Exception as e:  # the library reports every problem as a generic Exception
            raise TokenizerJSONError(f"the `tokenizers` package cannot read this tokenizer.json: {e}") from None
        self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values()) + 1
        self._resolve_specials(self._tok.token_to_id)

    def _encode(self, text: str) -> list[int]:
        return _library_call(lambda: self._tok.encode(text, add_special_tokens=False).ids)

    def _check(self, ids) -> list[int]:
        ids = [_check_id(i, self.vocab_size) for i in ids]
        missing = [i for i in ids if self._tok.id_to_token(i) is None]
        if missing:
            raise NpllamaError(f"token ids {missing[:10]} are not in this tokenizer.json (its vocabulary has gaps)")
        return ids

    def decode(self, ids) -> str:
        ids = self._check(ids)
        return _library_call(lambda: self._tok.decode(ids, skip_special_tokens=True))

    def stream_decoder(self) -> "_LibraryStream":
        return _LibraryStream(self)


class _LibraryStream:
    """Incremental decoding for decoders we do not model, as tokenizers' DecodeStream does it.

    The text of ids[start:] minus that of ids[start:read] is emitted once it grows and does not
    end in U+FFFD (an unfinished byte sequence); then start moves to read, so the tokens of the
    last emission stay as context and a decoder's start-of-text rules are not applied again.
    flush() emits what is left. This equals decode(ids) for decoders whose text only grows at its end, which
    the common ones (ByteLevel, Metaspace, ByteFallback) are.
    """

    def __init__(self, tokenizer: LibraryHFTokenizer):
        self._tokenizer = tokenizer
        self._ids, self._start, self._read = [], 0, 0

    def _diff(self) -> str:
        decode = self._tokenizer.decode
        done = decode(self._ids[self._start:self._read])
        return decode(self._ids[self._start:])[len(done):]

    def push(self, token_id: int) -> str:
        self._ids += self._tokenizer._check([token_id])
        text = self._diff()
        if not text or text.endswith("\ufffd"):
            return ""
        self._start, self._read = self._read, len(self._ids)
        return text

    def flush(self) -> str:
        text = self._diff()
        self._start = self._read = len(self._ids)
        return text


# ---------------------------------------------------------------- entry points

def hf_tokenizer(tokenizer_json, tokenizer_config=None):
    """HFTokenizer for the file, or LibraryHFTokenizer when only `tokenizers` can run it.

    Raises UnsupportedTokenizerError (install hint included) when the file needs the
    `tokenizers` package and it is not installed, TokenizerJSONError when the file is malformed.
    """
    try:
        return HFTokenizer(tokenizer_json, tokenizer_config)
    except UnsupportedTokenizerError:
        if not _library_installed():
            raise
    return LibraryHFTokenizer(tokenizer_json, tokenizer_config)


def _library_installed() -> bool:
    try:
        importlib.import_module("tokenizers")
    except ImportError:
        return False
    return True


def _read_folder(folder) -> tuple[str, str | None]:
    folder = Path(os.fspath(folder))
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise MissingFileError(f"{path} not found; a Hugging Face tokenizer folder holds tokenizer.json "
                                "(transformers' save_pretrained writes it)")
    config = folder / "tokenizer_config.json"
    try:
        return (path.read_text(encoding="utf-8"),
                config.read_text(encoding="utf-8") if config.is_file() else None)
    except UnicodeDecodeError as e:
        raise TokenizerJSONError(f"{folder}: a tokenizer file is not UTF-8 text: {e}") from None


def tokenizer_from_folder(folder):
    """For a model loader: (tokenizer or None, warning or None) for folder/tokenizer.json.

    (None, None) when the folder has no tokenizer.json; (None, message) when it has one that
    cannot be used, the message saying why and what to pass or install.
    """
    folder = Path(os.fspath(folder))
    if not (folder / "tokenizer.json").is_file():
        return None, None
    instead = "pass --tokenizer PATH (a sentencepiece tokenizer.model)"
    try:
        return hf_tokenizer(*_read_folder(folder)), None
    except UnsupportedTokenizerError as e:  # its message says what to install
        return None, f"cannot use {folder / 'tokenizer.json'}: {e}; or {instead}"
    except (TokenizerJSONError, UnboundedRegexError, OSError) as e:
        return None, f"cannot use {folder / 'tokenizer.json'}: {e}; {instead}"


def from_json_dict(d: dict):
    """The tokenizer a {"type": "hf_tokenizer_json", ...} dict (from to_json()) describes."""
    text, config = d.get("tokenizer_json"), d.get("tokenizer_config_json")
    if not isinstance(text, str) or not (config is None or isinstance(config, str)):
        raise TokenizerJSONError('tokenizer JSON {"type": "hf_tokenizer_json"} needs the string "tokenizer_json" '
                                 'and "tokenizer_config_json" as a string or null')
    return hf_tokenizer(text, config)
