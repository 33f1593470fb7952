"""Q8_0, Q4_0 and Q4_1: one fp16 scale (and Q4_1's fp16 minimum) per 32 values.

The rounding follows GGML's reference quantizers, so the bytes equal llama-quantize's
for the same float32 input (tests/compiler/test_quantize_blocks.py checks against
gguf-py's copy of them):
  Q8_0  d = max|x| / 127,            q = round-half-away(x / d)          in -127..127
  Q4_0  d = x[argmax |x|] / -8,      q = min(15, trunc(x / d + 8.5))     value d * (q - 8)
  Q4_1  d = (max - min) / 15,        q = min(15, trunc((x - min) / d + 0.5)), value d * q + min
The quotient is x * (1 / d) in float32, as in GGML (not x / d: the last bit can differ).
"""

from __future__ import annotations

import numpy as np


def _inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def _fp16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).view(np.uint8)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """32 values 0..15 -> 16 bytes: value j in the low nibble of byte j, j + 16 in the high."""
    return (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)


def q8_0(x: np.ndarray) -> np.ndarray:
    d = (np.abs(x).max(axis=1, keepdims=True) / np.float32(127)).astype(np.float32)
    v = x * _inverse(d)
    q = np.trunc(v + np.copysign(np.float32(0.5), v)).astype(np.int8)  # C roundf
    return np.concatenate([_fp16_bytes(d), q.view(np.uint8)], axis=1)


def q4_0(x: np.ndarray) -> np.ndarray:
    peak = np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)
    d = (peak / np.float32(-8)).astype(np.float32)
    q = np.minimum(np.trunc(x * _inverse(d) + np.float32(8.5)), 15).astype(np.uint8)
    return np.concatenate([_fp16_bytes(d), _nibbles(q)], axis=1)


def q4_1(x: np.ndarray) -> np.ndarray:
    lo = x.min(axis=1, keepdims=True)
    d = ((x.max(axis=1, keepdims=True) - lo) / np.float32(15)).astype(np.float32)
    q = np.minimum(np.trunc((x - lo) * _inverse(d) + np.float32(0.5)), 15).astype(np.uint8)
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(lo), _nibbles(q)], axis=1)
