"""Weights held in float16 or bfloat16 (npllama.storage), turned into float32 where they are used.

    upcast_into(src, dst)            exact float16 / bfloat16 -> float32 into a buffer, fast
    float_params(params, dtype)      params whose arrays come out as `dtype` floats when read

NumPy's own float16 -> float32 cast runs at ~0.3-0.6 G values/s here (no F16C path), slower
than DRAM; the bit manipulation below does ~1.5-2.2 G/s, and bfloat16 (a plain shift) ~2.4-3.2.
A decode step never turns a half-held matrix into float32 whole: it turns a block of rows into
a float32 buffer that stays in the L2 cache and multiplies it there (engine/projections.py,
ChunkedHalfLinear), so DRAM only ever sees the 2-byte weights and the process holds one small
buffer, not a float32 layer.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..storage import BFLOAT16_BITS, to_float

_F16_EXPONENT_SHIFT = np.float32(2.0 ** 112)    # float32 exponent bias 127 - float16 bias 15
_F16_KEEP_BITS = np.int32(-0x70000001)          # 0x8FFFFFFF: the sign and the low 28 bits

def upcast_into(src: np.ndarray, dst: np.ndarray) -> None:
    """dst (float32, same shape, contiguous) = src (float16, or bfloat16 bits as uint16), exactly.
    (A float64 dst, as the float64 tests use, goes through npllama.storage.to_float.)

    float16 h = sign | e (5 bits) | m (10 bits). Sign-extending h to 32 bits and shifting it left
    by 13 puts m at the top of a float32 mantissa and e in the low 5 bits of the float32
    exponent; clearing bits 28-30 (copies of the sign) leaves the float32 2^(e-127) * 1.m, and
    multiplying by 2^112 gives the float16's value 2^(e-15) * 1.m, exactly (subnormals too: e = 0
    is then a float32 subnormal). Needs finite weights (checked at load). bfloat16 is the top half
    of a float32: a shift by 16.
    """
    if dst.dtype != np.float32:
        np.copyto(dst, to_float(src, dst.dtype))
    elif src.dtype == BFLOAT16_BITS:
        np.left_shift(src, 16, out=dst.view(np.uint32), dtype=np.uint32)
    elif src.dtype == np.float16:
        bits = dst.view(np.int32)
        np.left_shift(src.view(np.int16), 13, out=bits, dtype=np.int32)
        np.bitwise_and(bits, _F16_KEEP_BITS, out=bits)
        np.multiply(dst, _F16_EXPONENT_SHIFT, out=dst)
    else:
        np.copyto(dst, src)


def is_half_array(a: np.ndarray) -> bool:
    return a.dtype == np.float16 or a.dtype == BFLOAT16_BITS


def upcast(a: np.ndarray, dtype=np.float32) -> np.ndarray:
    """A held weight as `dtype` floats: itself when it already is, else a new array (upcast_into)."""
    if not is_half_array(a):
        return a.astype(dtype, copy=False)
    if np.dtype(dtype) != np.float32:
        return to_float(a, dtype)
    out = np.empty(a.shape, dtype=np.float32)
    upcast_into(np.ascontiguousarray(a), out)
    return out


class FloatParams(Mapping):
    """params read as floats of one dtype: a half-held array is upcast each time it is read (and
    dropped when the reader is done with it), so a forward over such a model holds one layer in
    float32 at a time."""

    def __init__(self, params: dict, dtype):
        self._params, self._dtype = params, np.dtype(dtype)

    def __getitem__(self, name):
        return upcast(self._params[name], self._dtype)

    def __iter__(self):
        return iter(self._params)

    def __len__(self):
        return len(self._params)


def has_half(params: Mapping) -> bool:
    return any(is_half_array(a) for a in params.values())


def float_params(params: dict, dtype) -> Mapping:
    """params itself when every array is a float of `dtype`'s kind already, else a FloatParams view."""
    return FloatParams(params, dtype) if has_half(params) else params
