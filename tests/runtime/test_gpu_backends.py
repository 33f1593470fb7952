"""The cuda and hip backends on a fake GPU (runs anywhere, no GPU or bindings needed).

`FakeGpu` emulates what the backends rely on: device allocations backed by bytearrays,
pinned host buffers, copies, a module whose "code object" is JSON naming each
kernel's parameter types, launches that decode `kernelParams` exactly as a driver
does and run a Python model of the kernel, stream capture into graphs (argument
values copied at capture), and injected errors (at a call, at a launch, or
asynchronously at the next synchronize, sticky or not). `FakeCu` and `FakeHip` put it
behind cuda-bindings' and hip-python's calling conventions: functions returning
`(error enum, *values)`. Every test runs against both backends.

The toy plan: embed (ids -> x rows), addpos (x += pos[t], written to the KV pool's slot of
that position through the row's block table), head (logits = x[last rows] @ W.T through a
row_skip arena argument), and in prefill a kernel asking for 64 KiB of dynamic shared
memory (not in the batch list: which list ran shows).
"""

from __future__ import annotations

import ctypes
import enum
import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from hipc.base.errors import HipcError
from hipc.base.launch_plan import LAUNCH_PLAN_FORMAT, LAUNCH_PLAN_VERSION, Bases, Launch
from hipc.base.safetensors_file import LazyTensor, write_safetensors
from hipc.base.version import ARTIFACT_FORMAT_VERSION
from hipc.runtime import engine as engine_mod
from hipc.runtime.artifact import load_artifact
from hipc.runtime.backends import cuda as cuda_mod
from hipc.runtime.backends import gpu_common
from hipc.runtime.backends import hip as hip_mod
from hipc.runtime.backends.cuda import CudaBackend
from hipc.runtime.backends.gpu_common import PackedArgs, aligned_offsets
from hipc.runtime.backends.hip import HipBackend

import batch_runs

V, H, MAX_TOKENS, MAX_CTX, KV_BLOCK = 5, 4, 4, 64, 16
KV_TABLE = MAX_CTX // KV_BLOCK
SIGNATURES = {
    "embed": ["u64", "u64", "u64", "i32"],
    "addpos": ["u64", "u64", "u64", "u64", "i32", "u64"],
    "head": ["u64", "u64", "u64", "i32", "i32"],
    "big": ["u64", "i32"],
    "recur": ["u64", "i32", "u64", "u64", "u64"],
    "topk": ["u64", "i32", "i32", "u64", "u64", "u64"],
    "topk_greedy": ["u64", "i32", "u64", "u64", "u64", "u64", "u64"],
    "topk_pick": ["u64", "i32", "u64", "u64", "u64", "u64", "u64", "u64"],
    "topk_split": ["u64", "i32", "i32", "u64", "u64", "u64", "u64", "u64"],
}
OOM, INVALID_VALUE, INVALID_IMAGE, NOT_FOUND, ILLEGAL_ADDRESS, OUT_OF_RESOURCES = (
    2,
    1,
    200,
    500,
    700,
    701,
)


# -- the fake GPU ---------------------------------------------------------------------


class FakeGpu:
    def __init__(self, *, free=1 << 30, total=2 << 30, sm=(9, 0), gcn="gfx942:sramecc+:xnack-"):
        self.free_bytes, self.total_bytes = free, total
        self.sm, self.gcn = sm, gcn
        self.max_shared = 227 * 1024
        self.calls: list[tuple] = []
        self.mem: dict[int, bytearray] = {}
        self.freed: list[int] = []
        self.host: dict[int, ctypes.Array] = {}
        self.host_freed: list[int] = []
        self.next_ptr = 0x7F00_0000_0000
        self.signatures: dict[str, list[str]] = {}
        self.executed: list[tuple] = []  # (kernel, grid, block, shared, args, via)
        self.capturing: list | None = None
        self.graphs: dict[int, list] = {}
        self.execs: dict[int, list] = {}
        self.fail_call: dict[str, int] = {}  # call name -> error code, once
        self.fail_kernel: tuple | None = None  # (kernel, code, "launch"|"exec", sticky)
        self.pending = 0
        self.overlapped: list[str] = []  # kernels launched with programmatic overlap
        self.sticky = 0
        self.context_refs = 0
        self.shared_attr: dict[str, int] = {}

    # helpers for the facades
    def enter(self, name: str, *args) -> int:
        self.calls.append((name, *args))
        if self.sticky and name not in ("init", "count", "props"):
            return self.sticky
        return self.fail_call.pop(name, 0)

    def find(self, ptr: int) -> tuple[bytearray, int]:
        for base, buf in self.mem.items():
            if base <= ptr < base + len(buf):
                return buf, ptr - base
        raise AssertionError(f"fake GPU: {ptr:#x} is not device memory")

    def view(self, ptr: int, dtype, count: int) -> np.ndarray:
        buf, off = self.find(ptr)
        return np.frombuffer(buf, dtype=dtype, count=count, offset=off)

    # operations: each returns an error code (0 = success) and values
    def malloc(self, n: int):
        if (e := self.enter("malloc", n)) or n > self.free_bytes:
            return e or OOM, 0
        ptr = self.next_ptr
        self.next_ptr += -(-n // 4096) * 4096 + 4096
        self.mem[ptr] = bytearray(n)
        self.free_bytes -= n
        return 0, ptr

    def free(self, ptr: int) -> int:
        if e := self.enter("free", ptr):
            return e
        if ptr not in self.mem:
            return INVALID_VALUE
        self.free_bytes += len(self.mem.pop(ptr))
        self.freed.append(ptr)
        return 0

    def host_malloc(self, n: int):
        if e := self.enter("host_malloc", n):
            return e, 0
        buf = ctypes.create_string_buffer(n)
        self.host[ctypes.addressof(buf)] = buf
        return 0, ctypes.addressof(buf)

    def host_free(self, ptr: int) -> int:
        if e := self.enter("host_free", ptr):
            return e
        if ptr not in self.host:
            return INVALID_VALUE
        self.host_freed.append(ptr)  # keep the buffer alive: a use after free reads zeros
        return 0

    def memset(self, ptr: int, value: int, n: int) -> int:
        if e := self.enter("memset", ptr, value, n):
            return e
        buf, off = self.find(ptr)
        buf[off : off + n] = bytes([value]) * n
        return 0

    def h2d(self, dst: int, src: int, n: int) -> int:
        if e := self.enter("h2d", dst, src, n):
            return e
        buf, off = self.find(dst)
        assert off + n <= len(buf), "h2d past the end of an allocation"
        buf[off : off + n] = ctypes.string_at(src, n)
        return 0

    def d2h(self, dst: int, src: int, n: int) -> int:
        if e := self.enter("d2h", dst, src, n):
            return e
        buf, off = self.find(src)
        assert off + n <= len(buf), "d2h past the end of an allocation"
        ctypes.memmove(dst, bytes(buf[off : off + n]), n)
        return 0

    def d2d(self, dst: int, src: int, n: int) -> int:
        if e := self.enter("d2d", dst, src, n):
            return e
        dbuf, doff = self.find(dst)
        sbuf, soff = self.find(src)
        assert doff + n <= len(dbuf) and soff + n <= len(sbuf), "d2d past an allocation's end"
        dbuf[doff : doff + n] = bytes(sbuf[soff : soff + n])
        return 0

    def d2d_2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int):
        if e := self.enter("d2d_2d", dst, dpitch, src, spitch, width, height):
            return e
        for r in range(height):
            dbuf, doff = self.find(dst + r * dpitch)
            sbuf, soff = self.find(src + r * spitch)
            dbuf[doff : doff + width] = bytes(sbuf[soff : soff + width])
        return 0

    # events: the fake runs every operation as it is queued, so waiting for one is the
    # stream's synchronize (the pending error of a failed kernel comes back there)
    def event_create(self):
        if e := self.enter("event_create"):
            return e, None
        self.events = getattr(self, "events", 0) + 1
        return 0, f"event{self.events}"

    def load_module(self, image: bytes):
        if e := self.enter("load_module", len(image)):
            return e, None
        try:
            self.signatures = json.loads(image)["kernels"]
        except (ValueError, KeyError):
            return INVALID_IMAGE, None
        return 0, object()

    def get_function(self, name: str):
        if e := self.enter("get_function", name):
            return e, None
        if name not in self.signatures:
            return NOT_FOUND, None
        return 0, FakeFunction(name)

    def launch(self, fn, grid, block, shared, params: int) -> int:
        if e := self.enter("launch", fn.name, grid, block, shared):
            return e
        sig = self.signatures[fn.name]
        args = []
        for i, t in enumerate(sig):  # what a driver does with kernelParams
            p = ctypes.c_void_p.from_address(params + 8 * i).value
            c = ctypes.c_uint64 if t == "u64" else ctypes.c_int32
            args.append(c.from_address(p).value)
        if self.fail_kernel and self.fail_kernel[0] == fn.name and self.fail_kernel[2] == "launch":
            return self.fail_kernel[1]
        rec = (fn.name, tuple(grid), tuple(block), shared, tuple(args))
        if self.capturing is not None:
            self.capturing.append(rec)
        else:
            self.execute(rec, "eager")
        return 0

    def execute(self, rec, via: str) -> None:
        name, grid, _block, _shared, args = rec
        self.executed.append((*rec, via))
        if self.fail_kernel and self.fail_kernel[0] == name and self.fail_kernel[2] == "exec":
            code, sticky = self.fail_kernel[1], self.fail_kernel[3]
            if sticky:
                self.sticky = code
            else:
                self.pending = code
            return
        KERNELS[name](self, *args, grid=grid)

    def synchronize(self) -> int:
        if e := self.enter("sync"):
            return e
        code, self.pending = self.pending, 0
        return code

    def begin_capture(self) -> int:
        if e := self.enter("begin_capture"):
            return e
        assert self.capturing is None
        self.capturing = []
        return 0

    def end_capture(self):
        e = self.enter("end_capture")
        recs, self.capturing = self.capturing, None
        if e:
            return e, None
        gid = 1000 + len(self.graphs)
        self.graphs[gid] = recs
        return 0, gid

    def instantiate(self, graph):
        if e := self.enter("instantiate", graph):
            return e, None
        xid = 2000 + len(self.execs)
        self.execs[xid] = self.graphs[graph]
        return 0, xid

    def graph_launch(self, graph_exec) -> int:
        if e := self.enter("graph_launch", graph_exec):
            return e
        for rec in self.execs[graph_exec]:
            self.execute(rec, "graph")
        return 0

    def destroy(self, what: str, handle) -> int:
        if e := self.enter(what, handle):
            return e
        table = self.execs if what == "exec_destroy" else self.graphs
        return 0 if table.pop(handle, None) is not None else INVALID_VALUE

    def simple(self, name: str, *args) -> int:
        return self.enter(name, *args)

    def count(self, name: str) -> int:
        return sum(1 for c in self.calls if c[0] == name)


class FakeFunction:
    def __init__(self, name: str) -> None:
        self.name = name


# Python models of the toy kernels, on fake device memory
def k_embed(gpu, ids, emb, x, T, grid):
    assert grid == (T, 1, 1)
    tok = gpu.view(ids, np.int64, T)
    table = gpu.view(emb, np.float32, V * H).reshape(V, H)
    gpu.view(x, np.float32, T * H)[:] = table[tok].reshape(-1)


