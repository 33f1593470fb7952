"""The cuda backend: an artifact's NVIDIA code object (fatbin) through cuda-bindings.

A thin `GpuDriver` adapter over the CUDA driver API (`from cuda.bindings import
driver as cu`, cuda-bindings 12.x/13.x): the device's primary context, one
non-blocking stream, the module, and plain device allocations. Every call returns
`(CUresult, *values)`; `_call` turns a non-success result into a DriverError named
after the call. Buffers, launches, graphs and errors are gpu_common's.

Kernel arguments: cuLaunchKernel's `kernelParams` is given as a Python int, the
address of a ctypes `void*[N]` whose entries point at ctypes c_uint64/c_int32 values
(gpu_common.PackedArgs). cuda-bindings passes an int through as the `void**` itself
(cuda/bindings/_lib/utils.pxi, _HelperKernelParams: "user gave us an already
configured void** address"); `extra` is 0.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from typing import Any

from hipc.base.errors import HipcError
from hipc.runtime.artifact import Artifact
from hipc.runtime.backends.gpu_common import DriverError, GpuBackend

OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY
OVERLAP_ENV = "HIPC_OVERLAP_LAUNCHES"  # "0": launch every kernel after the previous one ends


# cuda.h: CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B
_TMAP_BF16, _TMAP_SWIZZLE_128B, _TMAP_L2_256B = 9, 3, 3


class _TensorMap(ctypes.Structure):
    _fields_ = [("opaque", ctypes.c_uint64 * 16)]  # CUtensorMap: 128 bytes, 64-byte aligned


def import_driver():
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        raise HipcError(
            "the cuda target needs cuda-bindings: pip install 'hipc-compiler[cuda]'"
        ) from None
    return cu


def _name(err: Any) -> str:
    return getattr(err, "name", None) or f"CUresult {int(err)}"


def probe(device: int = 0, cu: Any = None) -> tuple[str | None, str]:
    """(arch, device name) of NVIDIA GPU `device`, or (None, why not). Creates no context."""
    if cu is None:
        try:
            cu = import_driver()
        except HipcError:
            return None, "cuda-bindings is not installed"
    try:
        (err,) = cu.cuInit(0)
    except Exception as e:  # no libcuda: cuda-bindings raises from its loader
        return None, f"no NVIDIA driver ({type(e).__name__})"
    if int(err) != 0:
        return None, f"no usable NVIDIA GPU (cuInit: {_name(err)})"
    err, count = cu.cuDeviceGetCount()
    if int(err) != 0 or count <= device:
        return None, "no NVIDIA GPU found" if device == 0 else f"no NVIDIA GPU {device}"
    err, dev = cu.cuDeviceGet(device)
    A = cu.CUdevice_attribute
    _, major = cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
    _, minor = cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
    _, name = cu.cuDeviceGetName(256, dev)
    return f"sm_{major}{minor}", _decode(name)


def _decode(name: Any) -> str:
    if isinstance(name, bytes):
        name = name.split(b"\0", 1)[0].decode(errors="replace")
    return str(name).strip() or "NVIDIA GPU"


class CudaDriver:
    """GpuDriver over cuda-bindings' driver API (see gpu_common.GpuDriver)."""

    api = "CUDA"

    def __init__(self, device: int = 0, cu: Any = None) -> None:
        self.cu = cu if cu is not None else import_driver()
        self.device = device
        self._dev: Any = None
        self._ctx: Any = None
        self._stream: Any = None
        self._module: Any = None
        self._libcuda: Any = None
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _call(self, fn: str, *args: Any) -> Any:
        result = getattr(self.cu, fn)(*args)
        err = result[0]
        if int(err) != 0:
            raise DriverError(fn, _name(err), oom=int(err) == OUT_OF_MEMORY)
        return result[1] if len(result) == 2 else result[1:] or None

    def _open(self) -> None:
        cu, c = self.cu, self._call
        try:
            c("cuInit", 0)
        except DriverError as e:
            raise HipcError(f"CUDA: no usable NVIDIA GPU (cuInit: {e.error})") from None
        except Exception as e:
            raise HipcError(f"CUDA: no NVIDIA driver found ({e})") from None
        count = c("cuDeviceGetCount")
        if not 0 <= self.device < count:
            raise HipcError(f"CUDA: no GPU {self.device} (this machine has {count})")
        self._dev = dev = c("cuDeviceGet", self.device)
        A = cu.CUdevice_attribute
        major = c("cuDeviceGetAttribute", A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
        minor = c("cuDeviceGetAttribute", A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
        self.arch = f"sm_{major}{minor}"
        self.device_name = _decode(c("cuDeviceGetName", 256, dev))
        self.max_shared_per_block = int(
            c("cuDeviceGetAttribute", A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev)
        )
        self._ctx = c("cuDevicePrimaryCtxRetain", dev)
        c("cuCtxSetCurrent", self._ctx)
        self._stream = c("cuStreamCreate", int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
        # kernels compiled for sm_90+ wait in-kernel, so they may be launched to overlap
        self.overlap_launches = major >= 9 and os.environ.get(OVERLAP_ENV, "1") != "0"
        if self.overlap_launches:
            attr = cu.CUlaunchAttribute()
            attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            self._overlap_attr = attr

    def activate(self) -> None:
        self._call("cuCtxSetCurrent", self._ctx)

    def mem_info(self) -> tuple[int, int]:
        free, total = self._call("cuMemGetInfo")
        return int(free), int(total)

    def load_module(self, image: bytes) -> None:
        self._module = self._call("cuModuleLoadData", image)

    def get_function(self, name: str) -> Any:
        return self._call("cuModuleGetFunction", self._module, name.encode())

    def set_dynamic_shared(self, fn: Any, nbytes: int) -> None:
        attr = self.cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        self._call("cuFuncSetAttribute", fn, attr, nbytes)

    def malloc(self, nbytes: int) -> int:
        return int(self._call("cuMemAlloc", nbytes))

    def free(self, ptr: int) -> None:
        self._call("cuMemFree", ptr)

    def host_malloc(self, nbytes: int) -> int:
        return int(self._call("cuMemAllocHost", nbytes))

    def host_free(self, ptr: int) -> None:
        self._call("cuMemFreeHost", ptr)

    def memset0(self, ptr: int, nbytes: int) -> None:
        # on our stream: a non-blocking stream does not wait for the legacy default stream
        self._call("cuMemsetD8Async", ptr, 0, nbytes, self._stream)

    def h2d(self, dst: int, src: int, nbytes: int) -> None:
        self._call("cuMemcpyHtoDAsync", dst, src, nbytes, self._stream)

    def d2h(self, dst: int, src: int, nbytes: int) -> None:
        self._call("cuMemcpyDtoHAsync", dst, src, nbytes, self._stream)

    def d2d(self, dst: int, src: int, nbytes: int) -> None:
        self._call("cuMemcpyDtoDAsync", dst, src, nbytes, self._stream)

    def launch(self, fn: Any, grid, block, shared: int, params: int, overlap: bool = False) -> None:
        if not overlap:
            self._call("cuLaunchKernel", fn, *grid, *block, shared, self._stream, params, 0)
            return
        # programmatic dependent launch: the kernel may be scheduled while the previous
        # one finishes; it waits in-kernel (griddepcontrol.wait) before using its results
        cfg = self.cu.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block
        cfg.sharedMemBytes = shared
        cfg.hStream = self._stream
        cfg.attrs = [self._overlap_attr]
        cfg.numAttrs = 1
        self._call("cuLaunchKernelEx", cfg, fn, params, 0)

    def tensor_map(self, addr: int, cols: int, rows: int, box_cols: int, box_rows: int) -> Any:
        # through libcuda itself: cuda-bindings' CUtensorMap would need its own packing, and the
        # kernel argument is just the 128 bytes the driver writes
        if self._libcuda is None:
            self._libcuda = ctypes.CDLL("libcuda.so.1")
        raw = (ctypes.c_uint8 * 256)()  # the driver wants the map 64-byte aligned
        buf = _TensorMap.from_address(-(-ctypes.addressof(raw) // 64) * 64)
        buf.keep = raw
        dims = (ctypes.c_uint64 * 2)(cols, rows)
        strides = (ctypes.c_uint64 * 1)(cols * 2)
        box = (ctypes.c_uint32 * 2)(box_cols, box_rows)
        one = (ctypes.c_uint32 * 2)(1, 1)
        err = self._libcuda.cuTensorMapEncodeTiled(
            ctypes.byref(buf), _TMAP_BF16, 2, ctypes.c_void_p(addr), dims, strides, box, one,
            0, _TMAP_SWIZZLE_128B, _TMAP_L2_256B, 0,
        )  # fmt: skip
        if err != 0:
            raise DriverError(
                f"cuTensorMapEncodeTiled({cols}x{rows} at {addr:#x}, box {box_cols}x{box_rows})",
                f"error {err}",
            )
        return buf

    def synchronize(self) -> None:
        self._call("cuStreamSynchronize", self._stream)

    def new_event(self) -> Any:
        return self._call("cuEventCreate", int(self.cu.CUevent_flags.CU_EVENT_DISABLE_TIMING))

    def record(self, event: Any) -> None:
        self._call("cuEventRecord", event, self._stream)

    def wait(self, event: Any) -> None:
        self._call("cuEventSynchronize", event)

    def destroy_event(self, event: Any) -> None:
        self._call("cuEventDestroy", event)

    def d2d_2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> None:
        c = self.cu.CUDA_MEMCPY2D()
        c.srcMemoryType = c.dstMemoryType = self.cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
        c.srcDevice, c.srcPitch, c.dstDevice, c.dstPitch = src, spitch, dst, dpitch
        c.WidthInBytes, c.Height = width, height
        self._call("cuMemcpy2DAsync", c, self._stream)

    def begin_capture(self) -> None:
        mode = self.cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        self._call("cuStreamBeginCapture", self._stream, mode)

    def end_capture(self) -> Any:
        return self._call("cuStreamEndCapture", self._stream)

    def instantiate(self, graph: Any) -> Any:
        return self._call("cuGraphInstantiate", graph, 0)

    def graph_launch(self, graph_exec: Any) -> None:
        self._call("cuGraphLaunch", graph_exec, self._stream)

    def destroy_graph(self, graph: Any, graph_exec: Any) -> None:
        try:
            if graph_exec is not None:
                self._call("cuGraphExecDestroy", graph_exec)
        finally:
            if graph is not None:
                self._call("cuGraphDestroy", graph)

    def close(self) -> None:
        for fn, handle, attr in (
            ("cuStreamDestroy", self._stream, "_stream"),
            ("cuModuleUnload", self._module, "_module"),
        ):
            if handle is not None:
                setattr(self, attr, None)
                with contextlib.suppress(DriverError):
                    self._call(fn, handle)
        if self._ctx is not None:
            self._ctx = None
            with contextlib.suppress(DriverError):
                self._call("cuDevicePrimaryCtxRelease", self._dev)


class CudaBackend(GpuBackend):
    """Runs an artifact's sm_XX code object on NVIDIA GPU `device` (CpuBackend's surface)."""

    name = "cuda"

    def __init__(
        self,
        artifact: Artifact,
        device: int = 0,
        *,
        cu: Any = None,
        max_context: int | None = None,
        kv_blocks: int | None = None,
    ) -> None:
        try:
            driver = CudaDriver(device, cu)
        except DriverError as e:
            raise HipcError(f"CUDA: {e}") from None
        super().__init__(artifact, driver, max_context, kv_blocks)
