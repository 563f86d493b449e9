"""ggml's tensor encodings in npllama (io/gguf_quant.py) against llama.cpp's own Python package, bit for bit.

`gguf` (PyPI; llama.cpp's gguf-py) is the reference: its dequantize and quantize mirror
ggml-quants.c. Hypothesis draws arbitrary blocks, every byte random (so scales include
subnormals, infinities and NaNs), and npllama's float32 values must have the same bits.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from npllama.io.gguf import GGML_TYPE_IDS, GGML_TYPES
from npllama.io.gguf_quant import DEQUANTIZERS, dequantize, quantize_q8_0

gguf = pytest.importorskip("gguf", reason="the reference GGUF package `gguf` is not installed "
                                          "(pip install -e '.[gguf-tests]')")
from gguf.quants import dequantize as ref_dequantize, quantize as ref_quantize  # noqa: E402

TYPES = sorted(GGML_TYPES[t].name for t in DEQUANTIZERS)


def _ref_type(name):
    return gguf.GGMLQuantizationType[name]


@pytest.mark.parametrize("name", TYPES)
@settings(max_examples=100)
@given(data=st.data())
def test_dequantization_equals_ggufs_bit_for_bit(name, data):
    t = GGML_TYPES[GGML_TYPE_IDS[name]]
    n_blocks = data.draw(st.integers(1, 6))
    raw = np.frombuffer(data.draw(st.binary(min_size=n_blocks * t.type_size, max_size=n_blocks * t.type_size)),
                        dtype=np.uint8)
    ours = dequantize(raw, GGML_TYPE_IDS[name])
    with np.errstate(all="ignore"):
        ref = np.asarray(ref_dequantize(raw.reshape(1, -1), _ref_type(name)), dtype=np.float32).reshape(-1)
    assert ours.dtype == np.float32 and ours.shape == (n_blocks * t.block_size,)
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))


def test_dequantization_follows_the_documented_formulas():
    """Hand-made blocks, decoded by the module docstring's formulas (independently of `gguf`)."""
    d = np.float16(0.5)
    q8 = np.concatenate([np.frombuffer(d.tobytes(), np.uint8), np.arange(-16, 16, dtype=np.int8).view(np.uint8)])
    assert np.array_equal(dequantize(q8, GGML_TYPE_IDS["Q8_0"]), np.arange(-16, 16) * 0.5)
    nibbles = np.arange(16, dtype=np.uint8) | (np.uint8(15) - np.arange(16, dtype=np.uint8)) << 4
    q4 = np.concatenate([np.frombuffer(d.tobytes(), np.uint8), nibbles])
    expected = (np.concatenate([np.arange(16), 15 - np.arange(16)]) - 8) * 0.5
    assert np.array_equal(dequantize(q4, GGML_TYPE_IDS["Q4_0"]), expected)
    # Q6_K: all q = 33 (low nibble 1, high bits 2), scale of sub-block s = s - 8, d = 0.25
    q6 = np.concatenate([np.full(128, 0x11, np.uint8), np.full(64, 0xAA, np.uint8),
                         (np.arange(16) - 8).astype(np.int8).view(np.uint8),
                         np.frombuffer(np.float16(0.25).tobytes(), np.uint8)])
    assert np.array_equal(dequantize(q6, GGML_TYPE_IDS["Q6_K"]), np.repeat((np.arange(16) - 8) * 0.25, 16))


@settings(max_examples=100)
@given(x=hnp.arrays(np.float32, st.integers(1, 4).map(lambda n: 32 * n),
                    elements=st.one_of(st.floats(-1e4, 1e4, width=32),
                                       st.sampled_from([0.0, -0.0, 0.5, -0.5, 1.5, 127.0, -127.5, float(np.float32(1e-30))]))))
def test_q8_0_encoding_equals_ggufs_bit_for_bit(x):
    ours = quantize_q8_0(x)
    ref = np.asarray(ref_quantize(x.reshape(1, -1), gguf.GGMLQuantizationType.Q8_0)).reshape(ours.shape)
    assert ours.dtype == np.uint8 and np.array_equal(ours, ref)


def test_q8_0_rounds_half_away_from_zero():
    x = np.zeros(32, np.float32)
    x[:4] = [127.0, 0.5, -0.5, 1.5]        # d = 1: q = x exactly, ties away from zero
    q = quantize_q8_0(x)[0, 2:].view(np.int8)
    assert list(q[:4]) == [127, 1, -1, 2]
    assert np.array_equal(dequantize(quantize_q8_0(x).reshape(-1), GGML_TYPE_IDS["Q8_0"])[:4], [127, 1, -1, 2])