def k_addpos(gpu, x, pos, seq, blocks, T, kv, grid):
    assert grid == (-(-T // 2), 1, 1)  # cdiv(T,2)
    p = gpu.view(pos, np.int32, T).astype(np.int64)
    sq = gpu.view(seq, np.int32, T)
    buf, off = gpu.find(blocks)
    tables = np.frombuffer(buf, np.int32, (len(buf) - off) // 4, off).reshape(-1, KV_TABLE)
    xs = gpu.view(x, np.float32, T * H).reshape(T, H)
    xs += p[:, None].astype(np.float32)
    buf, off = gpu.find(kv)
    pool = np.frombuffer(buf, np.float32, (len(buf) - off) // 4, off).reshape(-1, H)
    slots = tables[sq, p // KV_BLOCK] * KV_BLOCK + p % KV_BLOCK
    assert slots.max() < len(pool), "a KV write past the pool"
    pool[slots] = xs


def k_head(gpu, x_rows, w, logits, rows, two, grid):
    assert two == 2 and grid == (V, rows, 1)
    xs = gpu.view(x_rows, np.float32, rows * H).reshape(rows, H)
    wm = gpu.view(w, np.float32, V * H).reshape(V, H)
    gpu.view(logits, np.float32, rows * V)[:] = (xs @ wm.T).reshape(-1)


def k_big(gpu, scratch, seven, grid):
    assert seven == 7


def k_recur(gpu, x, T, rec, pos, seq, grid):
    """A recurrent state in slot seq[t] of its pool: rec = rec / 2 + x[t], then x[t] = rec,
    token after token."""
    assert grid == (1, T, 1)
    xs = gpu.view(x, np.float32, T * H).reshape(T, H)
    sq = gpu.view(seq, np.int32, T)
    buf, off = gpu.find(rec)
    pool = np.frombuffer(buf, np.float32, (len(buf) - off) // 4, off).reshape(-1, H)
    assert sq.max() < len(pool), "a recurrent slot past the pool"
    for t in range(T):
        r = pool[sq[t]]
        r[:] = r / 2 + xs[t]
        xs[t] = r


def k_topk(gpu, logits, vocab, k, vals, ids, stats, grid):
    """The row top-k kernel's contract: k per row, largest first, ties by lower id."""
    rows = grid[0]
    x = gpu.view(logits, np.float32, rows * vocab).reshape(rows, vocab)
    order = np.argsort(-x, axis=1, kind="stable")[:, :k]
    gpu.view(vals, np.float32, rows * k)[:] = np.take_along_axis(x, order, 1).reshape(-1)
    gpu.view(ids, np.int32, rows * k)[:] = order.reshape(-1)
    m = x.max(axis=1)
    s = np.exp(x - m[:, None]).sum(axis=1)
    gpu.view(stats, np.float32, 2 * rows)[:] = np.stack([m, s], 1).reshape(-1)


def k_topk_greedy(gpu, logits, vocab, vals, ids, stats, parts, counters, grid):
    """The greedy kernel's contract: k_topk's for k = 1 on grid (blocks, rows), 4 words of
    partials a block and a counter a row, zero before (the load's memset, or the last launch's
    reset) and after."""
    G, rows = grid[0], grid[1]
    gpu.view(parts, np.float32, rows * G * 4)[:] = np.nan  # in bounds, or this raises
    assert not gpu.view(counters, np.uint32, rows).any(), "a counter not reset"
    k_topk(gpu, logits, vocab, 1, vals, ids, stats, (rows, 1, 1))


def k_topk_pick(gpu, logits, vocab, vals, ids, stats, parts, counters, draw, grid):
    """The pick kernel's contract: k_topk_greedy's with 5 words of partials a block, and each
    row's draw (1 / temperature, u): 0 keeps the greedy pick, else the token the host sampler's
    inverse_cdf draws by u from exp((logits - max) / temperature)."""
    from hipc.runtime.sampler import inverse_cdf

    G, rows = grid[0], grid[1]
    gpu.view(parts, np.float32, rows * G * 5)[:] = np.nan
    assert not gpu.view(counters, np.uint32, rows).any(), "a counter not reset"
    k_topk(gpu, logits, vocab, 1, vals, ids, stats, (rows, 1, 1))
    x = gpu.view(logits, np.float32, rows * vocab).reshape(rows, vocab)
    d = gpu.view(draw, np.float32, 2 * rows).reshape(rows, 2)
    for r in range(rows):
        if d[r, 0] > 0:
            w = np.exp((x[r].astype(np.float64) - x[r].max()) * float(d[r, 0]))
            i = inverse_cdf(w, float(d[r, 1]))
            gpu.view(ids, np.int32, rows)[r], gpu.view(vals, np.float32, rows)[r] = i, x[r, i]


def k_topk_split(gpu, logits, vocab, k, vals, ids, stats, parts, counters, grid):
    """The several-block top-k's contract: k_topk's on grid (blocks, rows), 2 k + 2 words of
    partials a block, the counters as k_topk_greedy's."""
    G, rows = grid[0], grid[1]
    gpu.view(parts, np.float32, rows * G * (2 * k + 2))[:] = np.nan
    assert not gpu.view(counters, np.uint32, rows).any(), "a counter not reset"
    k_topk(gpu, logits, vocab, k, vals, ids, stats, (rows, 1, 1))


KERNELS = {"embed": k_embed, "addpos": k_addpos, "head": k_head, "big": k_big, "recur": k_recur,
           "topk": k_topk, "topk_greedy": k_topk_greedy, "topk_pick": k_topk_pick,
           "topk_split": k_topk_split}  # fmt: skip


class FakeCu:
    """cuda-bindings' driver module, as far as CudaDriver uses it."""

    class CUresult(enum.IntEnum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_INVALID_VALUE = 1
        CUDA_ERROR_OUT_OF_MEMORY = 2
        CUDA_ERROR_INVALID_IMAGE = 200
        CUDA_ERROR_NOT_FOUND = 500
        CUDA_ERROR_ILLEGAL_ADDRESS = 700
        CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701

    class CUdevice_attribute(enum.IntEnum):
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
        CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97

    class CUfunction_attribute(enum.IntEnum):
        CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8

    class CUstream_flags(enum.IntEnum):
        CU_STREAM_NON_BLOCKING = 1

    class CUstreamCaptureMode(enum.IntEnum):
        CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1

    class CUlaunchAttributeID(enum.IntEnum):
        CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6

    class CUlaunchAttribute:
        def __init__(self) -> None:
            self.id = None
            self.value = SimpleNamespace(programmaticStreamSerializationAllowed=0)

    class CUlaunchConfig:
        def __init__(self) -> None:
            self.attrs: list = []
            self.numAttrs = 0

    class CUevent_flags(enum.IntEnum):
        CU_EVENT_DISABLE_TIMING = 2

    class CUmemorytype(enum.IntEnum):
        CU_MEMORYTYPE_DEVICE = 2

    class CUDA_MEMCPY2D:
        pass

    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu

    def _r(self, code, *values):
        return (self.CUresult(code), *values)

    def cuInit(self, flags):
        return self._r(self.gpu.simple("init"))

    def cuDeviceGetCount(self):
        return self._r(self.gpu.simple("count"), 1)

    def cuDeviceGet(self, ordinal):
        return self._r(self.gpu.simple("device_get"), ordinal)

    def cuDeviceGetAttribute(self, attr, dev):
        A = self.CUdevice_attribute
        value = {
            A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: self.gpu.sm[0],
            A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: self.gpu.sm[1],
            A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: self.gpu.max_shared,
        }[attr]
        return self._r(self.gpu.simple("props"), value)

    def cuDeviceGetName(self, length, dev):
        return self._r(0, b"Fake H200\0\0\0")

    def cuDevicePrimaryCtxRetain(self, dev):
        self.gpu.context_refs += 1
        return self._r(self.gpu.simple("ctx_retain"), "ctx")

    def cuDevicePrimaryCtxRelease(self, dev):
        self.gpu.context_refs -= 1
        return self._r(self.gpu.simple("ctx_release"))

    def cuCtxSetCurrent(self, ctx):
        return self._r(self.gpu.simple("set_current", ctx))

    def cuStreamCreate(self, flags):
        assert flags == 1
        return self._r(self.gpu.simple("stream_create"), "stream")

    def cuStreamDestroy(self, stream):
        return self._r(self.gpu.simple("stream_destroy", stream))

    def cuMemGetInfo(self):
        return self._r(self.gpu.simple("mem_info"), self.gpu.free_bytes, self.gpu.total_bytes)

    def cuModuleLoadData(self, image):
        return self._r(*self.gpu.load_module(bytes(image)))

    def cuModuleUnload(self, module):
        return self._r(self.gpu.simple("module_unload"))

    def cuModuleGetFunction(self, module, name):
        return self._r(*self.gpu.get_function(name.decode()))

    def cuFuncSetAttribute(self, fn, attr, value):
        assert attr == self.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        self.gpu.shared_attr[fn.name] = value
        return self._r(self.gpu.simple("func_set_attribute", fn.name, value))

    def cuMemAlloc(self, n):
        return self._r(*self.gpu.malloc(n))

    def cuMemFree(self, ptr):
        return self._r(self.gpu.free(ptr))

    def cuMemAllocHost(self, n):
        return self._r(*self.gpu.host_malloc(n))

    def cuMemFreeHost(self, ptr):
        return self._r(self.gpu.host_free(ptr))

    def cuMemsetD8Async(self, ptr, value, n, stream):
        return self._r(self.gpu.memset(ptr, value, n))

    def cuMemcpyHtoDAsync(self, dst, src, n, stream):
        return self._r(self.gpu.h2d(dst, src, n))

    def cuMemcpyDtoHAsync(self, dst, src, n, stream):
        return self._r(self.gpu.d2h(dst, src, n))

    def cuMemcpyDtoDAsync(self, dst, src, n, stream):
        assert stream == "stream"
        return self._r(self.gpu.d2d(dst, src, n))

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        assert extra == 0 and stream == "stream"
        return self._r(self.gpu.launch(fn, (gx, gy, gz), (bx, by, bz), shared, params))

    def cuLaunchKernelEx(self, cfg, fn, params, extra):
        assert extra == 0 and cfg.hStream == "stream" and cfg.numAttrs == len(cfg.attrs) == 1
        (attr,) = cfg.attrs
        assert (
            attr.id
            == self.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        )
        assert attr.value.programmaticStreamSerializationAllowed == 1
        self.gpu.overlapped.append(fn.name)
        grid = (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ)
        block = (cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ)
        return self._r(self.gpu.launch(fn, grid, block, cfg.sharedMemBytes, params))

    def cuStreamSynchronize(self, stream):
        return self._r(self.gpu.synchronize())

    def cuEventCreate(self, flags):
        assert flags == self.CUevent_flags.CU_EVENT_DISABLE_TIMING
        return self._r(*self.gpu.event_create())

    def cuEventRecord(self, event, stream):
        assert stream == "stream"
        return self._r(self.gpu.simple("event_record", event))

    def cuEventSynchronize(self, event):
        return self._r(self.gpu.synchronize())

    def cuEventDestroy(self, event):
        return self._r(self.gpu.simple("event_destroy", event))

    def cuMemcpy2DAsync(self, c, stream):
        assert stream == "stream"
        D = self.CUmemorytype.CU_MEMORYTYPE_DEVICE
        assert c.srcMemoryType == D and c.dstMemoryType == D
        return self._r(self.gpu.d2d_2d(c.dstDevice, c.dstPitch, c.srcDevice, c.srcPitch,
                                       c.WidthInBytes, c.Height))  # fmt: skip

    def cuStreamBeginCapture(self, stream, mode):
        assert mode == self.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        return self._r(self.gpu.begin_capture())

    def cuStreamEndCapture(self, stream):
        return self._r(*self.gpu.end_capture())

    def cuGraphInstantiate(self, graph, flags):
        return self._r(*self.gpu.instantiate(graph))

    def cuGraphLaunch(self, graph_exec, stream):
        return self._r(self.gpu.graph_launch(graph_exec))

    def cuGraphExecDestroy(self, graph_exec):
        return self._r(self.gpu.destroy("exec_destroy", graph_exec))

    def cuGraphDestroy(self, graph):
        return self._r(self.gpu.destroy("graph_destroy", graph))


class FakeHip:
    """hip-python's `hip` module, as far as HipDriver uses it (the 7.x+ signatures)."""

    class hipError_t(enum.IntEnum):
        hipSuccess = 0
        hipErrorInvalidValue = 1
        hipErrorOutOfMemory = 2
        hipErrorInvalidImage = 200
        hipErrorNotFound = 500
        hipErrorIllegalAddress = 700
        hipErrorLaunchOutOfResources = 701

    class hipStreamCaptureMode(enum.IntEnum):
        hipStreamCaptureModeGlobal = 0
        hipStreamCaptureModeThreadLocal = 1

    class hipDeviceProp_t:
        def __init__(self, gcn: str = "", name: str = "") -> None:
            self.gcnArchName, self.name = gcn, name
            self.sharedMemPerBlock = 64 * 1024

    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu

    def _r(self, code, *values):
        return (self.hipError_t(code), *values)

    def hipInit(self, flags):
        return self._r(self.gpu.simple("init"))

    def hipGetDeviceCount(self):
        return self._r(self.gpu.simple("count"), 1)

    def hipSetDevice(self, device):
        return self._r(self.gpu.simple("set_current", device))

    def hipGetDeviceProperties(self, device):
        return self._r(0, self.hipDeviceProp_t(self.gpu.gcn, "Fake MI300X"))

    def hipStreamCreateWithFlags(self, flags):
        assert flags == 1
        return self._r(self.gpu.simple("stream_create"), "stream")

    def hipStreamDestroy(self, stream):
        return self._r(self.gpu.simple("stream_destroy", stream))

    def hipMemGetInfo(self):
        return self._r(self.gpu.simple("mem_info"), self.gpu.free_bytes, self.gpu.total_bytes)

    def hipModuleLoadData(self, image):
        return self._r(*self.gpu.load_module(bytes(image)))

    def hipModuleUnload(self, module):
        return self._r(self.gpu.simple("module_unload"))

    def hipModuleGetFunction(self, module, name):
        return self._r(*self.gpu.get_function(name.decode()))

    def hipMalloc(self, n):
        return self._r(*self.gpu.malloc(n))

    def hipFree(self, ptr):
        return self._r(self.gpu.free(ptr))

    def hipHostMalloc(self, n, flags):
        return self._r(*self.gpu.host_malloc(n))

    def hipHostFree(self, ptr):
        return self._r(self.gpu.host_free(ptr))

    def hipMemsetD8Async(self, ptr, value, n, stream):
        return self._r(self.gpu.memset(ptr, value, n))

    def hipMemcpyHtoDAsync(self, dst, src, n, stream):
        return self._r(self.gpu.h2d(dst, src, n))

    def hipMemcpyDtoHAsync(self, dst, src, n, stream):
        return self._r(self.gpu.d2h(dst, src, n))

    def hipMemcpyDtoDAsync(self, dst, src, n, stream):
        assert stream == "stream"
        return self._r(self.gpu.d2d(dst, src, n))

    def hipModuleLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        assert extra is None and stream == "stream"
        return self._r(self.gpu.launch(fn, (gx, gy, gz), (bx, by, bz), shared, params))

    def hipStreamSynchronize(self, stream):
        return self._r(self.gpu.synchronize())

    class hipMemcpyKind(enum.IntEnum):
        hipMemcpyDeviceToDevice = 3

    def hipEventCreateWithFlags(self, flags):
        assert flags == 2  # hipEventDisableTiming
        return self._r(*self.gpu.event_create())

    def hipEventRecord(self, event, stream):
        assert stream == "stream"
        return self._r(self.gpu.simple("event_record", event))

    def hipEventSynchronize(self, event):
        return self._r(self.gpu.synchronize())

    def hipEventDestroy(self, event):
        return self._r(self.gpu.simple("event_destroy", event))

    def hipMemcpy2DAsync(self, dst, dpitch, src, spitch, width, height, kind, stream):
        assert stream == "stream" and kind == self.hipMemcpyKind.hipMemcpyDeviceToDevice
        return self._r(self.gpu.d2d_2d(dst, dpitch, src, spitch, width, height))

    def hipStreamBeginCapture(self, stream, mode):
        assert mode == self.hipStreamCaptureMode.hipStreamCaptureModeThreadLocal
        return self._r(self.gpu.begin_capture())

    def hipStreamEndCapture(self, stream):
        return self._r(*self.gpu.end_capture())

    def hipGraphInstantiateWithFlags(self, graph, flags):
        return self._r(*self.gpu.instantiate(graph))

    def hipGraphLaunch(self, graph_exec, stream):
        return self._r(self.gpu.graph_launch(graph_exec))

    def hipGraphExecDestroy(self, graph_exec):
        return self._r(self.gpu.destroy("exec_destroy", graph_exec))

    def hipGraphDestroy(self, graph):
        return self._r(self.gpu.destroy("graph_destroy", graph))


# -- the toy artifact -----------------------------------------------------------------


def section(big_shared: int = 64 * 1024) -> dict:
    x = {"kind": "arena", "offset": 0}
    launches = lambda rows_grid: [  # noqa: E731
        {
            "group": "g_embed",
            "kernel": "embed",
            "grid": ["T"],
            "block": [32],
            "args": [
                {"kind": "input", "name": "ids"},
                {"kind": "weight", "index": 0},
                x,
                {"kind": "int", "value": "T"},
            ],
        },
        {
            "group": "g_pos",
            "kernel": "addpos",
            "grid": ["cdiv(T,2)"],
            "block": [64],
            "args": [
                x,
                {"kind": "input", "name": "pos"},
                {"kind": "input", "name": "seq"},
                {"kind": "input", "name": "blocks"},
                {"kind": "int", "value": "T"},
                {"kind": "state", "index": 1},
            ],
        },
        {
            "group": "g_head",
            "kernel": "head",
            "grid": [V, rows_grid],
            "block": [128],
            "args": [
                {"kind": "arena", "offset": 0, "row_skip": H},
                {"kind": "weight", "index": 1},
                {"kind": "output", "name": "logits"},
                {"kind": "int", "value": "rows"},
                {"kind": "int", "value": 2},
            ],
        },
    ]
    prefill = launches("rows")
    prefill.insert(
        2,
        {
            "group": "g_big",
            "kernel": "big",
            "grid": [1],
            "block": [32],
            "shared": big_shared,
            "args": [{"kind": "scratch", "offset": 16}, {"kind": "int", "value": 7}],
        },
    )
    return {
        "arena_bytes": 4 * H * MAX_TOKENS,
        "scratch_bytes": 64,
        "wave": 32,
        "kv_block": KV_BLOCK,
        "steps": {
            "decode": [{**x, "overlap": x["kernel"] == "addpos"} for x in launches(1)],
            "prefill": prefill,
            "batch": launches("rows"),
        },
    }


EMB = np.arange(V * H, dtype=np.float32).reshape(V, H) / 10
W = (np.arange(V * H, dtype=np.float32).reshape(V, H) % 7 - 3) / 4


def write_artifact(
    path: Path,
    targets=("sm_90", "gfx942"),
    big_shared: int = 64 * 1024,
    images: dict[str, bytes] | None = None,
    edit=None,
) -> Path:
    """The toy artifact; `images` replaces code objects (real ones), `edit(plan)` the plan."""
    path.mkdir()
    (path / "kernels").mkdir()
    files, manifest_targets = {}, {}
    image = json.dumps({"kernels": SIGNATURES}).encode()
    for t in targets:
        rel = f"kernels/{t}.co"
        (path / rel).write_bytes((images or {}).get(t, image))
        manifest_targets[t] = {"code_object": rel}
    tensors = [
        LazyTensor("emb", np.dtype(np.float32), EMB.shape, lambda: EMB),
        LazyTensor("w", np.dtype(np.float32), W.shape, lambda: W),
    ]
    write_safetensors(path / "weights.safetensors", tensors)
    plan = {
        "format": LAUNCH_PLAN_FORMAT,
        "version": LAUNCH_PLAN_VERSION,
        "max_context": MAX_CTX,
        "max_tokens": MAX_TOKENS,
        "vocab_size": V,
        "weights": [
            {"name": "emb", "dtype": "float32", "shape": [V, H], "stored_shape": [V, H]},
            {"name": "w", "dtype": "float32", "shape": [V, H], "stored_shape": [V, H]},
        ],
        "states": [
            {"name": "k0", "kind": "kv", "dtype": "float32", "shape": [MAX_CTX, 1, 3]},
            {"name": "v0", "kind": "kv", "dtype": "float32", "shape": [MAX_CTX, 1, H]},
        ],
        "targets": {t: section(big_shared) for t in targets},
    }
    if edit is not None:
        edit(plan)
    (path / "plan.json").write_text(json.dumps(plan))
    for f in sorted(path.rglob("*")):
        if f.is_file():
            files[str(f.relative_to(path))] = {
                "size": f.stat().st_size,
                "sha256": hashlib.sha256(f.read_bytes()).hexdigest(),
            }
    manifest = {
        "format": "hipc-artifact",
        "format_version": ARTIFACT_FORMAT_VERSION,
        "config": {},
        "targets": manifest_targets,
        "files": files,
    }
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def expected(ids, start, all_logits):
    x = EMB[np.asarray(ids)] + (start + np.arange(len(ids), dtype=np.float32))[:, None]
    out = x @ W.T
    return out if all_logits else out[-1:]


@pytest.fixture(params=["cuda", "hip"])
def api(request):
    return request.param


@pytest.fixture
def artifact(tmp_path):
    return load_artifact(write_artifact(tmp_path / "toy.hipc"))


@pytest.fixture(autouse=True)
def _no_sync_env(monkeypatch):
    monkeypatch.delenv(gpu_common.SYNC_ENV, raising=False)


def backend(api: str, artifact, gpu: FakeGpu, max_context: int | None = None, kv_blocks=None):
    kw = dict(max_context=max_context, kv_blocks=kv_blocks)
    if api == "cuda":
        return CudaBackend(artifact, cu=FakeCu(gpu), **kw)
    return HipBackend(artifact, hip=FakeHip(gpu), **kw)


def arch_of(api):
    return "sm_90" if api == "cuda" else "gfx942"


# -- tests ----------------------------------------------------------------------------


def test_packed_args_are_kernel_params():
    args = PackedArgs([("u64", 0x7F00_0000_1234), ("i32", -5), ("i32", 2**31 - 1)])
    ptrs = (ctypes.c_void_p * 3).from_address(args.address)
    assert ctypes.c_uint64.from_address(ptrs[0]).value == 0x7F00_0000_1234
    assert ctypes.c_int32.from_address(ptrs[1]).value == -5
    assert ctypes.c_int32.from_address(ptrs[2]).value == 2**31 - 1
    assert PackedArgs([]).address == 0
    with pytest.raises(HipcError, match="32-bit"):
        PackedArgs([("i32", 2**31)])


def test_resolved_pointers_and_row_skip():
    launch = Launch.from_json(section()["steps"]["prefill"][3])  # head
    bases = Bases(1000, 2000, (3000, 4000), (5000, 6000), 7000, 7100, 7200, 8000, 9000)
    # 3 tokens, last row only: the x argument skips (T - rows) rows of H floats
    assert launch.resolve(bases, 3, 1) == [
        ("u64", 1000 + 2 * H * 4),
        ("u64", 4000),
        ("u64", 9000),
        ("i32", 1),
        ("i32", 2),
    ]
    assert launch.resolve(bases, 3, 3)[0] == ("u64", 1000)
    assert launch.grid_dims(3, 1) == (V, 1, 1)
    assert aligned_offsets([10, 256, 1]) == ((0, 256, 512), 768)


def test_load_uploads_weights_and_zeroes_kv(api, artifact):
    gpu = FakeGpu()
    b = backend(api, artifact, gpu)
    assert (b.name, b.arch, b.max_tokens, b.vocab) == (api, arch_of(api), MAX_TOKENS, V)
    pool = (KV_TABLE + 1) * KV_BLOCK  # one sequence's blocks and the padding rows' spare one
    assert (b.kv_blocks, b.kv_table) == (KV_TABLE, KV_TABLE)
    assert b.kv_bytes == 4 * pool * (3 + H)
    assert np.array_equal(gpu.view(b.bases.weights[0], np.float32, V * H), EMB.reshape(-1))
    assert np.array_equal(gpu.view(b.bases.weights[1], np.float32, V * H), W.reshape(-1))
    assert b.bases.weights[1] - b.bases.weights[0] == 256  # one block, aligned tensors
    assert b.bases.states[1] % 256 == 0
    memsets = [c for c in gpu.calls if c[0] == "memset"]
    # the KV cache, and the scratch buffer (counters kernels reset after use start at 0)
    states = -(-4 * pool * 3 // 256) * 256 + 4 * pool * H
    assert memsets == [
        ("memset", b.bases.states[0], 0, states),
        ("memset", b.bases.scratch, 0, 64),
    ]
    # the block tables: every row names the spare block, but SOLO: forward()'s identity
    tables = gpu.view(b.bases.blocks, np.int32, (MAX_TOKENS + 2) * KV_TABLE).reshape(-1, KV_TABLE)
    assert (tables[: b.SOLO] == KV_TABLE).all()
    assert tables[b.SOLO].tolist() == list(range(KV_TABLE))
    b.close()


def test_weight_upload_draws_a_bar_on_a_terminal_only(api, artifact, monkeypatch, capsys):
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    weights = EMB.nbytes + W.nbytes  # under 1000: tqdm writes plain bytes
    monkeypatch.setattr(gpu_common, "PROGRESS_MIN_BYTES", 0)
    backend(api, artifact, FakeGpu()).close()
    assert "uploading" not in capsys.readouterr().err  # not a terminal: no bar
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    b = backend(api, artifact, FakeGpu())
    b.close()
    out = term.getvalue()
    assert f"hipc: uploading weights to {b.device_name}" in out and "100%" in out
    assert f"{weights}/{weights}" in out


def test_prefill_runs_eagerly_with_T(api, artifact):
    gpu = FakeGpu()
    b = backend(api, artifact, gpu)
    ids = [3, 1, 4]
    out = b.forward(np.array(ids), 2, True)
    assert out.shape == (3, V) and out.dtype == np.float32
    np.testing.assert_allclose(out, expected(ids, 2, True), rtol=1e-6)
    # the decode graph is recorded after the prefill, not run
    assert gpu.count("begin_capture") == 1 and b.graph_captured
    assert gpu.count("graph_launch") == 0
    names = [e[0] for e in gpu.executed]
    assert names == ["embed", "addpos", "big", "head"]
    assert all(e[5] == "eager" for e in gpu.executed)
    embed, addpos, big, head = gpu.executed
    assert embed[1] == (3, 1, 1) and embed[4][3] == 3  # grid "T", int "T"
    assert addpos[1] == (2, 1, 1)  # cdiv(3,2)
    assert big[3] == 64 * 1024 and big[4] == (b.bases.scratch + 16, 7)
    assert head[1] == (V, 3, 1) and head[4][0] == b.bases.arena and head[4][3] == 3
    # the KV state got row start..start+T
    kv = gpu.view(b.bases.states[1], np.float32, MAX_CTX * H).reshape(MAX_CTX, H)
    np.testing.assert_allclose(kv[2:5], EMB[ids] + np.arange(2, 5)[:, None])
    # only the last token's logits: head reads x from row T-1 (row_skip), rows == 1
    gpu.executed.clear()
    out = b.forward(np.array(ids), 2, False)
    np.testing.assert_allclose(out, expected(ids, 2, False), rtol=1e-6)
    head = gpu.executed[-1]
    assert head[1] == (V, 1, 1) and head[4][0] == b.bases.arena + 2 * H * 4
    d2h = [c for c in gpu.calls if c[0] == "d2h"][-1]
    assert d2h[3] == V * 4  # rows x vocab float32
    # launches are packed once per step shape: the same shape again, and another T
    for ids2, start in (([2, 4, 0], 0), ([3, 0], 3), ([1, 1, 2], 1)):
        out = b.forward(np.array(ids2), start, True)
        np.testing.assert_allclose(out, expected(ids2, start, True), rtol=1e-6)
    # the next decode step replays the graph recorded after the first prefill
    out = b.forward(np.array([1]), 5, False)
    np.testing.assert_allclose(out, expected([1], 5, False), rtol=1e-6)
    assert gpu.count("begin_capture") == 1 and gpu.count("graph_launch") == 1
    b.close()


def test_decode_is_captured_once_then_replayed(api, artifact):
    gpu = FakeGpu()
    b = backend(api, artifact, gpu)
    for pos, tok in enumerate([2, 0, 4]):
        out = b.forward(np.array([tok]), 5 + pos, False)
        np.testing.assert_allclose(out, expected([tok], 5 + pos, False), rtol=1e-6)
    assert gpu.count("begin_capture") == 1 and gpu.count("instantiate") == 1
    assert gpu.count("graph_launch") == 3 and b.graph_captured
    assert [e[5] for e in gpu.executed] == ["graph"] * 9
    # all_logits with one token is still the decode graph (rows == 1)
    out = b.forward(np.array([1]), 8, True)
    assert out.shape == (1, V) and gpu.count("begin_capture") == 1
    kv = gpu.view(b.bases.states[1], np.float32, MAX_CTX * H).reshape(MAX_CTX, H)
    np.testing.assert_allclose(kv[5:9], EMB[[2, 0, 4, 1]] + np.arange(5, 9)[:, None])
    b.close()


def test_submit_then_collect_is_forward(api, artifact):
    """A step queued by submit() (the generation loop's overlap) gives forward()'s logits at
    collect(); one step is in flight at most, and the engine drains one left uncollected."""
    gpu = FakeGpu()
    b = backend(api, artifact, gpu)
    b.submit(np.array([2]), 5)
    with pytest.raises(HipcError, match="in flight"):
        b.submit(np.array([0]), 6)
    np.testing.assert_allclose(b.collect(), expected([2], 5, False), rtol=1e-6)
    with pytest.raises(HipcError, match="no step"):
        b.collect()
    eng = engine_mod.CompiledEngine(artifact, b)
    eng.submit([0], 6)
    np.testing.assert_allclose(eng.collect(), expected([0], 6, False)[-1], rtol=1e-6)
    eng.submit([4], 7)  # left in flight: the next call waits for it first
    np.testing.assert_allclose(eng.forward([1], 8), expected([1], 8, False)[-1], rtol=1e-6)
    kv = gpu.view(b.bases.states[1], np.float32, MAX_CTX * H).reshape(MAX_CTX, H)
    np.testing.assert_allclose(kv[5:9], EMB[[2, 0, 4, 1]] + np.arange(5, 9)[:, None])
    # copy=False: the pinned buffer itself, which the next step's logits overwrite
    eng.submit([3], 9)
    view = eng.collect(copy=False)
    np.testing.assert_allclose(view, expected([3], 9, False)[-1], rtol=1e-6)
    eng.submit([2], 10)
    eng.collect()
    np.testing.assert_allclose(view, expected([2], 10, False)[-1], rtol=1e-6)
    # and forward(copy=False) likewise, where the default's logits stay the caller's own
    kept = eng.forward([1], 11)
    view = eng.forward([0], 12, copy=False)
    np.testing.assert_allclose(view, expected([0], 12, False)[-1], rtol=1e-6)
    eng.forward([4], 13)
    np.testing.assert_allclose(view, expected([4], 13, False)[-1], rtol=1e-6)
    np.testing.assert_allclose(kept, expected([1], 11, False)[-1], rtol=1e-6)


class _Letters:
    """A tokenizer for token ids as letters (Generation's detokenizing and stop ids)."""

    eos_token_ids = ()

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + i % 26) for i in ids)


def test_generation_on_the_gpu_equals_a_forward_loop(api, artifact):
    """The generation loop (a step submitted while the token before is detokenized, its
    logits sampled from the pinned buffer before the next step is submitted) draws the tokens
    a plain forward() loop draws with the same seed."""
    from hipc.runtime.generate import Generation, GenerationRequest
    from hipc.runtime.sampler import Sampler, SamplingParams

    b = backend(api, artifact, FakeGpu())
    eng = engine_mod.CompiledEngine(artifact, b)
    # hot enough that the toy's tokens vary (its greedy tokens are all the same)
    params, prompt, n = SamplingParams(temperature=8.0, seed=7), [2, 0, 4], 12
    sampler, want, logits = Sampler(params), [], eng.forward(prompt, 0)
    for i in range(n):
        want.append(sampler(logits))
        logits = eng.forward([want[-1]], len(prompt) + i)
    assert len(set(want)) > 2
    req = GenerationRequest(
        prompt_ids=tuple(prompt), max_tokens=n, sampling=params, ignore_eos=True
    )
    gen = Generation(eng, _Letters(), req)
    text = "".join(gen)
    assert gen.result.token_ids == want and text == _Letters().decode(want)
    b.close()


@pytest.mark.parametrize("on_device", [True, False])
def test_greedy_generation_picks_on_the_device(api, tmp_path, on_device):
    """A greedy generation (no penalty, logprobs or grammar) asks each decode step for its
    argmax only: with the plan's top-k kernel it is picked on the device and one value, id
    and the row's stats come back per step instead of a vocabulary of logits; without it the
    host takes np.argmax. Either way the tokens are a plain forward() loop's argmaxes."""
    from hipc.runtime.generate import Generation, GenerationRequest

    def edit(plan):
        for sec in plan["targets"].values():
            sec["topk"] = {"kernel": "topk", "block": 1024, "max_k": 64}

    art = load_artifact(write_artifact(tmp_path / "g.hipc", edit=edit if on_device else None))
    gpu = FakeGpu()
    eng = engine_mod.CompiledEngine(art, backend(api, art, gpu))
    prompt, n = [2, 0, 4], 6
    want, logits = [], eng.forward(prompt, 0)
    for i in range(n):
        want.append(int(np.argmax(logits)))
        logits = eng.forward([want[-1]], len(prompt) + i)
    calls = len(gpu.calls)
    req = GenerationRequest(prompt_ids=tuple(prompt), max_tokens=n, ignore_eos=True)
    gen = Generation(eng, _Letters(), req)
    "".join(gen)
    assert gen.result.token_ids == want
    copies = [c[3] for c in gpu.calls[calls:] if c[0] == "d2h"]
    picks = sum(1 for e in gpu.executed if e[0] == "topk")
    if on_device:  # the prompt's logits, then n - 1 decode steps of one value, id and stats
        assert picks == n - 1 and copies.count(4 * V) == 1 and copies.count(4) == 2 * (n - 1)
    else:
        assert picks == 0 and copies.count(4 * V) == n
    eng.close()


@pytest.mark.parametrize("env, overlapped", [(None, 1), ("0", 0)])
def test_decode_kernels_marked_overlap_start_early_on_sm90(artifact, monkeypatch, env, overlapped):
    if env is not None:
        monkeypatch.setenv("HIPC_OVERLAP_LAUNCHES", env)
    gpu = FakeGpu(sm=(9, 0))
    b = backend("cuda", artifact, gpu)
    for pos, tok in enumerate([2, 0]):
        out = b.forward(np.array([tok]), 5 + pos, False)
        np.testing.assert_allclose(out, expected([tok], 5 + pos, False), rtol=1e-6)
    b.forward(np.array([1, 2]), 7, False)  # prefill: never marked
    assert gpu.overlapped == ["addpos"] * overlapped  # captured once, replayed
    b.close()


def test_no_overlap_before_sm90():
    from hipc.runtime.backends.cuda import CudaDriver

    driver = CudaDriver(0, FakeCu(FakeGpu(sm=(8, 9))))
    assert driver.arch == "sm_89" and not driver.overlap_launches
    driver.close()


def test_hip_launches_in_order(artifact):
    gpu = FakeGpu()
    b = backend("hip", artifact, gpu)
    b.forward(np.array([2]), 5, False)
    assert gpu.overlapped == [] and gpu.count("graph_launch") == 1
    b.close()


def test_dynamic_shared_memory_opt_in(api, artifact):
    gpu = FakeGpu()
    b = backend(api, artifact, gpu)
    # CUDA needs the attribute above 48 KiB; AMD has no opt-in
    assert gpu.shared_attr == ({"big": 64 * 1024} if api == "cuda" else {})
    b.close()


def test_shared_memory_over_the_device_limit(api, tmp_path):
    art = load_artifact(write_artifact(tmp_path / "a.hipc", big_shared=300 * 1024))
    gpu = FakeGpu()
    with pytest.raises(HipcError, match=r"kernel big needs 307200 bytes of shared memory"):
        backend(api, art, gpu)
    assert gpu.context_refs == 0 and gpu.count("stream_destroy") == 1


def test_oom_before_allocating(api, artifact):
    gpu = FakeGpu(free=1000, total=80 << 30)
    with pytest.raises(HipcError) as e:
        backend(api, artifact, gpu)
    msg = str(e.value)
    pool = (KV_TABLE + 1) * KV_BLOCK
    states = -(-4 * pool * 3 // 256) * 256 + -(-4 * pool * H // 256) * 256
    io = 24 * MAX_TOKENS + 4 * (MAX_TOKENS + 2) * KV_TABLE + 4 * MAX_TOKENS * V
    b_needed = 512 + states + 64 + 64 + io
    assert f"({b_needed} bytes:" in msg and "(1000 bytes) are free of 80.00 GiB" in msg
    assert "--max-context" in msg and f"({MAX_CTX} positions now)" in msg
    assert "--max-tokens" in msg
    assert gpu.count("malloc") == 0 and gpu.count("host_malloc") == 0
    assert gpu.context_refs == 0 and gpu.count("stream_destroy") == 1


def test_fit_positions_sizes_the_kv_cache_to_free_memory():
    # 2 layers of k and v, [positions, 8, 64] float32 = 2 KiB per position per state
    plan = {
        "max_context": 4096,
        "states": [{"name": f"s{i}", "dtype": "float32", "shape": [4096, 8, 64]} for i in range(4)],
    }
    gpu = SimpleNamespace(
        arena_bytes=1 << 20, scratch_bytes=4096, max_tokens=8, vocab=1000, kv_block=16, topk=None
    )
    weights = [50 << 20]
    full = gpu_common.device_memory(plan, gpu, weights).total
    assert gpu_common.fit_positions(plan, gpu, weights, int(full / 0.95) + 1, 4096) == 4096
    half_kv = full - 4 * 2048 * 2048  # room for about half the positions
    n = gpu_common.fit_positions(plan, gpu, weights, int(half_kv / 0.95), 4096)
    assert 2000 <= n < 2048
    assert gpu_common.device_memory(plan, gpu, weights, n).total <= 0.95 * int(half_kv / 0.95)
    assert gpu_common.device_memory(plan, gpu, weights, n + 1).total > 0.95 * int(half_kv / 0.95)
    assert gpu_common.fit_positions(plan, gpu, weights, 1000, 4096) == 0


def test_kv_cache_for_an_admitted_context(api, artifact):
    gpu = FakeGpu()
    full = backend(api, artifact, FakeGpu())
    full_kv = full._mem.kv_bytes
    full.close()
    b = backend(api, artifact, gpu, max_context=4)
    # one block for the sequence (of 4 for the compiled context) and the spare one
    assert b.max_context == 4 and b._mem.kv_bytes == full_kv * 2 // (KV_TABLE + 1)
    b.close()


def test_oom_from_an_allocation(api, artifact):
    gpu = FakeGpu()
    real_malloc = gpu.malloc

    def second_fails(n, calls=[]):  # noqa: B006
        calls.append(n)
        return (OOM, 0) if len(calls) == 2 else real_malloc(n)

    gpu.malloc = second_fails
    with pytest.raises(HipcError, match=r"allocating the KV cache failed.*--max-context"):
        backend(api, artifact, gpu)
    assert gpu.mem == {} and len(gpu.freed) == 1  # the weights block, freed once
    assert gpu.context_refs == 0


def test_missing_arch_lists_targets_and_the_compile_command(api, artifact):
    gpu = FakeGpu(sm=(8, 9), gcn="gfx1100")
    want = "sm_89" if api == "cuda" else "gfx1100"
    with pytest.raises(HipcError) as e:
        backend(api, artifact, gpu)
    msg = str(e.value)
    assert "no code object for this GPU" in msg and want in msg
    assert "the artifact has: sm_90, gfx942" in msg
    assert f"hipc compile MODEL --target {want}" in msg
    assert gpu.context_refs == 0 and gpu.count("stream_destroy") == 1


def test_launch_failure_names_the_kernel(api, artifact):
    gpu = FakeGpu()
    b = backend(api, artifact, gpu)
    gpu.fail_kernel = ("head", OUT_OF_RESOURCES, "launch", False)
    err = "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES" if api == "cuda" else "hipErrorLaunchOutOfResources"
    with pytest.raises(HipcError, match=rf"^kernel head \(group g_head\) failed: {err}$"):
        b.forward(np.array([1, 2]), 0, False)
    # at capture time too, and the stream leaves capture mode
    with pytest.raises(HipcError, match=r"kernel head \(group g_head\) failed"):
        b.forward(np.array([1]), 0, False)
    assert gpu.capturing is None and gpu.count("end_capture") == 1 and not b.graph_captured
    gpu.fail_kernel = None
    np.testing.assert_allclose(b.forward(np.array([1]), 0, False), expected([1], 0, False))
    b.close()


def test_async_failure_in_the_graph_is_located_by_rerunning(api, artifact):
    gpu = FakeGpu()
    b = backend(api, artifact, gpu)
    b.forward(np.array([1]), 0, False)  # captured, healthy
    gpu.fail_kernel = ("addpos", ILLEGAL_ADDRESS, "exec", False)
    with pytest.raises(HipcError, match=r"^kernel addpos \(group g_pos\) failed: \w+"):
        b.forward(np.array([1]), 1, False)
    via = [e[5] for e in gpu.executed[3:]]
    assert via == ["graph"] * 3 + ["eager"] * 2  # graph, then the eager re-run up to addpos
    b.close()


def test_sticky_failure_says_how_to_name_the_kernel(api, artifact):
    gpu = FakeGpu()
    b = backend(api, artifact, gpu)
    gpu.fail_kernel = ("addpos", ILLEGAL_ADDRESS, "exec", True)
    with pytest.raises(
        HipcError, match=r"decode graph failed on the GPU: \w+.*HIPC_SYNC_LAUNCHES=1"
    ):
        b.forward(np.array([1]), 0, False)
    with pytest.raises(HipcError, match="failed earlier"):
        b.forward(np.array([1]), 0, False)
    b.close()  # every call fails now; close still tries each free once and does not raise
    # pinned: the inputs' staging slot and the table mirror's upload stage (one each: without
    # the device top-k no step is queued ahead of another), the table mirror, the logits
    assert not b.pipelines
    assert gpu.count("free") == 7 and gpu.count("host_free") == 4
    b.close()
    assert gpu.count("free") == 7


def test_sync_launches_env_names_the_kernel_and_skips_graphs(api, artifact, monkeypatch):
    monkeypatch.setenv(gpu_common.SYNC_ENV, "1")
    gpu = FakeGpu()
    b = backend(api, artifact, gpu)
    np.testing.assert_allclose(b.forward(np.array([3]), 0, False), expected([3], 0, False))
    assert gpu.count("begin_capture") == 0
    syncs = gpu.count("sync")
    b.forward(np.array([3, 1]), 1, False)
    assert gpu.count("sync") - syncs == 4 + 1  # after each launch, then the step's
    gpu.fail_kernel = ("addpos", ILLEGAL_ADDRESS, "exec", True)
    with pytest.raises(HipcError, match=r"^kernel addpos \(group g_pos\) failed: .*restart"):
        b.forward(np.array([3]), 2, False)
    b.close()


def test_close_frees_everything_exactly_once(api, artifact):
    gpu = FakeGpu(free=1 << 30)
    b = backend(api, artifact, gpu)
    b.forward(np.array([1]), 0, False)
    b.forward(np.array([1, 2, 3]), 1, True)
    allocated = set(gpu.mem)
    # pinned: an input staging slot, the table mirror and its upload stage, the logits (one
    # slot and stage: without the device top-k this plan queues no step ahead of another)
    assert len(allocated) == 7 and len(gpu.host) == 4
    b.close()
    assert sorted(gpu.freed) == sorted(allocated) and gpu.mem == {}
    assert sorted(gpu.host_freed) == sorted(gpu.host)
    assert gpu.free_bytes == 1 << 30
    assert gpu.graphs == {} and gpu.execs == {}
    assert gpu.count("stream_destroy") == 1 and gpu.count("module_unload") == 1
    assert gpu.context_refs == 0
    n = len(gpu.calls)
    b.close()
    b.__del__()
    assert len(gpu.calls) == n
    with pytest.raises(HipcError, match="after close"):
        b.forward(np.array([1]), 0, False)


def test_step_size_is_checked(api, artifact):
    b = backend(api, artifact, FakeGpu())
    with pytest.raises(HipcError, match="1 to 4 tokens"):
        b.forward(np.arange(5), 0, False)
    b.close()


def test_engine_runs_on_the_fake_backend(api, artifact):
    gpu = FakeGpu()
    eng = engine_mod.CompiledEngine(artifact, backend(api, artifact, gpu))
    ids = [1, 2, 3, 4, 0, 1]  # two chunks of max_tokens=4
    got = eng.logits(ids)
    want = np.concatenate([expected(ids[:4], 0, True), expected(ids[4:], 4, True)])
    np.testing.assert_allclose(got, want, rtol=1e-6)
    eng.close()


def test_hip_arch_and_old_properties_signature():
    assert hip_mod.arch_of("gfx942:sramecc+:xnack-") == "gfx942"
    assert hip_mod.arch_of(b"gfx1100\0\0") == "gfx1100"

    class OldHip:  # hip-python 6.x: hipGetDeviceProperties(props, device) -> (err,)
        hipDeviceProp_t = FakeHip.hipDeviceProp_t

        def hipGetDeviceProperties(self, props, device):
            props.gcnArchName = b"gfx90a:sramecc+:xnack-"
            return (FakeHip.hipError_t.hipSuccess,)

    err, props = hip_mod.device_properties(OldHip(), 0)
    assert err == 0 and hip_mod.arch_of(props.gcnArchName) == "gfx90a"


def test_probes(api):
    gpu = FakeGpu(sm=(9, 0))
    if api == "cuda":
        assert cuda_mod.probe(0, FakeCu(gpu)) == ("sm_90", "Fake H200")
    else:
        assert hip_mod.probe(0, FakeHip(gpu)) == ("gfx942", "Fake MI300X")

    class NoDriver:
        def cuInit(self, flags):
            raise RuntimeError("libcuda.so not found")

        hipInit = cuInit

    probe = cuda_mod.probe if api == "cuda" else hip_mod.probe
    arch, why = probe(0, NoDriver())
    assert arch is None and "RuntimeError" in why


def test_auto_target(tmp_path, monkeypatch, capsys):
    gpu_only = write_artifact(tmp_path / "gpu.hipc")
    monkeypatch.setattr(cuda_mod, "probe", lambda device=0: ("sm_90", "Fake H200"))
    monkeypatch.setattr(hip_mod, "probe", lambda device=0: (None, "hip-python is not installed"))
    made = []
    fake_gpu, fake_cpu = SimpleNamespace(max_context=64), SimpleNamespace(max_context=64)
    monkeypatch.setattr(
        cuda_mod, "CudaBackend", lambda a, d, **kw: made.append(("cuda", d)) or fake_gpu
    )
    assert engine_mod.load_engine(gpu_only).backend is fake_gpu and made == [("cuda", 0)]

    # a GPU without a code object, and no cpu target: one error with the reasons
    monkeypatch.setattr(cuda_mod, "probe", lambda device=0: ("sm_80", "Fake A100"))
    with pytest.raises(HipcError) as e:
        engine_mod.load_engine(gpu_only)
    msg = str(e.value)
    assert "targets: gfx942, sm_90" in msg and "hipc compile MODEL --target sm_80" in msg
    assert "hip-python is not installed, so the gfx* code objects cannot run" in msg

    # ... and with a cpu target: the CPU, with a notice on stderr
    with_cpu = load_artifact(gpu_only)
    with_cpu.manifest["targets"]["cpu"] = {"code_object": "kernels/cpu.so"}
    from hipc.runtime.backends import cpu as cpu_mod

    monkeypatch.setattr(engine_mod, "load_artifact", lambda p: with_cpu)
    monkeypatch.setattr(cpu_mod, "CpuBackend", lambda a, threads, max_context=None: fake_cpu)
    assert engine_mod.load_engine(gpu_only).backend is fake_cpu
    assert "hipc: running on the CPU: Fake A100 (sm_80) found" in capsys.readouterr().err

    with pytest.raises(HipcError, match="choose auto, cpu, cuda or hip"):
        engine_mod.load_engine(gpu_only, target="tpu")


def test_reset_zeroes_recurrent_states_only(api, tmp_path):
    def add_recurrent(plan):
        plan["states"].append(
            {"name": "conv", "kind": "recurrent", "dtype": "float32", "shape": [3, 4]}
        )

    art = load_artifact(write_artifact(tmp_path / "r.hipc", edit=add_recurrent))
    gpu = FakeGpu()
    b = backend(api, art, gpu, max_context=8)
    try:
        b.forward(np.array([1, 2, 3]), 0, False)
        conv = gpu.view(b.bases.states[2], np.float32, 12)
        kv = gpu.view(b.bases.states[1], np.float32, 8 * H)
        buf, off = gpu.find(b.bases.states[2])
        buf[off : off + 48] = np.ones(12, np.float32).tobytes()
        kv_before = kv.copy()
        assert kv_before.any() and conv.all()
        b.reset()
        assert not conv.any()  # the recurrent state: 3 x 4 floats, whatever the context
        np.testing.assert_array_equal(kv, kv_before)  # a KV cache is left as it is
        # every slot of the pool: the batch's, PAD's and SOLO's
        assert b._mem.recurrent >= 48 * (b.slots + 2)
        assert ("memset", b.bases.states[2], 0, b._mem.recurrent) in gpu.calls
    finally:
        b.close()


# -- stepping rows of many sequences ----------------------------------------------------


def pool_of(gpu: FakeGpu, b) -> np.ndarray:
    """The v state's pool: [(kv_blocks + 1) * KV_BLOCK, H]."""
    return gpu.view(b.bases.states[1], np.float32, (b.kv_blocks + 1) * KV_BLOCK * H).reshape(-1, H)


def rows_expected(ids, pos) -> np.ndarray:
    return (EMB[np.asarray(ids)] + np.asarray(pos, np.float32)[:, None]) @ W.T


def slot(tables, s, p) -> int:
    return int(tables[s, p // KV_BLOCK]) * KV_BLOCK + p % KV_BLOCK


def test_step_runs_rows_of_many_sequences_through_their_tables(api, artifact):
    gpu = FakeGpu()
    b = backend(api, artifact, gpu, kv_blocks=6)
    assert (b.kv_blocks, b.kv_table, b.buckets) == (6, KV_TABLE, (1, 2, 4))
    tables = np.array([[3, 0, 5, 1], [4, 2, 1, 0], [1, 5, 0, 2]], np.int32)
    pool = pool_of(gpu, b)
    pool[:] = np.nan
    # a prefill chunk of sequence 0 crossing a block (positions 14..16) beside sequence 1's
    # decode row: the prefill list, eager, every row's logits computed, out_rows returned
    ids, pos, seq = [1, 2, 3, 4], [14, 15, 16, 20], [0, 0, 0, 1]
    out = b.step(np.array(ids), np.array(pos), np.array(seq), tables, np.array([2, 3]))
    np.testing.assert_allclose(out, rows_expected(ids, pos)[[2, 3]], rtol=1e-6)
    assert [e[0] for e in gpu.executed] == ["embed", "addpos", "big", "head"]
    assert gpu.executed[-1][1] == (V, 4, 1) and {e[5] for e in gpu.executed} == {"eager"}
    # only the wanted rows come back: rows 2..3 in one copy
    d2h = [c for c in gpu.calls if c[0] == "d2h"]
    assert d2h[-1][2:] == (b.bases.logits + 2 * V * 4, 2 * V * 4)
    out = b.step(np.array(ids), np.array(pos), np.array(seq), tables, np.array([0, 3]))
    np.testing.assert_allclose(out, rows_expected(ids, pos)[[0, 3]], rtol=1e-6)
    d2h = [c for c in gpu.calls if c[0] == "d2h"]
    assert [c[2:] for c in d2h[-2:]] == [
        (b.bases.logits, V * 4),
        (b.bases.logits + 3 * V * 4, V * 4),
    ]
    written = {slot(tables, s, p): EMB[i] + p for i, p, s in zip(ids, pos, seq, strict=True)}
    for at, want in written.items():
        np.testing.assert_array_equal(pool[at], want)
    # only the last row's logits wanted: the head reads row T-1 only
    gpu.executed.clear()
    out = b.step(np.array([0, 1]), np.array([17, 18]), np.array([0, 0]), tables, np.array([1]))
    np.testing.assert_allclose(out, rows_expected([1], [18]), rtol=1e-6)
    assert gpu.executed[-1][1] == (V, 1, 1)
    written.update({slot(tables, 0, 17): EMB[0] + 17, slot(tables, 0, 18): EMB[1] + 18})

    # three sequences, one row each: the batch list (no "big"), captured for bucket 4 with
    # a padding row that writes the spare block only
    gpu.executed.clear()
    captures = gpu.count("begin_capture")
    ids, pos, seq = [4, 0, 2], [19, 21, 3], [0, 1, 2]
    out = b.step(np.array(ids), np.array(pos), np.array(seq), tables, np.arange(3))
    np.testing.assert_allclose(out, rows_expected(ids, pos), rtol=1e-6)
    assert gpu.count("begin_capture") == captures + 1
    assert [e[0] for e in gpu.executed] == ["embed", "addpos", "head"]
    assert {e[5] for e in gpu.executed} == {"graph"} and gpu.executed[0][1] == (4, 1, 1)
    written.update({slot(tables, s, p): EMB[i] + p for i, p, s in zip(ids, pos, seq, strict=True)})
    spare = b.kv_blocks * KV_BLOCK
    np.testing.assert_array_equal(pool[spare], EMB[0])  # the padding row: id 0 at position 0
    written[spare] = EMB[0]
    for at in range(len(pool)):
        if at in written:
            np.testing.assert_array_equal(pool[at], written[at])
        else:
            assert np.isnan(pool[at]).all(), at  # nothing else was written
    # four rows: the same bucket's graph again; two: bucket 2's; one: the decode graph
    for n in (4, 2, 1, 3):
        ids, pos = np.arange(n) % V, np.arange(n) + 30
        out = b.step(ids, pos, np.arange(n), np.tile(tables[:1], (4, 1)), np.arange(n))
        np.testing.assert_allclose(out, rows_expected(ids, pos), rtol=1e-6)
    assert sorted(b._graphs) == [("batch", 2), ("batch", 4), ("decode", 1)]
    assert gpu.count("begin_capture") == captures + 2  # decode: after the first prefill
    b.close()


def test_step_uploads_the_tables_only_when_they_change(api, artifact):
    gpu = FakeGpu()
    b = backend(api, artifact, gpu, kv_blocks=4)
    tables = np.array([[0, 1, 2, 3], [3, 2, 1, 0]], np.int32)

    def uploads():
        return sum(1 for c in gpu.calls if c[0] == "h2d" and c[1] == b.bases.blocks)

    before = uploads()
    for _ in range(3):
        b.step(np.array([1, 2]), np.array([5, 7]), np.array([0, 1]), tables, np.arange(2))
    assert uploads() == before + 1
    tables[1, 0] = 1
    b.step(np.array([1, 2]), np.array([5, 7]), np.array([0, 1]), tables, np.arange(2))
    assert uploads() == before + 2
    b.close()


def test_batches_past_the_buckets_run_eagerly(api, artifact, monkeypatch):
    monkeypatch.setattr(gpu_common, "BUCKETS", (1, 2))
    gpu = FakeGpu()
    b = backend(api, artifact, gpu, kv_blocks=4)
    tables = np.array([[0, 1, 2, 3]] * 3, np.int32)
    ids, pos = np.array([1, 2, 3]), np.array([4, 9, 2])
    out = b.step(ids, pos, np.arange(3), tables, np.arange(3))
    np.testing.assert_allclose(out, rows_expected(ids, pos), rtol=1e-6)
    assert {e[5] for e in gpu.executed} == {"eager"} and gpu.executed[0][1] == (3, 1, 1)
    assert "big" not in [e[0] for e in gpu.executed]  # the batch list
    b.close()


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a["tables"].__setitem__((1, 1), 9), "outside the pool of 4"),
        (lambda a: a["tables"].__setitem__((1, 1), -1), "outside the pool of 4"),
        (lambda a: a.__setitem__("pos", np.array([5, 64])), "past the 64 positions"),
        (lambda a: a.__setitem__("seq", np.array([0, 2])), "past the 64 positions or the tables"),
        (lambda a: a.__setitem__("out", np.array([1, 0])), "ascending"),
        (lambda a: a.__setitem__("tables", np.zeros((2, 3), np.int32)), "block tables must be"),
    ],
)
def test_step_refuses_rows_the_kernels_cannot_trust(api, artifact, change, message):
    gpu = FakeGpu()
    b = backend(api, artifact, gpu, kv_blocks=4)
    a = {
        "ids": np.array([1, 2]),
        "pos": np.array([5, 20]),
        "seq": np.array([0, 1]),
        "tables": np.array([[0, 1, 2, 3], [3, 2, 1, 0]], np.int32),
        "out": np.arange(2),
    }
    change(a)
    launches = gpu.count("launch")
    with pytest.raises(HipcError, match=message):
        b.step(a["ids"], a["pos"], a["seq"], a["tables"], a["out"])
    assert gpu.count("launch") == launches
    b.close()


PROMPTS = [[1, 2, 3], [4, 0, 1, 2, 3, 4, 0, 1, 2], [3], [2, 2, 4, 1, 0, 3]]
NEW = [5, 3, 6, 4]


def test_the_batch_engine_runs_on_a_gpu_backend(api, artifact):
    """runtime/batch.py unchanged on a GPU backend: sequences joining and leaving at different
    steps, prompts chunked beside decode rows, each gets what it gets alone, every KV row
    at its position's slot, and the pool is full again after."""
    from hipc.runtime.batch import BatchEngine, batchable

    gpu = FakeGpu()
    eng = engine_mod.CompiledEngine(artifact, backend(api, artifact, gpu, kv_blocks=8))
    assert batchable(eng)
    want = {i: batch_runs.alone(eng, i, PROMPTS, NEW) for i in range(len(PROMPTS))}
    for i, (tokens, logits) in want.items():
        positions = range(len(PROMPTS[i]) - 1, len(PROMPTS[i]) + len(tokens) - 1)
        fed = [PROMPTS[i][-1], *tokens[:-1]]
        np.testing.assert_allclose(np.array(logits), rows_expected(fed, positions), atol=1e-5)
    seen, queued = [], []
    real_submit, real_collect = eng.backend.submit_step, eng.backend.collect

    def submit_spy(ids, pos, seq, tables, out_rows, top=0):
        seen.append((len(ids), len(set(seq.tolist()))))
        queued.append([np.array(a) for a in (ids, pos, seq, tables)])
        real_submit(ids, pos, seq, tables, out_rows, top)

    def collect_spy(copy=True):
        out = real_collect(copy)
        pool = pool_of(gpu, eng.backend)
        ids, pos, seq, tables = queued.pop()
        for i, p, s in zip(ids, pos, seq, strict=True):
            np.testing.assert_array_equal(pool[slot(tables, s, p)], EMB[i] + np.float32(p))
        return out

    eng.backend.submit_step, eng.backend.collect = submit_spy, collect_spy
    be = BatchEngine(eng, max_batch=4, prefill_chunk=2)
    assert be.overlaps  # each step: submit_step, then collect
    got = batch_runs.run(be, [0, 0, 1, 3], NEW, PROMPTS)
    assert got.keys() == want.keys()
    for i in want:
        assert got[i][0] == want[i][0]
        for g, w in zip(got[i][1], want[i][1], strict=True):
            # the fake head's matrix product rounds by the number of rows
            np.testing.assert_allclose(g, w, atol=1e-6)
    # steps of every kind: prefill chunks beside decode rows, decode rows only, one row
    kinds = {"mixed" if d < n else "batch" if n > 1 else "one" for n, d in seen}
    assert kinds == {"mixed", "batch", "one"}, seen
    batch_runs.assert_pool_full(be)
    # the server's order (the next step submitted before the last one's sequences end, one
    # of them fed past its end): the same tokens, the pool full again
    be = BatchEngine(eng, max_batch=4, prefill_chunk=2)
    got = batch_runs.run_overlapped(be, (0, 1, 2, 3), NEW, PROMPTS, fed_past=(1,))
    for i in (0, 1, 2, 3):
        assert got[i][0] == want[i][0]
        for g, w in zip(got[i][1], want[i][1], strict=True):
            np.testing.assert_allclose(g, w, atol=1e-6)
    batch_runs.assert_pool_full(be)
    eng.close()


def test_a_step_fed_ahead_takes_the_picks_of_the_step_in_flight(api, tmp_path):
    """submit_step(feed=runs): the rows' int64 ids are the step in flight's top-1 picks (at
    its k, in any order), copied on the device before this step's kernels; the rest come
    from the host. The two steps are collected in order."""
    from hipc.runtime.topk import top_of_logits

    def edit(plan):
        for sec in plan["targets"].values():
            sec["topk"] = {"kernel": "topk", "block": 1024, "max_k": 64}

    art = load_artifact(write_artifact(tmp_path / "f.hipc", edit=edit))
    gpu = FakeGpu()
    b = backend(api, art, gpu, kv_blocks=8)
    tables = np.array([[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]], np.int32)
    b.submit_step(np.array([3, 1, 4]), np.array([5, 9, 2]), np.arange(3), tables, np.arange(3), 3)
    feed = [(0, 2, 1), (2, 0, 2)]  # rows 0 <- pick 2; rows 2, 3 <- picks 0, 1
    ids = np.array([-1, 2, -1, -1])  # placeholders: the copies write the low halves only
    b.submit_step(ids, np.array([6, 7, 10, 3]), np.array([2, 0, 0, 1]), tables, np.arange(4), 1,
                  feed=feed)  # fmt: skip
    used = gpu.view(b.bases.ids, np.int64, 4).copy()  # the fake ran it as it was queued
    first, second = b.collect(), b.collect()
    picks = first[0][:, 0]
    assert first[0].shape == (3, 3) and second[0].shape == (4, 1)
    np.testing.assert_array_equal(used, [picks[2], 2, picks[0], picks[1]])
    np.testing.assert_array_equal(
        first[0], top_of_logits(rows_expected([3, 1, 4], [5, 9, 2]), 3)[0]
    )
    with pytest.raises(HipcError, match="no step in flight"):
        b.collect()
    # feeding needs the one step in flight, picked on the device, and runs inside both
    with pytest.raises(HipcError, match="picked on the device"):
        b.submit_step(ids, np.array([6, 7, 10, 3]), np.arange(4), tables[:4], np.arange(4), 1,
                      feed=[(0, 0, 1)])  # fmt: skip
    b.submit_step(np.array([3]), np.array([5]), np.array([0]), tables, np.array([0]), 1)
    with pytest.raises(HipcError, match="outside 1 rows / 1 picks"):
        b.submit_step(np.array([0]), np.array([6]), np.array([0]), tables, np.array([0]), 1,
                      feed=[(0, 1, 1)])  # fmt: skip
    b.collect()
    b.close()


def _topk_artifact(tmp_path, name, form: str = ""):
    """The toy with the row top-k kernel; `form` "pick" (or an older plan's "greedy"): and
    the several-block kernels, top-1 in that form."""

    def edit(plan):
        for sec in plan["targets"].values():
            sec["topk"] = {"kernel": "topk", "block": 1024, "max_k": 64}
            if form:
                sec["topk"][form] = {"kernel": f"topk_{form}", "block": 256, "blocks": 3}
                sec["topk"]["split"] = {"kernel": "topk_split", "block": 256, "blocks": 3}

    return load_artifact(write_artifact(tmp_path / name, edit=edit))


def picks_run(gpu) -> int:
    return sum(
        1 for e in gpu.executed if e[0] in ("topk", "topk_greedy", "topk_pick", "topk_split")
    )


@pytest.mark.parametrize("form", ["pick", "greedy"])
@pytest.mark.parametrize("pick_rows", [64, 1])
def test_device_picks_run_on_several_blocks_where_the_plan_has_them(
    api, tmp_path, monkeypatch, pick_rows, form
):
    """step_top launches the plan's several-block kernels (k = 1: pick, or an older plan's
    greedy, else split; their
    blocks a row, partials and counters in their own buffer) for at most PICK_ROWS rows, the
    row top-k's block a row past that; all agree with the host's pick."""
    from hipc.runtime.backends import gpu_common as gc
    from hipc.runtime.topk import top_of_logits

    monkeypatch.setattr(gc, "PICK_ROWS", pick_rows)
    art = _topk_artifact(tmp_path, "g.hipc", form)
    gpu = FakeGpu()
    b = backend(api, art, gpu, kv_blocks=8)
    tables = np.array([[0, 1, 2, 3], [4, 5, 6, 7]], np.int32)
    ids, pos, seq = np.array([3, 1]), np.array([5, 9]), np.arange(2)
    want = rows_expected([3, 1], [5, 9])
    for k in (1, 3, 1, 4):
        got = b.step_top(ids, pos, seq, tables, np.arange(2), k, logsumexp=True)
        name, grid = gpu.executed[-1][:2]
        if pick_rows >= 2:
            assert name == (f"topk_{form}" if k == 1 else "topk_split") and grid == (3, 2, 1)
        else:
            assert name == "topk" and grid == (2, 1, 1)
        host = top_of_logits(want, k)
        np.testing.assert_array_equal(got[0], host.ids)
        np.testing.assert_allclose(got[1], host.logits, rtol=1e-6)
        np.testing.assert_allclose(got[2], host.logsumexp, rtol=1e-6)
    b.close()


def test_device_draws_at_a_temperature(api, tmp_path):
    """submit_step's draws (top 1, the plan's pick kernel): a row at 1 / temperature 0 gets
    its greedy token, the others the token the host sampler's inverse_cdf draws by their u
    from the softmax at that temperature (the draws travel with the step's inputs, zeroed
    for a step without them); an older plan's greedy kernel, more rows than it picks, top 3
    and values out of range are refused."""
    from hipc.runtime.sampler import inverse_cdf

    art = _topk_artifact(tmp_path, "d.hipc", "pick")
    gpu = FakeGpu()
    b = backend(api, art, gpu, kv_blocks=8)
    assert b.draws_on_device == MAX_TOKENS
    tables = np.array([[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]], np.int32)[:2]
    ids, pos, seq = np.array([3, 1]), np.array([5, 9]), np.arange(2)
    x = rows_expected([3, 1], [5, 9])
    drawn = set()
    for inv_t in (0.05, 0.4):
        for u in (0.02, 0.3, 0.6, 0.97):
            draws = np.array([[0.0, u], [inv_t, u]], np.float32)
            b.submit_step(ids, pos, seq, tables, np.arange(2), 1, draws=draws)
            got = b.collect()
            w = np.exp((x[1].astype(np.float64) - x[1].max()) * float(np.float32(inv_t)))
            want = inverse_cdf(w, float(np.float32(u)))
            assert got[0][:, 0].tolist() == [int(np.argmax(x[0])), want]
            drawn.add(want)
    assert len(drawn) >= 3  # the draws reach different tokens
    b.submit_step(ids, pos, seq, tables, np.arange(2), 1)  # no draws: greedy rows
    assert b.collect()[0][:, 0].tolist() == np.argmax(x, axis=1).tolist()
    one = (np.array([3]), np.array([5]), np.array([0]), tables[:1], np.array([0]))
    for bad, match in [
        (dict(top=3, draws=[[0.5, 0.5]]), "with top 1"),
        (dict(top=1, draws=[[0.5, 0.5], [0.5, 0.5]]), "per out row"),
        (dict(top=1, draws=[[-1.0, 0.5]]), "must be finite"),
        (dict(top=1, draws=[[np.inf, 0.5]]), "must be finite"),
        (dict(top=1, draws=[[0.5, 1.0]]), r"u in \[0, 1\)"),
    ]:
        with pytest.raises(HipcError, match=match):
            b.submit_step(*one, **bad)
    b.close()
    old = _topk_artifact(tmp_path, "o.hipc", "greedy")
    b = backend(api, old, FakeGpu(), kv_blocks=8)
    assert b.draws_on_device == 0
    with pytest.raises(HipcError, match="at most 0 rows"):
        b.submit_step(*one, top=1, draws=[[0.5, 0.5]])
    b.close()


@pytest.mark.parametrize("form", ["", "pick", "greedy"])
def test_sampled_generation_draws_on_the_device_where_it_can(api, tmp_path, form):
    """A generation at a temperature alone on an engine whose pick kernel draws (form
    "pick") picks each decode token on the device, the next step queued ahead, and its
    tokens are those the host sampler draws from the same seed (the engines without it:
    logits to the host, as before); with top_p, logprobs or a penalty it samples on the
    host everywhere."""
    from hipc.runtime.generate import Generation, GenerationRequest
    from hipc.runtime.sampler import SamplingParams

    art = _topk_artifact(tmp_path, "s.hipc", form)
    gpu = FakeGpu()
    eng = engine_mod.CompiledEngine(art, backend(api, art, gpu))
    assert eng.can_draw == (form == "pick")
    n = 8
    runs = {}
    for name, sampling, extra in [
        ("t", SamplingParams(temperature=40.0, seed=3), {}),
        ("p", SamplingParams(temperature=40.0, top_p=0.99, seed=3), {}),
        ("lp", SamplingParams(temperature=40.0, seed=3), {"logprobs": 1}),
    ]:
        before, steps_ahead = picks_run(gpu), gpu.count("d2d_2d")
        req = GenerationRequest((1,), n, sampling, ignore_eos=True, **extra)
        gen = Generation(eng, _Letters(), req)
        "".join(gen)
        runs[name] = gen.result.token_ids
        on_device = form == "pick" and name == "t"
        assert (picks_run(gpu) - before == n - 1) == on_device, name
        assert (gpu.count("d2d_2d") - steps_ahead == n - 2) == on_device, name
    # the host's draws from the same seed, on the toy's logits
    from hipc.runtime.sampler import Sampler

    sampler, tokens, logits = Sampler(SamplingParams(temperature=40.0, seed=3)), [], None
    logits = expected([1], 0, False)[-1]
    for i in range(n):
        tokens.append(sampler(logits))
        logits = expected([tokens[-1]], 1 + i, False)[-1]
    assert runs["t"] == tokens and runs["lp"] == tokens
    assert len(set(tokens)) > 1  # a temperature that moves the picks
    eng.close()


@pytest.mark.parametrize("form", ["", "pick", "greedy"])
def test_a_decode_step_goes_next_on_the_device_pick(api, tmp_path, form):
    """submit_next(pos): the decode step after the one in flight, its token that step's
    device pick (copied on the device, not the host's placeholder), queued before it is
    collected; collect_argmax returns the two picks in order. It goes only behind one step
    picked on the device, and drop_steps waits for and drops what is in flight."""
    art = _topk_artifact(tmp_path, "n.hipc", form)
    gpu = FakeGpu()
    eng = engine_mod.CompiledEngine(art, backend(api, art, gpu))
    assert eng.can_submit_next
    want, logits = [], eng.forward([1], 0)
    for i in range(3):
        want.append(int(np.argmax(logits)))
        logits = eng.forward([want[-1]], 1 + i)
    assert want[:2] == [4, 1]  # the toy's pick changes: a placeholder 0 would show
    eng.submit([want[0]], 1, argmax=True)
    eng.submit_next(2)
    fed = int(gpu.view(eng.backend.bases.ids, np.int64, 1)[0])  # the fake ran it as queued
    assert fed == want[1] and gpu.count("d2d_2d") == 1
    assert [eng.collect_argmax(), eng.collect_argmax()] == want[1:3]
    with pytest.raises(HipcError, match="goes next only"):
        eng.submit_next(3)  # nothing in flight
    eng.submit([want[0]], 1)  # logits wanted: not picked on the device
    with pytest.raises(HipcError, match="goes next only"):
        eng.submit_next(2)
    eng.collect()
    eng.submit([want[0]], 1, argmax=True)
    eng.submit_next(2)
    eng.drop_steps()
    np.testing.assert_allclose(eng.forward([want[0]], 1), expected([want[0]], 1, False)[-1])
    with pytest.raises(HipcError, match="context overflow"):
        eng.submit([want[0]], MAX_CTX - 1, argmax=True)
        eng.submit_next(MAX_CTX)
    eng.drop_steps()
    eng.close()


@pytest.mark.parametrize("form", ["", "pick", "greedy"])
def test_greedy_generation_queues_the_next_step_ahead(api, tmp_path, form):
    """A greedy generation on an engine that can submit_next keeps a step queued behind the
    one in flight; a stop token leaves the step queued for the token after it, which is run
    and dropped (the engine free after); the length limit queues none past the end. The
    tokens are a forward() loop's argmaxes either way."""
    from hipc.runtime.generate import Generation, GenerationRequest

    art = _topk_artifact(tmp_path, "a.hipc", form)
    gpu = FakeGpu()
    eng = engine_mod.CompiledEngine(art, backend(api, art, gpu))
    calls = []
    real_next = eng.submit_next

    def next_spy(start):
        calls.append(start)
        real_next(start)

    eng.submit_next = next_spy
    prompt, n = [1], 6
    want, logits = [], eng.forward(prompt, 0)
    for i in range(n):
        want.append(int(np.argmax(logits)))
        logits = eng.forward([want[-1]], 1 + i)
    before = picks_run(gpu)
    gen = Generation(eng, _Letters(), GenerationRequest(tuple(prompt), n, ignore_eos=True))
    "".join(gen)
    assert gen.result.token_ids == want and gen.result.finish_reason == "length"
    # steps at positions 1..5 compute tokens 2..6; those from 2 on went ahead, none past 5
    assert calls == [2, 3, 4, 5]
    assert picks_run(gpu) - before == n - 1
    calls.clear()
    stop = GenerationRequest(tuple(prompt), n, ignore_eos=True, stop_token_ids=(want[1],))
    gen = Generation(eng, _Letters(), stop)
    "".join(gen)
    assert gen.result.token_ids == want[:1] and gen.result.finish_reason == "stop"
    assert calls == [2] and not eng._queued  # the step for the token after the stop, dropped
    np.testing.assert_allclose(eng.forward([3], 2), expected([3], 2, False)[-1], rtol=1e-6)
    eng.close()


@pytest.mark.parametrize("top", [1, 3])
def test_steps_ahead_feed_decode_rows_from_the_device_picks(api, tmp_path, top):
    """With the plan's top-k kernel a batch step goes in before the one in flight is
    collected: its decode rows' ids are that step's top-1 picks, copied on the device (int32
    picks into the int64 ids' low halves). Every sequence still gets its lone greedy tokens,
    with prompts chunked beside decode rows and sequences leaving at different steps; the pool
    is full after."""
    from hipc.runtime.batch import BatchEngine

    def edit(plan):
        for sec in plan["targets"].values():
            sec["topk"] = {"kernel": "topk", "block": 1024, "max_k": 64}

    art = load_artifact(write_artifact(tmp_path / "p.hipc", edit=edit))
    gpu = FakeGpu()
    eng = engine_mod.CompiledEngine(art, backend(api, art, gpu, kv_blocks=8))
    assert eng.backend.pipelines and len(eng.backend._events) == 2
    assert len(eng.backend._slot_views) == len(eng.backend._tables_stages) == 2
    want = {i: batch_runs.alone(eng, i, PROMPTS, NEW)[0] for i in range(len(PROMPTS))}
    feeds = []
    real_submit = eng.backend.submit_step

    def submit_spy(*args, feed=None):
        feeds.extend(feed or ())
        real_submit(*args, feed=feed)

    eng.backend.submit_step = submit_spy
    be = BatchEngine(eng, max_batch=4, prefill_chunk=2)
    assert be.pipelines
    got, ahead = batch_runs.run_pipelined(be, (0, 1, 2, 3), NEW, PROMPTS, top)
    assert got == want
    assert ahead >= max(NEW) - 2 and gpu.count("d2d_2d") == len(feeds)
    # rows fed from picks in another order (a sequence whose prompt ended in the step in
    # flight returns its token after that step's decode rows, and decodes among them now)
    assert any(row != src for row, src, _ in feeds), feeds
    assert gpu.count("event_record") >= be.steps
    batch_runs.assert_pool_full(be)
    # a long prompt alone: its first steps return no token, so none goes ahead of them
    be = BatchEngine(eng, max_batch=4, prefill_chunk=2)
    got, ahead = batch_runs.run_pipelined(be, (1,), NEW, PROMPTS, top)
    assert got[1] == want[1] and ahead >= NEW[1] - 2
    batch_runs.assert_pool_full(be)
    # a step goes ahead only of one whose tokens were picked on the device
    s = be.admit(PROMPTS[0], len(PROMPTS[0]) + 2)
    assert be.submit(0)
    with pytest.raises(HipcError, match="picked on the device"):
        be.submit(1, ahead=True)
    be.collect()
    be.release(s)
    batch_runs.assert_pool_full(be)
    eng.close()
    assert gpu.count("event_destroy") == 2


def test_eager_batch_and_prefill_steps_of_one_size_keep_their_lists(api, tmp_path, monkeypatch):
    """Without graphs (HIPC_SYNC_LAUNCHES=1) launches are packed once per step shape: a batch
    step and a prefill step of the same rows are different lists, even of one length."""

    def batch_like_prefill(plan):
        for section in plan["targets"].values():
            batch = json.loads(json.dumps(section["steps"]["prefill"]))
            batch[2]["args"][0]["offset"] = 32  # "big" on another scratch address
            section["steps"]["batch"] = batch

    art = load_artifact(write_artifact(tmp_path / "b.hipc", edit=batch_like_prefill))
    monkeypatch.setenv(gpu_common.SYNC_ENV, "1")
    gpu = FakeGpu()
    b = backend(api, art, gpu, kv_blocks=4)
    tables = np.array([[0, 1, 2, 3], [3, 2, 1, 0]], np.int32)
    for seq, offset in (([0, 1], 32), ([0, 0], 16), ([1, 0], 32)):
        gpu.executed.clear()
        b.step(np.array([1, 2]), np.array([5, 6]), np.array(seq), tables, np.arange(2))
        big = next(e for e in gpu.executed if e[0] == "big")
        assert big[4][0] == b.bases.scratch + offset
    b.close()


def test_cancelling_on_a_gpu_backend_frees_the_blocks(api, artifact):
    from hipc.runtime.batch import BatchEngine

    eng = engine_mod.CompiledEngine(artifact, backend(api, artifact, FakeGpu(), kv_blocks=8))
    be = BatchEngine(eng, max_batch=4, prefill_chunk=2)
    for round_ in range(3):

        def leave(i, step, round_=round_):
            return step >= 1 + (i + round_) % 4

        got = batch_runs.run(be, [0, 0, 1, 2], [20] * 4, PROMPTS, leave=leave)
        assert len(got) == 4
        batch_runs.assert_pool_full(be)
    eng.close()


# -- recurrent states: snapshots on the device ------------------------------------------


def add_recurrent_layer(plan):
    """A recurrent state (H floats) updated by the `recur` kernel after addpos, every step."""
    plan["states"].append({"name": "rec", "kind": "recurrent", "dtype": "float32", "shape": [H]})
    recur = {
        "group": "g_rec",
        "kernel": "recur",
        "grid": [1, "T"],
        "block": [32],
        "args": [
            {"kind": "arena", "offset": 0},
            {"kind": "int", "value": "T"},
            {"kind": "state", "index": 2},
            {"kind": "input", "name": "pos"},
            {"kind": "input", "name": "seq"},
        ],
    }
    for sec in plan["targets"].values():
        for steps in sec["steps"].values():
            steps.insert(2, dict(recur))


def toy_recurrent_logits(tokens):
    """The toy model with the recurrent layer over a whole sequence from position 0, in NumPy."""
    x = EMB[np.asarray(tokens)] + np.arange(len(tokens), dtype=np.float32)[:, None]
    r = np.zeros(H, np.float32)
    for t in range(len(tokens)):
        r = r / 2 + x[t]
        x[t] = r
    return x @ W.T


@pytest.fixture
def recurrent_artifact(tmp_path):
    return load_artifact(write_artifact(tmp_path / "rec.hipc", edit=add_recurrent_layer))


def test_snapshot_and_restore_copy_on_the_device(api, recurrent_artifact):
    gpu = FakeGpu()
    b = backend(api, recurrent_artifact, gpu)
    solo = b.bases.states[2] + 4 * H * b.SOLO  # the one-sequence view's slot
    rec = gpu.view(solo, np.float32, H)
    rec[:] = [1, 2, 3, 4]
    allocs = gpu.count("malloc")
    snap = b.snapshot()
    assert gpu.count("malloc") == allocs + 1
    assert ("d2d", snap, solo, 4 * H) in gpu.calls  # the recurrent state only
    assert gpu.count("d2d") == 1 and gpu.count("d2h") == 0
    b.reset()
    assert not rec.any()
    b.restore(snap)
    np.testing.assert_array_equal(rec, [1, 2, 3, 4])
    b.release(snap)
    again = b.snapshot()  # the released buffer, not a new allocation
    assert again == snap and gpu.count("malloc") == allocs + 1
    b.close()
    assert sorted(gpu.freed) == sorted(set(gpu.freed)) and snap in gpu.freed
    assert not gpu.mem


def test_no_snapshot_where_the_gpu_is_full(api, recurrent_artifact):
    gpu = FakeGpu()
    b = backend(api, recurrent_artifact, gpu)
    gpu.free_bytes = 0
    assert b.snapshot() is None  # the sequence keeps none there; nothing raised
    b.close()


def _greedy_run(engine, prompt, n=3):
    """(greedy tokens, the logits each step saw) of a new sequence; decode through
    submit/collect as the generation loop does."""
    engine.reset()
    logits = [engine.forward(prompt, 0)]
    out = []
    for i in range(n):
        out.append(int(logits[-1].argmax()))
        engine.submit([out[-1]], len(prompt) + i)
        logits.append(engine.collect())
    return out, np.stack(logits)


def test_prefix_reuse_on_the_gpu_equals_fresh_runs(api, recurrent_artifact):
    """runtime/recurrent.py over a GPU backend: snapshots every step (4 positions here) and
    at a prompt's end; the same prompt twice, a shared prefix, a next turn, an unrelated
    prompt, each equal to an engine that never reuses and to the toy model in NumPy."""
    gpu = FakeGpu()
    engine = engine_mod.CompiledEngine(recurrent_artifact, backend(api, recurrent_artifact, gpu))
    fresh_backend = backend(api, recurrent_artifact, FakeGpu())
    fresh = engine_mod.CompiledEngine(recurrent_artifact, fresh_backend)
    assert engine.sequence is not None and engine.sequence.interval == MAX_TOKENS
    fresh.sequence.max_snapshots = 0

    def check(prompt, reused):
        got = _greedy_run(engine, prompt)
        assert engine.reused == reused
        want = _greedy_run(fresh, prompt)
        assert fresh.reused == 0
        assert got[0] == want[0]
        np.testing.assert_allclose(got[1], want[1], rtol=1e-6)
        model = toy_recurrent_logits(prompt + got[0])[len(prompt) - 1 :]
        np.testing.assert_allclose(got[1], model, rtol=1e-5)
        return got[0]

    a = [1, 2, 3, 4, 0, 1, 2]
    answer = check(a, 0)
    launches = len(gpu.executed)
    assert check(a, len(a)) == answer  # from the snapshot at its end: no prefill launched
    assert not any(e[0] == "embed" and e[1] == (len(a), 1, 1) for e in gpu.executed[launches:])
    check([*a[:6], 3, 3], 4)  # from the snapshot at 4, a whole step
    # the first prompt again: b's K/V replaced a's from position 6, so its end's snapshot
    # is stale and the one at 4 serves; then a next turn: decoding a crossed position 8,
    # where a snapshot was taken
    check(a, 4)
    check(a + answer + [2], 8)
    check([4, 4, 0], 0)  # nothing shared
    assert gpu.count("d2d") > 0  # snapshots and restores: device-to-device copies
    engine.close()
    fresh.close()
    assert not gpu.mem  # snapshots freed with the engine


def test_decode_inside_a_span_is_submitted_asynchronously(api, recurrent_artifact):
    gpu = FakeGpu()
    engine = engine_mod.CompiledEngine(recurrent_artifact, backend(api, recurrent_artifact, gpu))
    engine.reset()
    engine.forward([1, 2, 3, 4, 0], 0)  # ends at 5, a snapshot there
    syncs = gpu.count("sync")
    engine.submit([1], 5)  # 5 -> 6: no boundary, nothing to copy
    assert gpu.count("sync") == syncs  # queued, not waited for
    engine.collect()
    engine.submit([2], 6)
    engine.collect()
    copies = gpu.count("d2d")
    engine.submit([3], 7)  # 7 -> 8 reaches a boundary: run in collect, then a snapshot
    engine.collect()
    assert gpu.count("d2d") == copies + 1
    np.testing.assert_allclose(
        engine.forward([0], 8), toy_recurrent_logits([1, 2, 3, 4, 0, 1, 2, 3, 0])[-1], rtol=1e-5
    )
    engine.close()


class PlanCheckingGpu(FakeGpu):
    """Runs no kernel: each launch of a real AMD artifact's plan is held to its code object's
    metadata (support.amd_kernel_metadata): the block within the kernel's launch bounds and a
    whole number of waves, dynamic plus static LDS within the 64 KiB a workgroup has."""

    def __init__(self, meta: dict[str, dict], **kw) -> None:
        super().__init__(**kw)
        self.meta = meta

    def execute(self, rec, via: str) -> None:
        name, _grid, block, shared, _args = rec
        self.executed.append((*rec, via))
        m = self.meta[name]
        assert block[0] <= int(m[".max_flat_workgroup_size"]), (name, block)
        assert block[0] % int(m[".wavefront_size"]) == 0, (name, block)
        assert shared + int(m[".group_segment_fixed_size"]) <= 64 * 1024, (name, shared)


@pytest.mark.parametrize("arch", ["gfx942", "gfx1100", "gfx1201"])
def test_amd_prefill_plan_on_the_fake_hip(arch, tmp_path):
    """A real AMD artifact (clang-19) whose plan the hip backend runs on the fake driver with
    the code object's own kernel signatures: the prefill attention is the flash kernel on the
    matrix instructions, one block per 64 query rows and head, 4 waves; every launch of prefill
    and decode within its kernel's bounds. (Nothing here runs the kernels: no AMD GPU.)"""
    import shutil

    from hipc.compiler.kernels.attention import AttentionParams, flash_attention
    from hipc.compiler.options import CompileOptions
    from hipc.compiler.pipeline import compile_model
    from hipc.compiler.targets import GpuTarget

    from support import IN_CI, amd_kernel_metadata, write_tiny_hf

    clang, readelf = shutil.which("clang++-19"), shutil.which("llvm-readelf-19")
    if clang is None or readelf is None:
        why = "clang++-19 and llvm-readelf-19 build and read AMD code objects"
        (pytest.fail if IN_CI else pytest.skip)(f"{why} (.ci/run installs them)")
    model = write_tiny_hf(tmp_path / "m", dtype="bfloat16", hidden_size=128, intermediate_size=96,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)  # fmt: skip
    out = tmp_path / "m.hipc"
    compile_model(model, out, CompileOptions(targets=(arch,), max_context=128), verbose=False)
    co = out / "kernels" / f"{arch}.co"
    meta = amd_kernel_metadata(co, readelf)
    plan = json.loads((out / "plan.json").read_text())
    for launch in [x for step in plan["targets"][arch]["steps"].values() for x in step]:
        assert len(launch["args"]) == len(meta[launch["kernel"]]["args"]), launch["kernel"]
    # the fake module: each kernel's arguments as the code object declares them
    types = {4: "i32", 8: "u64"}
    sigs = {n: [types[int(a[".size"])] for a in m["args"]] for n, m in meta.items()}
    co.write_bytes(json.dumps({"kernels": sigs}).encode())
    manifest = json.loads((out / "manifest.json").read_text())
    rel = f"kernels/{arch}.co"
    manifest["files"][rel] = {"size": co.stat().st_size,
                              "sha256": hashlib.sha256(co.read_bytes()).hexdigest()}  # fmt: skip
    (out / "manifest.json").write_text(json.dumps(manifest))

    wave = 64 if arch.startswith("gfx9") else 32
    gpu = PlanCheckingGpu(meta, gcn=f"{arch}:xnack-")
    b = HipBackend(load_artifact(out), hip=FakeHip(gpu))
    try:
        T = 70
        b.forward(np.arange(T) % 97, 0, True)
        flash = [e for e in gpu.executed if e[0].endswith("_flash")]
        assert len(flash) == 2  # one per layer
        p = AttentionParams(
            NH=2, NKV=1, D=64, scale=0.125, window=0, interleaved=False, norm_eps=0.0
        )
        fk = flash_attention("f", p, GpuTarget(arch), [], "bfloat16", 128)
        for _, grid, block, shared, args, _ in flash:
            assert grid == (2, 2, 1) and block == (4 * wave, 1, 1)  # cdiv(70, 64) x heads
            assert shared == fk.shared and args[2] == T  # the kernel's T
        assert not any(e[0].endswith("_attn") for e in gpu.executed)  # no SIMT attention
        gpu.executed.clear()
        b.forward(np.array([5]), T, False)  # decode: the captured graph
        assert gpu.executed and all(e[5] == "graph" for e in gpu.executed)
    finally:
        b.close()


# -- recurrent states in slots: hybrids batch on a GPU backend ----------------------------


def test_hybrids_batch_on_a_gpu_backend(api, recurrent_artifact):
    """runtime/batch.py over a recurrent model on a GPU backend: each sequence's state in its
    slot (the pools grown to the batch's slots, the captured graphs dropped with the old
    addresses), prefill chunks beside decode rows through the batch list eagerly, decode rows
    through the bucket graphs; each sequence gets what the toy model gives in NumPy and
    what it gets alone, and the one-sequence view's state survives the growth."""
    from hipc.runtime.batch import BatchEngine, batchable

    gpu = FakeGpu()
    eng = engine_mod.CompiledEngine(
        recurrent_artifact, backend(api, recurrent_artifact, gpu, kv_blocks=8)
    )
    b = eng.backend
    assert batchable(eng) and b.slots == 2 and (b.PAD, b.SOLO) == (2, 3)
    eng.reset()
    solo = eng.forward([1, 2, 3], 0)  # the SOLO slot holds this sequence's state
    assert b.graph_captured
    be = BatchEngine(eng, max_batch=4, prefill_chunk=2)
    assert b.slots == 4 and (b.PAD, b.SOLO) == (4, 5) and not b._graphs
    # the one sequence continues where it was, in its moved slot
    np.testing.assert_allclose(solo, toy_recurrent_logits([1, 2, 3])[-1], rtol=1e-5)
    np.testing.assert_allclose(
        eng.forward([4], 3), toy_recurrent_logits([1, 2, 3, 4])[-1], rtol=1e-5
    )
    want = {i: batch_runs.alone(eng, i, PROMPTS, NEW) for i in range(len(PROMPTS))}
    seen = []
    real_step = b.step

    def spy(ids, pos, seq, tables, out_rows):
        seen.append((len(ids), len(set(seq.tolist()))))
        return real_step(ids, pos, seq, tables, out_rows)

    b.step = spy
    got = batch_runs.run(be, [0, 0, 1, 3], NEW, PROMPTS)
    for i in want:
        assert got[i][0] == want[i][0]
        model = toy_recurrent_logits(PROMPTS[i] + got[i][0])[len(PROMPTS[i]) - 1 :][: NEW[i]]
        np.testing.assert_allclose(np.array(got[i][1]), model, rtol=1e-5)
        # the fake head's matrix product rounds by the number of rows
        np.testing.assert_allclose(np.array(got[i][1]), np.array(want[i][1]), atol=1e-5)
    kinds = {"mixed" if d < n else "batch" if n > 1 else "one" for n, d in seen}
    assert kinds == {"mixed", "batch", "one"}, seen
    assert any(k == "batch" for k, _ in b._graphs)
    batch_runs.assert_pool_full(be)
    assert sorted(be._slots) == list(range(be.max_batch))
    be.drop_snapshots()
    eng.close()
    assert not gpu.mem


def test_cancelled_hybrid_sequences_free_their_blocks_and_slots(api, recurrent_artifact):
    """Sequences cancelled in prefill and in decode: blocks back to the pool, slots back to
    the batch, and a later sequence in a reused slot starts from a zeroed state."""
    from hipc.runtime.batch import BatchEngine

    eng = engine_mod.CompiledEngine(
        recurrent_artifact, backend(api, recurrent_artifact, FakeGpu(), kv_blocks=8)
    )
    be = BatchEngine(eng, max_batch=4, prefill_chunk=2)
    for round_ in range(3):

        def leave(i, step, round_=round_):
            return step >= 1 + (i + round_) % 4

        got = batch_runs.run(be, [0, 0, 1, 2], [20] * 4, PROMPTS, leave=leave)
        assert len(got) == 4
        batch_runs.assert_pool_full(be)
        assert sorted(be._slots) == list(range(be.max_batch))
    got = batch_runs.run(be, [0, 1], NEW[:2], PROMPTS[:2])
    for i in (0, 1):
        model = toy_recurrent_logits(PROMPTS[i] + got[i][0])[len(PROMPTS[i]) - 1 :][: NEW[i]]
        np.testing.assert_allclose(np.array(got[i][1]), model, rtol=1e-5)
    eng.close()


def test_a_hybrid_step_refuses_a_sequence_in_two_runs(api, recurrent_artifact):
    b = backend(api, recurrent_artifact, FakeGpu(), kv_blocks=8)
    tables = np.array([[0, 1, 2, 3], [4, 5, 6, 7]], np.int32)
    with pytest.raises(HipcError, match="one run of consecutive positions per sequence"):
        b.step(np.array([1, 2, 3]), np.array([0, 0, 1]), np.array([0, 1, 0]), tables, np.arange(3))
    with pytest.raises(HipcError, match="one run of consecutive positions per sequence"):
        b.step(np.array([1, 2]), np.array([3, 5]), np.array([0, 0]), tables, np.arange(2))
    b.close()


def test_a_plan_without_recurrent_slots_is_refused(api, tmp_path):
    """A launch updating a recurrent state without `seq` (a plan from before GPU slots)."""

    def old_recurrent(plan):
        add_recurrent_layer(plan)
        for sec in plan["targets"].values():
            for steps in sec["steps"].values():
                for x in steps:
                    if x["kernel"] == "recur":
                        x["args"] = [a for a in x["args"] if a.get("name") != "seq"]

    art = load_artifact(write_artifact(tmp_path / "old.hipc", edit=old_recurrent))
    gpu = FakeGpu()
    with pytest.raises(HipcError, match="kernel recur updates a recurrent state without"):
        backend(api, art, gpu)
    assert not gpu.mem  # nothing left allocated


@pytest.mark.parametrize("on_device", [True, False])
def test_step_top_returns_each_wanted_rows_top_k(api, tmp_path, on_device):
    """step_top(k): the wanted rows' k largest logits (ids, logits[, log-sum-exp]) as top_of_logits picks
    them from step()'s logits; with the plan's top-k kernel only rows x k values (and ids, and
    two stats per row) come back, never a logits row; without it (an older plan) the same
    result from the logits on the host."""
    from hipc.runtime.topk import top_of_logits

    def edit(plan):
        for sec in plan["targets"].values():
            sec["topk"] = {"kernel": "topk", "block": 1024, "max_k": 64}

    art = load_artifact(write_artifact(tmp_path / "t.hipc", edit=edit if on_device else None))
    gpu = FakeGpu()
    b = backend(api, art, gpu, kv_blocks=4)
    tables = np.array([[0, 1, 2, 3], [3, 2, 1, 0], [1, 0, 3, 2]], np.int32)
    steps = [  # (ids, pos, seq, out_rows): a batch of 3 rows, a mixed step, one row
        (np.array([1, 4, 2]), np.array([5, 9, 3]), np.arange(3), np.arange(3)),
        (np.array([1, 2, 3, 0]), np.array([0, 1, 2, 7]), np.array([0, 0, 0, 1]), np.array([2, 3])),
        (np.array([3]), np.array([11]), np.array([2]), np.array([0])),
    ]
    for k in (1, 3, 5):
        for ids, pos, seq, rows in steps:
            want = top_of_logits(b.step(ids, pos, seq, tables, rows).copy(), k)
            n = len(gpu.calls)
            got_ids, got_logits, lse = b.step_top(ids, pos, seq, tables, rows, k, logsumexp=True)
            np.testing.assert_array_equal(got_ids, want.ids)
            np.testing.assert_array_equal(got_logits, want.logits)
            np.testing.assert_allclose(lse, want.logsumexp, rtol=1e-6)
            copies = [c[3] for c in gpu.calls[n:] if c[0] == "d2h"]
            two = b.step_top(ids, pos, seq, tables, rows, k)  # the server's form: (ids, logits)
            assert len(two) == 2 and np.array_equal(two[0], want.ids)
            assert b.max_top_k == (64 if on_device else 0)
            if on_device:
                assert sorted(copies) == sorted([4 * len(rows) * k] * 2 + [8 * len(rows)])
                assert [e[4][2] for e in gpu.executed if e[0] == "topk"][-1] == k
    with pytest.raises(HipcError, match="k must be 1 to 64"):
        b.step_top(np.array([3]), np.array([11]), np.array([2]), tables, np.array([0]), 65)
    b.close()


def test_gpu_snapshot_marks_follow_the_prefill_chunk(api, tmp_path):
    """A step ends at each snapshot mark: on a GPU they sit a prefill chunk apart (rounded down
    to the delta rule's 64), so a long prompt is not prefilled in 64-token steps; the end of
    the prompt's last full block stays a mark for prefix reuse."""
    from hipc.runtime.batch import BatchEngine, Sequence

    def wide(plan):
        add_recurrent_layer(plan)
        plan["max_tokens"], plan["max_context"] = 200, 1024
        for st in plan["states"]:
            if st["kind"] == "kv":
                st["shape"][0] = 1024

    art = load_artifact(write_artifact(tmp_path / "wide.hipc", edit=wide))
    eng = engine_mod.CompiledEngine(art, backend(api, art, FakeGpu(), kv_blocks=64))
    be = BatchEngine(eng, max_batch=2)
    s = Sequence(id=0, tokens=list(range(600)), prompt_len=600, slot=0)
    assert be._marks(s, 599) == [192, 384, 576, 592]  # 592: the last full block of 16
    be.drop_snapshots()
    eng.close()
