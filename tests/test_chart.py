"""The text loss chart (npllama/train/chart.py): its shape, its axes, and that it draws the data."""

import math

import pytest

from npllama.train.chart import TRAIN_MARK, VAL_MARK, loss_chart


def records(n_steps=100, eval_every=20):
    """A falling loss, 4.0 -> about 2.0, with a validation loss a little above it."""
    train = [{"kind": "train", "step": s, "loss": 2.0 + 2.0 * math.exp(-s / 25)} for s in range(1, n_steps + 1)]
    evals = [{"kind": "eval", "step": s, "val_loss": 2.1 + 2.0 * math.exp(-s / 25)}
             for s in range(0, n_steps + 1, eval_every)]
    return train, evals


def plot_rows(chart, height):
    """The plot area: the rows between the title and the x axis, without their y labels."""
    lines = chart.splitlines()
    return [line[10:] for line in lines[1:1 + height]]


@pytest.mark.parametrize("width, height", [(48, 6), (72, 12), (100, 20)])
def test_shape_and_axes(width, height):
    train, evals = records()
    chart = loss_chart(train, evals, width=width, height=height)
    lines = chart.splitlines()
    assert len(lines) == height + 4                       # title, plot rows, axis, step labels, last values
    assert all(len(line) <= width for line in lines[:-1]), [len(x) for x in lines]
    assert "train" in lines[0] and "validation" in lines[0]
    assert all(line[9] == "|" for line in lines[1:1 + height])
    assert lines[height + 1].startswith(" " * 9 + "+-") and len(lines[height + 1]) == width
    # y labels: the highest point on top, the lowest at the bottom
    plotted = [e["val_loss"] for e in evals] + [2.0 + 2.0 * math.exp(-1 / 25)]
    assert float(lines[1][:8]) == pytest.approx(max(plotted), abs=0.01)
    assert float(lines[height][:8]) <= min(r["loss"] for r in train) + 0.01
    assert float(lines[height][:8]) < float(lines[1 + (height - 1) // 2][:8]) < float(lines[1][:8])
    # x labels: the first, middle and last steps
    ticks = lines[height + 2].split()
    assert ticks == ["step", "0", "50", "100"]
    assert lines[height + 2].rstrip().endswith("100") and len(lines[height + 2].rstrip()) == width
    last_train = float(lines[-1].split()[2].rstrip(","))       # the mean of the last column's steps
    assert train[-1]["loss"] <= last_train <= train[-6]["loss"]
    assert lines[-1].endswith(f"validation {evals[-1]['val_loss']:.4f} (step 100)")


def test_it_draws_the_data():
    train, evals = records()
    height = 10
    rows = plot_rows(loss_chart(train, evals, width=60, height=height), height)
    # every evaluation is an o, in its own column; the first is the highest point
    assert sum(r.count(VAL_MARK) for r in rows) == len(evals)
    assert rows[0].startswith(VAL_MARK)
    # the falling training loss: its marks go down from left to right
    row_of = {}
    for r, line in enumerate(rows):
        for c, ch in enumerate(line):
            if ch == TRAIN_MARK:
                row_of[c] = r
    cols = sorted(row_of)
    assert len(cols) > 30 and row_of[cols[0]] < row_of[cols[-1]] == height - 1
    assert all(row_of[a] <= row_of[b] for a, b in zip(cols, cols[1:]))
    # a rising loss draws the mirror image
    rising = [dict(r, loss=6.0 - r["loss"]) for r in train]
    rows = plot_rows(loss_chart(rising, [], width=60, height=height), height)
    assert rows[0].rstrip().endswith(TRAIN_MARK) and rows[-1].startswith(TRAIN_MARK)


def test_few_flat_or_bad_points_do_not_break_it():
    assert "no finite losses" in loss_chart([], [])
    assert "no finite losses" in loss_chart([{"step": 1, "loss": math.nan}], [])
    one = loss_chart([{"step": 1, "loss": 3.0}], [], width=50, height=5)
    assert one.count(TRAIN_MARK) == 1 + 1 and "3.0000" in one        # the mark and the legend's
    flat = loss_chart([{"step": s, "loss": 2.5} for s in range(1, 40)], [{"step": 20, "val_loss": 2.5}],
                      width=50, height=5)
    assert VAL_MARK in flat and "2.5" in flat
    with_nan = loss_chart([{"step": 1, "loss": 4.0}, {"step": 2, "loss": math.inf}, {"step": 3, "loss": 3.0}], [],
                          width=50, height=5)
    assert "inf" not in with_nan and "nan" not in with_nan
    # labels keep enough decimals to differ when the range is narrow
    narrow = loss_chart([{"step": s, "loss": 2.0 + s * 1e-4} for s in range(1, 20)], [], width=50, height=5)
    labels = [line[:8].strip() for line in narrow.splitlines()[1:6] if line[:8].strip()]
    assert len(set(labels)) == 3, labels
