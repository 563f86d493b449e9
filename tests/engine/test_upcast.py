"""The engine's fast float16 / bfloat16 -> float32 upcast equals the exact one, on every finite value."""

import numpy as np

from npllama.engine.upcast import upcast, upcast_into
from npllama.storage import bfloat16_to_float32, float32_to_bfloat16, to_float

EVERY_16_BIT_PATTERN = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def test_float16_upcast_equals_numpy_on_every_finite_value_signed_zeros_and_subnormals_included():
    values = EVERY_16_BIT_PATTERN.view(np.float16)
    finite = values[np.isfinite(values)]                         # weights are checked finite at load
    out = np.empty(finite.shape, np.float32)
    upcast_into(finite, out)
    assert np.array_equal(out.view(np.uint32), finite.astype(np.float32).view(np.uint32))
    assert np.array_equal(upcast(finite.reshape(-1, 4)).ravel().view(np.uint32), out.view(np.uint32))


def test_bfloat16_upcast_is_the_top_half_of_float32_on_every_finite_value():
    bits = EVERY_16_BIT_PATTERN[(EVERY_16_BIT_PATTERN & 0x7F80) != 0x7F80]
    out = np.empty(bits.shape, np.float32)
    upcast_into(bits, out)
    assert np.array_equal(out.view(np.uint32), bits.astype(np.uint32) << 16)
    assert np.array_equal(out, bfloat16_to_float32(bits)) and np.array_equal(out, to_float(bits))
    assert np.array_equal(float32_to_bfloat16(out), bits)        # exact values round to themselves


def test_float64_upcast_for_the_float64_checks():
    bits = float32_to_bfloat16(np.array([1.5, -2.25, 3e-20], np.float32))
    out = np.empty(3, np.float64)
    upcast_into(bits, out)
    assert out.tolist() == [1.5, -2.25, float(bfloat16_to_float32(bits)[2])]
