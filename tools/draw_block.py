"""Draw a LLaMA-2 block's data flow, forward and backward, from npllama/model.py itself.

    python tools/draw_block.py            # writes docs/block.svg
    python tools/draw_block.py --check    # exit 1 if docs/block.svg is not what model.py draws today

The picture is read out of the source with `ast`, never drawn by hand: every statement of
`block_forward` and `block_backward` that calls an op (`rmsnorm_forward`, `projection_backward`,
...) or adds arrays (a residual, or gradients of one value summed) becomes a box, in the order
the code runs it, labelled with its inputs and outputs; an arrow joins the statement that
assigns a name to each statement that reads it. Forward runs down the left column, backward up
the right one, each backward op level with the forward op whose cache it reads (`cache.wq` is
what `c_wq` held), joined by a dashed line. Reshapes and transposes are not drawn (they move no
data between ops), nor the decoding branch that appends to the KV cache.
tests/test_docs_figures.py regenerates the picture and compares it with docs/block.svg.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools.svg import Svg, text_width, write_or_check  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "npllama" / "model.py"
OUT = REPO / "docs" / "block.svg"


@dataclass
class Node:
    """One drawn statement: `outputs = op(inputs)`."""
    op: str                          # the function called, or "+"
    inputs: list[str]                # names read, in argument order
    outputs: list[str]               # names assigned (the op's cache left out)
    args: list[str] = field(default_factory=list)       # every argument as written, w.wq as wq, cache.* left out
    cache: str | None = None         # the BlockCache field this op writes (forward) or reads (backward)

    @property
    def label(self) -> str:
        if self.op == "+":
            return " + ".join(self.inputs) + " -> " + self.outputs[0]
        return f"({', '.join(self.args)}) -> {', '.join(self.outputs)}"


def _name(node: ast.expr) -> str | None:
    return node.id if isinstance(node, ast.Name) else None


def _added_names(node: ast.expr) -> list[str] | None:
    """[a, b, c] for `a + b + c` of plain names; None for anything else."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _added_names(node.left), _added_names(node.right)
        return left + right if left is not None and right is not None else None
    return None


def read_function(tree: ast.Module, name: str) -> tuple[list[Node], str, str]:
    """The drawn statements of function `name`, its data input (first argument) and the name it returns."""
    func = next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == name)
    nodes = []
    returned = None
    for stmt in func.body:
        if isinstance(stmt, ast.Return):
            value = stmt.value.elts[0] if isinstance(stmt.value, ast.Tuple) else stmt.value
            returned = _name(value)
        if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
            continue
        target = stmt.targets[0]
        targets = [_name(t) for t in target.elts] if isinstance(target, ast.Tuple) else [_name(target)]
        value = stmt.value
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) \
                and value.func.id.endswith(("_forward", "_backward")):
            node = Node(value.func.id, [], [t for t in targets if t and not t.startswith("c_")])
            node.cache = next((t[2:] for t in targets if t and t.startswith("c_")), None)
            for arg in value.args:
                if isinstance(arg, ast.Attribute) and _name(arg.value) == "cache":
                    node.cache = arg.attr
                elif isinstance(arg, ast.Attribute) and _name(arg.value) == "w":
                    node.args.append(arg.attr)              # a parameter of the block
                elif _name(arg) is not None:
                    node.args.append(arg.id)
                    node.inputs.append(arg.id)
            nodes.append(node)
        elif (added := _added_names(value)) is not None and len(added) > 1:
            nodes.append(Node("+", added, targets))
    first_arg = func.args.args[0].arg
    return nodes, first_arg, returned


def data_inputs(nodes: list[Node], source: str) -> None:
    """Keep as inputs only the names that carry data (assigned by a drawn statement, or the
    function's input); the rest (cos, sin, eps, mask) are the op's settings."""
    known = {source}
    for node in nodes:
        node.inputs = [n for n in node.inputs if n in known]
        known.update(node.outputs)


@dataclass
class Row:
    forward: Node | None = None
    backward: Node | None = None


