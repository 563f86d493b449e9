"""Atomic file writes: a temporary file in the same folder, fsync, then one rename.

Used for every file npllama writes that a reader might open while it is being written or
after a crash: checkpoints, exported weights, downloads. A process killed mid-write (kill -9,
power loss) cannot delete its temporary file; `stale_temp_files` finds those of a path so that
whoever next owns the folder (a training run holding its lock) can remove them. An OSError
(disk full, read-only file system, permission denied) names the path being written, not the
temporary file.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..errors import with_path


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
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=_temp_prefix(path), suffix=suffix)
    except OSError as e:
        raise with_path(_renamed(e, path), path)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the usual permissions
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError):
            raise with_path(_renamed(e, path), path)
        raise
    _fsync_dir(directory)


def _temp_prefix(path: Path) -> str:
    return f".{path.name}."


def _renamed(error: OSError, path: Path) -> OSError:
    """error, naming path instead of the temporary file it happened to (the user never chose that name)."""
    if error.filename is not None and os.path.basename(str(error.filename)).startswith(_temp_prefix(path)):
        error.filename = str(path)
    return error


def stale_temp_files(path, suffix: str = ".tmp") -> list[Path]:
    """The temporary files write_atomic(path) leaves when its process is killed mid-write.

    Only their owner may delete them, and only when no other process can be writing path (a
    training run does it under its folder's lock, train/lock.py)."""
    path = Path(path)
    prefix = _temp_prefix(path)
    if not path.parent.is_dir():
        return []
    return sorted(p for p in path.parent.iterdir()
                  if p.name.startswith(prefix) and p.name.endswith(suffix) and p.is_file())


def write_bytes_atomic(path, data: bytes) -> None:
    """write_atomic for bytes already in memory (a config.json, a tokenizer file)."""
    write_atomic(path, lambda f: f.write(data))
