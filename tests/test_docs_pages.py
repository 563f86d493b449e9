"""README.md and docs/*.md as a reader meets them: short first screen, no dead link, formulas that
render, and every --help pointing at its page.

Links: every relative link `[text](path#fragment)` of a page resolves to a file or folder of the
repository, and a fragment to a heading of the Markdown file it names (GitHub's slugs). Anchors:
a link whose text is one code span naming a Python identifier and whose target is a .py file,
[`rmsnorm_backward`](../npllama/ops/rmsnorm.py), names a function, class or assignment that file
defines (read with ast: `Class.method` too); so does a code span `path.py:name`. A code span
that is a repository path (`npllama/...`, `tools/...`, `tests/x.py::test_y`) names something that
exists. Math: every `$...$` and `$$...$$` formula goes through latex2mathml (the `docs` extra),
with its braces balanced, no command it does not know, every fraction, sub- and superscript
given its arguments, and no `$` left over.
"""

from __future__ import annotations

import ast
import re
import xml.etree.ElementTree as ET
from functools import lru_cache
from pathlib import Path

import pytest

from npllama import cli

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 150
IDENTIFIER = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"


def page_id(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


def without_code_blocks(text: str) -> str:
    """The page with its fenced code blocks blanked out (line numbers kept)."""
    return re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)


def links(page: Path) -> list[tuple[str, str]]:
    """(text, target) of every Markdown link and image outside code blocks."""
    return re.findall(r"!?\[([^\]]*)\]\(([^)\s]+)\)", without_code_blocks(page.read_text(encoding="utf-8")))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@lru_cache(maxsize=None)
def anchors_of(page: Path) -> frozenset[str]:
    text = without_code_blocks(page.read_text(encoding="utf-8"))
    return frozenset(slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M))


