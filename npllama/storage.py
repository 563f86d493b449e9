"""Storage dtypes: the precision a model's weights are held in, apart from the one it computes in.

    float32, float64     compute dtypes: the weights are used as they are held
    float16, bfloat16    storage only, half the memory of float32: each weight is turned into
                         float32 where it is used, one layer at a time (npllama.engine), and the
                         model computes in float32

NumPy has no bfloat16, so a bfloat16 weight is held as its raw bits in a uint16 array (the
safetensors "BF16" bytes as they are). bfloat16 is the top half of a float32, so

    value = float32 whose bits are (bits << 16)                      exact
    bits  = top 16 bits of the float32, rounded to nearest, ties to even (as torch rounds)

and a parameter array of dtype uint16 always means bfloat16 bits. float16 is NumPy's own.
"""

from __future__ import annotations

import numpy as np

from .errors import NpllamaError

STORAGE_DTYPES = ("float32", "float64", "float16", "bfloat16")
HALF_DTYPES = ("float16", "bfloat16")
BFLOAT16_BITS = np.dtype(np.uint16)     # how a bfloat16 array is held
_CHUNK = 1 << 20                        # elements converted or checked at a time (small temporaries)


def storage_dtype_name(dtype) -> str:
    """The name in STORAGE_DTYPES of a dtype given as a NumPy dtype, a type or a string."""
    if isinstance(dtype, str) and dtype.lower() in ("bfloat16", "bf16"):
        return "bfloat16"
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = None
    if name not in STORAGE_DTYPES or name == "bfloat16":
        raise NpllamaError(f"dtype={dtype!r} is not a weight dtype npllama holds; use np.float32 (default), "
                         "np.float64, np.float16 or 'bfloat16' (the last two: half the memory, computed in float32)")
    return name


def storage_name_of(arr: np.ndarray) -> str:
    """The storage dtype an array is held in: uint16 arrays are bfloat16 bits."""
    return "bfloat16" if arr.dtype == BFLOAT16_BITS else arr.dtype.name


def is_half(name: str) -> bool:
    return name in HALF_DTYPES


def compute_dtype_of(storage: str) -> np.dtype:
    """The dtype a model holding weights in `storage` computes in: float64 for float64, else float32."""
    return np.dtype(np.float64 if storage == "float64" else np.float32)


def bfloat16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32, exact: the bits are the top half of the float32."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def float32_to_bfloat16(x) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounded to nearest with ties to even (as torch does);
    NaN stays NaN (0x7FC0), and values past bfloat16's range become inf, as in torch."""
    x = np.asarray(x)
    out = np.empty(x.shape, dtype=np.uint16)
    flat_x, flat_out = x.reshape(-1), out.reshape(-1)
    for start in range(0, flat_x.size, _CHUNK):      # a chunk at a time: temporaries stay small
        chunk = np.ascontiguousarray(flat_x[start:start + _CHUNK], dtype=np.float32)
        u = chunk.view(np.uint32)
        rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        rounded[np.isnan(chunk)] = 0x7FC0
        flat_out[start:start + _CHUNK] = rounded
    return out


def to_float(arr: np.ndarray, dtype=np.float32) -> np.ndarray:
    """A held weight as a float array of `dtype` (float32 or float64), exactly; no copy when it is one."""
    if arr.dtype == BFLOAT16_BITS:
        arr = bfloat16_to_float32(arr)
    return arr.astype(dtype, copy=False)


def to_storage(arr: np.ndarray, storage: str) -> np.ndarray:
    """A held weight (any storage dtype; uint16 is bfloat16 bits) held as `storage` instead.

    Widening is exact, narrowing rounds to nearest; no copy when it already is held so. A value
    beyond float16's range becomes inf: check the result with all_finite.
    """
    if storage == "bfloat16":
        return arr if arr.dtype == BFLOAT16_BITS else float32_to_bfloat16(arr)
    if arr.dtype == BFLOAT16_BITS:
        arr = bfloat16_to_float32(arr)
    with np.errstate(over="ignore"):        # overflow is reported by all_finite, naming the tensor
        return arr.astype(storage, copy=False)


def copy_into(out: np.ndarray, arr: np.ndarray, done=None) -> None:
    """out[...] = a held weight (any storage dtype) as out's float dtype, a block of leading rows
    (about _CHUNK elements) at a time, each cast element by element straight into out: no whole
    converted copy is made (bfloat16 bits go through a block's temporary, shifted in place).

    done: None, or called with each block of arr (a view) once it is copied: npllama.load hands
    the file's pages of the block back there, so a converting load holds one block of the file
    beside the converted weights, not a whole tensor of it."""
    if arr.ndim == 0 or len(arr) == 0:
        blocks = [...]
    else:
        rows = max(1, _CHUNK // max(1, arr[0].size))
        blocks = [slice(start, start + rows) for start in range(0, len(arr), rows)]
    for block in blocks:
        _cast_into(out[block], arr[block])
        if done is not None:
            done(arr[block])


def _cast_into(out: np.ndarray, arr: np.ndarray) -> None:
    if arr.dtype == BFLOAT16_BITS:
        wide = arr.astype(np.uint32)
        wide <<= 16                         # bfloat16_to_float32, with one temporary instead of two
        arr = wide.view(np.float32)
    with np.errstate(over="ignore"):        # overflow is reported by all_finite, naming the tensor
        np.copyto(out, arr, casting="same_kind")


def conversion_scratch_bytes(n_elements: int) -> int:
    """Temporaries of turning an array of n_elements into another storage dtype: float32_to_bfloat16
    works a chunk at a time with up to six uint32 / float32 arrays of a chunk alive at once."""
    return 6 * 4 * min(n_elements, _CHUNK)


def all_finite(arr: np.ndarray) -> bool:
    """True when no element of a held weight is NaN or infinite (bfloat16: exponent bits not all ones).

    Checked a chunk at a time, so a memory-mapped file's tensor never needs a second full-size array.
    """
    flat = arr.reshape(-1)
    for start in range(0, flat.size, _CHUNK):
        chunk = flat[start:start + _CHUNK]
        if arr.dtype == BFLOAT16_BITS:
            ok = not np.any(np.bitwise_and(chunk, 0x7F80) == 0x7F80)
        else:
            ok = bool(np.isfinite(chunk).all())
        if not ok:
            return False
    return True


def nbytes_per_element(storage: str) -> int:
    return 2 if is_half(storage) else np.dtype(storage).itemsize
