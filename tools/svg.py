"""A few SVG elements written as text, for the pictures in docs/ (tools/draw_block.py,
tools/draw_loss.py): no plotting library, so the same input gives the same bytes on any machine,
and a test can regenerate a picture and compare it with the committed file.
"""

from __future__ import annotations

from pathlib import Path
from xml.sax.saxutils import escape

FONT = "DejaVu Sans Mono, Menlo, Consolas, monospace"
CHAR_WIDTH = 0.6          # a monospace character's advance, as a fraction of the font size


def num(value: float) -> str:
    """A coordinate as short, fixed text: at most one decimal, no trailing zero, never "-0"."""
    text = f"{value:.1f}".rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


def text_width(text: str, size: float) -> float:
    """The width of text in a monospace font of this size."""
    return len(text) * size * CHAR_WIDTH


def write_or_check(svg: str, out: Path, check: bool, command: str) -> int:
    """Write the picture to out, or with check compare it with out; the exit code of a tool's main."""
    if check:
        same = out.is_file() and out.read_text(encoding="utf-8") == svg
        print(f"{out}: {'up to date' if same else f'differs from what its source draws today: run {command}'}")
        return 0 if same else 1
    out.write_text(svg, encoding="utf-8")
    print(f"wrote {out} ({len(svg):,} bytes)")
    return 0


class Svg:
    """An SVG document built element by element; str() gives its text."""

    def __init__(self, width: float, height: float, title: str):
        self.width, self.height = width, height
        self.items = [f"<title>{escape(title)}</title>",
                      '<defs><marker id="arrow" viewBox="0 0 8 8" refX="7" refY="4" markerWidth="7" '
                      'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L8,4 L0,8 z" fill="#444"/>'
                      "</marker></defs>",
                      f'<rect width="{num(width)}" height="{num(height)}" fill="#ffffff"/>']

    def rect(self, x, y, w, h, fill, stroke="#555", rx=4, dash=False):
        extra = ' stroke-dasharray="4 3"' if dash else ""
        self.items.append(f'<rect x="{num(x)}" y="{num(y)}" width="{num(w)}" height="{num(h)}" rx="{num(rx)}" '
                          f'fill="{fill}" stroke="{stroke}"{extra}/>')

    def text(self, x, y, text, size=12, anchor="start", weight="normal", fill="#222"):
        self.items.append(f'<text x="{num(x)}" y="{num(y)}" font-family="{FONT}" font-size="{num(size)}" '
                          f'text-anchor="{anchor}" font-weight="{weight}" fill="{fill}">{escape(text)}</text>')

    def polyline(self, points, stroke="#444", width=1.2, arrow=False, dash=False, fill="none"):
        d = " ".join(f"{'M' if i == 0 else 'L'}{num(x)},{num(y)}" for i, (x, y) in enumerate(points))
        extra = (' marker-end="url(#arrow)"' if arrow else "") + (' stroke-dasharray="4 3"' if dash else "")
        self.items.append(f'<path d="{d}" fill="{fill}" stroke="{stroke}" stroke-width="{num(width)}"{extra}/>')

    def circle(self, x, y, r, fill, stroke="none"):
        self.items.append(f'<circle cx="{num(x)}" cy="{num(y)}" r="{num(r)}" fill="{fill}" stroke="{stroke}"/>')

    def __str__(self) -> str:
        head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{num(self.width)}" height="{num(self.height)}" '
                f'viewBox="0 0 {num(self.width)} {num(self.height)}">')
        return "\n".join([head, *self.items, "</svg>"]) + "\n"
