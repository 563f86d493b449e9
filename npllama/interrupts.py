"""Stop signals: SIGINT (Ctrl-C), SIGTERM (`kill`, schedulers such as SLURM and Kubernetes,
launchers such as mpiexec) and SIGHUP (the terminal went away), handled alike.

A signal stops npllama in one of two ways:

    at once      raise_on_stop_signals(): each signal raises KeyboardInterrupt(signal) in the
                 main thread, as Python does for Ctrl-C alone by default, so `finally` blocks run
                 (a temporary file is deleted, a lock released) and the command line prints one
                 line; the launcher (npllama/__main__.py) installs this before anything else is
                 imported
    at a step    StopRequest: the first signal only sets a flag that a loop polls between steps
                 (training finishes its step and saves a checkpoint); a second one raises at once

The exit code after a signal is 128 + its number, what a shell reports for a process the signal
killed: 130 SIGINT, 143 SIGTERM, 129 SIGHUP. Python runs a signal handler between bytecodes in
the main thread, so a signal arriving inside one long NumPy call takes effect when it returns.

Never in the middle of an import: a KeyboardInterrupt raised while a module runs its top-level
code can be lost or mangled by the code importing it (seen: NumPy imports numpy.random on first
use, and an interrupt raised inside its Cython modules' initialisation vanished, so `generate`
ran to its end; another left a half-made module behind and a second KeyboardInterrupt at exit).
So a signal that comes during an import is sent again RETRY_SECONDS later, until it finds the
main thread outside any import.

This module imports the standard library only: the launcher imports it before NumPy.
"""

from __future__ import annotations

import os
import signal
import threading

RETRY_SECONDS = 0.005

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


def interrupt_signal(error: KeyboardInterrupt) -> signal.Signals:
    """The signal that raised error: the one it carries (raise_on_stop_signals, StopRequest), else
    SIGINT (Python's own Ctrl-C handler raises a bare KeyboardInterrupt)."""
    first = error.args[0] if error.args else None
    return first if isinstance(first, signal.Signals) else signal.SIGINT


def interrupt_detail(error: KeyboardInterrupt) -> str:
    """What the code that was interrupted added to say what is kept (a second argument), or ''."""
    return str(error.args[1]) if len(error.args) > 1 else ""


def exit_code(sig: int) -> int:
    """128 + the signal's number: 130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP."""
    return 128 + int(sig)


def _importing(frame) -> bool:
    """True when frame or one of its callers is importlib running an import."""
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith("<frozen importlib._bootstrap") or name.endswith(("importlib/_bootstrap.py",
                                                                              "importlib/_bootstrap_external.py")):
            return True
        frame = frame.f_back
    return False


def raise_interrupt(sig: signal.Signals, frame) -> None:
    """Raise KeyboardInterrupt(sig) where the main thread is (frame); during an import, send sig
    again RETRY_SECONDS later instead (module docstring), to be handled by whatever handler is in
    place by then."""
    if _importing(frame):
        again = threading.Timer(RETRY_SECONDS, os.kill, (os.getpid(), int(sig)))
        again.daemon = True
        again.start()
        return
    raise KeyboardInterrupt(sig)


class _Handlers:
    """Install self._handle (each subclass's) for STOP_SIGNALS on entering, restore the previous handlers on leaving.

    Outside the main thread nothing is installed (Python allows handlers in the main thread only)
    and the signals keep whatever handling they had."""

    def __enter__(self):
        self._old = {}
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
        self._old = {}


class raise_on_stop_signals(_Handlers):
    """Within it, every stop signal raises KeyboardInterrupt(signal) in the main thread."""

    def _handle(self, signum, frame):
        raise_interrupt(signal.Signals(signum), frame)


class exit_on_stop_signals(_Handlers):
    """Within it, a stop signal ends the process at once, quietly, with exit_code(signal): for the
    last moments of a command, whose outcome is already decided and reported (os._exit runs no
    more Python code, so nothing half-done can print a traceback)."""

    def _handle(self, signum, frame):
        os._exit(exit_code(signum))


class StopRequest(_Handlers):
    """A stop asked for by a signal, which a loop polls at its step boundaries.

        with StopRequest() as stop:
            while not stop.poll():
                one_step()
        stop.signal        # the signal that asked (signal.Signals), or None

    The first SIGINT, SIGTERM or SIGHUP only records itself (poll() is then True, so the loop
    can finish its step and save); a second one of any of them calls at_once(signal), or by
    default raises KeyboardInterrupt(signal) where the main thread is (raise_interrupt: once
    outside any import). Leaving the block
    restores the previous handlers.

    poll() is the one place a loop asks: a data-parallel run can replace it with a collective
    that is True on every rank as soon as any rank was signalled, so that all stop at one step.
    """

    def __init__(self, at_once=None):
        self.signal: signal.Signals | None = None
        self._at_once = at_once           # None: raise_interrupt

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def poll(self) -> bool:
        """True once a stop signal has arrived."""
        return self.requested

    def _handle(self, signum, frame):
        if self.signal is not None:
            if self._at_once is None:
                raise_interrupt(signal.Signals(signum), frame)
                return
            self._at_once(signal.Signals(signum))
        self.signal = signal.Signals(signum)


def exit_now(sig: signal.Signals, prefix: str = "npllama") -> None:
    """Write "{prefix}: interrupted by SIGNAL" to stderr and end the process with exit_code(sig), at
    once (os._exit: no Python code runs after it, so nothing can add a traceback)."""
    os.write(2, f"{prefix}: interrupted by {sig.name}\n".encode())
    os._exit(exit_code(sig))
