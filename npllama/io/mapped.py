"""A weights file in memory: read into it, or mapped from the file and then watched.

    buffer = file_buffer(f, path, mapped=should_map(size))   # the whole file as one buffer
    source = MappedSource.of(params)     # the mapped files some of params are views of, or None
    source.check()                       # WeightsFileChangedError if one changed on disk

Read or mapped. A file is read into anonymous memory (ReadBuffer) unless it is large against the
memory available: should_map() maps it when it holds more than MAP_FRACTION of what
npllama.memory.available_bytes() reports, or when the caller asks (npllama.load(..., mmap=True),
`npllama generate --mmap`). A read file can change on disk without any effect on the model; a
mapped one shares the operating system's page cache (nothing is copied, two processes share the
pages, the kernel can evict and re-read them), but its arrays are the file's pages:

  - replacing the file atomically (write a new file, rename it over the old one, as npllama.save
    and every npllama writer do) is safe: the mapping keeps the old file, which lives on unnamed
    until it is unmapped, and the model goes on with the weights it loaded;
  - rewriting it in place (`cp other.safetensors model.safetensors`) changes the arrays under
    the model, and truncating it makes reading the lost pages raise SIGBUS, which kills the
    process.

So a mapped model carries a MappedSource: the file's identity and state (device, inode, size,
mtime_ns) recorded from the descriptor it was mapped through, which check() compares with
os.fstat of that descriptor (a syscall: 0.5-7 us) before every forward, training pass and
generate call, and every 8th decode step (npllama.Llama and npllama.generate run it). A change
stops the model with a WeightsFileChangedError telling the user to reload. A truncation in the
middle of a step is caught by io/sigbus.py instead, which names the file before the process ends. What check() cannot see: a rewrite that
keeps the size and lands within the file system's timestamp granularity of the previous write
(a few milliseconds on ext4, tmpfs, xfs), and a change made between two checks, which the next
check reports (the step in between may have read some of the new bytes).
"""

from __future__ import annotations

import errno
import mmap
import os
import weakref
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .. import memory
from ..errors import MemoryLimitError
from .errors import CheckpointError, WeightsFileChangedError
from .sigbus import guard as guard_sigbus, release as release_sigbus

MAP_FRACTION = 0.5          # map files above this share of the memory available
READ_CHUNK = 64 << 20       # bytes read at a time (a Ctrl-C is seen between reads)


class ReadBuffer(mmap.mmap):
    """Anonymous private memory a file was read into: arrays in it are the process's own, but, as a
    mapping, its pages can be handed back one tensor at a time (safetensors.release_pages).

    Made by read_buffer: private (MAP_PRIVATE; Python's default for an anonymous mmap is shared,
    which Linux backs with shared-memory pages that transparent huge pages never serve by default)
    and advised MADV_HUGEPAGE, as NumPy advises its own large arrays: a decode step streams every
    weight once, and in 2 MB pages it reads them faster than in 4 KB ones (110M's one-row step
    16.98 against 18.41 ms, a generation of 128 tokens 53.8 against 50.9 tokens/s; medians of 9
    and 7 alternating rounds in one process, AMD EPYC, 6 December 2026)."""


def read_buffer(size: int) -> ReadBuffer:
    """A new ReadBuffer of size bytes (at least 1), zero-filled by the kernel."""
    private = {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS} if hasattr(mmap, "MAP_PRIVATE") else {}
    buffer = ReadBuffer(-1, max(size, 1), **private)
    if hasattr(mmap, "MADV_HUGEPAGE"):          # Linux
        try:
            buffer.madvise(mmap.MADV_HUGEPAGE)
        except OSError:                         # EINVAL: a kernel built without transparent huge pages
            pass
    return buffer


class Fingerprint(NamedTuple):
    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> "Fingerprint":
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class MappedFile:
    """One mapped file: its path, a descriptor of it (kept open while the mapping lives, so that
    the file checked is the one mapped, whatever is renamed over the path), and its fingerprint
    when mapped."""

    def __init__(self, path: Path, fd: int, fingerprint: Fingerprint, mapping: mmap.mmap):
        self.path, self.fd, self.fingerprint = path, fd, fingerprint
        self._mapping = weakref.ref(mapping)

    def changed(self) -> str | None:
        """How the file changed since it was mapped, or None (also once nothing maps it any more)."""
        mapping = self._mapping()             # held while fstat runs: the descriptor stays open
        if mapping is None:
            return None
        st, was = os.fstat(self.fd), self.fingerprint
        if st.st_size == was.size and st.st_mtime_ns == was.mtime_ns:
            return None
        if st.st_size < was.size:
            return f"it was truncated from {was.size:,} to {st.st_size:,} bytes"
        if st.st_size != was.size:
            return f"its size went from {was.size:,} to {st.st_size:,} bytes"
        return "it was rewritten in place, its modification time changed"


