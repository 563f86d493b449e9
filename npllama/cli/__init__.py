"""The `npllama` command line: one argparse subcommand per job.

Each subcommand lives in its own module and registers itself with `register(subparsers)`,
setting `func` to the function that runs it and returns an exit code.

Exit codes and errors (docs/faults.md):
    0    done
    1    an npllama error (NpllamaError, any ValueError npllama raises on bad input) or an OS
         error (disk full, read-only, permission denied, no such file): one line on stderr,
         "npllama COMMAND: error: ...", naming the path and the cause
    2    a usage error (argparse)
    130  Ctrl-C (SIGINT); 143 SIGTERM; 129 SIGHUP: 128 + the signal's number, one line on stderr
         (npllama/interrupts.py). Training finishes its step and saves a checkpoint first; a
         second signal stops it at once, keeping the last checkpoint written
    135  a memory-mapped weights file was cut short while in use (128 + SIGBUS; io/sigbus.py)
    141  stdout closed by its reader (`npllama generate | head -c 10`): the command ends
         quietly, as a Unix tool killed by SIGPIPE does (128 + 13); training saves first
Anything else (TypeError, AttributeError, AssertionError, ...) is a bug in npllama and keeps
its traceback. A stdout closed before the start (`npllama train >&-`) is treated as
/dev/null: the command runs and its files are written.
"""

from __future__ import annotations

import argparse
import os
import sys

from . import export, generate, gradcheck, plot, train
from .args import docs_epilog, report_error

SUBCOMMANDS = [gradcheck, train, generate, plot, export]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="npllama",
        description="LLaMA-2 in pure NumPy: train on a CPU, generate, load and check exported weights.",
        epilog=docs_epilog("README.md (the first steps)", "docs/training.md", "docs/finetuning.md",
                           "docs/generation.md", "docs/weights.md", "docs/math.md", "docs/faults.md",
                           "docs/speed.md", "docs/distributed.md"),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    if sys.stdout is None:          # started with stdout closed: nothing to show, the files still count
        sys.stdout = open(os.devnull, "w")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (OSError, ValueError, MemoryError, KeyboardInterrupt) as e:
        return report_error(args.command, e)


if __name__ == "__main__":
    sys.exit(main())
