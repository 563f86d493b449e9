"""The launcher: `python -m npllama` and the `npllama` script (pyproject.toml: npllama.__main__:main).

Its first act, before it imports the command line, NumPy and the rest, is to take over SIGINT,
SIGTERM and SIGHUP (npllama/interrupts.py), so that a signal at any moment ends with one line on
stderr, "npllama ...: interrupted by SIGTERM", and the exit code 128 + the signal's number, never a
traceback:

    while importing      the signal is recorded and acted on once the imports are done (a
                         KeyboardInterrupt raised inside an import can surface as another error,
                         e.g. NumPy's "could not import module datetime"); a second one ends the
                         process at once
    while a command runs it raises KeyboardInterrupt(signal), which npllama.cli.main reports
                         (training stops at a step boundary and saves first: train/loop.py); in
                         the middle of an import (NumPy imports some modules on first use) it
                         is held until the import is done (npllama/interrupts.py)
    once it has returned the process ends at once with that code, quietly: the outcome is decided

What no code of npllama can cover: the interpreter's own start-up (its `site` imports, ~0.1 s)
before this file's first line, where a Ctrl-C prints Python's own KeyboardInterrupt; and its
shut-down after main has returned, where Python puts the default handlers back, so a signal ends
the process by itself: quietly too, with the outcome reported (a shell sees 128 + the signal).
"""

import sys

from .interrupts import (StopRequest, exit_code, exit_now, exit_on_stop_signals, interrupt_signal,
                         raise_on_stop_signals)


def main(argv=None) -> int:
    """Run the command line (npllama.cli.main) with the stop signals handled; return its exit code."""
    starting = StopRequest(at_once=exit_now).__enter__()        # handlers kept for the life of the process
    # imported here, not at the top: the handlers above must be in place first
    from .cli import main as command_line
    try:
        raise_on_stop_signals().__enter__()
        if starting.signal is not None:
            raise KeyboardInterrupt(starting.signal)
        code = command_line(argv)
    except KeyboardInterrupt as e:                  # while starting, or parsing the arguments
        exit_on_stop_signals().__enter__()
        sys.stderr.write(f"npllama: interrupted by {interrupt_signal(e).name}\n")     # one write: cli/args.py say
        return exit_code(interrupt_signal(e))
    exit_on_stop_signals().__enter__()
    return code


if __name__ == "__main__":
    sys.exit(main())
