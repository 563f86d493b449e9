"""Argument checks shared by every layer: whole numbers, real numbers, dtypes.

The rules in one place: a bool is never a number here (True is an int subclass, but
n_heads=True is a typo, not a size), NumPy scalars count like Python ones, and a real number
must be finite. Each check raises NpllamaError (a ValueError) naming the argument and the range
it must lie in.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .errors import NpllamaError

SUPPORTED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def is_integer(value) -> bool:
    """True for Python and NumPy integers, False for bools and everything else."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_real(value) -> bool:
    """True for finite Python and NumPy numbers (integers included), False for bools, NaN and inf."""
    return (isinstance(value, (int, float, np.integer, np.floating))
            and not isinstance(value, (bool, np.bool_)) and math.isfinite(value))


def check_int(name: str, value, minimum: int | None = None, maximum: int | None = None, hint: str = "") -> int:
    """value as a Python int, or NpllamaError when it is not a whole number in [minimum, maximum]."""
    if not is_integer(value):
        raise NpllamaError(f"{name}={value!r} must be an integer{hint}")
    if minimum is not None and value < minimum:
        raise NpllamaError(f"{name}={value} must be >= {minimum}{hint}")
    if maximum is not None and value > maximum:
        raise NpllamaError(f"{name}={value} must be <= {maximum}{hint}")
    return int(value)


def check_real(name: str, value, low: float = -math.inf, high: float = math.inf, *,
               low_open: bool = False, high_open: bool = False, hint: str = "") -> float:
    """value as a Python float, or NpllamaError when it is not a finite number in the interval.

    The interval is [low, high], open at an end when low_open / high_open is set.
    """
    if not is_real(value):
        raise NpllamaError(f"{name}={value!r} must be a finite number{hint}")
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if too_low or too_high:
        left, right = "(" if low_open else "[", ")" if high_open else "]"
        raise NpllamaError(f"{name}={value!r} must lie in {left}{low}, {high}{right}{hint}")
    return float(value)


def check_dtype(dtype) -> np.dtype:
    """The compute dtype of a model: float32 (the default) or float64 (gradient checks)."""
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise NpllamaError(f"dtype={dtype!r} is not a NumPy dtype; use np.float32 (default) or np.float64") from None
    if dtype not in SUPPORTED_DTYPES:
        raise NpllamaError(f"dtype={dtype} is not supported; use np.float32 (default) or np.float64")
    return dtype


def dataclass_from_dict(cls, d, what: str):
    """cls(**d) for a dict read from JSON: anything but an object, or an unknown key, is an NpllamaError.

    The fields' own checks (the dataclass's __post_init__ or validate) then judge the values.
    """
    if not isinstance(d, dict):
        raise NpllamaError(f"{what} must be a JSON object, got {type(d).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(map(str, set(d) - known))
    if unknown:
        raise NpllamaError(f"unknown {what} fields {unknown}; known fields are {sorted(known)}")
    return cls(**d)
