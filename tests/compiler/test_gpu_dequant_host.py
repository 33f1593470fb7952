"""The sm_90a prefill's dequantize pass (templates/hip/linear_dequant.hip.j2) run on the host:
every quantized type the GPU reads, in the artifact's split layout and in GGUF's order, against
gguf-py's dequantize of the same blocks rounded to bf16 (ties to even, as the kernel rounds).
Rows of scales 1e-4 to 1e2 for the types quantized here, random bytes (every quant and
6-bit scale, extremes included) for the K-quants; the output is poisoned with NaN first.
"""

from __future__ import annotations

import ctypes

import gguf
import host_simt
import numpy as np
import pytest

from hipc.compiler.codegen.environment import render
from hipc.compiler.kernels.linear import QUANT_TYPES, LinearParams, dequant_kernel

from gpu_kernels import bf16_round, pack

N, K = 6, 512  # two 256-weight super-blocks a row; 384 chunks of 8: two blocks of 256 threads
TYPES = sorted(QUANT_TYPES)


def _params(wtype: str) -> LinearParams:
    return LinearParams(wtype=wtype, N=N, K=K, norm_eps=0.0, epilogue="none", bias=False)


@pytest.fixture(scope="module", params=["split", "gguf"])
def lib(request, tmp_path_factory):
    kernels, wrappers = [], []
    for wtype in TYPES:
        k = dequant_kernel(f"dq_{wtype}", _params(wtype))
        kernels.append(render(f"hip/{k.template}.hip.j2", fn=k.fn, **k.ctx))
        wrappers.append(
            f'extern "C" void run_{wtype}(const void* W, uint16_t* wb) {{\n'
            f"  grid({k.grid[0]}, 1, {k.threads}, [=] {{ {k.fn}(W, wb); }});\n}}"
        )
    defines = "#define HIPC_QSPLIT 0\n" if request.param == "gguf" else ""
    root = tmp_path_factory.mktemp(f"dequant_{request.param}")
    code = "\n".join(kernels) + "\n" + "\n".join(wrappers)
    handle = host_simt.build(root, "dequant_host", code, defines=defines)
    handle.layout = request.param
    return handle


@pytest.mark.parametrize("wtype", TYPES)
def test_dequantize_pass_on_the_host(lib, wtype):
    rng = np.random.default_rng(TYPES.index(wtype))
    scales = 10.0 ** rng.uniform(-4, 2, (N, 1))
    w = rng.standard_normal((N, K)) * scales
    stored, _ = pack(w, wtype, lib.layout)
    raw, _ = pack(w, wtype, "gguf")
    want = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, wtype.upper()))
    want = want.reshape(N, K).astype(np.float64)
    stored = np.ascontiguousarray(stored)
    got_bits = np.full((N, K), 0xFFFF, np.uint16)  # bf16 NaN: a chunk never written shows
    getattr(lib, f"run_{wtype}")(
        stored.ctypes.data_as(ctypes.c_void_p), got_bits.ctypes.data_as(ctypes.c_void_p)
    )
    got = (got_bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    assert not np.isnan(got).any()
    # the kernel forms s * q + o in float32, then rounds once to bf16: within one bf16 step
    # of the exact value, and equal to its bf16 rounding wherever float32 held it exactly
    assert np.all(np.abs(got - want) <= np.abs(want) * 2.0**-8), wtype
    assert np.mean(got == bf16_round(want)) >= 0.999, wtype
