"""One run per folder: `npllama train` holds a lock on its --out-dir for the life of the run.

    with RunLock(out_dir) as lock:     # RunLockedError, naming the holder, if another run has it
        ...

The lock is flock(2) on OUT_DIR/train.lock: an exclusive lock on an open file, held until the
file is closed. The kernel drops it when the process ends, however it ends (kill -9 included),
so a lock left behind by a killed run can never pass for a live one: the next run takes it
over and says whose it was. The file holds the holder's pid, host and start time (JSON), for
those messages. A run that ends (normally, by an error or by Ctrl-C) deletes the file while
still holding the lock, and a start that failed before writing anything (a missing --data,
say) also removes the folder it created, so a typo leaves nothing behind. Deleting is safe
because `_lock` checks, after locking, that the file it locked is still the one at the path.
The lock is opened with O_NOFOLLOW: a symbolic link (or a hard link) planted at train.lock is
refused with one line, never followed, so the file it points at keeps its contents.

flock is advisory and per machine: it stops two `npllama train` runs on one machine (or on
NFS, where Linux maps it to a lock the server keeps), not an unrelated program writing there.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time
from pathlib import Path

from ..checks import parse_json
from ..errors import NpllamaError
from ..io.atomic import refuse_symlink
from ..io.errors import OutputPathError

LOCK_NAME = "train.lock"


class RunLockedError(NpllamaError):
    """Another training run holds the --out-dir."""


def make_run_dir(out_dir) -> bool:
    """Create the folder out_dir (and its parents) unless it exists; returns True if it was created.

    NpllamaError when out_dir is a file, or lies under one; any other failure (read-only file
    system, permission denied) is the OSError itself, naming the path.
    """
    path = Path(out_dir)
    if path.exists() and not path.is_dir():
        raise NpllamaError(f"--out-dir {path} is a file, not a folder; choose another --out-dir")
    if path.is_dir():
        return False
    try:
        path.mkdir(parents=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
        if blocker is None:         # another process made it between the check and mkdir
            return False
        raise NpllamaError(f"--out-dir {path} lies under {blocker}, which is a file, not a folder; "
                           "choose another --out-dir") from None
    return True


def _holder_text(holder: dict | None) -> str:
    if not holder:
        return "another process"
    return (f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"
            f"{' (' + str(holder['command']) + ')' if holder.get('command') else ''}")


def _read_holder(f) -> dict | None:
    f.seek(0)
    try:
        holder = parse_json(f.read() or "null", "the lock file")
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


class RunLock:
    """The lock of one run's folder (see the module docstring). `previous` is the holder record a
    killed run left behind, or None."""

    def __init__(self, out_dir, command: str = "npllama train"):
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / LOCK_NAME
        self.command = command
        self.previous: dict | None = None
        self._file = None
        self._created_dir = False

    def _open(self):
        """self.path opened for reading and writing, created if missing, never through a symbolic link
        (O_NOFOLLOW) and never a file that has other names (truncating it would empty those too)."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:          # O_NOFOLLOW met a symbolic link
                refuse_symlink(self.path)
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            os.close(fd)
            what = "a hard link to another file" if stat.S_ISREG(st.st_mode) else "not a plain file"
            raise OutputPathError(f"{self.path} is {what}, which the run's lock would overwrite; remove it "
                                  "(npllama creates the lock itself)")
        return open(fd, "r+", encoding="utf-8")

    def _lock(self):
        """An open, flock-ed file that is still the one at self.path (a run that failed to start may
        have removed the path between our open and our flock: then open the new one)."""
        for _ in range(100):
            f = self._open()
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(f)
                f.close()
                raise RunLockedError(f"{self.out_dir} is in use by another training run ({_holder_text(holder)}); "
                                     "wait for it to end, or choose another --out-dir") from None
            try:
                if os.lstat(self.path).st_ino == os.fstat(f.fileno()).st_ino:
                    return f
            except FileNotFoundError:
                pass
            f.close()
        raise RunLockedError(f"{self.path} keeps being replaced; is another program removing it?")

    def acquire(self) -> "RunLock":
        self._created_dir = make_run_dir(self.out_dir)
        f = self._lock()
        self.previous = _read_holder(f)
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": self.command}))
        f.flush()
        self._file = f
        return self

    def stale_note(self) -> str | None:
        """What to say when the lock was taken over from a run that ended without releasing it
        (a lock file with a holder in it, which only a killed run leaves)."""
        if not self.previous:
            return None
        return (f"note: {self.path} was left by a run that ended without releasing it "
                f"({_holder_text(self.previous)}; killed?); taking it over")

    def release(self) -> None:
        f, self._file = self._file, None
        if f is None:
            return
        try:
            self.path.unlink()                  # still locked: nobody can be taking it now
            if self._created_dir and not any(self.out_dir.iterdir()):
                self.out_dir.rmdir()            # a start that wrote nothing leaves nothing behind
        except OSError:
            pass
        finally:
            f.close()                           # and the kernel drops the lock

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
