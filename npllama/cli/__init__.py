"""The `npllama` command line: one argparse subcommand per job.

Each subcommand lives in its own module and registers itself with `register(subparsers)`,
setting `func` to the function that runs it and returns an exit code.

Exit codes and errors (README "Faults and guarantees"):
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

from ..errors import describe_os_error
from ..interrupts import exit_code, interrupt_detail, interrupt_signal
from . import export, generate, gradcheck, plot, train
from .args import EXIT_PIPE_CLOSED

SUBCOMMANDS = [gradcheck, train, generate, plot, export]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="npllama",
        description="LLaMA-2 in pure NumPy: train on a CPU, generate, load and check exported weights.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.register(subparsers)
    return parser


def _discard_stdout() -> None:
    """Send what is still buffered for stdout, and all later output, to /dev/null."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


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
    except BrokenPipeError:
        _discard_stdout()
        return EXIT_PIPE_CLOSED
    except OSError as e:
        print(f"npllama {args.command}: error: {describe_os_error(e) or type(e).__name__}", file=sys.stderr)
        return 1
    except (ValueError, MemoryError) as e:
        # Bad input is the user's to fix: one line naming it, not a traceback. (npllama's errors are
        # all ValueErrors; a MemoryError that npllama.memory did not foresee is not a bug either.)
        message = str(e) or ("out of memory (an allocation failed that npllama did not foresee)"
                              if isinstance(e, MemoryError) else type(e).__name__)
        print(f"npllama {args.command}: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        sig, detail = interrupt_signal(e), interrupt_detail(e)
        print(f"npllama {args.command}: interrupted by {sig.name}" + (f"; {detail}" if detail else ""),
              file=sys.stderr)
        return exit_code(sig)


if __name__ == "__main__":
    sys.exit(main())
