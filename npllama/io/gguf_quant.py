"""ggml's tensor encodings, decoded to float32 in NumPy (and Q8_0 encoded), bit for bit as ggml does.

A quantized tensor is a sequence of blocks, each coding `block_size` consecutive values of a
row in `type_size` bytes (ggml-common.h). fp16(b) below reads two bytes as an IEEE half; every
product is a float32 product, in ggml's order (dequantize_row_* in ggml-quants.c), so the
results equal ggml's, and the `gguf` package's, exactly (tests/test_gguf_quant.py):

    F32, F16, BF16   one value per element; bf16 is the top half of a float32 (bits << 16)
    Q8_0   32 values in 34 bytes: d = fp16, q[32] int8                    x = q * d
    Q4_0   32 values in 18 bytes: d = fp16, 16 bytes of nibbles; value j < 16 is the low nibble
           of byte j, value j + 16 its high nibble                         x = (nibble - 8) * d
    Q4_K   256 values in 144 bytes: d, dmin = fp16; 12 bytes packing 8 six-bit scales sc and
           mins m; 128 bytes of nibbles. Sub-block s (32 values) of the 64-value group g = s // 2
           takes the low (s even) or high (s odd) nibbles of bytes 32g .. 32g + 31
                                                                           x = (d * sc_s) * q - dmin * m_s
           (get_scale_min_k4: for s < 4, sc = b[s] & 63, m = b[s + 4] & 63; for s >= 4, the low
           four bits come from b[s + 4] (low nibble for sc, high for m) and the top two from the
           top bits of b[s - 4] (sc) or b[s] (m))
    Q6_K   256 values in 210 bytes: ql[128] low nibbles, qh[64] two high bits each, 16 int8
           scales, d = fp16. Value p of the half h = p // 128 (r = p % 128, group g = r // 32,
           l = r % 32): low bits from ql[64h + 32 (g % 2) + l], the low nibble for g < 2 else the
           high one; high bits (qh[32h + l] >> 2g) & 3; q = low | high << 4   x = (d * scale[p // 16]) * (q - 32)

Q8_0 encoding (quantize_row_q8_0_ref): d = max|x| / 127, q = roundf(x / d) computed as
x * (1 / d), rounding half away from zero; d is stored as fp16 (q is computed with the float32 d).
"""

from __future__ import annotations

import numpy as np

from .gguf import GGML_TYPE_IDS, GGML_TYPES

F32, F16, BF16 = GGML_TYPE_IDS["F32"], GGML_TYPE_IDS["F16"], GGML_TYPE_IDS["BF16"]
Q8_0, Q4_0, Q4_K, Q6_K = GGML_TYPE_IDS["Q8_0"], GGML_TYPE_IDS["Q4_0"], GGML_TYPE_IDS["Q4_K"], GGML_TYPE_IDS["Q6_K"]


def _fp16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at bytes [start, start + 2) of each block, as float32 (n, 1)."""
    return blocks[:, start:start + 2].copy().view("<f2").astype(np.float32)


def _f32(blocks):
    return blocks.copy().view("<f4").astype(np.float32).reshape(-1, 1)


def _f16(blocks):
    return blocks.copy().view("<f2").astype(np.float32).reshape(-1, 1)


def _bf16(blocks):
    return (blocks.copy().view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(-1, 1)


def _q8_0(blocks):
    q = blocks[:, 2:].view(np.int8).astype(np.float32)
    return q * _fp16(blocks, 0)


def _q4_0(blocks):
    nibbles = blocks[:, 2:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1).astype(np.int8) - np.int8(8)
    return q.astype(np.float32) * _fp16(blocks, 0)


def _q4_k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """get_scale_min_k4 for all 8 sub-blocks: (sc, m), each (n, 8) uint8, from the 12 packed bytes."""
    low, mid, top = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([low & 63, (top & 0x0F) | ((low >> 6) << 4)], axis=1)
    m = np.concatenate([mid & 63, (top >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc, m


def _q4_k(blocks):
    n = blocks.shape[0]
    sc, m = _q4_k_scales(blocks[:, 4:16])
    scale = _fp16(blocks, 0) * sc.astype(np.float32)        # (n, 8): d * sc_s
    offset = _fp16(blocks, 2) * m.astype(np.float32)        # (n, 8): dmin * m_s
    nibbles = blocks[:, 16:].reshape(n, 4, 1, 32)           # group g, then low / high, then 32 bytes
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=2).reshape(n, 8, 32).astype(np.float32)
    return (scale[:, :, None] * q - offset[:, :, None]).reshape(n, 256)


def _q6_k(blocks):
    n = blocks.shape[0]
    ql = blocks[:, :128].reshape(n, 2, 1, 2, 32)            # half, (nibble), g % 2, l
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(n, 2, 4, 32)      # group g = 2 * nibble + g % 2
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = ((low | (high << 4)).astype(np.int8) - np.int8(32)).astype(np.float32).reshape(n, 16, 16)
    scale = _fp16(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32)   # (n, 16): d * scale
    return (scale[:, :, None] * q).reshape(n, 256)


DEQUANTIZERS = {F32: _f32, F16: _f16, BF16: _bf16, Q8_0: _q8_0, Q4_0: _q4_0, Q4_K: _q4_k, Q6_K: _q6_k}
SUPPORTED = tuple(GGML_TYPES[t].name for t in DEQUANTIZERS)


def dequantize(raw: np.ndarray, type_id: int) -> np.ndarray:
    """float32 values of `raw` (uint8, a whole number of blocks of ggml type `type_id`), 1-D."""
    t = GGML_TYPES[type_id]
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, t.type_size)
    with np.errstate(invalid="ignore", over="ignore"):   # a NaN or inf scale: the caller's finiteness check names it
        return DEQUANTIZERS[type_id](blocks).reshape(-1)


def _round_half_away(x: np.ndarray) -> np.ndarray:
    """C's roundf in float32: floor(|x|) plus one when the fraction is at least 0.5 (exact: the
    fraction of a float is representable), with x's sign."""
    a = np.abs(x)
    whole = np.floor(a)
    return np.copysign(whole + (a - whole >= 0.5), x)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """Q8_0 blocks (uint8, (n_blocks, 34)) of float32 values x (size a multiple of 32)."""
    x = np.asarray(x, dtype=np.float32).reshape(-1, 32)
    d = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    q = _round_half_away(x * inv).astype(np.int8)
    return np.concatenate([d.astype("<f2").view(np.uint8), q.view(np.uint8)], axis=1)
