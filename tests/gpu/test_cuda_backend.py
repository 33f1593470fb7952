"""The cuda backend's driver layer on a real NVIDIA GPU (no artifact kernels needed).

Run with `pytest -m gpu` on the GPU machine; skipped unless cuda-bindings imports and
an NVIDIA device answers. What the fake-driver tests (tests/runtime/test_gpu_backends.py)
cannot show: that the calls and return conventions match cuda-bindings and the driver.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from hipc.base.errors import HipcError
from hipc.compiler.options import CompileOptions
from hipc.compiler.pipeline import compile_model
from hipc.runtime.artifact import load_artifact
from hipc.runtime.backends import cuda
from hipc.runtime.backends.gpu_common import DriverError

from support import write_tiny_hf

pytestmark = pytest.mark.gpu

pytest.importorskip("cuda.bindings.driver", reason="cuda-bindings not installed")
ARCH, NAME = cuda.probe()
if ARCH is None:
    pytest.skip(f"no NVIDIA GPU: {NAME}", allow_module_level=True)


@pytest.fixture
def driver():
    d = cuda.CudaDriver(0)
    yield d
    d.close()


def test_device_is_described(driver):
    assert driver.arch == ARCH and ARCH.startswith("sm_")
    assert driver.device_name == NAME and NAME
    assert driver.max_shared_per_block >= 48 * 1024


def test_free_memory_query(driver):
    free, total = driver.mem_info()
    assert 0 < free <= total


def test_alloc_copy_memset_roundtrip(driver):
    n = 1 << 20
    data = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
    dev = driver.malloc(n)
    pinned = driver.host_malloc(n)
    try:
        host = np.frombuffer((ctypes.c_char * n).from_address(pinned), np.uint8)
        driver.h2d(dev, data.ctypes.data, n)  # pageable source, like the weights
        driver.memset0(dev + 4096, 4096)
        driver.d2h(pinned, dev, n)
        driver.synchronize()
        want = data.copy()
        want[4096:8192] = 0
        assert np.array_equal(host, want)
    finally:
        driver.host_free(pinned)
        driver.free(dev)


def test_graph_capture_and_replay(driver):
    n = 1 << 16
    dev = driver.malloc(n)
    out = np.zeros(n, np.uint8)
    try:
        driver.h2d(dev, np.full(n, 7, np.uint8).ctypes.data, n)
        driver.synchronize()
        driver.begin_capture()
        driver.memset0(dev, n // 2)
        graph = driver.end_capture()
        graph_exec = driver.instantiate(graph)
        driver.graph_launch(graph_exec)
        driver.d2h(out.ctypes.data, dev, n)
        driver.synchronize()
        driver.destroy_graph(graph, graph_exec)
        assert (out[: n // 2] == 0).all() and (out[n // 2 :] == 7).all()
    finally:
        driver.free(dev)


def test_out_of_memory_is_recognized(driver):
    _, total = driver.mem_info()
    with pytest.raises(DriverError) as e:
        driver.malloc(total + (1 << 30))
    assert e.value.oom and e.value.error == "CUDA_ERROR_OUT_OF_MEMORY"


def test_bad_code_object(driver):
    with pytest.raises(DriverError, match="cuModuleLoadData"):
        driver.load_module(b"not a fatbin")


def test_missing_arch_names_targets_and_command(tmp_path):
    """A whole, verified artifact compiled for another arch: the backend names this GPU, the
    artifact's targets and the command that would compile for it."""

    other = "sm_80" if ARCH != "sm_80" else "sm_90"
    art = tmp_path / "a.hipc"
    model = write_tiny_hf(tmp_path / "m")
    compile_model(model, art, CompileOptions(max_context=32, targets=(other,)), verbose=False)
    with pytest.raises(HipcError) as e:
        cuda.CudaBackend(load_artifact(art))
    msg = str(e.value)
    assert f"({NAME}, {ARCH})" in msg and f"the artifact has: {other}" in msg
    assert f"hipc compile MODEL --target {ARCH}" in msg
