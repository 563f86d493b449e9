"""The `npllama` command line: one argparse subcommand per job.

Each subcommand lives in its own module and registers itself with `register(subparsers)`,
setting `func` to the function that runs it and returns an exit code.
"""

from __future__ import annotations

import argparse
import sys

from . import export, generate, gradcheck, plot, train

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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, KeyError, FileNotFoundError) as e:
        # Bad input is the user's to fix: one line naming it, not a traceback.
        print(f"npllama {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"npllama {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
