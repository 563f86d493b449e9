"""Shared by the subcommands: argument types (numbers checked for finiteness and range), exit codes."""

from __future__ import annotations

import argparse
import math

EXIT_PIPE_CLOSED = 128 + 13     # stdout's reader went away: what a shell reports for a process killed by SIGPIPE
# (a stop signal's code, 128 + its number, is npllama.interrupts.exit_code)


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
