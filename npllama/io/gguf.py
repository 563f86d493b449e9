"""The GGUF container (llama.cpp's file format), read and written here in NumPy alone.

Layout (ggml's gguf.h; versions 2 and 3 differ only in that v3 may be big-endian, which npllama
refuses; v1 used 32-bit counts and is long gone), all little-endian:

    4 bytes     magic "GGUF"
    uint32      version (2 or 3)
    uint64      tensor count, then uint64 key-value count
    key-values  each: string key, uint32 value type, value (a string is uint64 length + UTF-8
                bytes; an array is uint32 element type, uint64 count, the elements)
    tensor info each: string name, uint32 n_dims, uint64 ne[n_dims] (innermost dimension first,
                as ggml counts them), uint32 ggml type, uint64 offset into the data section
    padding     to general.alignment (default 32)
    data        the tensors, each starting at a multiple of the alignment

A tensor of ggml dims ne = [ne0, ne1] is the C-order array of NumPy shape (ne1, ne0): a weight
PyTorch stores as (out, in) is written as ne = [in, out] with the same bytes.

Reading never trusts a number before checking it against the file: every count, length and
offset is compared with the bytes that remain before anything of that size is read or
allocated, so a flipped bit or a truncated download is one GGUFError naming what is wrong,
never a MemoryError, a hang or a crash. The tensors are views of the file, memory-mapped
copy-on-write like the other formats (io/mapped.py file_buffer).

Writing (write_gguf_atomic) goes through io/atomic.py: a file is replaced whole or left as it was.
"""

from __future__ import annotations

import math
import os
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..errors import MissingFileError, NpllamaError
from .atomic import write_atomic
from .errors import GGUFError
from .mapped import file_buffer

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4                 # GGML_MAX_DIMS

# value types (gguf.h enum gguf_type)
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_SCALAR_DTYPES = {UINT8: "<u1", INT8: "<i1", UINT16: "<u2", INT16: "<i2", UINT32: "<u4", INT32: "<i4",
                  FLOAT32: "<f4", BOOL: "<u1", UINT64: "<u8", INT64: "<i8", FLOAT64: "<f8"}
INTEGER_TYPES = (UINT8, INT8, UINT16, INT16, UINT32, INT32, UINT64, INT64)
FLOAT_TYPES = (FLOAT32, FLOAT64)
TYPE_NAMES = {UINT8: "uint8", INT8: "int8", UINT16: "uint16", INT16: "int16", UINT32: "uint32", INT32: "int32",
              FLOAT32: "float32", BOOL: "bool", STRING: "string", ARRAY: "array", UINT64: "uint64",
              INT64: "int64", FLOAT64: "float64"}


class GGMLType(NamedTuple):
    """A ggml tensor type: its name and how many values a block of how many bytes holds."""
    name: str
    block_size: int
    type_size: int


# ggml.h enum ggml_type, with ggml.c's type_traits (blck_size, type_size). Every type is listed so
# that a file holding one npllama cannot dequantize is named in the error, not called "unknown".
GGML_TYPES = {
    0: GGMLType("F32", 1, 4), 1: GGMLType("F16", 1, 2), 2: GGMLType("Q4_0", 32, 18), 3: GGMLType("Q4_1", 32, 20),
    6: GGMLType("Q5_0", 32, 22), 7: GGMLType("Q5_1", 32, 24), 8: GGMLType("Q8_0", 32, 34),
    9: GGMLType("Q8_1", 32, 36), 10: GGMLType("Q2_K", 256, 84), 11: GGMLType("Q3_K", 256, 110),
    12: GGMLType("Q4_K", 256, 144), 13: GGMLType("Q5_K", 256, 176), 14: GGMLType("Q6_K", 256, 210),
    15: GGMLType("Q8_K", 256, 292), 16: GGMLType("IQ2_XXS", 256, 66), 17: GGMLType("IQ2_XS", 256, 74),
    18: GGMLType("IQ3_XXS", 256, 98), 19: GGMLType("IQ1_S", 256, 50), 20: GGMLType("IQ4_NL", 32, 18),
    21: GGMLType("IQ3_S", 256, 110), 22: GGMLType("IQ2_S", 256, 82), 23: GGMLType("IQ4_XS", 256, 136),
    24: GGMLType("I8", 1, 1), 25: GGMLType("I16", 1, 2), 26: GGMLType("I32", 1, 4), 27: GGMLType("I64", 1, 8),
    28: GGMLType("F64", 1, 8), 29: GGMLType("IQ1_M", 256, 56), 30: GGMLType("BF16", 1, 2),
    34: GGMLType("TQ1_0", 256, 54), 35: GGMLType("TQ2_0", 256, 66), 39: GGMLType("MXFP4", 32, 17),
}
GGML_TYPE_IDS = {t.name: i for i, t in GGML_TYPES.items()}