_files: "weakref.WeakKeyDictionary[mmap.mmap, MappedFile]" = weakref.WeakKeyDictionary()


class MappedSource:
    """The mapped files a model's weights are views of; check() raises if one of them changed."""

    def __init__(self, files: list[MappedFile]):
        self.files = files

    @classmethod
    def of(cls, params: dict) -> "MappedSource | None":
        """The files (mapped by file_buffer) that arrays of params are views of; None for none."""
        found = {}
        for arr in params.values():
            base = _buffer_of(arr)
            record = _files.get(base) if isinstance(base, mmap.mmap) else None
            if record is not None:
                found[id(record)] = record
        return cls(list(found.values())) if found else None

    def check(self) -> None:
        """Raise WeightsFileChangedError naming the first file that changed since it was mapped."""
        for f in self.files:
            how = f.changed()
            if how:
                raise WeightsFileChangedError(
                    f"{f.path} changed on disk while the model's weights were memory-mapped from it: {how}; "
                    "those weights can no longer be trusted: load the model again, and replace weights files "
                    "atomically (write a new file, then rename it over the old one, as npllama does) instead "
                    "of copying over them or truncating them")


def should_map(nbytes: int) -> bool:
    """The rule for npllama.load(..., mmap=None): map a file of nbytes when it is larger than
    MAP_FRACTION of the memory available (memory.available_bytes; unknown: read it)."""
    available = memory.available_bytes()
    return available is not None and nbytes > MAP_FRACTION * available


def file_buffer(f, path: Path, mapped: bool) -> mmap.mmap:
    """The whole of the open file f as one buffer: mapped copy-on-write (writes to its arrays change
    this process's copy of a page, never the file), with a MappedFile record and the SIGBUS guard
    (io/sigbus.py) for as long as the mapping lives; or, not mapped, read into a ReadBuffer.

    A private writable mapping counts against the memory the kernel lets the process commit, so
    a file beyond it fails to map: that is a MemoryLimitError here, not a bare OSError. Reading
    checks the file's size against the memory available first (npllama.memory)."""
    size = os.fstat(f.fileno()).st_size
    if not mapped:
        return _read(f, path, size)
    try:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except OSError as e:
        if e.errno == errno.ENOMEM:
            raise MemoryLimitError(f"mapping {path} needs {memory.gib(size)} GiB, more than this process "
                                   "may commit; load it on a machine with more memory") from None
        raise
    fd = os.dup(f.fileno())
    _files[mapping] = MappedFile(path, fd, Fingerprint.of(os.fstat(fd)), mapping)
    token = guard_sigbus(path)
    weakref.finalize(mapping, _unmapped, fd, token)
    return mapping


def _unmapped(fd: int, token) -> None:
    os.close(fd)
    release_sigbus(token)


def _read(f, path: Path, size: int) -> ReadBuffer:
    memory.require(size, f"reading {path}", "load it on a machine with more memory, or map it instead of reading it "
                   "(npllama.load(..., mmap=True), npllama generate --mmap)")
    buffer = read_buffer(size)
    view, done = memoryview(buffer), 0
    f.seek(0)
    while done < size:
        n = f.readinto(view[done:min(size, done + READ_CHUNK)])
        if not n:
            raise CheckpointError(f"{path}: the file ended after {done:,} of its {size:,} bytes while it was read; "
                                  "it was cut short (is something writing it?)")
        done += n
    view.release()
    return buffer


def _buffer_of(arr):
    """The object at the bottom of arr's chain of views (an mmap for a view of a file buffer)."""
    base = arr
    while isinstance(base, np.ndarray):
        base = base.base
    return base.obj if isinstance(base, memoryview) else base


def is_file_mapped(arr) -> bool:
    """True when arr is a view of a mapped file (not of a ReadBuffer)."""
    base = _buffer_of(arr)
    return isinstance(base, mmap.mmap) and not isinstance(base, ReadBuffer)
