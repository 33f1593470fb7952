"""Quantize float weights into GGUF block types, in NumPy.

`quantize(array, dtype)` returns the bytes a GGUF tensor of that type stores (rows of
blocks along the last axis), so the result can be written with gguf-py, read back by
hipc's loader and dequantized by gguf-py's `quants.dequantize`, the reference every
test here checks against. The block layouts are the GGUF formats (see
templates/cpu/blocks.h); the rounding choices are this module's own: each block's
scales are taken from its range, rounded to their storage type first, and the values
rounded to nearest against the stored scales. No search for better scales is done
(llama.cpp's quantizers do one): the aim is valid, faithful files, for tests and for a
`--quant` option, not the last 0.1% of perplexity.
"""

from __future__ import annotations

import numpy as np

from hipc.compiler.ir import QUANT_BLOCKS
from hipc.compiler.quantize import iquants, kquants, legacy

_QUANTIZERS = {
    "q4_0": legacy.q4_0,
    "q4_1": legacy.q4_1,
    "q5_0": legacy.q5_0,
    "q5_1": legacy.q5_1,
    "q8_0": legacy.q8_0,
    "q4_k": kquants.q4_k,
    "q5_k": kquants.q5_k,
    "q6_k": kquants.q6_k,
    "q3_k": kquants.q3_k,
    "q2_k": kquants.q2_k,
    "iq4_nl": iquants.iq4_nl,
    "iq4_xs": iquants.iq4_xs,
}
QUANTIZABLE = tuple(_QUANTIZERS)


def quantize(array: np.ndarray, dtype: str) -> bytes:
    """`array` (float, last axis a multiple of the type's block size) as `dtype` blocks."""
    if dtype not in _QUANTIZERS:
        raise ValueError(f"cannot quantize to {dtype!r} (supported: {', '.join(QUANTIZABLE)})")
    elems, nbytes = QUANT_BLOCKS[dtype]
    x = np.asarray(array, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % elems:
        raise ValueError(
            f"{dtype} needs rows that are a multiple of {elems} values (got shape {x.shape})"
        )
    if not np.isfinite(x).all():
        raise ValueError(f"cannot quantize non-finite values to {dtype}")
    blocks = _QUANTIZERS[dtype](x.reshape(-1, elems))
    assert blocks.shape == (x.size // elems, nbytes), (dtype, blocks.shape)
    return blocks.tobytes()


def q4_k_m_type(name: str, shape: tuple[int, ...], n_layers: int) -> str | None:
    """The type llama.cpp's Q4_K_M recipe gives a GGUF tensor (None: kept as float).

    Q4_K everywhere, Q6_K for the output (or a tied token_embd) and for attn_v and
    ffn_down in the first and last eighth of the layers and every third between; a row
    length that is not a multiple of 256 falls back to Q5_0 (for Q4_K) or Q8_0 (for Q6_K).
    """
    if len(shape) != 2:
        return None
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    eighth = n_layers // 8
    more_bits = layer < eighth or layer >= 7 * n_layers // 8 or (layer - eighth) % 3 == 2
    if name in ("output.weight", "token_embd.weight") or (
        name.endswith(("attn_v.weight", "ffn_down.weight")) and more_bits
    ):
        wanted = "q6_k"
    else:
        wanted = "q4_k"
    if shape[-1] % QUANT_BLOCKS[wanted][0]:
        return {"q4_k": "q5_0", "q6_k": "q8_0"}[wanted]
    return wanted
