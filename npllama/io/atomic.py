"""Atomic file writes: a temporary file in the same folder, fsync, then one rename.

Used for every file npllama writes that a reader might open while it is being written or
after a crash: checkpoints, exported weights, downloads.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _fsync_dir(directory: Path) -> None:
    try:  # make the rename itself durable; not every platform can open a directory
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path, write, suffix: str = ".tmp") -> None:
    """Call write(file) on a temp file beside path, fsync, then os.replace it onto path.

    If write raises (a full disk, a failed checksum, Ctrl-C), the temp file is deleted and path
    is left as it was: a reader sees the old file or the new one, never half of one.
    """
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the usual permissions
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(directory)


def write_bytes_atomic(path, data: bytes) -> None:
    """write_atomic for bytes already in memory (a config.json, a tokenizer file)."""
    write_atomic(path, lambda f: f.write(data))
