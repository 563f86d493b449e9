"""What a training run leaves behind to read: metrics.jsonl, and its loss curve as a picture.

    metrics.jsonl   one JSON object per line, flushed as written (see MetricsLog)
    loss.png        train and validation loss against the step, when matplotlib is installed
"""

from __future__ import annotations

import io
import json
import math
import os
from pathlib import Path

import numpy as np

from ..checks import parse_json
from ..errors import with_path
from ..io.atomic import refuse_symlink, write_bytes_atomic

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
    """metrics.jsonl: one JSON object per line, written whole (a killed run keeps its log, and a
    write that fails, on a full disk say, is cut back off so the file stays valid JSON Lines).

    {"kind": "train", "step", "loss", "lr", "grad_norm", "tok_per_s", "elapsed"} per step and
    {"kind": "eval", "step", "val_loss", "train_loss"} per evaluation, and at the end of a run
    {"kind": "final", "step", "full_val_loss"}; "step" counts optimizer steps completed. On
    resume, lines past the resumed step (written after that checkpoint by the interrupted run),
    the earlier run's "final" line and any line that is not JSON are dropped, so the log reads
    as one run.
    """

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        refuse_symlink(path)                            # never written through a link planted there
        if resume_step is not None and path.is_file():
            records = [r for r in map(_record, path.read_text(errors="replace").splitlines()) if r is not None]
            kept = [json.dumps(r) for r in records if r.get("kind") != "final" and _step(r) <= resume_step]
            write_bytes_atomic(path, "".join(line + "\n" for line in kept).encode("utf-8"))
        elif path.exists():
            path.unlink()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        self._f = open(fd, "ab", buffering=0)

    def write(self, **record) -> None:
        line = (json.dumps(record) + "\n").encode("utf-8")
        end = self._f.seek(0, os.SEEK_END)
        try:
            view = memoryview(line)
            while view:                                 # an unbuffered write may be partial
                view = view[self._f.write(view):]
        except BaseException as e:
            os.ftruncate(self._f.fileno(), end)         # no half line: the file stays valid JSON Lines
            raise with_path(e, self.path) if isinstance(e, OSError) else e

    def close(self) -> None:
        self._f.close()


def _record(line: str) -> dict | None:
    """The JSON object on a line, or None for anything else (damage, hostile nesting included)."""
    try:
        record = parse_json(line, "a metrics line")
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _step(record: dict) -> float:
    step = record.get("step", 0)
    return step if isinstance(step, (int, float)) else float("inf")


_VALUE = {"train": "loss", "eval": "val_loss"}   # the number a record of each kind is drawn by


def read_metrics(path, skipped: list | None = None) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) of a metrics.jsonl file.

    A line that is not a JSON object, or a train / eval record without a numeric step and loss,
    is damage (MetricsLog writes whole lines): it is left out, and its line number appended to
    `skipped` when a list is given. Other kinds ("final") are not drawn.
    """
    train, evals = [], []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        rec = _record(line)
        kind = rec.get("kind") if rec is not None else None
        if rec is None or (kind in _VALUE and not (_number(rec.get("step")) and _number(rec.get(_VALUE[kind])))):
            if skipped is not None:
                skipped.append(number)
        elif kind == "eval":
            evals.append(rec)
        elif kind == "train":
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
    picture = io.BytesIO()
    fig.savefig(picture, format="png")
    plt.close(fig)
    write_bytes_atomic(png_path, picture.getvalue())    # replaced whole; never through a planted link
    return Path(png_path)
