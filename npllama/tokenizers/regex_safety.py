"""tokenizer.json regexes, checked for unbounded backtracking before any text meets them.

Python's `re` and the Oniguruma engine of Hugging Face's `tokenizers` both backtrack, and
neither has a time limit (Oniguruma's retry limit ends in a Rust panic). A pattern such as
`(?:a+)+$` takes 2^n steps on "hello " + "a"*n + "c": a tokenizer.json that carries one
would hang every encode. So each Regex of a tokenizer.json's normalizer, pre-tokenizer and
decoder is parsed here, as written (Oniguruma syntax; Python's own parser would first merge
`a|a` into `a` and `\\p{L}|[a-z]` into one class, hiding what Oniguruma runs), and refused
with one line naming it when it can backtrack without bound:

  - inside a repeat, a part that can stop early or go on: an inner repeat, or a choice with a
    branch that matches nothing, whose next characters meet what may follow it (the next
    round of the outer repeat included): (a+)+, (?: ?[a-z]+)+, (a|aa)*, (a|a)*; not
    (?:\\r?\\n)+ or (ab+)+, which read one way only;
  - a repeated choice whose branches can start with the same character ((\\p{L}|[a-z])+);
  - a repeat of something that can match nothing ((a?)*, (a*)+);
  - three or more unbounded repeats in a row over shared characters (a*a*a*c: polynomial
    of degree 3 and up); two in a row (\\s*[\\r\\n]+, in the GPT-4-style patterns of Llama 3
    and Qwen) are allowed;
  - backreferences.

Character sets are compared on a finite sample: ASCII, a few characters of every Unicode
category and script a tokenizer pattern names, and every literal and range end of the pattern
itself, so that two ranges, or a range and a class, overlap here exactly when they share one
of those characters. A pattern this reader cannot parse (POSIX brackets, nested classes,
conditionals) is left to the engine that runs it.
"""

from __future__ import annotations

import re
import unicodedata

from ..errors import NpllamaError


class UnboundedRegexError(NpllamaError):
    """A tokenizer.json regex that can backtrack without bound: encoding with it could hang."""


class _Unparsed(NpllamaError):
    """Syntax this reader does not know: the pattern is left to its engine."""


INF = float("inf")

# ----------------------------------------------------------------------------- character classes

_SAMPLE = ("\t\n\x0b\x0c\r\x1c\x85\xa0\xad\xb2\xb5\xbd\xc0\xd7\xdf\xe9\xf7\xff\u0100\u0101\u017f\u0180\u024f"
           "\u0300\u0301\u0370\u03b1\u03c9\u0400\u0430\u05d0\u0627\u0660\u06f0\u0900\u0915\u0966\u0e01\u0e50"
           "\u1100\u1680\u2000\u2009\u200b\u2018\u201c\u2026\u2028\u2029\u202f\u205f\u20ac\u2160\u2581\u3000"
           "\u3001\u3042\u30a2\u4e00\u4e2d\u9fa5\uac00\ud7a3\uff01\uff10\uff21\uff41\ufffd\U0001f600\U00010400")
_UNIVERSE = [chr(i) for i in range(32, 127)] + list(_SAMPLE)
_SCRIPTS = {"han": "CJK", "hiragana": "HIRAGANA", "katakana": "KATAKANA", "hangul": "HANGUL", "latin": "LATIN",
            "greek": "GREEK", "cyrillic": "CYRILLIC", "arabic": "ARABIC", "hebrew": "HEBREW", "thai": "THAI",
            "devanagari": "DEVANAGARI"}
_CATEGORY_NAMES = {"letter": "L", "mark": "M", "number": "N", "punctuation": "P", "symbol": "S", "separator": "Z",
                   "other": "C", "digit": "Nd", "punct": "P"}


def _is_word(ch: str) -> bool:
    return ch.isalnum() or ch == "_" or unicodedata.category(ch)[0] == "M"


_NAMED = {"alpha": str.isalpha, "alphabetic": str.isalpha, "space": str.isspace, "whitespace": str.isspace,
          "upper": str.isupper, "uppercase": str.isupper, "lower": str.islower, "lowercase": str.islower,
          "alnum": str.isalnum, "word": _is_word, "any": lambda ch: True}
_ESCAPES = {"d": str.isdecimal, "s": str.isspace, "w": _is_word, "h": lambda ch: ch in "0123456789abcdefABCDEF"}
_LITERAL_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a", "e": "\x1b", "0": "\0"}


