"""What a training run leaves behind to read: metrics.jsonl, and its loss curve as a picture.

    metrics.jsonl   one JSON object per line, flushed as written (see MetricsLog)
    loss.png        train and validation loss against the step, when matplotlib is installed
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

METRICS_NAME = "metrics.jsonl"
PLOT_NAME = "loss.png"


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class MetricsLog:
    """metrics.jsonl: one JSON object per line, flushed as written (a killed run keeps its log).

    {"kind": "train", "step", "loss", "lr", "grad_norm", "tok_per_s", "elapsed"} per step and
    {"kind": "eval", "step", "val_loss", "train_loss"} per evaluation, and at the end of a run
    {"kind": "final", "step", "full_val_loss"}; "step" counts optimizer steps completed. On
    resume, lines past the resumed step (written after that checkpoint by the interrupted run)
    and the earlier run's "final" line are dropped, so the log reads as one run.
    """

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        if resume_step is not None and path.is_file():
            records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            kept = [json.dumps(r) for r in records if r.get("kind") != "final" and r.get("step", 0) <= resume_step]
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, path)
        elif path.exists():
            path.unlink()
        self._f = open(path, "a", encoding="utf-8")

    def write(self, **record) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_metrics(path) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) of a metrics.jsonl file."""
    train, evals = [], []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            if rec.get("kind") == "eval":
                evals.append(rec)
            elif rec.get("kind") == "train":
                train.append(rec)
    return train, evals


def plot_metrics(metrics_path, png_path) -> Path | None:
    """Draw the training loss (raw and smoothed) and the validation loss against the step.

    Returns the PNG's path, or None when matplotlib is not installed.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    train, evals = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    if train:
        steps = np.array([r["step"] for r in train])
        loss = np.array([r["loss"] for r in train])
        ax.plot(steps, loss, color="tab:blue", alpha=0.25, lw=0.8, label="train (per step)")
        w = max(1, len(loss) // 50)
        if w > 1:
            smooth = np.convolve(loss, np.ones(w) / w, mode="valid")
            ax.plot(steps[w - 1:], smooth, color="tab:blue", lw=1.5, label=f"train ({w}-step mean)")
    if evals:
        ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", color="tab:orange",
                lw=1.5, ms=3, label="validation")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"npllama train: {Path(metrics_path).parent.name}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return Path(png_path)
