"""The K-quants: super-blocks of 256 with 4-bit (Q2_K), 6-bit (Q3_K, Q4_K, Q5_K) or int8 (Q6_K)
sub-block scales under one float16 scale (blocks [n, 256] -> bytes [n, B]). Layouts: blocks.h."""

from __future__ import annotations

import numpy as np

from hipc.compiler.quantize.legacy import f16_bytes, safe_div, signed_absmax, stored


def _pack_scale_min(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """[n, 8] 6-bit scales and mins -> the 12 packed bytes of Q4_K/Q5_K."""
    lo, hi = slice(0, 4), slice(4, 8)
    return np.concatenate(
        [
            sc[:, lo] | ((sc[:, hi] >> 4) << 6),
            mn[:, lo] | ((mn[:, hi] >> 4) << 6),
            (sc[:, hi] & 15) | ((mn[:, hi] & 15) << 4),
        ],
        axis=-1,
    ).astype(np.uint8)


def _affine_k(b: np.ndarray, top: int):
    """Sub-blocks of 32: x ~= q * d * sc - dmin * mn, q in 0..top, sc and mn 6-bit."""
    sub = b.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0)  # the min term only subtracts
    scale, offset = (sub.max(axis=-1) - lo) / top, -lo
    d = stored(scale.max(axis=-1, keepdims=True) / 63)
    dmin = stored(offset.max(axis=-1, keepdims=True) / 63)
    sc = np.clip(np.rint(safe_div(scale, d)), 0, 63).astype(np.int32)
    mn = np.clip(np.rint(safe_div(offset, dmin)), 0, 63).astype(np.int32)
    step = (d * sc)[..., None]
    q = np.clip(np.rint(safe_div(sub + (dmin * mn)[..., None], step)), 0, top).astype(np.int32)
    return d, dmin, sc, mn, q  # q: [n, 8, 32]


def _nibbles_k(q: np.ndarray) -> np.ndarray:
    """[n, 8, 32] -> qs [n, 128]: sub-blocks 2c and 2c+1 share bytes 32c.. (low, high)."""
    q = q & 15
    return (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128).astype(np.uint8)


def q4_k(b: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _affine_k(b, 15)
    return np.concatenate(
        [f16_bytes(d), f16_bytes(dmin), _pack_scale_min(sc, mn), _nibbles_k(q)], axis=-1
    )


def q5_k(b: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _affine_k(b, 31)
    # bit j of qh[i]: the fifth bit of element i of sub-block j
    qh = ((q >> 4) << np.arange(8).reshape(1, 8, 1)).sum(axis=1).astype(np.uint8)
    return np.concatenate(
        [f16_bytes(d), f16_bytes(dmin), _pack_scale_min(sc, mn), qh, _nibbles_k(q)], axis=-1
    )


def q6_k(b: np.ndarray) -> np.ndarray:
    """Sub-blocks of 16: x ~= d * sc * (q - 32), sc int8, q in 0..63."""
    sub = b.reshape(-1, 16, 16)
    scale = signed_absmax(sub)[..., 0] / -32  # the extreme maps to q - 32 = -32
    d = stored(np.abs(scale).max(axis=-1, keepdims=True) / 127)
    sc = np.clip(np.rint(safe_div(scale, d)), -127, 127).astype(np.int32)
    step = (d * sc)[..., None]
    q = (np.clip(np.rint(safe_div(sub, step)), -32, 31) + 32).astype(np.int32).reshape(-1, 2, 128)
    lo, hi = q & 15, q >> 4
    # half h, element r: low nibble in ql[64h + r % 64] (nibble r // 64), top 2 bits in
    # qh[32h + r % 32] (bits 2 * (r // 32))
    ql = lo[..., :64] | (lo[..., 64:] << 4)
    qh = hi[..., :32] | (hi[..., 32:64] << 2) | (hi[..., 64:96] << 4) | (hi[..., 96:] << 6)
    return np.concatenate(
        [
            ql.reshape(-1, 128).astype(np.uint8),
            qh.reshape(-1, 64).astype(np.uint8),
            sc.astype(np.int8).view(np.uint8),
            f16_bytes(d),
        ],
        axis=-1,
    )


def q3_k(b: np.ndarray) -> np.ndarray:
    """Sub-blocks of 16: x ~= d * (sc - 32) * (q - 4), sc 6-bit, q in 0..7."""
    sub = b.reshape(-1, 16, 16)
    scale = signed_absmax(sub)[..., 0] / -4  # the extreme maps to q - 4 = -4
    d = stored(np.abs(scale).max(axis=-1, keepdims=True) / 32)
    sc = np.clip(np.rint(safe_div(scale, d)), -32, 31).astype(np.int32) + 32
    step = (d * (sc - 32))[..., None]
    q = (np.clip(np.rint(safe_div(sub, step)), -4, 3) + 4).astype(np.int32)
    # element 128h + 32c + l: bits 2c.. of qs[32h + l], bit 4h + c of hmask[l]
    q = q.reshape(-1, 2, 4, 32)
    shift = np.arange(4).reshape(1, 1, 4, 1)
    qs = ((q & 3) << (2 * shift)).sum(axis=2).reshape(-1, 64)
    bit = 4 * np.arange(2).reshape(1, 2, 1, 1) + shift
    hmask = ((q >> 2) << bit).sum(axis=(1, 2))
    # scale n: its low 4 bits in the nibble n // 8 of byte n % 8, its top 2 bits at bits
    # 2 (n // 4) of byte 8 + n % 4
    scales = np.concatenate(
        [
            (sc[:, :8] & 15) | ((sc[:, 8:] & 15) << 4),
            sum(((sc[:, 4 * j : 4 * j + 4] >> 4) & 3) << (2 * j) for j in range(4)),
        ],
        axis=-1,
    )
    return np.concatenate(
        [hmask.astype(np.uint8), qs.astype(np.uint8), scales.astype(np.uint8), f16_bytes(d)],
        axis=-1,
    )


def q2_k(b: np.ndarray) -> np.ndarray:
    """Sub-blocks of 16: x ~= q * d * sc - dmin * mn, q in 0..3, sc and mn 4-bit."""
    sub = b.reshape(-1, 16, 16)
    lo = np.minimum(sub.min(axis=-1), 0)  # the min term only subtracts
    scale, offset = (sub.max(axis=-1) - lo) / 3, -lo
    d = stored(scale.max(axis=-1, keepdims=True) / 15)
    dmin = stored(offset.max(axis=-1, keepdims=True) / 15)
    sc = np.clip(np.rint(safe_div(scale, d)), 0, 15).astype(np.int32)
    mn = np.clip(np.rint(safe_div(offset, dmin)), 0, 15).astype(np.int32)
    step = (d * sc)[..., None]
    q = np.clip(np.rint(safe_div(sub + (dmin * mn)[..., None], step)), 0, 3).astype(np.int32)
    # element 128h + 32c + l: bits 2c.. of qs[32h + l] (Q3_K's low bits)
    q = q.reshape(-1, 2, 4, 32)
    qs = (q << (2 * np.arange(4).reshape(1, 1, 4, 1))).sum(axis=2).reshape(-1, 64)
    return np.concatenate(
        [(sc | (mn << 4)).astype(np.uint8), qs.astype(np.uint8), f16_bytes(d), f16_bytes(dmin)],
        axis=-1,
    )
