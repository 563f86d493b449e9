"""Atomic writes: a file (or a whole folder) is written beside its path, then renamed into place.

Used for every file npllama writes that a reader might open while it is being written or
after a crash: checkpoints, exported weights, downloads, the loss curve. A process killed
mid-write (kill -9, power loss) cannot delete its temporary file; `stale_temp_files` finds
those of a path so that whoever next owns the folder (a training run holding its lock) can
remove them. An OSError (disk full, read-only file system, permission denied) names the path
being written, not the temporary file.

Folders (Hugging Face exports) are written whole by write_folder_atomic: into a temporary
sibling folder `.NAME.XXXXXXXX.tmpdir`, which then takes NAME's place in one rename. On Linux
that rename is an exchange (renameat2 RENAME_EXCHANGE): at every instant NAME is the complete
old folder or the complete new one, never missing and never a mix; elsewhere the old folder is
renamed aside first (`.NAME.XXXXXXXX.old`), leaving an instant with no NAME. The writer holds a
flock on its temporary folder, so a later writer of the same NAME can tell a folder left by a
killed writer (removed) from one still being written (left alone).

npllama never writes through a symbolic link planted at a path it writes: refuse_symlink.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from ..errors import with_path
from .errors import OutputPathError, PathInTheWayError


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
    refuse_symlink(path)
    directory = path.parent if str(path.parent) else Path(".")
    for stale in stale_temp_files(path, suffix, unlocked=True):   # what a killed writer of path left
        stale.unlink(missing_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=_temp_prefix(path), suffix=suffix)
    except OSError as e:
        raise with_path(_renamed(e, path), path)
    try:
        with os.fdopen(fd, "wb") as f:
            # "being written" until it is renamed (the lock goes with the file's closing): see
            # stale_temp_files(unlocked=True)
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
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


def stale_temp_files(path, suffix: str = ".tmp", unlocked: bool = False) -> list[Path]:
    """The temporary files write_atomic(path) leaves when its process is killed mid-write.

    Only their owner may delete them, and only when no other process can be writing path (a
    training run does it under its folder's lock, train/lock.py). unlocked=True keeps only those
    no live writer holds (write_atomic flocks its temporary file), less an empty one so young that
    its writer may be about to lock it: what any later writer of path may remove."""
    path = Path(path)
    prefix = _temp_prefix(path)
    if not path.parent.is_dir():
        return []
    found = sorted(p for p in path.parent.iterdir()
                   if p.name.startswith(prefix) and p.name.endswith(suffix) and p.is_file() and not p.is_symlink())
    return [p for p in found if _abandoned(p)] if unlocked else found


def _abandoned(p: Path) -> bool:
    """True when no live process holds a flock on p, and p is not a just-made empty file or folder
    (its maker may not have locked it yet)."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | (os.O_DIRECTORY if p.is_dir() else 0))
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False                                # a live writer's
    finally:
        os.close(fd)
    try:
        st = p.stat()
        empty = not any(p.iterdir()) if p.is_dir() else st.st_size == 0
    except OSError:
        return False
    return not (empty and time.time() - st.st_mtime < _QUIET_SECONDS)


def write_bytes_atomic(path, data: bytes) -> None:
    """write_atomic for bytes already in memory (a config.json, a tokenizer file)."""
    write_atomic(path, lambda f: f.write(data))


def refuse_symlink(path) -> None:
    """OutputPathError when path is a symbolic link: npllama never writes a file through a link
    planted at its path (whatever it points at would be overwritten or replaced)."""
    path = Path(path)
    if path.is_symlink():
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        raise OutputPathError(f"{path} is a symbolic link (to {target}); npllama does not write through links: "
                              "remove the link or choose another path")


# ----------------------------------------------------------------------------- whole folders

FOLDER_SUFFIX = ".tmpdir"       # a folder being written, or the old one being removed
ASIDE_SUFFIX = ".old"           # the old folder, for the instant between two renames (no exchange)
_QUIET_SECONDS = 10.0           # an unlocked, empty temporary folder younger than this may be a writer's
                                # between mkdtemp and flock: left alone


def write_folder_atomic(path, write_contents: Callable[[Path], None],
                        replaces: Callable[[str], bool] = lambda name: False) -> Path:
    """Write the folder path whole: write_contents(folder) fills a new temporary folder beside path,
    which then takes path's place in one rename; the old folder, if any, is then removed.

    A reader that opens path/x sees the old folder's x or the new one's, never a half-written x and
    never a folder half old and half new. (One that opens several files one after another can still
    straddle a swap; npllama's loader notices by the save id the files carry: io/checkpoint.py.)
    Entries of the old folder that write_contents did not write are carried into the new one as
    hard links (nothing is copied, nothing is lost), except those `replaces(name)` says the new
    contents supersede (the pieces of the model being replaced). If write_contents raises (a full
    disk, Ctrl-C) or the process is killed, path is left as it was; the temporary folder of a
    killed writer is removed by the next write_folder_atomic(path).
    Returns path.
    """
    path = Path(path)
    refuse_symlink(path)
    if path.exists() and not path.is_dir():
        raise PathInTheWayError(f"{path} is a file, where a folder is to be written; choose another path")
    parent = path.parent if str(path.parent) else Path(".")
    parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_folders(path)
    try:
        tmp = Path(tempfile.mkdtemp(dir=parent, prefix=_temp_prefix(path), suffix=FOLDER_SUFFIX))
    except OSError as e:
        raise with_path(_renamed(e, path), path)
    lock = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
    old = None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)            # "being written": see remove_stale_temp_folders
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)               # mkdtemp makes 0700; give the usual permissions
        write_contents(tmp)
        if path.is_dir():
            _carry_over(path, tmp, replaces)
        _fsync_dir(tmp)
        old = _swap_in(tmp, path)
    except BaseException as e:
        if old is None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise with_path(_renamed(e, path), path)
        raise
    finally:
        os.close(lock)
    _fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return path


