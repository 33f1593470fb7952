"""NumPy quantizers: float rows -> GGML blocks, byte for byte as GGUF files store them.

`quantize(array, dtype)` takes [..., K] floats (K a multiple of the type's block) and
returns uint8 [..., K / block * block_bytes]: each row's blocks in order, which is the
layout gguf-py reads and the kernels take. One module per block family registers its
types in QUANTIZERS (a function from float32 blocks [n, block] to uint8 [n, bytes]).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from hipc.compiler.quants import legacy

# dtype -> (elements per block, bytes per block): GGML's block layouts.
BLOCKS = {
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "q5_0": (32, 22),
    "q5_1": (32, 24),
    "q8_0": (32, 34),
    "q4_k": (256, 144),
    "q5_k": (256, 176),
    "q6_k": (256, 210),
}

QUANTIZERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "q4_0": legacy.q4_0,
    "q4_1": legacy.q4_1,
    "q8_0": legacy.q8_0,
}


def quantize(array: np.ndarray, dtype: str) -> np.ndarray:
    """[..., K] floats -> uint8 [..., K / block * bytes] in GGML's `dtype` blocks."""
    fn = QUANTIZERS.get(dtype)
    if fn is None:
        raise ValueError(f"no quantizer for {dtype} (have: {', '.join(QUANTIZERS)})")
    block, nbytes = BLOCKS[dtype]
    x = np.ascontiguousarray(array, dtype=np.float32)
    if x.shape[-1] % block:
        raise ValueError(f"{dtype}: row length {x.shape[-1]} is not a multiple of {block}")
    blocks = fn(x.reshape(-1, block))
    return blocks.reshape(*x.shape[:-1], x.shape[-1] // block * nbytes)


def row_bytes(dtype: str, k: int) -> int:
    block, nbytes = BLOCKS[dtype]
    return k // block * nbytes
