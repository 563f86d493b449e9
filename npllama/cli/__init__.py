"""The `npllama` command line: one argparse subcommand per job.

Each subcommand lives in its own module and registers itself with `register(subparsers)`,
setting `func` to the function that runs it and returns an exit code.

Exit codes and errors (README "Faults and guarantees"):
    0    done
    1    an npllama error (NpllamaError, any ValueError npllama raises on bad input) or an OS
         error (disk full, read-only, permission denied, no such file): one line on stderr,
         "npllama COMMAND: error: ...", naming the path and the cause
    2    a usage error (argparse)
    130  Ctrl-C (training saves first)
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
from . import export, generate, gradcheck, plot, train
from .args import EXIT_INTERRUPTED, EXIT_PIPE_CLOSED

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


def describe_bare(error: BaseException, command: str) -> str:
    """What to print for an error raised without a message, so no error line is ever empty."""
    if isinstance(error, MemoryError):
        return (f"out of memory ({type(error).__name__} with no message) during `npllama {command}`: the "
                "process could not get the memory it asked for; choose smaller settings or free some memory")
    return (f"{type(error).__name__} with no message during `npllama {command}` (an error npllama did not "
            "word: please report it, with the command line)")


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
        print(f"npllama {args.command}: error: {describe_os_error(e) or describe_bare(e, args.command)}",
              file=sys.stderr)
        return 1
    except (ValueError, MemoryError) as e:
        # Bad input is the user's to fix: one line naming it, not a traceback. (npllama's errors are
        # all ValueErrors; a MemoryError that npllama.memory did not foresee is not a bug either.)
        print(f"npllama {args.command}: error: {str(e).strip() or describe_bare(e, args.command)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"npllama {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
