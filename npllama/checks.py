"""Argument checks shared by every layer: whole numbers, real numbers, dtypes, JSON text.

The rules in one place: a bool is never a number here (True is an int subclass, but
n_heads=True is a typo, not a size), NumPy scalars count like Python ones, and a real number
must be finite. Each check raises NpllamaError (a ValueError) naming the argument and the range
it must lie in. JSON read from a file or from metadata goes through parse_json, which refuses
nesting deeper than MAX_JSON_DEPTH before the parser recurses into it.
"""

from __future__ import annotations

import dataclasses
import json
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


# Every JSON npllama reads (config.json, tokenizer.json, safetensors headers and metadata,
# training state, metrics.jsonl, the run lock) nests a handful of levels: tokenizer.json, the
# deepest, about 8. json.loads recurses once per level and ends in RecursionError past ~1000.
MAX_JSON_DEPTH = 100


def json_depth(text: str) -> int:
    """The deepest nesting of [ and { in JSON text, brackets inside strings left out (0 for a scalar).

    Linear, and vectorised over the bytes: a quote opens or closes a string unless an odd run of
    backslashes precedes it; a bracket counts when an even number of such quotes precede it.
    """
    codes = np.frombuffer(text.encode("utf-8", errors="surrogatepass"), dtype=np.uint8)
    quotes = np.flatnonzero(codes == 34)
    backslash = codes == 92
    escaped = quotes[(quotes > 0) & backslash[quotes - 1]]           # rare: work out their runs only
    if escaped.size:
        runs = np.flatnonzero(backslash & ~np.concatenate(([False], backslash[:-1])))   # where each run starts
        run_start = runs[np.searchsorted(runs, escaped - 1, side="right") - 1]
        quotes = np.setdiff1d(quotes, escaped[(escaped - run_start) % 2 == 1], assume_unique=True)
    brackets = np.flatnonzero((codes == 91) | (codes == 93) | (codes == 123) | (codes == 125))
    outside = brackets[np.searchsorted(quotes, brackets) % 2 == 0]
    step = np.where((codes[outside] == 91) | (codes[outside] == 123), 1, -1)
    return int(np.cumsum(step).max(initial=0))


def parse_json(text, what: str, error: type = NpllamaError, max_depth: int = MAX_JSON_DEPTH):
    """json.loads(text) for text read from a file or metadata, or `error` (an NpllamaError class)
    naming `what`: text that is not UTF-8 or not JSON, or that nests deeper than max_depth levels
    (refused before parsing, so hostile nesting is never a RecursionError)."""
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            raise error(f"{what} is not UTF-8 text ({e})") from None
    if not isinstance(text, str):
        raise error(f"{what} must be JSON text, got {type(text).__name__}")
    # fewer brackets than the limit cannot nest deeper than it: most texts skip the scan
    depth = 0 if text.count("[") + text.count("{") <= max_depth else json_depth(text)
    if depth > max_depth:
        raise error(f"{what} nests JSON {depth} levels deep; npllama reads at most {max_depth} "
                    "(the file is damaged or was not made for this)")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:      # JSONDecodeError, or an integer of too many digits
        raise error(f"{what} is not valid JSON ({e})") from None
