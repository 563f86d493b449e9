"""The safetensors format, read and written here in NumPy alone (it is small enough).

    8 bytes   N, little-endian uint64
    N bytes   UTF-8 JSON: {"__metadata__": {str: str}, name: {"dtype": "F32", "shape": [...],
              "data_offsets": [begin, end]}, ...}, padded with spaces
    rest      the tensors' bytes, little-endian, C order; offsets count from the end of the header

The header is validated against the file size, and the memory the tensors will take against
the memory available (npllama.memory), before any data is read. Every write goes through
write_safetensors_atomic: a temporary file in the same folder, fsync, then os.replace, so an
existing file is either the old one or the new one, never a torn mix; it records CRC-32s of
the header and of every tensor in the metadata, which reading verifies (io/integrity.py).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .. import memory
from ..checks import is_integer, parse_json
from ..errors import MissingFileError, NpllamaError
from ..storage import bfloat16_to_float32
from .atomic import write_atomic
from .errors import CheckpointError
from .integrity import Verifier, checksum_metadata, refuse_damaged_record
from .mapped import file_buffer
from .metadata import CHECKSUM_KEY
from .pickles import refuse_pickle_magic

_ST_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # read as raw bits (npllama.storage converts them)
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_NP_TO_ST = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
             np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.int16): "I16",
             np.dtype(np.int8): "I8", np.dtype(np.uint64): "U64", np.dtype(np.uint32): "U32",
             np.dtype(np.uint16): "U16", np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL"}
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit


class Bfloat16(NamedTuple):
    """A bfloat16 tensor for write_safetensors_atomic: its raw uint16 bits (NumPy has no bfloat16)."""
    bits: np.ndarray


def _header_entries(path: Path, header: dict, data_len: int) -> list[tuple[str, str, tuple, int, int]]:
    """Validate every header entry against the file before any data is trusted."""
    entries = []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise CheckpointError(f"{path}: header entry {name!r} is not {{dtype, shape, data_offsets}}: {info!r}; "
                                  "the file is corrupt")
        st, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(st, str) or st not in _ST_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {st!r}, which npllama cannot read "
                                  f"(known: {sorted(_ST_DTYPES)})")
        if not isinstance(shape, list) or not all(is_integer(s) and s >= 0
                                                  for s in shape):
            raise CheckpointError(f"{path}: tensor {name!r} has shape {shape!r}, not a list of sizes; corrupt header")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(is_integer(o) for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise CheckpointError(f"{path}: tensor {name!r} has data_offsets {offsets!r}; corrupt header")
        begin, end = offsets
        nbytes = math.prod(shape) * _ST_DTYPES[st].itemsize
        if end - begin != nbytes:
            raise CheckpointError(f"{path}: tensor {name!r} spans {end - begin} bytes but {st} {tuple(shape)} "
                                  f"needs {nbytes}; corrupt header")
        if end > data_len:
            raise CheckpointError(f"{path}: tensor {name!r} ends at data byte {end} but the file holds only "
                                  f"{data_len} data bytes; the file is truncated (re-download or re-export it)")
        entries.append((name, st, tuple(shape), begin, end))
    spans = sorted((b, e, n) for n, _, _, b, e in entries if e > b)
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CheckpointError(f"{path}: tensors {n0!r} and {n1!r} overlap; corrupt header")
    last = max((e for _, _, _, _, e in entries), default=0)
    if last != data_len:
        raise CheckpointError(f"{path}: {data_len - last} bytes follow the last tensor; the header and the "
                              "data disagree, so the file is corrupt")
    return entries


def _table(entries) -> dict:
    """The header's tensor table as the file's JSON holds it (what the header checksum covers)."""
    return {n: {"dtype": st, "shape": list(shape), "data_offsets": [b, e]} for n, st, shape, b, e in entries}


def _verifier(path: Path, entries, metadata: dict, verify: bool) -> Verifier | None:
    """A Verifier for a file that records checksums (checking its header now), else None; a record
    under a damaged key is refused (io/integrity.py)."""
    if not verify:
        return None
    if CHECKSUM_KEY not in metadata:
        refuse_damaged_record(path, metadata)
        return None
    return Verifier(path, _table(entries), metadata)


def read_safetensors_header(path, verify: bool = True) -> tuple[dict[str, tuple[str, tuple]], dict[str, str]]:
    """({name: (dtype_code, shape)}, metadata) of a safetensors file, validated, without its data.

    verify: check the header against its recorded checksum, when the file has one."""
    path = Path(path)
    with open(path, "rb") as f:
        entries, metadata, _ = _read_header(f, path)
    _verifier(path, entries, metadata, verify)
    return {n: (st, shape) for n, st, shape, _, _ in entries}, _without_checksum(metadata)


def _read_header(f, path: Path):
    size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    refuse_pickle_magic(path, head)
    if len(head) < 8:
        raise CheckpointError(f"{path}: {size} bytes is too short for a safetensors file (it starts with an "
                              "8-byte header length); the file is truncated or not safetensors")
    (n,) = struct.unpack("<Q", head)
    if n > min(size - 8, _MAX_HEADER):
        raise CheckpointError(f"{path}: header length {n} does not fit in the {size}-byte file; "
                              "the file is truncated, corrupt, or not safetensors")
    raw = f.read(n)
    header = parse_json(raw, f"{path}: the safetensors header (the file is corrupt)", CheckpointError)
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is a JSON {type(header).__name__}, not an object; "
                              "the file is corrupt")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise CheckpointError(f"{path}: __metadata__ must map strings to strings; the file is corrupt")
    data_start = 8 + n
    return _header_entries(path, header, size - data_start), metadata, data_start


def _without_checksum(metadata: dict) -> dict:
    """The metadata as its writer gave it: the checksum record is verified, not handed on."""
    return {k: v for k, v in metadata.items() if k != CHECKSUM_KEY}


def _decoded_bytes(entries) -> int:
    """What reading the tensors allocates: each as stored, and BF16 ones again as float32."""
    return sum(memory.array_bytes(math.prod(shape), _ST_DTYPES[st].itemsize + (4 if st == "BF16" else 0))
               for _, st, shape, _, _ in entries)


def read_safetensors(path, verify: bool = True) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Read a .safetensors file: ({name: array}, metadata).

    The header (length, JSON, dtypes, shapes, offsets) is checked against the file size, and the
    bytes the tensors will take against the memory available, before any data is read. BF16
    tensors come back as float32 (exact: bfloat16 is a truncated float32); every other dtype
    comes back as itself, in native byte order.
    verify: check the header and every tensor against the checksums npllama recorded in the file
    (io/integrity.py; files without them are read unverified). The metadata returned leaves out
    that record, as it does in read_safetensors_header.
    Raises FileNotFoundError, PickleRefusedError, MemoryLimitError, or CheckpointError naming the problem.
    """
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"{path}: no such safetensors file")
    tensors = {}
    with open(path, "rb") as f:
        entries, metadata, data_start = _read_header(f, path)
        verifier = _verifier(path, entries, metadata, verify)
        memory.require(_decoded_bytes(entries), f"reading {path}", "load it on a machine with more memory")
        for name, st, shape, begin, end in entries:
            dt = _ST_DTYPES[st]
            f.seek(data_start + begin)
            count = math.prod(shape)
            arr = np.fromfile(f, dtype=dt, count=count) if count else np.empty(0, dt)
            if arr.size != count:  # the file shrank under us
                raise CheckpointError(f"{path}: tensor {name!r} is cut short; the file is truncated")
            if verifier is not None:
                verifier.check(name, arr)
            arr = arr.reshape(shape)
            arr = bfloat16_to_float32(arr) if st == "BF16" else arr.astype(dt.newbyteorder("="), copy=False)
            tensors[name] = arr
    return tensors, _without_checksum(metadata)