class TensorInfo(NamedTuple):
    """One tensor of a GGUF file: shape in NumPy order (outermost first), ggml type id, and where
    its bytes are (offset from the start of the file, length)."""
    name: str
    shape: tuple
    type_id: int
    start: int
    nbytes: int

    @property
    def type(self) -> GGMLType:
        return GGML_TYPES[self.type_id]

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


class GGUFFile(NamedTuple):
    """A parsed GGUF file: version, metadata {key: (value type, value)}, tensors {name: TensorInfo}
    in file order, and the whole file mapped copy-on-write (tensor_bytes gives each one's bytes)."""
    path: Path
    version: int
    metadata: dict
    tensors: dict
    mapped: object

    def tensor_bytes(self, info: TensorInfo) -> np.ndarray:
        """The raw bytes of a tensor, a uint8 view of the mapped file (no copy)."""
        return np.frombuffer(self.mapped, dtype=np.uint8, count=info.nbytes, offset=info.start)


def tensor_nbytes(shape, type_id: int, what: str = "tensor") -> int:
    """Bytes of a tensor of NumPy shape `shape` stored as ggml type `type_id`: rows of shape[-1]
    values, each row a whole number of blocks (ggml's rule); a GGUFError otherwise."""
    t = GGML_TYPES[type_id]
    row = shape[-1] if shape else 1
    if row % t.block_size:
        raise GGUFError(f"{what}: rows of {row} values are not a whole number of {t.name} blocks of "
                        f"{t.block_size}; the file is corrupt")
    return math.prod(shape) // t.block_size * t.type_size


_STRUCTS = {"<Q": struct.Struct("<Q"), "<I": struct.Struct("<I")}


class _Cursor:
    """Reads the header of a mapped file front to back, checking each read against the file's end."""

    def __init__(self, buf, path: Path):
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise GGUFError(f"{self.path}: {what} needs {n} bytes at offset {self.pos}, but the file ends at "
                            f"{self.size}; the file is truncated or corrupt (re-download or re-convert it)")

    def take(self, n: int, what: str) -> bytes:
        self.need(n, what)
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str, what: str):
        packer = _STRUCTS[fmt]
        self.need(packer.size, what)
        self.pos += packer.size
        return packer.unpack_from(self.buf, self.pos - packer.size)[0]

    def string(self, what: str) -> str:
        n = self.unpack("<Q", what)
        raw = self.take(n, f"{what} ({n}-byte string)")
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{self.path}: {what} is not UTF-8 text; the file is corrupt") from None

    def _strings(self, count: int, what: str) -> list[str]:
        """count strings in a row: string() unrolled, since a vocabulary holds 32,000 to 150,000."""
        buf, pos, size, out = self.buf, self.pos, self.size, []
        unpack = _STRUCTS["<Q"].unpack_from
        for i in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, f"{what}[{i}]")
            (n,) = unpack(buf, pos)
            if n > size - pos - 8:
                self.pos = pos + 8
                self.need(n, f"{what}[{i}] ({n}-byte string)")
            try:
                out.append(str(buf[pos + 8:pos + 8 + n], "utf-8"))
            except UnicodeDecodeError:
                raise GGUFError(f"{self.path}: {what}[{i}] is not UTF-8 text; the file is corrupt") from None
            pos += 8 + n
        self.pos = pos
        return out

    def value(self, vtype: int, what: str):
        if vtype == STRING:
            return self.string(what)
        if vtype == ARRAY:
            etype = self.unpack("<I", what)
            count = self.unpack("<Q", what)
            if etype == ARRAY:
                raise GGUFError(f"{self.path}: {what} is an array of arrays, which GGUF does not allow; corrupt file")
            if etype == STRING:
                self.need(8 * count, f"{what} ({count} strings)")   # each at least its 8-byte length
                return self._strings(count, what)
            dtype = self._dtype(etype, what)
            raw = self.take(count * dtype.itemsize, f"{what} ({count} x {TYPE_NAMES[etype]})")
            arr = np.frombuffer(raw, dtype=dtype).astype(dtype.newbyteorder("="))
            return arr.astype(bool) if etype == BOOL else arr
        dtype = self._dtype(vtype, what)
        v = np.frombuffer(self.take(dtype.itemsize, what), dtype=dtype)[0]
        if vtype == BOOL:
            if v > 1:
                raise GGUFError(f"{self.path}: {what} is a bool of value {v}; corrupt file")
            return bool(v)
        return v.item()

    def _dtype(self, vtype: int, what: str) -> np.dtype:
        if vtype not in _SCALAR_DTYPES:
            raise GGUFError(f"{self.path}: {what} has value type {vtype}, which GGUF does not define "
                            "(known: 0..12); the file is corrupt")
        return np.dtype(_SCALAR_DTYPES[vtype])


