"""`npllama train`: the flags are TrainConfig's fields, generated from the dataclass.

    npllama train                                   # the shakespeare-char preset, 2000 steps
    npllama train --time-budget 5m --out-dir runs/five-minutes
    npllama train --resume --out-dir runs/five-minutes --max-steps 3000
    npllama train --preset shakespeare-bpe --vocab-size 1024
    npllama train --init stories260K.bin --init-tokenizer tok512.model --lora-rank 8   # fine-tune (LoRA)
    mpiexec -n 2 npllama train --batch-size 32      # data-parallel over MPI: 2 ranks share each batch of 32

A flag given on the command line overrides the preset. With --resume every setting comes
from the checkpoint in --out-dir, and only the flags given now override it (those that
define the model and the data cannot change).
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
from pathlib import Path

from ..train import distributed
from ..train.checkpoint import CHECKPOINT_NAME, load_train_state
from ..train.config import (NON_NEGATIVE_FLOATS, NON_NEGATIVE_INTS, POSITIVE_INTS, PRESETS, TrainConfig, parse_duration,
                            preset)
from ..train.loop import train
from ..interrupts import exit_code
from .args import EXIT_PIPE_CLOSED, docs_epilog, number, report_error, say


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _parse_type(f: dataclasses.Field):
    if f.name == "time_budget":
        return _duration
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    if kind == "int":
        return number(int, 0)
    if kind == "float":
        return number(float)
    return str


def _range(f: dataclasses.Field) -> str:
    """The type and range of a field, as validate() enforces them."""
    if f.name in POSITIVE_INTS:
        return "int >= 1"
    if f.name in NON_NEGATIVE_INTS:
        return "int >= 0"
    if f.name == "time_budget":
        return "seconds, or 90s / 5m / 1h"
    if f.name in ("beta1", "beta2"):
        return "float in [0, 1)"
    if f.name == "train_fraction":
        return "float in (0, 1)"
    if f.name in ("lr", "lora_alpha"):
        return "float > 0"
    if f.name in NON_NEGATIVE_FLOATS:
        return "float >= 0"
    return ""


def _metavar(f: dataclasses.Field) -> str | None:
    if f.metadata.get("choices"):
        return None
    if f.name in ("data", "out_dir", "export", "init", "init_tokenizer"):
        return "PATH"
    if f.name == "time_budget":
        return "TIME"
    if f.name == "lora_targets":
        return "NAMES"
    return "N" if f.name in POSITIVE_INTS + NON_NEGATIVE_INTS else "X"


def register(subparsers) -> argparse.ArgumentParser:
    default = preset("shakespeare-char")
    p = subparsers.add_parser(
        "train", help="train a LLaMA on TinyShakespeare (or any text) on the CPU",
        description="Train a LLaMA-2 model on a CPU with AdamW. Defaults are the chosen --preset's "
                    "(shown below for shakespeare-char); flags given here override it. Writes "
                    "OUT_DIR/ckpt.safetensors (model, optimizer state, tokenizer: `npllama generate "
                    "--model` reads it), metrics.jsonl and loss.png. --resume continues a run exactly.",
        epilog=docs_epilog("docs/training.md", "docs/finetuning.md (--init, --lora-*)",
                           "docs/distributed.md (mpiexec -n N npllama train)"),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="shakespeare-char",
                   help="starting settings: " + "; ".join(
                       f"{name}: {fn.__doc__.strip().splitlines()[0].rstrip('.')}" for name, fn in PRESETS.items()))
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        value = getattr(default, f.name)
        kind = _range(f)
        help_text = f.metadata["help"] + f" ({kind + '; ' if kind else ''}default {value!r})"
        help_text = help_text.replace("%", "%%")
        if f.type in ("bool", bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        else:
            p.add_argument(flag, type=_parse_type(f), default=argparse.SUPPRESS, help=help_text,
                           choices=f.metadata.get("choices"), metavar=_metavar(f))
    p.set_defaults(func=run)
    return p


def resolve_config(args: argparse.Namespace) -> TrainConfig:
    """The preset (or, with --resume, the checkpoint's config) updated by the flags given."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    given = {k: v for k, v in vars(args).items() if k in names}
    base = preset(args.preset)
    if not given.get("resume"):
        return base.replace(**given)
    # resuming: the saved run's settings, then the flags given now (train() refuses the flags
    # that would change the model or the data)
    ckpt = Path(given.get("out_dir", base.out_dir)) / CHECKPOINT_NAME
    return TrainConfig.from_dict(load_train_state(ckpt)["train_config"]).replace(**given)


def run(args: argparse.Namespace) -> int:
    """Train; under mpiexec, as one rank of the run (train/distributed.py), which only rank 0 reports on."""
    try:
        world = distributed.connect()
    except distributed.MpiUnavailable:
        if distributed.launched_rank() != 0:
            return 1                    # rank 0 says it, once
        raise
    try:
        cfg = resolve_config(args)
        explicit = {f.name for f in dataclasses.fields(TrainConfig) if hasattr(args, f.name)}
        result = train(cfg, preset_name=None if cfg.resume else args.preset, explicit=explicit, world=world)
        world.close()
    except BaseException as error:
        if world.size == 1:
            raise
        if getattr(error, "on_every_rank", False):                  # World.raise_together
            world.close()
            return report_error("train", error) if world.rank == 0 else 1
        world.stop_all(lambda where, e=error: report_error("train", e, where), error)   # one line, then every rank ends
    if result.stopped == "output_closed":
        if world.rank == 0:
            say(f"npllama train: output closed; stopped at step {result.steps}, saved {result.checkpoint} "
                "(continue with --resume)")
        return EXIT_PIPE_CLOSED
    if result.stopped == "interrupted":
        sig = signal.Signals(result.signal or signal.SIGINT)
        if world.rank == 0:
            say(f"npllama train: {sig.name}: stopped at step {result.steps}, saved {result.checkpoint} "
                "(continue with --resume)")
        return exit_code(sig)
    return 0