def map_safetensors(path, verify: bool = True, mapped: bool = True) -> tuple[dict[str, np.ndarray], dict[str, str],
                                                                          dict[str, str]]:
    """A .safetensors file held whole in memory: ({name: array}, metadata, {name: dtype code, e.g. "F32"}).

    mapped: each array is a view of the file's pages, mapped copy-on-write (io/mapped.py): the
    pages are shared with the OS page cache instead of copied, and writing to an array (an
    optimizer step) changes this process's copy of the page only, never the file. Not mapped:
    the file is read into memory and the arrays are views of that (io/mapped.py ReadBuffer).
    BF16 tensors come back as their raw bits (uint16; npllama.storage). The header is checked as
    in read_safetensors. verify: check the header and every tensor against the checksums
    npllama recorded (which reads each page once); unverified and mapped, nothing is read until
    used. The metadata returned leaves out the checksum record. A mapped file must not be
    truncated or rewritten in place while its arrays are in use (npllama's own writes replace
    files whole, which is safe: the old pages stay mapped); release_pages hands back the pages of
    a tensor that was copied out, or that is not needed.
    """
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"{path}: no such safetensors file")
    with open(path, "rb") as f:
        entries, metadata, data_start = _read_header(f, path)
        verifier = _verifier(path, entries, metadata, verify)
        buffer = file_buffer(f, path, mapped)
    _require_whole(path, len(buffer), data_start + max((e for *_, e in entries), default=0))
    tensors, codes = {}, {}
    for name, st, shape, begin, _ in entries:
        dt = _ST_DTYPES[st]
        count = math.prod(shape)
        arr = (np.frombuffer(buffer, dtype=dt, count=count, offset=data_start + begin) if count
               else np.empty(0, dt)).reshape(shape)
        if verifier is not None:
            verifier.check(name, arr)
            if mapped:      # the check read every page: hand them back (they read back from the file when
                release_pages(arr)  # used), or a converting load holds the file's pages and its copy at once
        if not arr.flags.aligned or not dt.isnative:    # unaligned data (no padded header) or a big-endian host
            arr = arr.astype(dt.newbyteorder("="))
        tensors[name], codes[name] = arr, st
    return tensors, _without_checksum(metadata), codes