def lay_out(fwd: list[Node], bwd: list[Node]) -> list[Row]:
    """Rows top to bottom: forward in order; backward in reverse order beside the forward op whose
    cache it reads, its sums in a free or new row just below the backward op above them."""
    rows = [Row(forward=n) for n in fwd]
    by_cache = {n.cache: row for n, row in zip(fwd, rows) if n.cache}
    by_cache["<source>"] = rows[0]             # x beside dx
    by_cache["<sink>"] = rows[-1]              # out beside dout
    upward = list(reversed(bwd))
    prev = -1
    for i, node in enumerate(upward):
        key = node.cache if node.cache in by_cache else None
        if key is not None and rows.index(by_cache[key]) > prev:
            prev = rows.index(by_cache[key])
            rows[prev].backward = node
            continue
        following = next((rows.index(by_cache[n.cache]) for n in upward[i + 1:] if n.cache in by_cache), len(rows))
        if prev + 1 < following and rows[prev + 1].backward is None:
            prev += 1
        else:
            prev += 1
            rows.insert(prev, Row())
        rows[prev].backward = node
    return rows


# ---- drawing ------------------------------------------------------------------------------------

ROW_H, BOX_H = 46, 34
TITLE_SIZE, OP_SIZE, LABEL_SIZE = 13, 12, 11
LANE = 9                      # gap between the vertical runs of routed arrows
FWD_FILL, BWD_FILL, END_FILL = "#e3edfb", "#fbe9dc", "#eeeeee"


def _lanes(edges: list[tuple[int, int]]) -> list[int]:
    """A lane for each (top row, bottom row) span, the shortest innermost, no two overlapping spans sharing one."""
    taken: list[list[tuple[int, int]]] = []
    lanes = [0] * len(edges)
    for i in sorted(range(len(edges)), key=lambda i: (edges[i][1] - edges[i][0], edges[i])):
        lo, hi = edges[i]
        lane = next((k for k, spans in enumerate(taken) if all(hi <= a or lo >= b for a, b in spans)), len(taken))
        if lane == len(taken):
            taken.append([])
        taken[lane].append((lo, hi))
        lanes[i] = lane
    return lanes


def _edges(rows: list[Row], side: str) -> list[tuple[int, int, int]]:
    """(producer row, consumer row, input index) of every arrow in one column."""
    producer: dict[str, int] = {}
    order = range(len(rows)) if side == "forward" else range(len(rows) - 1, -1, -1)
    edges = []
    for r in order:
        node = getattr(rows[r], side)
        if node is None:
            continue
        for k, name in enumerate(node.inputs):
            if name in producer:
                edges.append((producer[name], r, k))
        for name in node.outputs:
            producer[name] = r
    return edges


