"""The loss curve as text: train and validation loss against the step, for any terminal.

Printed at the end of `npllama train` and by `npllama plot RUN_DIR`, with or without matplotlib
(loss.png is the picture when it is installed). Plain ASCII, so it survives any encoding, a log
file or a pipe (`npllama train --preset tiny --max-steps 200 --eval-interval 25`):

        loss   * train (column mean)   o validation
        4.19 |o*
             |  *
             |   *
        3.43 |    **
             |      o* *
             |        * ***o **
             |              *  ***o*****o *** *** *  **  *
        2.43 |                           *   * o * ** o** ***o*****o
             +------------------------------------------------------
        step  0                         100                      200
        last: train 2.4269, validation 2.4522 (step 200)

Each column covers an equal span of steps and shows the mean training loss of the steps in it,
which smooths the per-step noise the way the PNG's moving average does; each evaluation is an
`o` at its step, drawn over the training curve where the two meet.
"""

from __future__ import annotations

import math
import shutil

import numpy as np

TRAIN_MARK, VAL_MARK = "*", "o"




def loss_chart(train: list[dict], evals: list[dict], width: int | None = None, height: int = 12) -> str:
    """A text chart of train records {"step", "loss"} and eval records {"step", "val_loss"}.

    width: characters of the whole chart (default: the terminal's, 48 to 100); height: rows of
    the plot area. Non-finite losses are left out. Returns the lines joined by newlines.
    """
    if width is None:
        width = min(100, max(48, shutil.get_terminal_size((80, 24)).columns))
    points_t = [(r["step"], r["loss"]) for r in train if math.isfinite(r.get("loss", math.nan))]
    points_v = [(r["step"], r["val_loss"]) for r in evals if math.isfinite(r.get("val_loss", math.nan))]
    if not points_t and not points_v:
        return "loss chart: no finite losses logged yet"

    steps = [s for s, _ in points_t + points_v]
    s0, s1 = min(steps), max(steps)
    cols = max(8, width - 10)          # 8 characters of y labels, then " |"

    def column(step):
        return 0 if s1 == s0 else min(cols - 1, int((step - s0) * cols / (s1 - s0 + 1e-12)))

    # the mean training loss of the steps falling in each column
    sums, counts = np.zeros(cols), np.zeros(cols)
    for s, y in points_t:
        sums[column(s)] += y
        counts[column(s)] += 1
    train_curve = {c: sums[c] / counts[c] for c in np.flatnonzero(counts)}
    val_points = {column(s): y for s, y in points_v}        # the later eval wins a shared column

    plotted = list(train_curve.values()) + list(val_points.values())
    lo, hi = min(plotted), max(plotted)
    if hi - lo < 1e-9:
        lo, hi = lo - 0.5, hi + 0.5

    def row(y):          # row 0 is the top (hi), row height-1 the bottom (lo)
        return int(round((hi - y) / (hi - lo) * (height - 1)))

    grid = [[" "] * cols for _ in range(height)]
    for c, y in train_curve.items():
        grid[row(y)][c] = TRAIN_MARK
    for c, y in val_points.items():
        grid[row(y)][c] = VAL_MARK

    # y labels on the top, middle and bottom rows, with enough decimals to tell them apart
    decimals = max(2, 1 - math.floor(math.log10(hi - lo)))
    labelled = {r: f"{hi - (hi - lo) * r / (height - 1):.{decimals}f}" for r in (0, (height - 1) // 2, height - 1)}
    lines = [f"    loss   {TRAIN_MARK} train (column mean)   {VAL_MARK} validation"]
    for r in range(height):
        lines.append(f"{labelled.get(r, ''):>8} |" + "".join(grid[r]).rstrip())
    lines.append(" " * 8 + " +" + "-" * cols)
    # step labels under the first, middle and last columns (one label when all share a step)
    mid = (s0 + s1) // 2
    ticks = [(s0, 0)] + ([(s1, cols - len(str(s1)))] if s1 != s0 else []) + \
        ([(mid, cols // 2 - len(str(mid)) // 2)] if mid not in (s0, s1) else [])
    axis_line = [" "] * cols
    for tick, c in ticks:
        axis_line[c:c + len(str(tick))] = str(tick)
    lines.append("    step  " + "".join(axis_line).rstrip())
    last = [f"train {train_curve[max(train_curve)]:.4f}"] if points_t else []
    last += [f"validation {points_v[-1][1]:.4f} (step {points_v[-1][0]})"] if points_v else []
    lines.append("    last: " + ", ".join(last))
    return "\n".join(lines)
