"""IQ4_NL and IQ4_XS: 4-bit indices into a fixed table of 16 int8 values (blocks.h), under
a float16 scale per 32 (IQ4_NL) or 6-bit scales per 32 under one per 256 (IQ4_XS). Each
value takes the table entry nearest it; the scale maps the block's extreme to the table's
-127 end."""

from __future__ import annotations

import numpy as np

from hipc.compiler.quantize.legacy import f16_bytes, pack_nibbles, safe_div, signed_absmax, stored

# llama.cpp's kvalues_iq4nl (a format fact: the values the 4-bit indices stand for)
IQ4_NL_VALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32
)


def _nearest(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """[n, 32] values over their block's scale [n, 1] -> the nearest table indices."""
    v = safe_div(x, scale)
    return np.abs(v[..., None] - IQ4_NL_VALUES).argmin(axis=-1)


def iq4_nl(b: np.ndarray) -> np.ndarray:
    d = stored(signed_absmax(b) / -127)
    return np.concatenate([f16_bytes(d), pack_nibbles(_nearest(b, d))], axis=-1)


def iq4_xs(b: np.ndarray) -> np.ndarray:
    """Sub-blocks of 32: x ~= d * (ls - 32) * table[i], ls 6-bit."""
    sub = b.reshape(-1, 8, 32)
    scale = signed_absmax(sub)[..., 0] / -127
    d = stored(np.abs(scale).max(axis=-1, keepdims=True) / 32)
    ls = np.clip(np.rint(safe_div(scale, d)), -32, 31).astype(np.int32) + 32
    idx = _nearest(sub.reshape(-1, 32), (d * (ls - 32)).reshape(-1, 1))
    scales_h = ((ls >> 4) << (2 * np.arange(8))).sum(axis=-1).astype("<u2")
    scales_l = (ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)
    return np.concatenate(
        [
            f16_bytes(d),
            scales_h.reshape(-1, 1).view(np.uint8),
            scales_l.astype(np.uint8),
            pack_nibbles(idx).reshape(-1, 128),
        ],
        axis=-1,
    )
