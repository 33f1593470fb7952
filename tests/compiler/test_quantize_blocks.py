"""The NumPy quantizers (compiler/quantize/) against gguf-py's reference quantize().

gguf-py's quantize() reproduces GGML's reference quantizers (ggml-quants.c, what
llama-quantize runs without an importance matrix) for Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0;
it has none for the K-quants (those are checked through gguf-py's dequantize in
test_quantize.py). Ours are not bit-exact with it, by design: GGML rounds x * (1/d)
with the scale d (and Q4_1/Q5_1's minimum) before they are stored as fp16, ours round
against the stored fp16 values, so each value lands on the nearest point of the grid
the file actually holds. The checks: the same scales (the fp16 fields are equal in
every block), the same value in nearly every element, and wherever they differ ours is
no farther from the input.
"""

from __future__ import annotations

import numpy as np
import pytest

from hipc.compiler.ir import QUANT_BLOCKS
from hipc.compiler.quantize import QUANTIZABLE, quantize

gguf = pytest.importorskip("gguf")

# bytes per block that hold fp16 fields (scale, minimum), at the start of the block
HEADER = {"q4_0": 2, "q4_1": 4, "q5_0": 2, "q5_1": 4, "q8_0": 2}


def _rows(seed: int, k: int = 512) -> np.ndarray:
    """Random rows plus the cases that break quantizers: zeros, constants, a lone spike,
    tiny and huge scales, one-signed and sparse blocks, heavy tails."""
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


@pytest.mark.parametrize("dtype", sorted(set(QUANTIZABLE) & set(HEADER)))
@pytest.mark.parametrize("seed", [0, 1])
def test_against_gguf_reference_quantize(dtype, seed):
    qt = gguf.GGMLQuantizationType[dtype.upper()]
    x = _rows(seed)
    want = gguf.quants.quantize(x, qt)
    got = np.frombuffer(quantize(x, dtype), np.uint8).reshape(want.shape)
    nbytes = QUANT_BLOCKS[dtype][1]
    g, w = got.reshape(-1, nbytes), want.reshape(-1, nbytes)
    np.testing.assert_array_equal(g[:, : HEADER[dtype]], w[:, : HEADER[dtype]])

    ours = gguf.quants.dequantize(got, qt).reshape(x.shape)
    ref = gguf.quants.dequantize(want, qt).reshape(x.shape)
    differ = ours != ref
    # row 3's scales are fp16 subnormals, coarse enough that the stored scale moves many
    # values (36% of them for Q8_0); elsewhere under 2% (measured: at most 1.2%)
    normal = np.delete(differ, 3, axis=0)
    assert normal.mean() < 0.02, f"{normal.mean():.2%} of the values differ"
    # where they differ, ours is the nearer grid point (or as near: a tie)
    slack = np.abs(x).max() * 2.0**-20
    assert np.all(np.abs(ours - x) <= np.abs(ref - x) + slack)
    # and on the rows above, identical in the cases with one answer
    np.testing.assert_array_equal(got[0], want[0])  # all zeros