def _property(name: str):
    """A predicate on characters for \\p{name}; an unknown name may be any character."""
    key = name.replace("_", "").replace(" ", "").replace("-", "").lower()
    if key in _NAMED:
        return _NAMED[key]
    if key in _SCRIPTS:
        return lambda ch, script=_SCRIPTS[key]: unicodedata.name(ch, "").startswith(script)
    category = _CATEGORY_NAMES.get(key, name if 1 <= len(name) <= 2 and name[0] in "LMNPSZC" else None)
    if category is None:
        return _NAMED["any"]
    return lambda ch: unicodedata.category(ch).startswith(category)


# ----------------------------------------------------------------------------- the parser

# Nodes: ("set", predicate) one character; ("seq", [nodes]); ("alt", [nodes]); ("repeat", node,
# lo, hi, possessive); ("look", node) a zero-width assertion around node; ("anchor",).

class _Parser:
    """Oniguruma (Ruby syntax) patterns as tokenizer.json files hold them, into the nodes above."""

    MAX_DEPTH = 100                             # groups nested deeper are refused (the parsers recurse)

    def __init__(self, pattern: str):
        self.s, self.i, self.depth = pattern, 0, 0
        self.literals: set[str] = set()        # join the sample universe

    def peek(self, n: int = 1) -> str:
        return self.s[self.i:self.i + n]

    def take(self) -> str:
        if self.i >= len(self.s):
            raise _Unparsed("unexpected end")
        ch = self.s[self.i]
        self.i += 1
        return ch

    def parse(self):
        node = self.alternation(False)
        if self.i != len(self.s):
            raise _Unparsed(f"unexpected {self.peek()!r}")
        return node

    def alternation(self, ignore_case: bool):
        branches = [self.sequence(ignore_case)]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.sequence(ignore_case))
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def sequence(self, ignore_case: bool):
        items = []
        while self.i < len(self.s) and self.peek() not in "|)":
            if self.peek(3) in ("(?i", "(?-") and re.match(r"\(\?[imx]*(?:-[imx]*)?\)", self.s[self.i:]):
                flags = re.match(r"\(\?([imx]*)(?:-([imx]*))?\)", self.s[self.i:])
                ignore_case = ("i" in flags.group(1)) or (ignore_case and "i" not in (flags.group(2) or ""))
                self.i += flags.end()
                continue
            items.append(self.quantified(self.atom(ignore_case)))
        return ("seq", items)

    def quantified(self, node):
        while True:
            ch, bounds = self.peek(), None
            if ch in ("*", "+", "?"):
                self.i += 1
                bounds = {"*": (0, INF), "+": (1, INF), "?": (0, 1)}[ch]
                possessive = self.peek() == "+"
                if self.peek() in ("?", "+"):
                    self.i += 1
            elif ch == "{" and (m := re.match(r"\{(\d*)(?:(,)(\d*))?\}", self.s[self.i:])) and (m.group(1) or m.group(3)):
                self.i += m.end()
                lo = int(m.group(1) or 0)
                hi = INF if m.group(2) and not m.group(3) else int(m.group(3) or lo)
                bounds, possessive = (lo, hi), False
                if self.peek() == "?":
                    self.i += 1
            if bounds is None:
                return node
            node = ("repeat", node, bounds[0], bounds[1], possessive)

    def atom(self, ignore_case: bool):
        ch = self.take()
        if ch == "(":
            return self.group(ignore_case)
        if ch == "[":
            return ("set", self.char_class(ignore_case))
        if ch == ".":
            return ("set", lambda c: c != "\n")
        if ch in "^$":
            return ("anchor",)
        if ch == "\\":
            return self.escape(ignore_case, in_class=False)
        if ch in "*+?":
            raise _Unparsed("nothing to repeat")
        return ("set", self.literal(ch, ignore_case))

    def group(self, ignore_case: bool):
        self.depth += 1
        if self.depth > self.MAX_DEPTH:
            raise UnboundedRegexError(f"its groups nest more than {self.MAX_DEPTH} deep")
        try:
            return self._group(ignore_case)
        finally:
            self.depth -= 1

    def _group(self, ignore_case: bool):
        if self.peek() != "?":
            inner = self.alternation(ignore_case)
        else:
            m = re.match(r"\?(:|=|!|<=|<!|>|P?<[A-Za-z_]\w*>|[imx]*(?:-[imx]*)?:)", self.s[self.i:])
            if m is None:
                raise _Unparsed("group syntax")
            self.i += m.end()
            kind = m.group(1)
            if kind.endswith(":") and kind != ":":
                flags = re.match(r"([imx]*)(?:-([imx]*))?:", kind)
                ignore_case = ("i" in flags.group(1)) or (ignore_case and "i" not in (flags.group(2) or ""))
            inner = self.alternation(ignore_case)
            if kind in ("=", "!", "<=", "<!"):
                inner = ("look", inner)
        if self.take() != ")":
            raise _Unparsed("unclosed group")
        return inner

    def literal(self, ch: str, ignore_case: bool):
        self.literals.add(ch)
        same = {ch, ch.lower(), ch.upper()} if ignore_case else {ch}
        return lambda c: c in same

    def escape(self, ignore_case: bool, in_class: bool):
        """The node (or, in a class, the predicate) of the escape after a backslash."""
        ch = self.take()
        wrap = (lambda pred: pred) if in_class else (lambda pred: ("set", pred))
        if ch.lower() in _ESCAPES:
            pred = _ESCAPES[ch.lower()]
            return wrap(pred if ch.islower() else (lambda c, p=pred: not p(c)))
        if ch in "pP" and (m := re.match(r"\{(\^?)([^}]*)\}", self.s[self.i:])):
            self.i += m.end()
            pred = _property(m.group(2))
            return wrap(pred if (ch == "P") == bool(m.group(1)) else (lambda c, p=pred: not p(c)))
        if ch == "x" and (m := re.match(r"\{([0-9a-fA-F]{1,8})\}|([0-9a-fA-F]{2})", self.s[self.i:])):
            self.i += m.end()
            return wrap(self.literal(chr(int(m.group(1) or m.group(2), 16)), ignore_case))
        if ch == "u" and (m := re.match(r"[0-9a-fA-F]{4}", self.s[self.i:])):
            self.i += m.end()
            return wrap(self.literal(chr(int(m.group(), 16)), ignore_case))
        if ch in _LITERAL_ESCAPES:
            return wrap(self.literal(_LITERAL_ESCAPES[ch], ignore_case))
        if not in_class and ch in "AzZbBG":
            return ("anchor",)
        if not in_class and (ch in "123456789k"):
            raise UnboundedRegexError("backreference")
        if ch.isalnum():
            raise _Unparsed(f"escape \\{ch}")
        return wrap(self.literal(ch, ignore_case))

    def char_class(self, ignore_case: bool):
        """The predicate of a bracketed class, after its '['."""
        negate = self.peek() == "^"
        self.i += negate
        tests, first = [], True
        while first or self.peek() != "]":
            if self.peek() in ("[", "") or self.peek(2) == "&&":
                raise _Unparsed("nested class, POSIX bracket or intersection")
            first = False
            ch = self.take()
            pred = self.escape(ignore_case, in_class=True) if ch == "\\" else None
            if pred is None and self.peek() == "-" and self.peek(2)[1:] not in ("]", ""):
                self.i += 1
                end = self.take()
                if end == "\\":
                    end = {"x": None}.get(self.peek(), _LITERAL_ESCAPES.get(self.peek(), self.peek()))
                    if end is None or len(end) != 1:
                        raise _Unparsed("range end")
                    self.i += 1
                lo, hi = ord(ch), ord(end)
                self.literals.update(chr(c) for c in (lo, hi, lo + 1, max(hi - 1, 0), max(lo - 1, 0), hi + 1)
                                     if c <= 0x10FFFF and not 0xD800 <= c <= 0xDFFF)
                tests.append(lambda c, lo=lo, hi=hi: lo <= ord(c) <= hi or (
                    ignore_case and (lo <= ord(c.lower()[0]) <= hi or lo <= ord(c.upper()[0]) <= hi)))
            else:
                tests.append(pred or self.literal(ch, ignore_case))
        self.i += 1
        return (lambda c: not any(t(c) for t in tests)) if negate else (lambda c: any(t(c) for t in tests))


