"""The Gated DeltaNet kernel (templates/hip/deltanet.hip.j2) alone on a real GPU, against NumPy.

Run with `pytest -m gpu` on the GPU machine (skipped where no GPU is found). Each case renders
the kernel as compiler/kernels/deltanet.py does and runs a sequence of steps on one pair of
states (prefill steps of several tokens and decode steps of one, so the conv window and the
delta-rule matrices carry from step to step), checked by tests/deltanet_cases.py (every
output row NaN-poisoned first, both states, against NumPy in float64; the host test
tests/compiler/test_gpu_deltanet_host.py runs the same cases without a GPU). Cases: grouped and tiled value heads, odd head counts, the
three conv weight types, Qwen3-Next's projections packed per key head, and the Qwen3.5-35B
shape (16 key / 32 value heads of 128) with one lane per state column (the default) and with
two, and dk 256 with the default two lanes and with four.
"""

from __future__ import annotations

import pytest
from deltanet_cases import CASES, LANES, check_steps, params

from hipc.compiler.kernels.deltanet import gpu_kernel
from hipc.compiler.targets import GpuTarget

from gpu_kernels import DeviceKernels

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def kernels():
    specs = {}

    def build(arch):
        for name, case in CASES.items():
            k = gpu_kernel(
                f"dn_{name}", params(case), GpuTarget(arch).wave, [name], LANES.get(name)
            )
            specs[name] = (k.fn, k.threads)
            yield (k.fn, k.template, k.ctx, 0)

    dev = DeviceKernels(lambda arch: list(build(arch)))
    dev.specs = specs
    yield dev
    dev.close()


@pytest.mark.parametrize("name", sorted(CASES))
def test_deltanet_steps_match_numpy(kernels, name):
    check_steps(kernels, name)
