"""Checksums for safetensors files: npllama records them when it writes and verifies them when it reads.

safetensors has no checksum of its own, so a flipped bit in the data loads silently and a
flipped optimizer moment would be resumed. Every file npllama writes (training checkpoints,
save(format="meta"), the model.safetensors of save(format="hf")) carries, under the metadata
key CHECKSUM_KEY (io/metadata.py):

    {"algorithm": "crc32",
     "header": crc of the header's canonical JSON (sorted keys, compact) without this key,
     "content": the same without the tensors' data_offsets,
     "tensors": {name: crc of the tensor's bytes as stored, ...},
     "record": crc of the four entries above as canonical JSON}

so a flip in the config, the training state or the tensor table is caught as well as one in
any tensor, and the error names the tensor. Reading checks "content" (files of older npllama
have only "header"): the names, dtypes, shapes, metadata and every tensor's bytes, not where
in the file each tensor sits. So a file another tool re-saved with the same metadata and
tensors (safetensors.numpy.save_file orders and aligns them its own way) is verified, not
called damaged; a misplaced tensor still fails its own CRC.

The record checks itself: "record" covers its other entries, so a flip in any of them (the
"header" one too, which a re-saved file cannot match) is caught; a record with other keys
than these is damaged; and a file whose metadata holds a checksum record under any other key
(a flipped bit in the key name), or a key one or two characters off CHECKSUM_KEY, is refused
as damaged, never loaded unverified. Files with no record at all (older npllama, other
tools) load as before, unverified.

Why CRC-32: it detects every burst of up to 32 flipped bits and any other random damage
with probability 1 - 2^-32, which is what it is for; a cryptographic hash would add nothing
against deliberate tampering, since the checksum sits in the same file. zlib.crc32 ran at
~4 GB/s on the 2-core machine of docs/speed.md, sha256 at ~1.1 GB/s.
"""

from __future__ import annotations

import hashlib
import json
import zlib

import numpy as np

from ..checks import parse_json
from .errors import CheckpointError
from .metadata import CHECKSUM_KEY

ALGORITHM = "crc32"
_RECORD_KEYS = ({"algorithm", "header", "tensors"}, {"algorithm", "header", "content", "tensors", "record"})


class ChecksumMismatchError(CheckpointError):
    """A file's bytes differ from the checksum recorded when it was written: it is damaged."""


def _crc(data) -> str:
    return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


def _raw(arr: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, without a copy."""
    return memoryview(arr.reshape(-1)).cast("B") if arr.size else memoryview(b"")


def header_checksum(table: dict, metadata: dict, offsets: bool = True) -> str:
    """CRC of the header as JSON with sorted keys, without CHECKSUM_KEY: the same for the writer,
    which builds it, and the reader, which parsed it (table: {name: {dtype, shape, data_offsets}}).
    offsets=False leaves out every data_offsets: the "content" checksum, the same for any layout."""
    if not offsets:
        table = {name: {k: v for k, v in entry.items() if k != "data_offsets"} for name, entry in table.items()}
    header = dict(table, __metadata__={k: v for k, v in metadata.items() if k != CHECKSUM_KEY})
    return _crc(json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8"))


def checksum_metadata(table: dict, metadata: dict, arrays: dict[str, np.ndarray]) -> str:
    """The JSON to store under CHECKSUM_KEY for a file with this header table, metadata and
    tensors (arrays: {name: the C-contiguous array whose bytes are written})."""
    record = {"algorithm": ALGORITHM, "header": header_checksum(table, metadata),
              "content": header_checksum(table, metadata, offsets=False),
              "tensors": {name: _crc(_raw(arr)) for name, arr in arrays.items()}}
    return json.dumps(dict(record, record=_record_checksum(record)), sort_keys=True)


def _record_checksum(record: dict) -> str:
    """CRC of a checksum record's entries other than "record" (canonical JSON)."""
    return _crc(json.dumps({k: v for k, v in record.items() if k != "record"}, sort_keys=True,
                           separators=(",", ":")).encode("utf-8"))


def refuse_damaged_record(path, metadata: dict) -> None:
    """For a file without CHECKSUM_KEY: ChecksumMismatchError when its checksum record is there under a
    damaged key (a value that reads as a record, or a key one or two characters off the name)."""
    for key, value in metadata.items():
        near = len(key) == len(CHECKSUM_KEY) and sum(a != b for a, b in zip(key, CHECKSUM_KEY)) <= 2
        if near or (value.startswith("{") and '"algorithm"' in value and '"tensors"' in value):
            raise ChecksumMismatchError(f"{path}: metadata key {key!r} holds npllama's checksum record, which "
                                        f"belongs under {CHECKSUM_KEY!r}; the key name is damaged, so the file "
                                        f"is damaged. {_HINT}")


class Verifier:
    """Checks a file against its recorded checksums: the header at once, each tensor as it is read."""

    def __init__(self, path, table: dict, metadata: dict):
        self.path = path
        try:
            record = parse_json(metadata[CHECKSUM_KEY], CHECKSUM_KEY, ChecksumMismatchError)
            offsets = "content" not in record           # older npllama recorded the header with offsets only
            header, self.tensors = record["header" if offsets else "content"], record["tensors"]
            ok = (record["algorithm"] == ALGORITHM and isinstance(header, str) and isinstance(self.tensors, dict)
                  and set(record) in _RECORD_KEYS      # a damaged key name is damage too
                  and (offsets or record["record"] == _record_checksum(record)))
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            raise ChecksumMismatchError(f"{path}: the checksum record {CHECKSUM_KEY!r} is unreadable; "
                                        "the file is damaged")
        if header != header_checksum(table, metadata, offsets):
            raise ChecksumMismatchError(f"{path}: the header (tensor table or metadata) does not match its "
                                        f"recorded {ALGORITHM} checksum; the file is damaged. {_HINT}")

    def check(self, name: str, stored: np.ndarray) -> None:
        """stored: the tensor exactly as read from the file, before any conversion."""
        want = self.tensors.get(name)
        got = _crc(_raw(stored))
        if want != got:
            raise ChecksumMismatchError(f"{self.path}: tensor {name!r} does not match its recorded {ALGORITHM} "
                                        f"checksum (recorded {want}, read {got}); the file is damaged. {_HINT}")


_HINT = ("Restore it from a copy or write it again; npllama.load(path, verify=False) reads it anyway, "
         "at your own risk")


def sha256_file(path) -> str:
    """The sha256 hex digest of a file, read a MB at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
