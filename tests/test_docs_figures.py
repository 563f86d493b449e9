"""The pictures in docs/ are what their sources draw today: docs/block.svg from npllama/model.py
(tools/draw_block.py), docs/loss.svg from the shipped model's training metrics (tools/draw_loss.py).
Each is regenerated and compared with the committed file byte for byte."""

import ast
import re
from pathlib import Path

from tools import draw_block, draw_loss

REPO = Path(__file__).resolve().parents[1]


def test_the_block_picture_is_what_model_py_draws():
    committed = (REPO / "docs" / "block.svg").read_text(encoding="utf-8")
    assert draw_block.draw() == committed, "docs/block.svg is stale: run python tools/draw_block.py"


def test_the_block_picture_holds_every_op_call_of_the_block():
    """Every op call of block_forward and block_backward outside a branch has its box, in order."""
    tree = ast.parse((REPO / "npllama" / "model.py").read_text(encoding="utf-8"))
    svg = draw_block.draw()
    for name in ("block_forward", "block_backward"):
        func = next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == name)
        calls = [stmt.value.func.id for stmt in func.body if isinstance(stmt, ast.Assign)
                 and isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Name)
                 and stmt.value.func.id.endswith(("_forward", "_backward"))]
        nodes, _, _ = draw_block.read_function(tree, name)
        assert [n.op for n in nodes if n.op != "+"] == calls and len(calls) >= 10
        for op in set(calls):
            assert svg.count(f">{op}</text>") == calls.count(op), op
    # the residual adds and the gradient sums: 2 in forward, 4 in backward
    assert svg.count(">+</text>") == 6


def test_the_loss_curve_is_what_its_metrics_draw():
    committed = (REPO / "docs" / "loss.svg").read_text(encoding="utf-8")
    assert draw_loss.draw() == committed, "docs/loss.svg is stale: run python tools/draw_loss.py"


def test_the_metrics_are_the_shipped_models_run():
    """The committed metrics end where weights/README.md says the shipped model's run ended."""
    records = draw_loss.read_records(draw_loss.METRICS)
    final = records[-1]
    assert final["kind"] == "final"
    readme = (REPO / "weights" / "README.md").read_text(encoding="utf-8")
    assert f"**{final['full_val_loss']:.4f}**" in readme
    steps = re.search(r"--max-steps (\d+)", readme).group(1)
    assert final["step"] == int(steps) == max(r["step"] for r in records if r["kind"] == "train")
