"""The 32-element block types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (blocks [n, 32] -> bytes [n, B])."""

from __future__ import annotations

import numpy as np


def f16_bytes(v: np.ndarray) -> np.ndarray:
    """[n] -> [n, 2] little-endian float16."""
    return v.astype("<f2").reshape(-1, 1).view(np.uint8)


def stored(v: np.ndarray) -> np.ndarray:
    """The value a float16 field will hold, as float32."""
    return v.astype(np.float16).astype(np.float32)


def safe_div(x: np.ndarray, d: np.ndarray) -> np.ndarray:
    """x / d, 0 where d == 0 (an all-zero block, or a zero scale)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(d != 0, x / np.where(d != 0, d, 1), 0)


def signed_absmax(b: np.ndarray) -> np.ndarray:
    """The value of largest magnitude per row, with its sign, [n, 1]."""
    return np.take_along_axis(b, np.abs(b).argmax(axis=-1, keepdims=True), axis=-1)


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """[n, 32] values 0..15 -> [n, 16]: element j low nibble, element j + 16 high."""
    return (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)


def high_bits(q: np.ndarray) -> np.ndarray:
    """[n, 32] 5-bit values -> [n, 4]: bit j of the little-endian uint32 = bit 4 of q[j]."""
    return np.packbits((q >> 4).astype(np.uint8), axis=-1, bitorder="little")


def _symmetric(b: np.ndarray, levels: int):
    """Scale d = signed max / -levels (the extreme maps to -levels), q = round(x / d)."""
    d = stored(signed_absmax(b) / -levels)
    return d, np.rint(safe_div(b, d)).astype(np.int32)


def _affine(b: np.ndarray, top: int):
    """x ~= q * d + m with m = min, d = (max - min) / top, q in 0..top."""
    lo, hi = b.min(axis=-1, keepdims=True), b.max(axis=-1, keepdims=True)
    d, m = stored((hi - lo) / top), stored(lo)
    q = np.clip(np.rint(safe_div(b - m, d)), 0, top).astype(np.int32)
    return d, m, q


def q8_0(b: np.ndarray) -> np.ndarray:
    d = stored(np.abs(b).max(axis=-1, keepdims=True) / 127)
    q = np.clip(np.rint(safe_div(b, d)), -127, 127).astype(np.int8)
    return np.concatenate([f16_bytes(d), q.view(np.uint8)], axis=-1)


def q4_0(b: np.ndarray) -> np.ndarray:
    d, q = _symmetric(b, 8)
    q = np.clip(q + 8, 0, 15)
    return np.concatenate([f16_bytes(d), pack_nibbles(q)], axis=-1)


def q4_1(b: np.ndarray) -> np.ndarray:
    d, m, q = _affine(b, 15)
    return np.concatenate([f16_bytes(d), f16_bytes(m), pack_nibbles(q)], axis=-1)


def q5_0(b: np.ndarray) -> np.ndarray:
    d, q = _symmetric(b, 16)
    q = np.clip(q + 16, 0, 31)
    return np.concatenate([f16_bytes(d), high_bits(q), pack_nibbles(q & 15)], axis=-1)


def q5_1(b: np.ndarray) -> np.ndarray:
    d, m, q = _affine(b, 31)
    return np.concatenate([f16_bytes(d), f16_bytes(m), high_bits(q), pack_nibbles(q & 15)], axis=-1)
