"""Shared by the subcommands: argument types (numbers checked for finiteness and range), exit codes,
and the one line an error ends a command with."""

from __future__ import annotations

import argparse
import math
import os
import sys

from ..errors import describe_os_error
from ..interrupts import exit_code, interrupt_detail, interrupt_signal

EXIT_PIPE_CLOSED = 128 + 13     # stdout's reader went away: what a shell reports for a process killed by SIGPIPE
# (a stop signal's code, 128 + its number, is npllama.interrupts.exit_code)


def say(line: str) -> None:
    """Write line and its newline to stderr in one write, flushed. (print() writes the text and the
    newline separately, and a stop signal handled between the two glued the "interrupted by"
    line to the unfinished one.)"""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def docs_epilog(*pages: str) -> str:
    """The last paragraph of a command's --help: the pages of docs/ (in npllama's source tree) that
    cover it, each "docs/PAGE.md" or "docs/PAGE.md (what for)". tests/test_docs_pages.py checks
    that every --help ends with one and that the pages exist."""
    return "Documentation: " + "; ".join(pages) + "."


def number(kind, low=None, high=None, low_open=False):
    """An argparse type: `kind` (int or float) from text, finite, >= low (> low if low_open), <= high."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text} must be finite")
        if low is not None and (value <= low if low_open else value < low):
            raise argparse.ArgumentTypeError(f"{text} must be {'>' if low_open else '>='} {low}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"{text} must be <= {high}")
        return value
    parse.__name__ = kind.__name__        # argparse names the type in its messages
    return parse


def report_error(command: str, error: BaseException, where: str = "") -> int | None:
    """Print the one line that `error` ends `npllama command` with; returns the exit code (cli/__init__.py).

    None for any other exception: a bug in npllama, whose traceback the caller keeps.
    where: said before the message ("rank 1: " when a rank of an mpiexec run reports).
    """
    if isinstance(error, BrokenPipeError):
        _discard_stdout()
        return EXIT_PIPE_CLOSED
    if isinstance(error, OSError):
        say(f"npllama {command}: error: {where}{describe_os_error(error) or describe_bare(error, command)}")
        return 1
    if isinstance(error, (ValueError, MemoryError)):
        # Bad input is the user's to fix: one line naming it, not a traceback. (npllama's errors are
        # all ValueErrors; a MemoryError that npllama.memory did not foresee is not a bug either.)
        say(f"npllama {command}: error: {where}{str(error).strip() or describe_bare(error, command)}")
        return 1
    if isinstance(error, KeyboardInterrupt):
        sig, detail = interrupt_signal(error), interrupt_detail(error)
        say(f"npllama {command}: {where}interrupted by {sig.name}" + (f"; {detail}" if detail else ""))
        return exit_code(sig)
    return None


def describe_bare(error: BaseException, command: str) -> str:
    """What to print for an error raised without a message, so no error line is ever empty."""
    if isinstance(error, MemoryError):
        return (f"out of memory ({type(error).__name__} with no message) during `npllama {command}`: the "
                "process could not get the memory it asked for; choose smaller settings or free some memory")
    return (f"{type(error).__name__} with no message during `npllama {command}` (an error npllama did not "
            "word: please report it, with the command line)")


def _discard_stdout() -> None:
    """Send what is still buffered for stdout, and all later output, to /dev/null."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)