# ----------------------------------------------------------------------------- the analysis

class _Analysis:
    """Which characters each part of a parsed pattern can start with or consume, as bit masks over a
    finite universe, and the search for the constructs of the module docstring."""

    def __init__(self, literals: set[str]):
        self.universe = list(dict.fromkeys(_UNIVERSE + sorted(literals)))
        self.masks: dict[int, int] = {}

    def mask(self, node) -> int:
        key = id(node[1])
        if key not in self.masks:
            self.masks[key] = sum(1 << i for i, ch in enumerate(self.universe) if node[1](ch))
        return self.masks[key]

    def first(self, node) -> tuple[int, bool]:
        """(the characters a match of node can start with, whether it can match nothing)."""
        kind = node[0]
        if kind == "set":
            return self.mask(node), False
        if kind == "seq":
            out = 0
            for item in node[1]:
                m, nullable = self.first(item)
                out |= m
                if not nullable:
                    return out, False
            return out, True
        if kind == "alt":
            parts = [self.first(b) for b in node[1]]
            return _union(m for m, _ in parts), any(n for _, n in parts)
        if kind == "repeat":
            m, nullable = self.first(node[1])
            return m, nullable or node[2] == 0
        return 0, True                  # anchors and lookarounds consume nothing

    def chars(self, node) -> int:
        kind = node[0]
        if kind == "set":
            return self.mask(node)
        if kind in ("seq", "alt"):
            return _union(self.chars(n) for n in node[1])
        if kind == "repeat":
            return self.chars(node[1])
        return 0

    def check(self, node, follow: int, in_loop: bool) -> None:
        """UnboundedRegexError for the first construct of node that can backtrack without bound.

        follow: the characters that may come right after node; in_loop: node is inside a repeat."""
        kind = node[0]
        if kind == "seq":
            self.check_sequence(node[1], follow, in_loop)
        elif kind == "alt":
            branches = node[1]
            firsts = [self.first(b) for b in branches]
            if in_loop:
                seen = 0
                for m, _ in firsts:
                    if m & seen:
                        raise UnboundedRegexError("a repeated choice between branches that start alike")
                    seen |= m
                if sum(n for _, n in firsts) > 1 or (any(n for _, n in firsts) and _union(m for m, _ in firsts) & follow):
                    raise UnboundedRegexError("a choice inside a repeat that can match nothing or go on")
            for b in branches:
                self.check(b, follow, in_loop)
        elif kind == "repeat":
            _, body, lo, hi, possessive = node
            first, nullable = self.first(body)
            if hi > 1:
                if nullable:
                    raise UnboundedRegexError("a repeat of something that can match nothing")
                self.check(body, first | follow, True)
            else:
                self.check(body, follow, in_loop)
            if in_loop and lo != hi and first & follow and not possessive:
                raise UnboundedRegexError("a repeat inside a repeat, which can stop early or go on")
        elif kind == "look":
            self.check(node[1], 0, False)

    def check_sequence(self, items, follow: int, in_loop: bool) -> None:
        chain, chain_chars = 0, 0
        for i, item in enumerate(items):
            rest, rest_nullable = self.first(("seq", items[i + 1:]))
            self.check(item, rest | (follow if rest_nullable else 0), in_loop)
            if item[0] == "repeat" and item[3] == INF and item[2] != item[3] and not item[4]:
                chars = self.chars(item[1])
                chain, chain_chars = (chain + 1 if chain and chars & chain_chars else 1), chars
                if chain >= 3:
                    raise UnboundedRegexError("three or more repeats in a row over the same characters")
            elif not self.first(item)[1]:   # something that must match ends the row
                chain = 0


