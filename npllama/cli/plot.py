"""`npllama plot RUN_DIR`: (re)draw RUN_DIR/loss.png from RUN_DIR/metrics.jsonl."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..train.metrics import METRICS_NAME, PLOT_NAME, plot_metrics


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plot", help="draw the loss curve of a training run",
        description=f"Draw RUN_DIR/{PLOT_NAME} from RUN_DIR/{METRICS_NAME} (the --out-dir of `npllama train`).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", help="the --out-dir of a training run")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not (run_dir / METRICS_NAME).is_file():
        raise FileNotFoundError(f"no {METRICS_NAME} in {run_dir}; pass the --out-dir of a training run")
    png = plot_metrics(run_dir / METRICS_NAME, run_dir / PLOT_NAME)
    if png is None:
        raise ValueError("matplotlib is not installed: pip install matplotlib (or pip install 'npllama[plot]')")
    print(png)
    return 0