def _require_whole(path: Path, held: int, needed: int) -> None:
    """Refuse a file that shrank between reading its header and holding its data."""
    if held < needed:
        raise CheckpointError(f"{path}: the file shrank to {held:,} bytes while it was opened, below the {needed:,} "
                              "its header describes; it is being written or truncated: wait for it, then load again")


def release_pages(arr: np.ndarray) -> None:
    """Drop the whole pages under an array of a file buffer (map_safetensors) from this process, after
    its data was copied or converted or when it is not needed, so that a load holds one copy of the
    weights, not the file's pages too.

    Only pages wholly inside the array are dropped, so neighbouring tensors keep theirs; unwritten
    copy-on-write pages of a mapped file read back from the file if touched again, those of a read
    one as zeros (it must not be used again). Does nothing for other arrays.
    """
    base = arr
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):                  # np.frombuffer's view of the mmap
        base = base.obj
    if not isinstance(base, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED") or arr.nbytes == 0:
        return
    start = arr.__array_interface__["data"][0] - np.frombuffer(base, np.uint8, count=1).__array_interface__["data"][0]
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (start + arr.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > first:
        base.madvise(mmap.MADV_DONTNEED, first, end - first)


def write_safetensors_atomic(path, tensors: dict, metadata: dict | None = None) -> None:
    """Write tensors ({name: np.ndarray or Bfloat16}) as one .safetensors file, atomically.

    Metadata values must be strings; "format": "pt" is always written, since transformers refuses
    safetensors files without it, and so are the checksums read_safetensors verifies
    (io/integrity.py). Tensors are stored in the given order, little-endian, C order.
    """
    metadata = dict(metadata or {})
    metadata["format"] = "pt"
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise NpllamaError(f"safetensors metadata must map str to str; got {k!r}: {type(v).__name__}")
    header, arrays, offset = {}, [], 0
    for name, t in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise NpllamaError(f"invalid tensor name {name!r}")
        if isinstance(t, Bfloat16):
            arr, st = np.asarray(t.bits, dtype="<u2", order="C"), "BF16"
        else:
            t = np.asarray(t)
            st = _NP_TO_ST.get(t.dtype.newbyteorder("="))
            if st is None:
                raise NpllamaError(f"tensor {name!r}: dtype {t.dtype} cannot be stored in safetensors")
            arr = np.asarray(t, dtype=_ST_DTYPES[st], order="C")  # (ascontiguousarray would make 0-d 1-d)
        header[name] = {"dtype": st, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        arrays.append(arr)
        offset += arr.nbytes
    metadata[CHECKSUM_KEY] = checksum_metadata(header, metadata, dict(zip(header, arrays)))
    header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the safetensors library writes it

    def write(f):
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for arr in arrays:
            f.write(memoryview(arr.reshape(-1)).cast("B") if arr.size else b"")

    write_atomic(Path(path), write)