def _union(masks) -> int:
    out = 0
    for m in masks:
        out |= m
    return out


def check_regex(pattern: str, where: str) -> None:
    """UnboundedRegexError (one line naming where and why) when the tokenizer.json regex `pattern`
    (Oniguruma syntax) can backtrack without bound; nothing when it cannot, or cannot be parsed."""
    try:
        parser = _Parser(pattern)
        tree = parser.parse()
        _Analysis(parser.literals).check(tree, 0, False)
    except UnboundedRegexError as e:
        why = str(e) if str(e).startswith("its groups") else f"it can backtrack without bound: {e}"
        raise UnboundedRegexError(f"tokenizer.json: {where} regex {pattern!r} could make encoding hang ({why}); "
                                  "npllama refuses it: rewrite the pattern, or use a tokenizer without it") from None
    except (_Unparsed, ValueError):
        return                          # syntax this reader does not know: the engine judges it


def check_tokenizer_regexes(tokenizer_json: dict) -> None:
    """check_regex on every {"Regex": ...} pattern of the normalizer, pre-tokenizer and decoder."""
    for part in ("normalizer", "pre_tokenizer", "decoder"):
        stack = [tokenizer_json.get(part)]
        while stack:
            node = stack.pop()
            if isinstance(node, list):
                stack.extend(node)
            elif isinstance(node, dict):
                pattern = node.get("pattern")
                if isinstance(pattern, dict) and isinstance(pattern.get("Regex"), str):
                    check_regex(pattern["Regex"], f"{part} {node.get('type', '')}".rstrip())
                stack.extend(v for v in node.values() if isinstance(v, (list, dict)))