def _swap_in(tmp: Path, path: Path) -> Path | None:
    """Put the folder tmp at path; returns where the old folder now is (to remove), or None."""
    for _ in range(100):
        if os.path.lexists(path):
            if _exchange(tmp, path):
                return tmp                          # tmp's name now holds the old folder
            aside = Path(tempfile.mkdtemp(dir=path.parent, prefix=_temp_prefix(path), suffix=ASIDE_SUFFIX))
            os.rename(path, aside)                  # onto the empty folder mkdtemp made
            try:
                os.rename(tmp, path)
            except BaseException:
                os.rename(aside, path)
                raise
            return aside
        try:
            os.rename(tmp, path)
            return None
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):     # else another writer got there first: exchange
                raise
    raise OutputPathError(f"{path} keeps being replaced by another process while npllama saves there; retry "
                          "when it is done")


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _libc_renameat2():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):               # a C library without it (glibc < 2.28, musl < 1.2.?)
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _libc_renameat2()


def _exchange(a: Path, b: Path) -> bool:
    """Swap the paths a and b in one step (Linux renameat2 RENAME_EXCHANGE); False where the system
    or the file system cannot."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise _os_error(err, b)


def _os_error(code: int, path) -> OSError:
    """The OSError the system call failing with errno `code` on path means (the operating system's
    error, as errors.py keeps them: the CLI prints it as one line naming the path)."""
    return OSError(code, os.strerror(code), str(path))


def _link_or_copy(src, dst) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:                                 # a file system without hard links
        shutil.copy2(src, dst, follow_symlinks=False)


def _carry_over(old: Path, new: Path, replaces: Callable[[str], bool]) -> None:
    """Bring the entries of the folder old that new lacks into new (hard links; folders as trees of
    them), except the superseded ones and the temporary files of writes into old."""
    written = set(os.listdir(new))
    for entry in os.scandir(old):
        name = entry.name
        temp = _TEMP_FILE.match(name)
        if name in written or replaces(name) or (temp and temp.group(1) in written):
            continue
        src, dst = os.path.join(old, name), os.path.join(new, name)
        if entry.is_symlink():
            os.symlink(os.readlink(src), dst)
        elif entry.is_dir(follow_symlinks=False):
            shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(src, dst)


_TEMP_FILE = re.compile(r"^\.(.+)\.[^.]+\.tmp$")     # write_atomic's temporary file of the file group(1)


def stale_temp_folders(path) -> list[Path]:
    """The temporary folders write_folder_atomic(path) left behind when killed: not locked by a
    live writer, and not an empty one so young that its writer may be about to lock it."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        return []
    prefix = _temp_prefix(path)
    return [p for p in sorted(parent.iterdir())
            if p.name.startswith(prefix) and p.name.endswith((FOLDER_SUFFIX, ASIDE_SUFFIX))
            and not p.is_symlink() and p.is_dir() and _abandoned(p)]


def remove_stale_temp_folders(path) -> None:
    """Remove what killed writers of the folder path left; an old folder set aside (no exchange) while
    path is missing is put back, as it is the only copy."""
    path = Path(path)
    for p in stale_temp_folders(path):
        if p.name.endswith(ASIDE_SUFFIX) and not os.path.lexists(path):
            os.rename(p, path)
        else:
            shutil.rmtree(p, ignore_errors=True)
