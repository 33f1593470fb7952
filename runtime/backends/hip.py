"""The hip backend: an artifact's AMD code object through hip-python.

A thin `GpuDriver` adapter over hip-python (`from hip import hip`; the bindings ship
as hip-python / rocm-bindings-hip): the device set current with hipSetDevice, one
non-blocking stream, the module, plain device allocations. Every call returns a
tuple `(hipError_t, *values)`; `_call` turns a non-success result into a DriverError
named after the call. Buffers, launches, graphs and errors are gpu_common's.

Kernel arguments: hipModuleLaunchKernel's `kernelParams` is given as a Python int,
the address of a ctypes `void*[N]` (gpu_common.PackedArgs); hip-python reads an int
as the pointer itself (ListOfPointer/Pointer: "Interprets the integer value as
pointer address"), and `extra` is None. AMD GPUs need no opt-in for dynamic shared
memory (LDS) up to the device limit, so `set_dynamic_shared` is a no-op (gpu_common
checks every launch against the limit).

hip-python changed one signature this adapter uses: hipGetDeviceProperties(props,
device) -> (err,) in 6.x, hipGetDeviceProperties(device) -> (err, props) later; both
are handled. Graphs are instantiated with hipGraphInstantiateWithFlags, which kept
its signature.
"""

from __future__ import annotations

import contextlib
from typing import Any

from hipc.base.errors import HipcError
from hipc.runtime.artifact import Artifact
from hipc.runtime.backends.gpu_common import DriverError, GpuBackend

OUT_OF_MEMORY = 2  # hipErrorOutOfMemory
STREAM_NON_BLOCKING = 1  # hipStreamNonBlocking
EVENT_DISABLE_TIMING = 2  # hipEventDisableTiming


def import_hip():
    try:
        from hip import hip
    except ImportError:
        raise HipcError(
            "the hip target needs hip-python: pip install 'hipc-compiler[rocm]'"
        ) from None
    return hip


def _name(err: Any) -> str:
    return getattr(err, "name", None) or f"hipError_t {int(err)}"


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        value = value.split(b"\0", 1)[0].decode(errors="replace")
    return str(value).strip()


def arch_of(gcn_arch_name: Any) -> str:
    """'gfx942:sramecc+:xnack-' -> 'gfx942'."""
    return _text(gcn_arch_name).split(":", 1)[0]


def device_properties(hip: Any, device: int) -> tuple[Any, Any]:
    """(err, props) with either hip-python signature of hipGetDeviceProperties."""
    try:
        err, props = hip.hipGetDeviceProperties(device)
    except TypeError:  # hip-python 6.x: the caller passes the struct to fill
        props = hip.hipDeviceProp_t()
        (err,) = hip.hipGetDeviceProperties(props, device)
    return err, props


def probe(device: int = 0, hip: Any = None) -> tuple[str | None, str]:
    """(arch, device name) of AMD GPU `device`, or (None, why not)."""
    if hip is None:
        try:
            hip = import_hip()
        except HipcError:
            return None, "hip-python is not installed"
    try:
        (err,) = hip.hipInit(0)
    except Exception as e:  # no libamdhip64: hip-python raises from its loader
        return None, f"no ROCm runtime ({type(e).__name__})"
    if int(err) != 0:
        return None, f"no usable AMD GPU (hipInit: {_name(err)})"
    err, count = hip.hipGetDeviceCount()
    if int(err) != 0 or count <= device:
        return None, "no AMD GPU found" if device == 0 else f"no AMD GPU {device}"
    err, props = device_properties(hip, device)
    if int(err) != 0:
        return None, f"hipGetDeviceProperties: {_name(err)}"
    return arch_of(props.gcnArchName), _text(props.name) or "AMD GPU"


