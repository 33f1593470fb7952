"""The GPU Gated DeltaNet kernel (templates/hip/deltanet.hip.j2) run on the host: rendered as
compiler/kernels/deltanet.py renders it, compiled by a plain C++ compiler with HIPC_HOST_SIMT,
each block's threads run in step as fibers of one host thread (tests/host_simt.py), the
key-head blocks one after another.
The cases and their NumPy check are tests/deltanet_cases.py's, which tests/gpu runs on a
device: grouped and tiled value heads, odd head counts, Qwen3-Next's packing, 1, 2 and 4
lanes per state column, for a wave of 32 and of 64.
"""

from __future__ import annotations

import ctypes

import host_simt
import numpy as np
import pytest
from deltanet_cases import (
    CASES,
    CHUNKED,
    LANES,
    check_batch,
    check_forms,
    check_steps,
    chunk_kernels,
    params,
)

from hipc.compiler.codegen.environment import render
from hipc.compiler.kernels.deltanet import (
    CHUNK_GPU,
    GPU,
    chunk_launches,
    gpu_kernel,
    scan_mma_fits,
)

HOST_CASES = [
    "grouped_odd",
    "tiled_bf16",
    "next_packed_f16",
    "one_tap",
    "grouped_two_lanes",
    "dk256",
    "dk256_four_lanes",
]


class HostKernels:
    """tests/gpu_kernels.DeviceKernels' interface over host memory and the compiled kernels."""

    def __init__(self, lib, specs, paths) -> None:
        self.lib, self.specs, self.keep = lib, specs, []
        self.paths = paths  # path -> {name: chunked kernels}; the mma ones at wave 32 only

    def on(self, path: str, name: str):
        """Case `name`'s chunked kernels on `path`: "simt"; "mma" (_solve's products on the
        emulated mma.sync); "mma_scan" (_scan's too)."""
        if name not in self.paths[path]:
            pytest.skip(f"no {path} chunked kernels for {name} at this wave / shape")
        return self.paths[path][name]

    def upload(self, a: np.ndarray) -> int:
        a = np.array(a, copy=True, order="C")
        self.keep.append(a)
        return a.ctypes.data

    def poisoned(self, shape) -> int:
        return self.upload(np.full(shape, np.nan, np.float32))

    def launch(self, name, grid, block, args, shared=0) -> None:
        conv = [ctypes.c_int(v) if k == "i32" else ctypes.c_void_p(v or None) for k, v in args]
        gx, gy = (*grid, 1)[:2]
        getattr(self.lib, f"run_{name}")(gx, gy, block, *conv)

    def read(self, ptr: int, shape, dtype=np.float32) -> np.ndarray:
        out = np.empty(shape, dtype)
        ctypes.memmove(out.ctypes.data, ptr, out.nbytes)
        return out

    def free(self) -> None:
        self.keep = []


def wrapper(fn: str, sig) -> str:
    """run_FN(grid x, grid y, threads, the kernel's arguments): the grid on host threads."""
    names = ", ".join(a.name for a in sig.args)
    return (
        f'extern "C" void run_{fn}(int gx, int gy, int nt, {sig.render(0)}) {{\n'
        f"  grid(gx, gy, nt, [=] {{ {fn}({names}); }});\n}}"
    )


@pytest.fixture(scope="module", params=[32, 64])
def kernels(request, tmp_path_factory):
    wave = request.param
    sources, wrappers, specs = [], [], {}
    paths: dict[str, dict] = {"simt": {}, "mma": {}, "mma_scan": {}}
    emulated = "mma.sync.m16n8k16 bf16, emulated"
    for name in HOST_CASES:
        k = gpu_kernel(f"dn_{name}", params(CASES[name]), wave, [name], LANES.get(name))
        specs[name] = (k.fn, k.threads)
        sources.append(render(f"hip/{k.template}.hip.j2", fn=k.fn, **k.ctx))
        wrappers.append(wrapper(k.fn, GPU))
    for name in CHUNKED:
        if name not in HOST_CASES:
            continue
        for path, mma, scan in (("simt", "", False), ("mma", emulated, False),
                                ("mma_scan", emulated, True)):  # fmt: skip
            p = params(CASES[name], CHUNKED[name][0])
            if mma and (wave != 32 or (scan and not scan_mma_fits(p, mma))):
                continue
            paths[path][name] = k, p = chunk_kernels(name, wave, mma, scan)
            sources.append(render(f"hip/{k.template}.hip.j2", fn=k.fn, **k.ctx))
            wrappers += [wrapper(kernel, CHUNK_GPU) for kernel, _, _ in chunk_launches(p, k)]
    code = "#define __launch_bounds__(n)\n" + "\n".join(sources) + "\n" + "\n".join(wrappers)
    root = tmp_path_factory.mktemp(f"deltanet{wave}")
    lib = host_simt.build(
        root, "deltanet_host", code, wave, "HIPC_MMA_HOST" if wave == 32 else None
    )
    return HostKernels(lib, specs, paths)


@pytest.mark.parametrize("name", HOST_CASES)
def test_deltanet_kernel_on_the_host(kernels, name):
    check_steps(kernels, name)


@pytest.mark.parametrize("name", ["grouped_odd", "next_packed_f16", "dk256"])
def test_rows_of_several_sequences_on_the_host(kernels, name):
    """A step's runs of several sequences (and padding rows) each in its own slot of the
    states: what each sequence's own recurrence gives."""
    check_batch(kernels, name)


PATHS = ["simt", "mma", "mma_scan"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", [n for n in CHUNKED if n in HOST_CASES])
def test_chunked_prefill_on_the_host(kernels, name, path):
    """Steps of a chunk or more through the chunked kernels (SIMT; _solve's products on the
    emulated mma.sync; _scan's too), shorter ones through the serial one, on the same
    states, against the NumPy recurrence."""
    check_steps(kernels, name, kernels.on(path, name))


@pytest.mark.parametrize("path", ["simt", "mma"])
@pytest.mark.parametrize("name", ["grouped_odd", "next_packed_f16"])
def test_one_sequence_in_another_slot_on_the_host(kernels, name, path):
    """One sequence's steps in slot 2 of the pools (the one-sequence view's slot sits past
    the batch's): the serial and the chunked kernels read and write that slot only."""
    check_steps(kernels, name, kernels.on(path, name), slot=2)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("name", "T"), [("grouped_odd", 37), ("next_packed_f16", 16)])
def test_chunked_and_serial_kernels_agree_on_the_host(kernels, name, T, path):
    check_forms(kernels, name, T, kernels.on(path, name))


def test_device_specs_name_each_kernel_once():
    """tests/gpu/test_deltanet_gpu.py compiles every path's kernels into one code object: each
    path (as compiled, SIMT, _solve alone on mma, _scan on it too) needs names of its own."""
    from deltanet_cases import device_specs

    specs, _, paths = device_specs("sm_90")
    names = [fn for fn, *_ in specs]
    assert len(names) == len(set(names))
    assert all(paths[p] for p in ("target", "simt", "mma_solve", "mma_scan"))
