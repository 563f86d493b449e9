"""The files a training run writes, checked before it starts: never an input, never through a link.

A run writes OUT_DIR/ckpt.safetensors, metrics.jsonl, loss.png and train.lock, and --export at
the end. None of them may be one of the run's inputs (--data, --init and what loading it reads,
--init-tokenizer) or lie inside an input folder (io/outputs.py), or be a symbolic link planted
there (io/atomic.py); --export may not replace the run's own folder or files, nor a training or
LoRA checkpoint. Checked at the start, so a run never trains for an hour to fail at its end.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..io.atomic import refuse_symlink
from ..io.errors import OutputPathError
from ..io.outputs import check_save_target, model_inputs, refuse_inputs, same_file
from .checkpoint import CHECKPOINT_NAME
from .config import TrainConfig, export_format
from .data import TINYSHAKESPEARE_FILE
from .lock import LOCK_NAME
from .metrics import METRICS_NAME, PLOT_NAME


def run_inputs(cfg: TrainConfig) -> dict:
    """{description: path} of the files the run reads."""
    inputs = {}
    if cfg.data:
        data = Path(cfg.data).expanduser()
        inputs["--data"] = data / TINYSHAKESPEARE_FILE if data.is_dir() else data
    if cfg.init:
        inputs.update(model_inputs(cfg.init, "--init"))
    if cfg.init_tokenizer:
        inputs["--init-tokenizer"] = cfg.init_tokenizer
    return inputs


def check_run_files(cfg: TrainConfig) -> None:
    """OutputPathError naming the first file of the run that would overwrite an input, be written
    through a symbolic link, or (--export) replace the run's folder or a checkpoint."""
    out = Path(cfg.out_dir)
    written = {"the run's checkpoint": out / CHECKPOINT_NAME, "the run's metrics": out / METRICS_NAME,
               "the run's loss curve": out / PLOT_NAME, "the run's lock": out / LOCK_NAME}
    inputs = run_inputs(cfg)
    for label, path in written.items():
        refuse_symlink(path)
        refuse_inputs(path, inputs, f"{label}")
    if cfg.export:
        export = Path(cfg.export)
        refuse_inputs(export, inputs, "--export")
        for label, path in written.items():            # compared by path: they may not exist yet
            if same_file(export, path):
                raise OutputPathError(f"--export {export} is {label}; export to another path")
        if same_file(export, out) or Path(os.path.realpath(out)).is_relative_to(os.path.realpath(export)):
            raise OutputPathError(f"--export {export} would replace the run's folder --out-dir {out}; export to a "
                                  "path inside or beside it")
        check_save_target(export, export_format(export), flag=None)