def draw(model_path: Path = MODEL) -> str:
    tree = ast.parse(model_path.read_text(encoding="utf-8"))
    fwd, x, out = read_function(tree, "block_forward")
    bwd, dout, dx = read_function(tree, "block_backward")
    data_inputs(fwd, x)
    data_inputs(bwd, dout)
    fwd = [Node("input", [], [x], cache="<source>"), *fwd, Node("output", [out], [], cache="<sink>")]
    bwd = [Node("input", [], [dout], cache="<sink>"), *bwd, Node("output", [dx], [], cache="<source>")]
    rows = lay_out(fwd, bwd)

    def box_width(nodes):
        return max(max(text_width(n.op, OP_SIZE), text_width(n.label, LABEL_SIZE)) for n in nodes) + 24

    fwd_w, bwd_w = box_width(fwd), box_width(bwd)
    fwd_edges, bwd_edges = _edges(rows, "forward"), _edges(rows, "backward")
    routed = {side: [e for e in edges if not _straight(rows, side, e)]
              for side, edges in (("forward", fwd_edges), ("backward", bwd_edges))}
    lanes = {side: _lanes([(min(a, b), max(a, b)) for a, b, _ in es]) for side, es in routed.items()}
    lane_room = {side: (max(ls, default=-1) + 2) * LANE for side, ls in lanes.items()}
    heading = [("block_forward (down) and block_backward (up), npllama/model.py", TITLE_SIZE, "bold"),
               ("a box: a statement calling an op or adding arrays, (arguments) -> outputs", LABEL_SIZE, "normal"),
               ("dashed: the cache the forward op keeps, which the backward op reads", LABEL_SIZE, "normal"),
               ("drawn by tools/draw_block.py from the source (reshapes, transposes and", LABEL_SIZE, "normal"),
               ("decoding's KV-cache branch left out)", LABEL_SIZE, "normal")]
    top = 24 + 16 * len(heading) + 14
    fx = 20 + lane_room["forward"]
    bx = fx + fwd_w + 90
    width = max(bx + bwd_w + lane_room["backward"], max(text_width(t, s) for t, s, _ in heading) + 20) + 20
    height = top + len(rows) * ROW_H + 44
    svg = Svg(width, height, "A LLaMA-2 block, forward and backward, drawn from npllama/model.py")
    for i, (line, size, weight) in enumerate(heading):
        svg.text(20, 24 + 16 * i, line, size=size, weight=weight, fill="#222" if i == 0 else "#555")
    centre = {}
    for r, row in enumerate(rows):
        y = top + r * ROW_H
        for side, node, x0, w, fill in (("forward", row.forward, fx, fwd_w, FWD_FILL),
                                        ("backward", row.backward, bx, bwd_w, BWD_FILL)):
            if node is None:
                continue
            is_end = node.op in ("input", "output")
            svg.rect(x0, y, w, BOX_H, END_FILL if is_end else fill)
            title = ", ".join(node.outputs or node.inputs) if is_end else node.op
            svg.text(x0 + 8, y + 14, f"{node.op}: {title}" if is_end else title, size=OP_SIZE,
                     weight="bold" if not is_end else "normal")
            if not is_end:
                svg.text(x0 + 8, y + 28, node.label, size=LABEL_SIZE, fill="#333")
            centre[side, r] = (x0, y, w)
        if row.forward is not None and row.backward is not None and row.forward.cache is not None \
                and row.forward.cache == row.backward.cache:
            svg.polyline([(fx + fwd_w, top + r * ROW_H + BOX_H / 2), (bx, top + r * ROW_H + BOX_H / 2)],
                         stroke="#999", width=1, dash=True)
    for side, edges in (("forward", fwd_edges), ("backward", bwd_edges)):
        routed_edges = routed[side]
        for a, b, k in edges:
            xa, ya, wa = centre[side, a]
            xb, yb, wb = centre[side, b]
            if (a, b, k) not in routed_edges:
                down = b > a
                svg.polyline([(xa + wa / 2, ya + (BOX_H if down else 0)), (xb + wb / 2, yb + (0 if down else BOX_H))],
                             arrow=True)
                continue
            lane = lanes[side][routed_edges.index((a, b, k))]
            exit_y, entry_y = ya + BOX_H / 2 + 5, yb + BOX_H / 2 - 5 + 4 * k
            if side == "forward":
                lx = xa - (lane + 1) * LANE
                svg.polyline([(xa, exit_y), (lx, exit_y), (lx, entry_y), (xb, entry_y)], arrow=True)
            else:
                lx = xa + wa + (lane + 1) * LANE
                svg.polyline([(xa + wa, exit_y), (lx, exit_y), (lx, entry_y), (xb + wb, entry_y)], arrow=True)
    svg.text(fx, height - 16, "forward: top to bottom", size=LABEL_SIZE, fill="#555")
    svg.text(bx, height - 16, "backward: bottom to top", size=LABEL_SIZE, fill="#555")
    return str(svg)


def _straight(rows: list[Row], side: str, edge: tuple[int, int, int]) -> bool:
    """An arrow straight down (up) when no box of its column sits between its two ends."""
    a, b, _ = edge
    lo, hi = min(a, b), max(a, b)
    return all(getattr(rows[r], side) is None for r in range(lo + 1, hi))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="the SVG file to write (default: docs/block.svg)")
    parser.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = parser.parse_args(argv)
    return write_or_check(draw(), args.out, args.check, "python tools/draw_block.py")


if __name__ == "__main__":
    sys.exit(main())
