"""`npllama plot RUN_DIR`: the loss curve of a training run, as text and as RUN_DIR/loss.png.

The text chart (train/chart.py) is always printed; the PNG is (re)drawn when matplotlib is
installed, and otherwise a note on stderr says how to get it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..train.chart import loss_chart
from ..train.metrics import METRICS_NAME, PLOT_NAME, plot_metrics, read_metrics
from .args import docs_epilog, number, say
from ..errors import MissingFileError


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plot", help="show the loss curve of a training run (text; loss.png with matplotlib)",
        description=f"Print the train and validation loss of RUN_DIR/{METRICS_NAME} (the --out-dir of "
                    f"`npllama train`) as a text chart, and draw RUN_DIR/{PLOT_NAME} when matplotlib is installed.",
        epilog=docs_epilog("docs/training.md"),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", help="the --out-dir of a training run")
    p.add_argument("--width", type=number(int, 20), default=argparse.SUPPRESS, metavar="COLS",
                   help="characters per line of the chart [default: the terminal's, 48 to 100]")
    p.add_argument("--height", type=number(int, 3), default=12, metavar="ROWS", help="rows of the chart")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    metrics = run_dir / METRICS_NAME
    if not metrics.is_file():
        raise MissingFileError(f"no {METRICS_NAME} in {run_dir}; pass the --out-dir of a training run")
    skipped = []
    print(loss_chart(*read_metrics(metrics, skipped), width=getattr(args, "width", None), height=args.height))
    if skipped:
        shown = ", ".join(map(str, skipped[:5])) + (", ..." if len(skipped) > 5 else "")
        say(f"note: left out {len(skipped)} damaged line(s) of {metrics} (line {shown}): not a JSON "
            "object with a numeric step and loss")
    png = plot_metrics(metrics, run_dir / PLOT_NAME)
    if png is None:
        say(f"{PLOT_NAME} not drawn: matplotlib is not installed (pip install matplotlib, or "
            "pip install 'npllama[plot]')")
    else:
        print(f"loss curve  {png}")
    return 0
