"""Single kernels on a real GPU, without a model or a plan (tests/gpu).

`DeviceKernels` opens the first GPU found (cuda, else hip; the test is skipped with
neither), builds the rendered kernels into one code object with the arch's toolchain, and
launches them through the backends' driver layer with gpu_common.PackedArgs, the way the
runtime does. Buffers it uploads are freed by `free()`.
"""

from __future__ import annotations

import numpy as np
import pytest

from hipc.base.version import HIPC_VERSION
from hipc.compiler.codegen.environment import render
from hipc.compiler.codegen.hip import program_source
from hipc.compiler.toolchains.gpu import gpu_toolchain
from hipc.runtime.backends import cuda, hip
from hipc.runtime.backends.gpu_common import DEFAULT_SHARED_LIMIT, PackedArgs

POISON = np.float32(np.nan)  # outputs start as NaN: a value a kernel forgot to write shows


def open_driver():
    if cuda.probe()[0]:
        return cuda.CudaDriver(0)
    if hip.probe()[0]:
        return hip.HipDriver(0)
    pytest.skip("no GPU")


class DeviceKernels:
    def __init__(self, build) -> None:
        """`build(arch)` -> [(fn, template, ctx, dynamic shared bytes)] to compile."""
        self.d = open_driver()
        self.arch = self.d.arch
        specs = build(self.arch)
        sources = [render(f"hip/{t}.hip.j2", fn=fn, **ctx) for fn, t, ctx, _ in specs]
        source = program_source("kernel_test", HIPC_VERSION, self.arch, sources)
        self.d.load_module(gpu_toolchain(self.arch).compile(source))
        self.fns = {}
        for fn, _, _, shared in specs:
            self.fns[fn] = f = self.d.get_function(fn)
            if shared > DEFAULT_SHARED_LIMIT:
                self.d.set_dynamic_shared(f, shared)
        self.allocs: list[int] = []

    def function(self, name: str):
        if name not in self.fns:
            self.fns[name] = self.d.get_function(name)
        return self.fns[name]

    def upload(self, a: np.ndarray) -> int:
        a = np.ascontiguousarray(a)
        ptr = self.d.malloc(max(a.nbytes, 4))
        self.allocs.append(ptr)
        self.d.h2d(ptr, a.ctypes.data, a.nbytes)
        return ptr

    def poisoned(self, shape) -> int:
        return self.upload(np.full(shape, POISON, np.float32))

    def launch(self, name: str, grid, block: int, args: list[tuple[str, int]], shared: int = 0):
        grid = tuple(grid) + (1,) * (3 - len(grid))
        packed = PackedArgs(args)
        self.d.launch(self.function(name), grid, (block, 1, 1), shared, packed.address)

    def read(self, ptr: int, shape, dtype=np.float32) -> np.ndarray:
        out = np.empty(shape, dtype)
        self.d.d2h(out.ctypes.data, ptr, out.nbytes)
        self.d.synchronize()
        return out

    def free(self) -> None:
        for ptr in self.allocs:
            self.d.free(ptr)
        self.allocs = []

    def close(self) -> None:
        self.free()
        self.d.close()