@lru_cache(maxsize=None)
def defined_names(path: Path) -> frozenset[str]:
    """The top-level functions, classes and assigned names of a Python file, and Class.member."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                names.update(f"{node.name}.{m.name}" for m in node.body
                             if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))
                names.update(f"{node.name}.{m.target.id}" for m in node.body
                             if isinstance(m, ast.AnnAssign) and isinstance(m.target, ast.Name))
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return frozenset(names)


def dead_link(page: Path, target: str) -> str | None:
    """Why a relative link does not resolve, or None when it does (web links are not followed)."""
    if re.match(r"[a-z]+:", target):
        return None
    path_part, _, fragment = target.partition("#")
    path = (page.parent / path_part).resolve() if path_part else page
    if not path.exists():
        return f"{target}: no such file"
    if REPO not in (path, *path.parents):
        return f"{target}: outside the repository"
    if fragment and path.suffix == ".md" and fragment not in anchors_of(path):
        return f"{target}: {page_id(path)} has no heading #{fragment}"
    return None


def test_the_readme_is_one_or_two_screens():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; keep it to {README_MAX_LINES} and move the rest to docs/"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_relative_link_resolves(page):
    dead = [f"[{text}]({target}): {why}" for text, target in links(page) if (why := dead_link(page, target))]
    assert not dead, f"{page_id(page)}: dead links: {dead}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_code_anchor_names_what_its_file_defines(page):
    text = without_code_blocks(page.read_text(encoding="utf-8"))
    anchors = [(name, (page.parent / target).resolve())
               for name, target in re.findall(rf"\[`({IDENTIFIER})`\]\(([^)#\s]+\.py)\)", text)]
    anchors += [(name, REPO / path) for path, name in re.findall(rf"`([\w./-]+\.py):({IDENTIFIER})`", text)]
    bad = [f"{name} in {path.relative_to(REPO)}" for name, path in anchors
           if not path.is_file() or name not in defined_names(path)]
    assert not bad, f"{page_id(page)}: anchors naming nothing: {bad}"
    if page.name == "math.md":
        assert len(anchors) >= 30, "math.md links each formula to the function computing it"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_repository_path_in_code_exists(page):
    text = without_code_blocks(page.read_text(encoding="utf-8"))
    missing = []
    for span in re.findall(r"`((?:npllama|tools|tests|docs|weights|\.ci)/[\w./-]*(?:::\w+)?)`", text):
        path, _, test = span.partition("::")
        file = REPO / path
        if not file.exists() or (test and f"def {test}(" not in file.read_text(encoding="utf-8")):
            missing.append(span)
    assert not missing, f"{page_id(page)}: paths that do not exist: {missing}"


def test_the_anchor_checks_can_fail(tmp_path):
    """The checks above catch what they are for: a moved file, a renamed function, a lost heading."""
    page = REPO / "docs" / "math.md"
    assert dead_link(page, "../npllama/ops/nothing.py") and dead_link(page, "training.md#no-such-heading")
    assert dead_link(page, "training.md#stop-and-resume") is None and dead_link(page, "https://example.org") is None
    assert "rmsnorm_backward" in defined_names(REPO / "npllama" / "ops" / "rmsnorm.py")
    assert "AdamW.step" in defined_names(REPO / "npllama" / "optim.py")
    assert "rmsnorm_sideways" not in defined_names(REPO / "npllama" / "ops" / "rmsnorm.py")
    assert slug("Rotary position embedding (RoPE)") == "rotary-position-embedding-rope"


# ---- --help ------------------------------------------------------------------------------------------

def help_texts() -> dict[str, str]:
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    return {"npllama": parser.format_help(), **{f"npllama {n}": p.format_help() for n, p in commands.items()}}


def test_every_help_ends_with_the_docs_pages_that_cover_it():
    named_by_main = set()
    for command, text in help_texts().items():
        last = text.strip().split("\n\n")[-1]
        assert last.startswith("Documentation: "), f"`{command} --help` does not end with its docs page:\n{last}"
        pages = re.findall(r"(README\.md|docs/[\w-]+\.md)", last)
        assert pages, last
        missing = [p for p in pages if not (REPO / p).is_file()]
        assert not missing, f"`{command} --help` names pages that do not exist: {missing}"
        if command == "npllama":
            named_by_main = set(pages)
    assert named_by_main == {page_id(p) for p in PAGES}, "`npllama --help` lists every page of docs/"


# ---- math ------------------------------------------------------------------------------------------

def formulas(text: str) -> tuple[list[str], list[str]]:
    """(formulas, problems) of a page: $$...$$ blocks and $...$ spans outside code, as GitHub reads
    them (an inline one opens with `$` not followed by a space, closes with `$` not preceded by one,
    and is not followed by a letter or digit); a `$` left over is a problem."""
    text = without_code_blocks(text)
    found, problems = [], []

    def display(m):
        found.append(m.group(1))
        return " "
    text = re.sub(r"^\$\$\n(.*?)\n\$\$$", display, text, flags=re.S | re.M)
    text = re.sub(r"`[^`]*`", lambda m: "\n" * m.group(0).count("\n"), text)     # code spans hold no math
    for line_no, line in enumerate(text.splitlines(), 1):
        def inline(m):
            found.append(m.group(1))
            return " "
        rest = re.sub(r"(?<![\\$\w])\$(?![\s$])([^$\n]*?[^\s\\$])\$(?![\w$])", inline, line)
        if "$" in rest.replace("\\$", ""):
            problems.append(f"line {line_no}: a `$` that opens or closes no formula: {line.strip()[:100]}")
    return found, problems


def tex_problems(tex: str) -> list[str]:
    """What would keep a formula from rendering, by latex2mathml and a few checks of our own."""
    from latex2mathml.converter import convert
    problems = []
    depth = 0
    for ch in re.sub(r"\\[{}]", "", tex):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth < 0:
            break
    if depth:
        problems.append("unbalanced braces")
    if re.search(r"<[A-Za-z/!]", tex):
        problems.append("`<` before a letter reads as an HTML tag on GitHub: write \\lt")
    try:
        mathml = convert(tex)
    except Exception as e:                                    # latex2mathml raises its own error types
        return problems + [f"latex2mathml: {type(e).__name__} {e}"]
    unknown = sorted(set(re.findall(r"\\[A-Za-z]+", mathml)))
    if unknown:
        problems.append(f"commands latex2mathml does not know: {unknown}")
    arity = {"mfrac": 2, "msub": 2, "msup": 2, "msubsup": 3, "mover": 2, "munder": 2, "munderover": 3, "mroot": 2}
    # latex2mathml writes the column separator of `aligned` as a bare `&`: escaped, so XML reads it
    for element in ET.fromstring(re.sub(r"&(?!#?\w+;)", "&amp;", mathml)).iter():
        tag = element.tag.split("}")[-1]
        if tag in arity and len(element) != arity[tag]:
            problems.append(f"{tag} with {len(element)} arguments instead of {arity[tag]}")
    return problems


def test_the_math_checks_can_fail():
    pytest.importorskip("latex2mathml", reason="latex2mathml is not installed: pip install -e '.[docs]'")
    assert tex_problems(r"\frac{a}{b} + x_{i}") == []
    for broken in (r"\frac{a}", r"x_{i", r"\left( x", r"\nosuchcommand x", r"a <b"):
        assert tex_problems(broken), broken
    found, problems = formulas("one $x_1$, two $y$.\n\n$$\nz = 1\n$$\n\n`$HOME` is code; a lone $ sign")
    assert found == ["z = 1", "x_1", "y"] and len(problems) == 1


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_formula_renders(page):
    pytest.importorskip("latex2mathml", reason="latex2mathml is not installed: pip install -e '.[docs]'")
    found, problems = formulas(page.read_text(encoding="utf-8"))
    for tex in found:
        problems += [f"{why}: {tex.strip()[:120]}" for why in tex_problems(tex)]
    assert not problems, f"{page_id(page)}:\n" + "\n".join(problems)
    if page.name == "math.md":
        assert len(found) >= 60, f"math.md holds {len(found)} formulas"
