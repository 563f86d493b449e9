"""Training on a CPU: the loop behind `npllama train` and the files it reads and writes.

    config.py      TrainConfig (one field per flag), the presets, the resume rule
    data.py        the text (TinyShakespeare found, cached or downloaded), splits, batches
    loop.py        train(): start or resume, plan, the loop, finish
    distributed.py data parallelism over MPI (mpiexec -n N npllama train): shards, one Allreduce a step
    watcher.py     the process that names a rank lost under mpiexec
    metrics.py     metrics.jsonl and the loss curve
    checkpoint.py  training checkpoints: model, optimizer state and run state in one file
    lock.py        one run per --out-dir (flock on train.lock)
    run_files.py   the files a run writes, checked against its inputs before it starts
"""

from .config import PRESETS, TrainConfig, preset
from .loop import TrainingDiverged, TrainResult, train, train_step

__all__ = ["TrainConfig", "PRESETS", "preset", "train", "train_step", "TrainResult", "TrainingDiverged"]
