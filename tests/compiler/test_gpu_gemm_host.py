"""The prefill GEMM on AMD's matrix instructions (templates/hip/linear_mma.hip.j2) run on the
host, as tests/compiler/test_gpu_flash_host.py runs the flash attention: rendered for gfx942
(MFMA, wave64), gfx1100 (RDNA3 WMMA) and gfx1201 (RDNA4 WMMA), each block's lanes as host
threads, the instruction emulated across the wave from the ISA's operand layout. Against
NumPy in float64 with x rounded to bf16 as the kernel does (--prefill-precision bf16); outputs
poisoned with NaN. Partial tiles in T and N, K not a multiple of the K slice, every epilogue,
and quantized weights (q4_1: each 16-weight group's scale and offset). No AMD GPU runs these.
"""

from __future__ import annotations

import ctypes

import host_simt
import numpy as np
import pytest

from hipc.compiler.codegen.environment import render
from hipc.compiler.kernels.linear import MMA_TILES, LinearParams, prefill_gemm
from hipc.compiler.reference.executor import round_bf16
from hipc.compiler.targets import GpuTarget

from gpu_kernels import pack
from support import rel_err

EPS = 1e-5
ARCHS = ("gfx942", "gfx1100", "gfx1201")
# name: (weight type, T, N weight rows, K, epilogue, norm prologue, bias)
CASES = {
    "residual_bias_k80": ("bfloat16", 37, 72, 80, "residual", False, True),
    "glu_norm": ("bfloat16", 20, 2 * 40, 64, "glu", True, False),
    "q4_1_norm_bias": ("q4_1", 19, 48, 64, "none", True, True),
}


def _params(case) -> LinearParams:
    wtype, _, N, K, epilogue, norm, bias = case
    return LinearParams(wtype=wtype, N=N, K=K, norm_eps=EPS if norm else 0.0, epilogue=epilogue,
                        bias=bias)  # fmt: skip


@pytest.fixture(scope="module", params=ARCHS)
def lib(request, tmp_path_factory):
    arch = request.param
    target = GpuTarget(arch)
    kernels, wrappers, specs = [], [], {}
    for i, (name, case) in enumerate(CASES.items()):
        g = prefill_gemm(f"g{i}", _params(case), target, [name])
        assert g.template == "linear_mma", (arch, name, g.template)
        specs[name] = g
        kernels.append(render(f"hip/{g.template}.hip.j2", fn=g.fn, **g.ctx))
        T, n_out = case[1], _params(case).n_out
        grid = f"{-(-n_out // g.block_outputs)}, {-(-T // g.block_tokens)}"
        wrappers.append(
            f'extern "C" void run_{g.fn}(const float* x, const void* w, const float* nw, '
            f"const float* inv, const float* b, const float* res, float* y) {{\n"
            f"  grid({grid}, {g.threads}, [=] {{ {g.fn}(x, {T}, w, nw, inv, b, res, y); }}, "
            f"{g.shared});\n}}"
        )
    code = "\n".join(kernels) + "\n" + "\n".join(wrappers)
    root = tmp_path_factory.mktemp(f"gemm_{arch}")
    handle = host_simt.build(root, "gemm_host", code, target.wave, MMA_TILES[arch].macro)
    handle.specs, handle.arch = specs, arch
    return handle


@pytest.mark.parametrize("name", list(CASES))
def test_amd_prefill_gemm_on_the_host(lib, name):
    wtype, T, N, K, epilogue, norm, bias = CASES[name]
    n_out = N // 2 if epilogue == "glu" else N
    rng = np.random.default_rng(list(CASES).index(name))
    x = (rng.standard_normal((T, K)) * 10.0 ** rng.uniform(-1, 1, (T, 1))).astype(np.float32)
    w_stored, w = pack(0.05 * rng.standard_normal((N, K)), wtype)
    g = (1 + 0.2 * rng.standard_normal(K)).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    r = rng.standard_normal((T, n_out)).astype(np.float32)
    x64 = x.astype(np.float64)
    inv = (1 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + EPS)).astype(np.float32)
    xn = x * inv * g if norm else x  # float32, as the kernel scales x on its way to the tiles
    # the tiles hold bf16(x) and the weights exactly (a quantized type's integer quants), and
    # the offsets multiply sums of that same rounded x: the whole product sees one x
    acc = round_bf16(xn).astype(np.float64) @ w.T
    acc += b if bias else 0.0
    if epilogue == "glu":
        want = acc[:, :n_out] / (1 + np.exp(-acc[:, :n_out])) * acc[:, n_out:]
    else:
        want = acc + (r if epilogue == "residual" else 0.0)
    y = r.copy() if epilogue == "residual" else np.full((T, n_out), np.nan, np.float32)
    ptr = ctypes.c_void_p
    args = [x, w_stored, g, np.broadcast_to(inv[:, 0], (T,)).copy(), b, r, y]
    getattr(lib, f"run_{lib.specs[name].fn}")(*(a.ctypes.data_as(ptr) for a in args))
    assert not np.isnan(y).any(), (lib.arch, name, "outputs left unwritten")
    assert lib.hipc_mma_unequal_lanes() == 0, "RDNA3 WMMA operands differ between half-waves"
    # float32 sums of exact products: a wrong fragment, tile edge or scale is O(1)
    assert rel_err(y, want) <= 1e-4, (lib.arch, name, rel_err(y, want))
