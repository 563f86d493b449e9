"""The errors npllama raises on purpose, and how an OS error reads as one line.

    NpllamaError (a ValueError)     bad input, a damaged file, a run that cannot go on: the
                                    message names the problem and a fix. The errors of files,
                                    tokens, memory and runs derive from it (CheckpointError,
                                    TokenError, ...): `except ValueError` catches every one, and
                                    tests/test_errors.py fails on a plain `raise ValueError`.
    MissingFileError                a path to read that does not exist; also a FileNotFoundError
    MemoryLimitError                an allocation refused before it was made ("needs X GiB,
                                    Y GiB available"); also a MemoryError
    OSError                         the operating system's (disk full, read-only, permission
                                    denied): left as it is, with the path it concerns set

The command line prints an NpllamaError or an OSError as one line and exits 1; any other
exception (TypeError, AttributeError, AssertionError, ...) is a bug in npllama and keeps its
traceback.
"""

from __future__ import annotations

import errno


class NpllamaError(ValueError):
    """npllama's own error: the message says what is wrong and how to fix it."""


class MissingFileError(NpllamaError, FileNotFoundError):
    """A file or folder npllama was asked to read that does not exist (also a FileNotFoundError)."""


class MemoryLimitError(NpllamaError, MemoryError):
    """An allocation that cannot fit in the memory available, refused before it is made."""


_OS_HINTS = {
    errno.ENOSPC: "the disk is full; free some space",
    errno.EDQUOT: "the disk quota is exhausted; free some space",
    errno.EROFS: "the file system is read-only; choose a writable folder",
    errno.EACCES: "permission denied; choose a folder you may write, or fix its permissions",
    errno.EPERM: "operation not permitted; choose a folder you may write, or fix its permissions",
}


def with_path(error: OSError, path) -> OSError:
    """error, naming path when the OS left its filename unset (a write() that hit a full disk)."""
    if error.filename is None and error.errno is not None:
        error.filename = str(path)
    return error


def describe_os_error(error: OSError) -> str:
    """One line: the path(s) and the cause, e.g. "runs/x/ckpt.safetensors: No space left on device
    (the disk is full; free some space)". An OSError npllama raised with its own message keeps it."""
    if error.errno is None or not error.strerror:
        return str(error)
    paths = " -> ".join(dict.fromkeys(str(p) for p in (error.filename, error.filename2) if p is not None))
    hint = _OS_HINTS.get(error.errno)
    cause = error.strerror + (f" ({hint})" if hint else "")
    return f"{paths}: {cause}" if paths else cause