class HipDriver:
    """GpuDriver over hip-python (see gpu_common.GpuDriver)."""

    api = "HIP"
    overlap_launches = False

    def __init__(self, device: int = 0, hip: Any = None) -> None:
        self.hip = hip if hip is not None else import_hip()
        self.device = device
        self._stream: Any = None
        self._module: Any = None
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _call(self, fn: str, *args: Any) -> Any:
        result = getattr(self.hip, fn)(*args)
        err = result[0]
        if int(err) != 0:
            raise DriverError(fn, _name(err), oom=int(err) == OUT_OF_MEMORY)
        return result[1] if len(result) == 2 else result[1:] or None

    def _open(self) -> None:
        c = self._call
        try:
            c("hipInit", 0)
        except DriverError as e:
            raise HipcError(f"HIP: no usable AMD GPU (hipInit: {e.error})") from None
        except Exception as e:
            raise HipcError(f"HIP: no ROCm runtime found ({e})") from None
        count = c("hipGetDeviceCount")
        if not 0 <= self.device < count:
            raise HipcError(f"HIP: no GPU {self.device} (this machine has {count})")
        c("hipSetDevice", self.device)
        err, props = device_properties(self.hip, self.device)
        if int(err) != 0:
            raise DriverError("hipGetDeviceProperties", _name(err))
        self.arch = arch_of(props.gcnArchName)
        self.device_name = _text(props.name) or "AMD GPU"
        self.max_shared_per_block = max(
            int(getattr(props, "sharedMemPerBlock", 0) or 0),
            int(getattr(props, "sharedMemPerBlockOptin", 0) or 0),
        )
        self._stream = c("hipStreamCreateWithFlags", STREAM_NON_BLOCKING)

    def activate(self) -> None:
        self._call("hipSetDevice", self.device)

    def mem_info(self) -> tuple[int, int]:
        free, total = self._call("hipMemGetInfo")
        return int(free), int(total)

    def load_module(self, image: bytes) -> None:
        self._module = self._call("hipModuleLoadData", image)

    def get_function(self, name: str) -> Any:
        return self._call("hipModuleGetFunction", self._module, name.encode())

    def set_dynamic_shared(self, fn: Any, nbytes: int) -> None:
        # no opt-in on AMD: a launch may use LDS up to the device limit, checked by the caller
        pass

    def malloc(self, nbytes: int) -> int:
        return int(self._call("hipMalloc", nbytes))

    def free(self, ptr: int) -> None:
        self._call("hipFree", ptr)

    def host_malloc(self, nbytes: int) -> int:
        return int(self._call("hipHostMalloc", nbytes, 0))  # hipHostMallocDefault

    def host_free(self, ptr: int) -> None:
        self._call("hipHostFree", ptr)

    def memset0(self, ptr: int, nbytes: int) -> None:
        self._call("hipMemsetD8Async", ptr, 0, nbytes, self._stream)

    def h2d(self, dst: int, src: int, nbytes: int) -> None:
        self._call("hipMemcpyHtoDAsync", dst, src, nbytes, self._stream)

    def d2h(self, dst: int, src: int, nbytes: int) -> None:
        self._call("hipMemcpyDtoHAsync", dst, src, nbytes, self._stream)

    def d2d(self, dst: int, src: int, nbytes: int) -> None:
        self._call("hipMemcpyDtoDAsync", dst, src, nbytes, self._stream)

    def launch(self, fn: Any, grid, block, shared: int, params: int, overlap: bool = False) -> None:
        # AMD has no programmatic launch: overlap_launches is False and kernels run in order
        self._call("hipModuleLaunchKernel", fn, *grid, *block, shared, self._stream, params, None)

    def synchronize(self) -> None:
        self._call("hipStreamSynchronize", self._stream)

    def new_event(self) -> Any:
        return self._call("hipEventCreateWithFlags", EVENT_DISABLE_TIMING)

    def record(self, event: Any) -> None:
        self._call("hipEventRecord", event, self._stream)

    def wait(self, event: Any) -> None:
        self._call("hipEventSynchronize", event)

    def destroy_event(self, event: Any) -> None:
        self._call("hipEventDestroy", event)

    def d2d_2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> None:
        kind = self.hip.hipMemcpyKind.hipMemcpyDeviceToDevice
        self._call("hipMemcpy2DAsync", dst, dpitch, src, spitch, width, height, kind, self._stream)

    def tensor_map(self, addr: int, cols: int, rows: int, box_cols: int, box_rows: int) -> Any:
        # only the sm_90 GEMM takes tensor maps; an AMD plan section never binds one
        raise DriverError("tensor_map", "TMA tensor maps are NVIDIA sm_90 only")

    def begin_capture(self) -> None:
        mode = self.hip.hipStreamCaptureMode.hipStreamCaptureModeThreadLocal
        self._call("hipStreamBeginCapture", self._stream, mode)

    def end_capture(self) -> Any:
        return self._call("hipStreamEndCapture", self._stream)

    def instantiate(self, graph: Any) -> Any:
        return self._call("hipGraphInstantiateWithFlags", graph, 0)

    def graph_launch(self, graph_exec: Any) -> None:
        self._call("hipGraphLaunch", graph_exec, self._stream)

    def destroy_graph(self, graph: Any, graph_exec: Any) -> None:
        try:
            if graph_exec is not None:
                self._call("hipGraphExecDestroy", graph_exec)
        finally:
            if graph is not None:
                self._call("hipGraphDestroy", graph)

    def close(self) -> None:
        for fn, handle, attr in (
            ("hipStreamDestroy", self._stream, "_stream"),
            ("hipModuleUnload", self._module, "_module"),
        ):
            if handle is not None:
                setattr(self, attr, None)
                with contextlib.suppress(DriverError):
                    self._call(fn, handle)


class HipBackend(GpuBackend):
    """Runs an artifact's gfx code object on AMD GPU `device` (CpuBackend's surface)."""

    name = "hip"

    def __init__(
        self,
        artifact: Artifact,
        device: int = 0,
        *,
        hip: Any = None,
        max_context: int | None = None,
        kv_blocks: int | None = None,
    ) -> None:
        try:
            driver = HipDriver(device, hip)
        except DriverError as e:
            raise HipcError(f"HIP: {e}") from None
        super().__init__(artifact, driver, max_context, kv_blocks)
