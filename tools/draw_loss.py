"""Draw the shipped model's loss curve, docs/loss.svg, from the metrics its training run wrote.

    python tools/draw_loss.py            # weights/shakespeare-char.metrics.jsonl.gz -> docs/loss.svg
    python tools/draw_loss.py --check    # exit 1 if docs/loss.svg is not what the metrics draw

The metrics are the run's metrics.jsonl (npllama/train/metrics.py: MetricsLog), gzipped as it
was written; weights/README.md has the command that made the run. Drawn: the training loss, each
point the mean of STEPS_PER_POINT consecutive steps; every validation estimate (a dot); and the
loss over the whole validation split at the end (a square). The SVG is written as text (tools/svg.py), so
the same metrics give the same bytes; tests/test_docs_figures.py regenerates it and compares.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools.svg import Svg, write_or_check  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
METRICS = REPO / "weights" / "shakespeare-char.metrics.jsonl.gz"
OUT = REPO / "docs" / "loss.svg"
STEPS_PER_POINT = 50
WIDTH, HEIGHT = 720, 400
LEFT, RIGHT, TOP, BOTTOM = 64, 24, 52, 56          # the plot area's margins
TRAIN_COLOUR, VAL_COLOUR, FINAL_COLOUR = "#3b6fb6", "#d0571b", "#2e8b57"


def read_records(path: Path) -> list[dict]:
    """The JSON objects of a metrics.jsonl, plain or gzipped, in order."""
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return [json.loads(line) for line in raw.decode("utf-8").splitlines() if line.strip()]


def curves(records: list[dict]) -> tuple[list[tuple[float, float]], list[tuple[float, float]], dict | None]:
    """(training points, validation points, the final record): a training point is the mean step
    and mean loss of STEPS_PER_POINT consecutive steps."""
    train = [(r["step"], r["loss"]) for r in records if r.get("kind") == "train"]
    train_points = []
    for i in range(0, len(train), STEPS_PER_POINT):
        chunk = train[i:i + STEPS_PER_POINT]
        train_points.append((sum(s for s, _ in chunk) / len(chunk), math.fsum(v for _, v in chunk) / len(chunk)))
    val_points = [(r["step"], r["val_loss"]) for r in records if r.get("kind") == "eval"]
    final = next((r for r in reversed(records) if r.get("kind") == "final"), None)
    return train_points, val_points, final


def _shown(path: Path) -> str:
    """A path as the picture names it: relative to the repository when inside it."""
    return path.relative_to(REPO).as_posix() if REPO in path.parents else path.name


def draw(metrics: Path = METRICS) -> str:
    train, val, final = curves(read_records(metrics))
    last_step = max(s for s, _ in train + val)
    values = [v for _, v in train + val]
    y_low, y_high = math.floor(min(values) * 2) / 2, math.ceil(max(values) * 2) / 2
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(step):
        return LEFT + plot_w * step / last_step

    def y(loss):
        return TOP + plot_h * (y_high - loss) / (y_high - y_low)

    svg = Svg(WIDTH, HEIGHT, "Training and validation loss of weights/shakespeare-char.safetensors")
    svg.text(LEFT, 22, "weights/shakespeare-char.safetensors: loss (nats per character) while training",
             size=13, weight="bold")
    svg.text(LEFT, 38, f"drawn by tools/draw_loss.py from {_shown(metrics)}", size=11, fill="#555")
    svg.rect(LEFT, TOP, plot_w, plot_h, fill="#ffffff", stroke="#888", rx=0)
    tick = 0.5
    for i in range(int(round((y_high - y_low) / tick)) + 1):
        loss = y_low + i * tick
        svg.polyline([(LEFT, y(loss)), (LEFT + plot_w, y(loss))], stroke="#e4e4e4", width=1)
        svg.text(LEFT - 8, y(loss) + 4, f"{loss:.1f}", size=11, anchor="end", fill="#444")
    # the smallest of 1, 2, 5 x 10^k steps that leaves at most 10 intervals
    step_tick = min(m * 10 ** k for k in range(9) for m in (1, 2, 5) if last_step / (m * 10 ** k) <= 10)
    for i in range(int(last_step // step_tick) + 1):
        step = i * step_tick
        svg.polyline([(x(step), TOP + plot_h), (x(step), TOP + plot_h + 4)], stroke="#888", width=1)
        svg.text(x(step), TOP + plot_h + 18, f"{int(step):,}", size=11, anchor="middle", fill="#444")
    svg.text(LEFT + plot_w / 2, HEIGHT - 14, "optimizer step", size=11, anchor="middle", fill="#444")
    svg.polyline([(x(s), y(v)) for s, v in train], stroke=TRAIN_COLOUR, width=1.5)
    for s, v in val:
        svg.circle(x(s), y(v), 3.5, fill=VAL_COLOUR)
    legend_x, legend_y = LEFT + plot_w - 330, TOP + 20
    svg.polyline([(legend_x, legend_y - 4), (legend_x + 24, legend_y - 4)], stroke=TRAIN_COLOUR, width=2)
    svg.text(legend_x + 32, legend_y, f"training loss, mean of {STEPS_PER_POINT} steps", size=11)
    svg.circle(legend_x + 12, legend_y + 14, 3.5, fill=VAL_COLOUR)
    svg.text(legend_x + 32, legend_y + 18, "validation loss, estimated", size=11)
    if final is not None:
        svg.rect(x(final["step"]) - 4, y(final["full_val_loss"]) - 4, 8, 8, fill=FINAL_COLOUR, stroke="none", rx=0)
        svg.rect(legend_x + 8, legend_y + 28, 8, 8, fill=FINAL_COLOUR, stroke="none", rx=0)
        svg.text(legend_x + 32, legend_y + 36,
                 f"whole validation split, step {final['step']:,}: {final['full_val_loss']:.4f}", size=11)
    return str(svg)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--metrics", type=Path, default=METRICS, help="the run's metrics.jsonl, plain or gzipped")
    parser.add_argument("--out", type=Path, default=OUT, help="the SVG file to write (default: docs/loss.svg)")
    parser.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = parser.parse_args(argv)
    return write_or_check(draw(args.metrics.resolve()), args.out, args.check, "python tools/draw_loss.py")


if __name__ == "__main__":
    sys.exit(main())
