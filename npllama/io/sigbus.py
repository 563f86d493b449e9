"""SIGBUS while weights are mapped: one line naming the file, then exit 135, instead of a silent death.

Reading a page of a mapped file beyond its end, after someone truncated it, makes the kernel
send SIGBUS to the thread that read it, in the middle of a NumPy loop or a BLAS kernel. Its
default action kills the process with no word (a shell reports 135). A Python-level handler
(signal.signal) cannot help: CPython only sets a flag in C and runs the Python function later,
between bytecodes, but the faulting instruction runs again as soon as the C handler returns and
faults again, forever. faulthandler's handler runs in C, but prints Python's "Fatal Python error:
Bus error" and a traceback, and nothing npllama can word.

So while at least one file is mapped (io/mapped.py calls guard() when it maps one and release()
when the mapping is gone), a C-level handler is installed through ctypes (no compiler: libc's
signal() with a ctypes callback): it writes one line, prepared in advance, naming the mapped
files, to stderr with os.write and ends the process with os._exit(EXIT_BUS_ERROR), 128 + SIGBUS
(135 on Linux): no cleanup runs, none is safe in the middle of a fault. When the last mapping is
gone the previous handler (Python's default, or faulthandler's) is put back exactly, as
sigaction() saved it.

What is guaranteed, and what is not:
  - the line and the exit code, for a SIGBUS in any thread while a file is mapped; the line names
    every file mapped at that moment (the kernel's report of which address faulted is not read);
  - the callback runs Python code (two calls): it needs the GIL, which the faulting thread either
    holds already (a NumPy loop that kept it) or gets once the thread holding it lets it go, as a
    thread waiting on NumPy work does; a thread that keeps the GIL and waits forever for the
    faulting one would hang the process instead (npllama's threads never do that);
  - a SIGBUS that has another cause while a file is mapped (a bug in a C extension) gets the
    same line;
  - without libc's signal() (not glibc, musl or macOS) or without SIGBUS (Windows), nothing is
    installed, and a truncated mapped file kills the process as before;
  - nothing can make the interrupted computation finish: the process always ends.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import threading
from pathlib import Path

SIGBUS = getattr(signal, "SIGBUS", None)
EXIT_BUS_ERROR = 128 + (SIGBUS or 7)            # 135 on Linux, what a shell reports for a SIGBUS death
_SIGACTION_BYTES = 1024                          # more than any platform's struct sigaction

_lock = threading.Lock()
_mapped: dict[int, Path] = {}                    # token -> file, for every live mapping
_next_token = 0
_saved = None                                    # the previous sigaction while ours is installed
_message = b""


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    if not (hasattr(libc, "signal") and hasattr(libc, "sigaction")):
        return None
    libc.signal.argtypes, libc.signal.restype = [ctypes.c_int, ctypes.c_void_p], ctypes.c_void_p
    libc.sigaction.argtypes, libc.sigaction.restype = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
    return libc


_LIBC = _libc() if SIGBUS is not None else None


def _on_bus_error(signum: int) -> None:
    """The handler: the prepared line, then the exit code, at once."""
    os.write(2, _message)
    os._exit(EXIT_BUS_ERROR)


_HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_int)(_on_bus_error)


def _set_message() -> None:
    global _message
    files = ", ".join(dict.fromkeys(str(p) for p in _mapped.values()))
    if len(files) > 1000:
        files = files[:1000] + "..."
    _message = (f"npllama: error: bus error (SIGBUS) reading memory-mapped weights ({files}): the file was cut "
                f"short while in use, so this process cannot go on (exit {EXIT_BUS_ERROR}); load the model again "
                "once the file is whole, and replace weights files atomically (write a new file, then rename "
                "it over the old one) instead of truncating or rewriting them\n").encode("utf-8", "replace")


def guard(path) -> int | None:
    """Record that path is now mapped (installing the handler if it is the first); returns the
    token to pass to release(), or None where no handler can be installed."""
    global _next_token, _saved
    if _LIBC is None:
        return None
    with _lock:
        if not _mapped:
            saved = ctypes.create_string_buffer(_SIGACTION_BYTES)
            if _LIBC.sigaction(SIGBUS, None, saved) != 0:
                return None
            _saved = saved
            _LIBC.signal(SIGBUS, ctypes.cast(_HANDLER, ctypes.c_void_p))
        _next_token += 1
        _mapped[_next_token] = Path(path)
        _set_message()
        return _next_token


def release(token: int | None) -> None:
    """The mapping of guard()'s token is gone; the last one puts the previous handler back."""
    global _saved
    if token is None:
        return
    with _lock:
        if _mapped.pop(token, None) is None:
            return
        if _mapped:
            _set_message()
        elif _saved is not None:
            _LIBC.sigaction(SIGBUS, _saved, None)
            _saved = None


def installed() -> bool:
    """Whether the handler is in place (some file is mapped)."""
    return _saved is not None