def read_gguf(path, mapped: bool = True) -> GGUFFile:
    """Parse a GGUF file's header, the file mapped (io/mapped.py file_buffer: copy-on-write, watched)
    or read into memory (mapped=False): every count, string, shape and offset is checked against
    the file before it is used (module docstring). Raises MissingFileError, or GGUFError naming the
    problem in one line."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"{path}: no such GGUF file")
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < 24:
            raise GGUFError(f"{path}: {os.fstat(f.fileno()).st_size} bytes is too short for a GGUF file (its header "
                            "alone is 24 bytes); the file is truncated")
        buffer = file_buffer(f, path, mapped)
    cur = _Cursor(memoryview(buffer), path)
    magic = bytes(cur.take(4, "the magic"))
    if magic != MAGIC:
        raise GGUFError(f"{path}: starts with {magic!r}, not the GGUF magic b'GGUF'; it is not a GGUF file")
    version = cur.unpack("<I", "the version")
    if version not in VERSIONS:
        if struct.unpack(">I", struct.pack("<I", version))[0] in VERSIONS:
            raise GGUFError(f"{path}: a big-endian GGUF file; npllama reads little-endian ones (convert it with "
                            "gguf's gguf_convert_endian.py)")
        raise GGUFError(f"{path}: GGUF version {version}; npllama reads versions 2 and 3 (re-convert the model "
                        "with a current llama.cpp)")
    n_tensors = cur.unpack("<Q", "the tensor count")
    n_kv = cur.unpack("<Q", "the metadata count")
    # the smallest key-value takes 8 + 4 + 1 bytes, the smallest tensor info 8 + 4 + 4 + 8
    cur.need(n_kv * 13 + n_tensors * 24, f"{n_kv} metadata entries and {n_tensors} tensor infos")
    metadata = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key {i}")
        vtype = cur.unpack("<I", f"the type of {key!r}")
        if key in metadata:
            raise GGUFError(f"{path}: metadata key {key!r} appears twice; the file is corrupt")
        metadata[key] = (vtype, cur.value(vtype, f"metadata {key!r}"))
    alignment = _alignment(metadata, path)
    infos = []
    for i in range(n_tensors):
        name = cur.string(f"the name of tensor {i}")
        n_dims = cur.unpack("<I", f"tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"{path}: tensor {name!r} has {n_dims} dimensions; GGUF allows 1 to {MAX_DIMS}, "
                            "so the file is corrupt")
        ne = [cur.unpack("<Q", f"tensor {name!r}") for _ in range(n_dims)]
        type_id = cur.unpack("<I", f"tensor {name!r}")
        offset = cur.unpack("<Q", f"tensor {name!r}")
        infos.append((name, tuple(reversed(ne)), type_id, offset))
    data_start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, shape, type_id, offset in infos:
        tensors[name] = _check_tensor(path, name, shape, type_id, offset, data_start, alignment, cur.size,
                                      tensors)
    _check_overlaps(path, tensors)
    return GGUFFile(path, version, metadata, tensors, buffer)


def _alignment(metadata: dict, path: Path) -> int:
    vtype, value = metadata.get("general.alignment", (UINT32, DEFAULT_ALIGNMENT))
    if vtype not in INTEGER_TYPES or not (0 < value <= 1 << 20 and value & (value - 1) == 0):
        raise GGUFError(f"{path}: general.alignment is {value!r}; it must be a power of two; corrupt file")
    return value


def _check_tensor(path, name, shape, type_id, offset, data_start, alignment, size, seen) -> TensorInfo:
    if name in seen:
        raise GGUFError(f"{path}: tensor {name!r} appears twice; the file is corrupt")
    if type_id not in GGML_TYPES:
        raise GGUFError(f"{path}: tensor {name!r} has ggml type {type_id}, which no ggml version defines "
                        "(the file is corrupt, or from a llama.cpp newer than this npllama knows)")
    if any(d == 0 for d in shape) or any(d > 1 << 40 for d in shape):
        raise GGUFError(f"{path}: tensor {name!r} has shape {shape}; corrupt file")
    nbytes = tensor_nbytes(shape, type_id, f"{path}: tensor {name!r}")
    if offset % alignment:
        raise GGUFError(f"{path}: tensor {name!r} starts at data offset {offset}, not a multiple of the "
                        f"alignment {alignment}; the file is corrupt")
    start = data_start + offset
    if start + nbytes > size:
        raise GGUFError(f"{path}: tensor {name!r} ({GGML_TYPES[type_id].name} {shape}, {nbytes} bytes) ends at "
                        f"byte {start + nbytes}, past the end of the {size}-byte file; the file is truncated "
                        "(re-download or re-convert it)")
    return TensorInfo(name, shape, type_id, start, nbytes)


def _check_overlaps(path, tensors: dict) -> None:
    spans = sorted((t.start, t.start + t.nbytes, t.name) for t in tensors.values())
    for (_, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise GGUFError(f"{path}: tensors {n0!r} and {n1!r} overlap; the file is corrupt")


# ----------------------------------------------------------------------------- typed metadata

_REQUIRED = object()
_KINDS = {  # kind -> (accepted value types, accepted array element types or None for scalars)
    "int": (INTEGER_TYPES, None), "float": (FLOAT_TYPES + INTEGER_TYPES, None), "str": ((STRING,), None),
    "bool": ((BOOL,), None), "strings": ((ARRAY,), (STRING,)), "ints": ((ARRAY,), INTEGER_TYPES),
    "floats": ((ARRAY,), FLOAT_TYPES + INTEGER_TYPES),
}


def _type_name(vtype: int, value) -> str:
    if vtype == ARRAY:
        return "array of strings" if isinstance(value, list) else f"array of {value.dtype}"
    return TYPE_NAMES.get(vtype, str(vtype))


def get_value(metadata: dict, key: str, kind: str, source, default=_REQUIRED):
    """metadata[key] as `kind` ("int", "float", "str", "bool", or the arrays "strings", "ints",
    "floats"); `default` when absent (GGUFError when there is none). Any integer type is an
    "int" (writers differ: llama.cpp writes uint32, others int32 or uint64)."""
    if key not in metadata:
        if default is _REQUIRED:
            raise GGUFError(f"{source}: metadata {key!r} is missing; the file was not written by a LLaMA "
                            "converter, or is damaged")
        return default
    vtype, value = metadata[key]
    types, elements = _KINDS[kind]
    ok = vtype in types
    if ok and elements is not None:
        ok = (isinstance(value, list) and STRING in elements) or (
            isinstance(value, np.ndarray) and value.dtype.kind in ("iu" if elements == INTEGER_TYPES else "iuf"))
    if not ok:
        raise GGUFError(f"{source}: metadata {key!r} has type {_type_name(vtype, value)} where {kind} belongs; "
                        "the file is corrupt or not a LLaMA GGUF")
    return float(value) if kind == "float" else value


# ----------------------------------------------------------------------------- writing

class TensorToWrite(NamedTuple):
    """A tensor for write_gguf_atomic: its NumPy shape (the logical values), ggml type id, and its
    bytes as stored: an array of any dtype whose bytes are the ggml data, or a function making
    that array when the tensor is written (so a whole model is never encoded at once)."""
    name: str
    shape: tuple
    type_id: int
    data: object


def _pack_string(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _pack_value(vtype: int, value) -> bytes:
    if vtype == STRING:
        return _pack_string(value)
    if vtype == ARRAY:
        etype, items = value
        if etype == STRING:
            return struct.pack("<IQ", STRING, len(items)) + b"".join(map(_pack_string, items))
        arr = np.asarray(items, dtype=_SCALAR_DTYPES[etype])
        return struct.pack("<IQ", etype, arr.size) + arr.tobytes()
    return np.asarray(value, dtype=_SCALAR_DTYPES[vtype]).tobytes()


def gguf_header(metadata: list, tensors: list, alignment: int = DEFAULT_ALIGNMENT) -> tuple[bytes, list[int]]:
    """(header bytes padded to the alignment, each tensor's data offset) of a version 3 GGUF file.

    metadata: [(key, value type, value)], an ARRAY value being (element type, list of elements);
    tensors: [TensorToWrite]. Offsets are packed in order, each padded to the alignment.
    """
    keys = [k for k, _, _ in metadata]
    if len(set(keys)) != len(keys):
        raise NpllamaError(f"GGUF metadata keys must be unique; got {keys}")
    out = [MAGIC, struct.pack("<IQQ", 3, len(tensors), len(metadata))]
    for key, vtype, value in metadata:
        out += [_pack_string(key), struct.pack("<I", vtype), _pack_value(vtype, value)]
    offsets, offset = [], 0
    for t in tensors:
        nbytes = tensor_nbytes(t.shape, t.type_id, f"tensor {t.name!r}")
        if not callable(t.data):
            _check_size(t, t.data, nbytes)
        out += [_pack_string(t.name), struct.pack("<I", len(t.shape)),
                struct.pack(f"<{len(t.shape)}Q", *reversed(t.shape)), struct.pack("<IQ", t.type_id, offset)]
        offsets.append(offset)
        offset += -(-nbytes // alignment) * alignment
    header = b"".join(out)
    return header + b"\0" * (-len(header) % alignment), offsets


def _check_size(t: TensorToWrite, data: np.ndarray, nbytes: int) -> None:
    if data.nbytes != nbytes:
        raise NpllamaError(f"tensor {t.name!r}: {data.nbytes} bytes given, {GGML_TYPES[t.type_id].name} "
                           f"{t.shape} takes {nbytes}")


_ELEMENT_TYPES = {("u", 1): UINT8, ("i", 1): INT8, ("u", 2): UINT16, ("i", 2): INT16, ("u", 4): UINT32,
                  ("i", 4): INT32, ("f", 4): FLOAT32, ("b", 1): BOOL, ("u", 8): UINT64, ("i", 8): INT64,
                  ("f", 8): FLOAT64}


def as_entries(metadata: dict) -> list:
    """A read file's metadata ({key: (type, value)}, as GGUFFile holds it) as gguf_header's entries,
    so a file can be read, changed and written again."""
    entries = []
    for key, (vtype, value) in metadata.items():
        if vtype == ARRAY:
            etype = STRING if isinstance(value, list) else _ELEMENT_TYPES[value.dtype.kind, value.dtype.itemsize]
            value = (etype, value)
        entries.append((key, vtype, value))
    return entries


def write_gguf_atomic(path, metadata: list, tensors: list, alignment: int = DEFAULT_ALIGNMENT) -> None:
    """Write a version 3 GGUF file (see gguf_header for the arguments), atomically (io/atomic.py):
    an error while a tensor is made leaves any existing file at path as it was."""
    header, _ = gguf_header(metadata, tensors, alignment)

    def write(f):
        f.write(header)
        for t in tensors:
            data = np.ascontiguousarray(t.data() if callable(t.data) else t.data)
            _check_size(t, data, tensor_nbytes(t.shape, t.type_id))
            f.write(memoryview(data.reshape(-1)).cast("B"))
            f.write(b"\0" * (-data.nbytes % alignment))

    write_atomic(Path(path), write)
