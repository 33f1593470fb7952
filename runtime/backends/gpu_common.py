"""What the cuda and hip backends share: buffers, argument packing, the launch loop,
decode-graph capture, error naming. Each backend is a thin `GpuDriver` adapter over
its binding (cuda-bindings' driver API, hip-python); everything else lives here.

One engine holds, on the device: the weights (one block, uploaded once from the
memory-mapped safetensors file, tensors at 256-byte offsets), the states (zeroed: each KV
state a paged pool of kv_block-position blocks, as on the cpu target, in one block; each
recurrent state a pool of slots, row t's sequence seq[t] also its slot, in another, which
ensure_slots regrows), the activation arena, the scratch buffer, the step
inputs (ids int64, pos and seq int32, max_tokens of each, in one buffer), the block
tables and the logits (float32 x max_tokens x vocab); and pinned host mirrors of the
inputs, tables and logits. A step copies the inputs (and the tables when they changed)
in, runs a launch list (the plan's targets[arch] steps, see hipc.base.launch_plan) on one
stream, copies the logits rows out and synchronizes (waits for its event, where the driver
has events: a second step may then be queued behind it, `submit_step(feed=...)`, its decode
rows' ids copied on the device from the first one's top-1 picks; host staging alternates
between two pinned slots so that the host never writes what a queued copy still reads).

`step()` runs rows of many sequences with the cpu backend's contract (runtime/batch.py
drives it): one row is the decode list; rows of as many sequences (decode rows) the batch
list, padded up to a bucket of BUCKETS; any other step (prefill chunks) the prefill list,
except where a model with recurrent states mixes sequences: the batch list, eagerly (its
deltanet kernel steps each sequence's run in its slot; the prefill list's chunked one takes
one sequence).
The decode list and each bucket's batch list are captured once as graphs and replayed:
their kernels read ids, positions and block tables from device memory, so one graph
serves every position and sequence. Padding rows are sequence PAD, whose table names only
the spare block at the pool's end (and whose recurrent slot is a spare one), so they write
nowhere a sequence reads. `forward()` is the one-sequence view (the SOLO table: block b of
the sequence is pool block b; SOLO's recurrent slot).

Kernel arguments use the `kernelParams` convention of cuLaunchKernel and
hipModuleLaunchKernel: a C array of N `void*`, entry i pointing at argument i's value
(a uint64 device address or an int32); the bindings take the array's address as a
Python int. The driver copies the values at launch (and at graph capture), so the
ctypes storage only has to outlive the launch call.

A failed kernel is named: launch-time errors at the launch, asynchronous ones by
synchronizing after each launch (HIPC_SYNC_LAUNCHES=1, which also turns graphs off)
or, when the step's final synchronize fails and the context is still usable, by
re-running the step's launches one at a time. Errors that poison the context
(illegal address and the like: every later call returns them) cannot be located
after the fact; the message then says to rerun with HIPC_SYNC_LAUNCHES=1.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, Protocol

import numpy as np

from hipc.base.errors import HipcError
from hipc.base.launch_plan import TOPK_MAX, Bases, Launch, StateSpec, TargetPlan, states
from hipc.base.progress import byte_bar
from hipc.base.safetensors_file import SafetensorsFile
from hipc.runtime.artifact import Artifact
from hipc.runtime.topk import TopK, logsumexp, top_of_logits

SYNC_ENV = "HIPC_SYNC_LAUNCHES"
ALIGN = 256  # offsets of tensors inside one allocation: cudaMalloc's own guarantee
DEFAULT_SHARED_LIMIT = 48 * 1024  # dynamic shared memory above this needs an opt-in (CUDA)
UPLOAD_CHUNK = 64 << 20
PROGRESS_MIN_BYTES = 10**9

_ARG_CTYPES = {"u64": ctypes.c_uint64, "i32": ctypes.c_int32}


class DriverError(Exception):
    """A driver call that did not return success: the call and the error's name."""

    def __init__(self, call: str, error: str, *, oom: bool = False) -> None:
        super().__init__(f"{call} failed: {error}")
        self.call = call
        self.error = error
        self.oom = oom


class GpuDriver(Protocol):
    """What a backend needs from a GPU API; every method raises DriverError on failure.

    Pointers are ints. Copies, memsets, launches and graph launches are enqueued on
    the driver's one stream; `synchronize` waits for it.
    """

    api: str  # "CUDA" / "HIP", for messages
    arch: str  # the target name of the device: "sm_90", "gfx942"
    device_name: str
    max_shared_per_block: int  # the most dynamic shared memory one block may be given

    def activate(self) -> None: ...  # make the device/context current on this thread
    def mem_info(self) -> tuple[int, int]: ...  # (free, total) bytes
    def load_module(self, image: bytes) -> None: ...
    def get_function(self, name: str) -> Any: ...
    def set_dynamic_shared(self, fn: Any, nbytes: int) -> None: ...
    def malloc(self, nbytes: int) -> int: ...
    def free(self, ptr: int) -> None: ...
    def host_malloc(self, nbytes: int) -> int: ...  # pinned
    def host_free(self, ptr: int) -> None: ...
    def memset0(self, ptr: int, nbytes: int) -> None: ...
    def h2d(self, dst: int, src: int, nbytes: int) -> None: ...
    def d2h(self, dst: int, src: int, nbytes: int) -> None: ...
    def d2d(self, dst: int, src: int, nbytes: int) -> None: ...

    # True where launch(overlap=True) lets a kernel start before the previous one ends
    overlap_launches: bool

    def launch(
        self,
        fn: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared: int,
        params: int,
        overlap: bool = False,
    ) -> None: ...
    def synchronize(self) -> None: ...
    # steps ahead: events on the stream, and a 2-D device copy (`height` rows of `width`
    # bytes, pitches apart)
    def new_event(self) -> Any: ...
    def record(self, event: Any) -> None: ...
    def wait(self, event: Any) -> None: ...  # the host waits for the work before its record
    def destroy_event(self, event: Any) -> None: ...
    def d2d_2d(
        self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int
    ) -> None: ...
    # a 2-D bf16 TMA tensor map (CUDA sm_90): rows x cols at addr, copied in box_cols x
    # box_rows boxes with the 128-byte swizzle; a ctypes object holding its 128 bytes
    def tensor_map(self, addr: int, cols: int, rows: int, box_cols: int, box_rows: int) -> Any: ...
    def begin_capture(self) -> None: ...
    def end_capture(self) -> Any: ...  # the captured graph
    def instantiate(self, graph: Any) -> Any: ...  # the executable graph
    def graph_launch(self, graph_exec: Any) -> None: ...
    def destroy_graph(self, graph: Any, graph_exec: Any) -> None: ...  # either may be None
    def close(self) -> None: ...  # stream, module, context; idempotent


class PackedArgs:
    """One launch's arguments in `kernelParams` form (see the module docstring). A "tmap"
    argument is given as its encoded 128 bytes (GpuDriver.tensor_map)."""

    __slots__ = ("pointers", "values")

    def __init__(self, resolved: Sequence[tuple[str, Any]]) -> None:
        values = []
        for ctype, value in resolved:
            if ctype == "tmap":
                values.append(value)
                continue
            if ctype == "i32" and not -(2**31) <= value < 2**31:
                raise HipcError(f"kernel argument {value} does not fit a 32-bit int")
            values.append(_ARG_CTYPES[ctype](value))
        self.values = values
        self.pointers = (ctypes.c_void_p * max(len(values), 1))(
            *[ctypes.addressof(v) for v in values]
        )

    @property
    def address(self) -> int:
        """The `void**` to pass as kernelParams (0 for a kernel without arguments)."""
        return ctypes.addressof(self.pointers) if self.values else 0


def aligned_offsets(sizes: Sequence[int], align: int = ALIGN) -> tuple[tuple[int, ...], int]:
    """Offsets of `sizes` packed into one block, each at a multiple of `align`; block size."""
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(pos)
        pos += -(-int(n) // align) * align
    return tuple(offsets), pos


# batch sizes whose batch step is captured as a graph: a batch of n rows runs the smallest
# bucket >= n with the rest padded (larger batches run eagerly)
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes of every device allocation of one engine."""

    weight_offsets: tuple[int, ...]
    weights: int
    state_offsets: tuple[int, ...]  # the KV pools' in `states` (recurrent states: 0)
    states: int
    kv_bytes: int  # the states (KV pools and recurrent slots) without alignment padding
    recurrent_offsets: tuple[int, ...]  # the recurrent pools' in `recurrent` (KV: 0)
    recurrent: int  # a separate block: it grows with the batch's slots (ensure_slots)
    arena: int
    scratch: int
    inputs: int  # ids, pos, seq, the device pick's draws
    tables: int
    logits: int
    top: int = 0  # step_top's values, ids and row stats
    picks: int = 0  # the several-block top-k's partials and counters (PICK_ROWS rows)

    @property
    def total(self) -> int:
        return (
            self.weights
            + self.states
            + self.recurrent
            + self.arena
            + self.scratch
            + self.inputs
            + self.tables
            + self.logits
            + self.top
            + self.picks
        )


def table_rows(gpu: TargetPlan) -> int:
    """Rows of the device block tables: a slot per sequence a step may hold, PAD and SOLO."""
    return gpu.max_tokens + 2


def recurrent_slots(slots: int) -> int:
    """Slots of each recurrent pool for `slots` batch sequences: theirs, then the spare slot
    padding rows write (PAD) and the one-sequence view's (SOLO)."""
    return slots + 2


def device_memory(
    plan: dict[str, Any],
    gpu: TargetPlan,
    weight_nbytes: Sequence[int],
    positions: int | None = None,
    slots: int = 0,
) -> DeviceMemory:
    """Device bytes per buffer; `positions` sizes the KV pools (default: as compiled),
    `slots` the recurrent pools (batch sequences; recurrent_slots)."""
    specs = states(plan)
    kv_sizes = [s.nbytes(positions) if s.positional else 0 for s in specs]
    rec_sizes = [0 if s.positional else s.nbytes() * recurrent_slots(slots) for s in specs]
    w_off, w_total = aligned_offsets(weight_nbytes)
    s_off, s_total = aligned_offsets(kv_sizes)
    r_off, r_total = aligned_offsets(rec_sizes)
    kv_table = -(-int(plan["max_context"]) // max(gpu.kv_block, 1))
    return DeviceMemory(
        weight_offsets=w_off,
        weights=w_total,
        state_offsets=s_off,
        states=s_total,
        kv_bytes=sum(kv_sizes) + sum(rec_sizes),
        recurrent_offsets=r_off,
        recurrent=r_total,
        arena=gpu.arena_bytes,
        scratch=gpu.scratch_bytes,
        inputs=INPUT_BYTES * gpu.max_tokens,
        tables=4 * table_rows(gpu) * kv_table,
        logits=4 * gpu.max_tokens * gpu.vocab,
        top=4 * gpu.max_tokens * (2 * TOPK_MAX + 2) if gpu.topk else 0,
        picks=4 * pick_rows(gpu) * (pick_blocks(gpu) * (2 * TOPK_MAX + 2) + 1),
    )


# step input bytes a row: the id (int64), position and sequence (int32), and the draw a
# device pick reads (float32: 1 / temperature, u)
INPUT_BYTES = 24

# the most rows a step's top-k runs on several blocks a row (more: a block a row, which with
# that many rows fills the GPU anyway)
PICK_ROWS = 64


def pick_rows(gpu: TargetPlan) -> int:
    return min(gpu.max_tokens, PICK_ROWS) if pick_blocks(gpu) else 0


def pick_blocks(gpu: TargetPlan) -> int:
    """Blocks a row of the plan's several-block top-k kernels; 0 where it has neither."""
    return max((int(spec["blocks"]) for spec in topk_kernels(gpu)[1:]), default=0)


def topk_kernels(gpu: TargetPlan) -> list[dict[str, Any]]:
    """The plan's top-k kernels: the row top-k, then the several-block ones it has (topk's
    "pick", k = 1, or an older plan's "greedy", and "split", k > 1: kernel, block, blocks);
    none without the row top-k."""
    topk = gpu.topk or {}
    forms = ("pick", "greedy", "split")
    return [topk, *(topk[key] for key in forms if key in topk)] if topk else []


def fit_positions(
    plan: dict[str, Any],
    gpu: TargetPlan,
    weight_nbytes: Sequence[int],
    free: int,
    most: int,
    slots: int = 0,
) -> int:
    """The most KV positions (<= most) whose allocations fit in 95% of `free` (0 if none do).

    The other 5% is left for the driver, the graphs and the allocator's rounding.
    """
    budget = int(0.95 * free)
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if device_memory(plan, gpu, weight_nbytes, mid, slots).total <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


class _Pending(NamedTuple):
    """A queued step: what collect() waits for and reads back."""

    launches: Sequence[Launch]
    B: int
    rows: int
    where: str
    pick: Any
    kind: str
    top: int
    slot: int  # its host staging slot
    event: Any  # recorded after its copies back, or None (collect synchronizes the stream)
    n_out: int  # the rows it returns (a step fed from it reads these picks)


def sync_launches_from_env() -> bool:
    return os.environ.get(SYNC_ENV, "").strip() not in ("", "0")


class _KernelFailed(Exception):
    def __init__(self, launch: Launch, err: DriverError) -> None:
        super().__init__(launch.kernel)
        self.launch = launch
        self.err = err


class GpuBackend:
    """The shared engine behind CudaBackend and HipBackend (same surface as CpuBackend)."""

    name = "gpu"

    def __init__(
        self,
        artifact: Artifact,
        driver: GpuDriver,
        max_context: int | None = None,
        kv_blocks: int | None = None,
    ) -> None:
        """kv_blocks: blocks in each KV pool (default and minimum: one sequence of
        max_context positions; fewer where the GPU's free memory holds fewer)."""
        self._requested_context = max_context
        self._requested_blocks = kv_blocks
        self._closed = False
        self._driver = driver
        self._allocs: list[tuple[str, int]] = []
        self._host_allocs: list[int] = []
        # captured graphs by (step, rows): ("decode", 1) and ("batch", bucket)
        self._graphs: dict[tuple[str, int], tuple[Any, Any, list[PackedArgs]]] = {}
        self._tmaps: dict[tuple[int, ...], Any] = {}
        self._packed: dict[tuple[int, int, int], list] = {}
        self._broken: str | None = None
        # the steps submitted and not collected, oldest first: one, or two where a step was
        # queued ahead of the last one (its decode rows' ids from that step's device picks)
        self._pending: collections.deque[_Pending] = collections.deque()
        self._queued = 0  # steps queued so far: step k uses host staging slot k % slots
        self._events: list[Any] = []
        self._upload_tables = 0  # table rows changed on the host since the last step
        self._spare_snapshots: list[int] = []  # released snapshot buffers, reused first
        self.sync_launches = sync_launches_from_env()
        try:
            self._setup(artifact)
        except BaseException:
            self.close()
            raise

    # -- loading -------------------------------------------------------------------

    def _setup(self, artifact: Artifact) -> None:
        d = self._driver
        self.arch = d.arch
        self.device_name = d.device_name
        plan = artifact.plan
        info = artifact.manifest["targets"].get(self.arch)
        if info is None:
            raise HipcError(
                f"{artifact.path}: no code object for this GPU ({self.device_name}, {self.arch}); "
                f"the artifact has: {', '.join(artifact.targets) or 'none'}; "
                f"compile for it with: hipc compile MODEL --target {self.arch}"
            )
        sections = plan.get("targets") or {}
        try:
            self.gpu = TargetPlan.from_json(plan, self.arch if self.arch in sections else None)
        except (KeyError, ValueError, TypeError) as e:
            raise HipcError(
                f"{artifact.path}: plan.json has no GPU launch plan for {self.arch} ({e!r}); "
                f"recompile with: hipc compile MODEL --target {self.arch}"
            ) from None
        self.max_tokens = self.gpu.max_tokens
        self._buckets: tuple[int, ...] | None = None
        self.vocab = self.gpu.vocab
        self._states: tuple[StateSpec, ...] = states(plan)
        self.max_context = int(plan["max_context"])

        code_object = artifact.file(info["code_object"])
        try:
            d.load_module(code_object.read_bytes())
        except DriverError as e:
            raise HipcError(
                f"{code_object}: cannot load the {self.arch} code object ({e})"
            ) from None
        self._functions = self._load_functions(code_object)
        self._check_slots(artifact)

        B = self.kv_block = self.gpu.kv_block
        if B < 1:
            raise HipcError(
                f"{artifact.path}/plan.json: the {self.arch} section has no kv_block "
                f"(recompile with: hipc compile MODEL --target {self.arch})"
            )
        # block-table entries per sequence: the compiled context's (the kernels' stride)
        self.kv_table = -(-self.max_context // B)
        weights = self._open_weights(artifact)
        nbytes = [a.nbytes for a in weights]
        context = self._requested_context or self.max_context
        blocks = max(self._requested_blocks or 0, -(-context // B))
        # recurrent slots: as many as the KV pool holds whole sequences (more on demand:
        # ensure_slots); a model without recurrent states has none
        self.recurrent = any(not s.positional for s in self._states)
        self.slots = slots = (
            min(self.max_tokens, max(1, blocks * B // context)) if self.recurrent else 0
        )
        # one block more than the sequences get: the one padding rows write to
        self._mem = mem = device_memory(plan, self.gpu, nbytes, (blocks + 1) * B, slots)
        free, total = d.mem_info()
        if mem.total > free:
            most = (blocks + 1) * B
            fits = fit_positions(plan, self.gpu, nbytes, free, most, slots) // B - 1
            if fits >= -(-context // B) and fits < blocks:
                # a pool of many sequences: as many blocks as fit, one sequence at least
                print(
                    f"hipc: KV pool sized for {fits * B} of {blocks * B} positions to fit "
                    f"{gib(free)} free on {self.device_name}",
                    file=sys.stderr,
                )
                blocks = fits
            elif self._requested_context is None and fits * B >= 2:
                # Auto-size: keep the compiled context if it fits, else the most that does
                print(
                    f"hipc: KV cache sized for {fits * B} of {self.max_context} positions "
                    f"to fit {gib(free)} free on {self.device_name}",
                    file=sys.stderr,
                )
                blocks, context = fits, fits * B
            self._mem = mem = device_memory(plan, self.gpu, nbytes, (blocks + 1) * B, slots)
        if mem.total > free:
            raise HipcError(self._oom_message(free, total))
        self.max_context = context
        self.kv_blocks = blocks

        def alloc(what: str, nbytes: int) -> int:
            if nbytes == 0:
                return 0
            try:
                ptr = d.malloc(nbytes)
            except DriverError as e:
                if e.oom:
                    raise HipcError(self._oom_message(free, total, failed=what)) from None
                raise HipcError(f"{d.api}: allocating {what} ({nbytes} bytes): {e.error}") from None
            self._allocs.append((what, ptr))
            return ptr

        w_base = alloc("the weights", mem.weights)
        s_base = alloc("the KV cache", mem.states)
        self._rec_base = r_base = alloc("the recurrent states", mem.recurrent)
        self._states_base = s_base
        # what ensure_slots sizes a larger recurrent block from
        self._plan, self._weight_nbytes, self._positions = plan, nbytes, (blocks + 1) * B
        self.bases = Bases(
            arena=alloc("the activation arena", mem.arena),
            scratch=alloc("the scratch buffer", mem.scratch),
            weights=tuple(w_base + o for o in mem.weight_offsets),
            states=self._state_bases(s_base, r_base, mem),
            ids=(inputs := alloc("the step inputs", mem.inputs)),
            pos=inputs + 8 * self.max_tokens,
            seq=inputs + 12 * self.max_tokens,
            blocks=alloc("the block tables", mem.tables),
            logits=alloc("the logits", mem.logits),
        )
        MT = self.max_tokens
        # step_top's results, [MT, k] values, [MT, k] ids, [MT, 2] row stats at the row
        # stride of the step's k (packed, so one copy each brings them back)
        self._top_base = alloc("the top-k buffer", mem.top)
        # the several-block top-k's partials, [PICK_ROWS, blocks, 2 k + 2] words at most, then
        # a counter per row (zero between launches: the last block of a row resets it)
        self._picks_base = alloc("the top-k partials", mem.picks)
        self._pick_rows = pick_rows(self.gpu)
        self._pick_counters = self._picks_base + mem.picks - 4 * self._pick_rows
        # host staging in two slots, alternating by step, where a step may be queued ahead of
        # the one running (the host fills one slot while the device may still read the other);
        # one slot otherwise
        self.pipelines = self._can_pipeline()
        n_slots = 2 if self.pipelines else 1
        self._top_hosts = [self._pinned(np.float32, mem.top // 4) if mem.top else None
                           for _ in range(n_slots)]  # fmt: skip
        self._inputs_hosts = [self._pinned(np.uint8, INPUT_BYTES * MT) for _ in range(n_slots)]
        # per slot: the inputs (ids int64, pos and seq int32, MT each, then the draws [MT, 2]
        # float32), their address, views
        self._slot_views = [
            (raw, raw.ctypes.data, raw[: 8 * MT].view(np.int64),
             raw[8 * MT : 12 * MT].view(np.int32), raw[12 * MT : 16 * MT].view(np.int32), top,
             raw[16 * MT :].view(np.float32).reshape(MT, 2))
            for raw, top in zip(self._inputs_hosts, self._top_hosts, strict=True)
        ]  # fmt: skip
        self._draw_base = self.bases.ids + 16 * MT
        self._use_slot(0)
        # table rows: a row per sequence of a batch, then PAD (padding rows: every entry the
        # spare block) and SOLO (forward(): block b of the one sequence is pool block b). A
        # row is also the sequence's slot of the recurrent states (the deltanet kernels read
        # slot seq[t]), so with recurrent states PAD and SOLO follow the batch's slots
        rows = table_rows(self.gpu)
        self._tables_host = self._pinned(np.int32, rows * self.kv_table).reshape(rows, -1)
        # what a step's changed table rows are uploaded from (the mirror above may change for
        # the next step before this one's upload has run)
        self._tables_stages = [
            self._pinned(np.int32, rows * self.kv_table).reshape(rows, -1) for _ in range(n_slots)
        ]
        self._tables_host[:] = self.kv_blocks  # the spare block
        self._place_pad_and_solo(self.slots if self.recurrent else MT)
        self._logits_host = self._pinned(np.float32, self.max_tokens * self.vocab).reshape(
            self.max_tokens, self.vocab
        )
        self._logits_addr = self._logits_host.ctypes.data
        if self.pipelines:
            self._events = [d.new_event() for _ in range(2)]
        try:
            if mem.states:
                d.memset0(s_base, mem.states)
            if mem.recurrent:
                d.memset0(r_base, mem.recurrent)
            if mem.scratch:
                d.memset0(self.bases.scratch, mem.scratch)  # the decode attention's counters
            if mem.picks:
                d.memset0(self._picks_base, mem.picks)
            self._upload(weights, self.bases.weights)
            d.h2d(self.bases.blocks, self._tables_host.ctypes.data, self._tables_host.nbytes)
            d.synchronize()
        except DriverError as e:
            raise HipcError(f"{d.api}: loading the model onto {self.device_name}: {e}") from None

    def _state_bases(self, kv_base: int, rec_base: int, mem: DeviceMemory) -> tuple[int, ...]:
        return tuple(
            (kv_base + o) if spec.positional else (rec_base + r)
            for spec, o, r in zip(
                self._states, mem.state_offsets, mem.recurrent_offsets, strict=True
            )
        )

    def _place_pad_and_solo(self, pad: int) -> None:
        """PAD at table row `pad`, SOLO after it (every row past the batch's: the spare block)."""
        self.PAD, self.SOLO = pad, pad + 1
        self._tables_host[pad:] = self.kv_blocks  # the spare block
        self._tables_host[self.SOLO] = np.arange(self.kv_table) % self.kv_blocks
        self._upload_tables = len(self._tables_host)

    def _check_slots(self, artifact: Artifact) -> None:
        """Every launch binding a recurrent state also binds `seq` (its rows' slots): a plan
        compiled before GPU recurrent states had slots kept one copy, which this runtime,
        placing the one sequence in SOLO's slot, would read at slot 0."""
        recurrent = {j for j, s in enumerate(self._states) if not s.positional}
        for launch in (x for step in self.gpu.steps.values() for x in step):
            binds = {a.get("index") for a in launch.args if a["kind"] == "state"}
            inputs = {a.get("name") for a in launch.args if a["kind"] == "input"}
            if binds & recurrent and "seq" not in inputs:
                raise HipcError(
                    f"{artifact.path}: kernel {launch.kernel} updates a recurrent state "
                    "without per-sequence slots (compiled by an older hipc); recompile with: "
                    f"hipc compile MODEL --target {self.arch}"
                )

    def _load_functions(self, code_object) -> dict[str, Any]:
        d = self._driver
        shared: dict[str, int] = {}
        for launch in (x for step in self.gpu.steps.values() for x in step):
            shared[launch.kernel] = max(shared.get(launch.kernel, 0), launch.shared)
        for spec in topk_kernels(self.gpu):
            shared.setdefault(spec["kernel"], 0)
        functions = {}
        for kernel, nbytes in shared.items():
            try:
                functions[kernel] = fn = d.get_function(kernel)
            except DriverError as e:
                raise HipcError(
                    f"{code_object}: kernel {kernel} not found ({e.error}); "
                    "the code object and plan.json disagree (recompile the artifact)"
                ) from None
            if nbytes > d.max_shared_per_block:
                raise HipcError(
                    f"kernel {kernel} needs {nbytes} bytes of shared memory per block, "
                    f"{self.device_name} allows {d.max_shared_per_block}"
                )
            if nbytes > DEFAULT_SHARED_LIMIT:
                try:
                    d.set_dynamic_shared(fn, nbytes)
                except DriverError as e:
                    raise HipcError(
                        f"kernel {kernel}: cannot allow {nbytes} bytes of dynamic shared memory "
                        f"({e.error})"
                    ) from None
        return functions

    def _open_weights(self, artifact: Artifact) -> list[np.ndarray]:
        specs = artifact.plan["weights"]
        if not specs:
            return []
        st = SafetensorsFile(artifact.file("weights.safetensors"))
        arrays = []
        for w in specs:
            if w["name"] not in st.entries:
                raise HipcError(f"{st.path}: tensor {w['name']!r} missing")
            a = st.raw(w["name"])
            stored = w.get("stored_shape")
            if stored is not None and tuple(stored) != a.shape:
                raise HipcError(
                    f"{st.path}: tensor {w['name']!r} has shape {list(a.shape)}, "
                    f"plan.json says {list(stored)}"
                )
            arrays.append(a)
        return arrays

    def _upload(self, arrays: list[np.ndarray], dsts: Sequence[int]) -> None:
        total = sum(a.nbytes for a in arrays)
        label = f"uploading weights to {self.device_name}"
        with byte_bar(label, total, show=total > PROGRESS_MIN_BYTES) as bar:
            for a, dst in zip(arrays, dsts, strict=True):
                src = np.ascontiguousarray(a)
                addr = src.ctypes.data
                for pos in range(0, src.nbytes, UPLOAD_CHUNK):
                    n = min(UPLOAD_CHUNK, src.nbytes - pos)
                    self._driver.h2d(dst + pos, addr + pos, n)
                    bar.update(n)

    def _pinned(self, dtype, count: int) -> np.ndarray:
        nbytes = np.dtype(dtype).itemsize * count
        try:
            ptr = self._driver.host_malloc(nbytes)
        except DriverError as e:
            raise HipcError(
                f"{self._driver.api}: pinned host buffer of {nbytes} bytes: {e.error}"
            ) from None
        self._host_allocs.append(ptr)
        return np.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=dtype)

    def _oom_message(self, free: int, total: int, failed: str | None = None) -> str:
        m = self._mem
        io, kv = m.inputs + m.tables + m.logits, m.states + m.recurrent
        why = f" (allocating {failed} failed)" if failed else ""
        return (
            f"{self.device_name}: not enough GPU memory{why}: this artifact needs "
            f"{gib(m.total)} ({m.total} bytes: weights {gib(m.weights)}, KV cache {gib(kv)}, "
            f"activations {gib(m.arena + m.scratch)}, ids/logits {gib(io)}), "
            f"{gib(free)} ({free} bytes) are free of {gib(total)}; "
            f"compile with a smaller --max-context to shrink the KV cache "
            f"({self.max_context} positions now), or a smaller --max-tokens to shrink "
            f"activations and logits ({self.max_tokens} tokens per step now)"
        )

    # -- running -------------------------------------------------------------------

    @property
    def kv_bytes(self) -> int:
        return self._mem.kv_bytes

    @property
    def graph_captured(self) -> bool:
        """Whether the one-row decode graph is recorded."""
        return ("decode", 1) in self._graphs

    @property
    def block_bytes(self) -> int:
        """Bytes one KV block takes over every layer's pools."""
        return sum(s.nbytes(self.kv_block) for s in self._states if s.positional)

    def reset(self, slot: int | None = None) -> None:
        """A new sequence (in recurrent `slot`; None: every slot): apply each state's reset
        rule (zero the recurrent ones; a KV cache's positions are written before they are
        read, so it is left as it is)."""
        if self._closed:
            raise HipcError(f"{self.name} backend: used after close()")
        try:
            # the server steps from a worker thread: the context must be current there too
            self._driver.activate()
            if slot is None:
                if self._mem.recurrent:
                    self._driver.memset0(self._rec_base, self._mem.recurrent)
            else:
                for base, n in self._recurrent(slot):
                    self._driver.memset0(base, n)
        except DriverError as e:
            raise self._step_error(e, "resetting the states") from None

    # -- recurrent states: a pool of slots per state, row t's in slot seq[t] (batch rows,
    # then PAD's spare slot and SOLO's, the one-sequence view's); runtime/recurrent.py and
    # runtime/batch.py take and restore snapshots -------------------------------------

    @property
    def snapshot_interval(self) -> int:
        """Positions between the snapshots a sequence keeps (runtime/recurrent.py): a whole
        step, so that a long prompt runs in steps of max_tokens (the CPU's 64 would cut a
        GPU prefill into small steps)."""
        return self.max_tokens

    @property
    def slot_bytes(self) -> int:
        """Bytes one sequence's recurrent states take (a slot, or a snapshot)."""
        return sum(s.nbytes() for s in self._states if s.needs_reset)

    def _recurrent(self, slot: int | None = None) -> list[tuple[int, int]]:
        """(device address, bytes) of each recurrent state's `slot` (None: SOLO's)."""
        slot = self.SOLO if slot is None else slot
        if not 0 <= slot < recurrent_slots(self.slots):
            raise HipcError(f"recurrent slot {slot} outside the {self.slots} slots")
        return [
            (base + slot * spec.nbytes(), spec.nbytes())
            for spec, base in zip(self._states, self.bases.states, strict=True)
            if spec.needs_reset
        ]

    def ensure_slots(self, n: int) -> None:
        """At least `n` recurrent slots (the batch's sequences): the pools are reallocated
        larger (existing slots and SOLO's kept), PAD and SOLO move past them, and the
        captured graphs (whose arguments hold the old addresses) are dropped."""
        if not self.recurrent or n <= self.slots:
            return
        if n > self.max_tokens:
            raise HipcError(f"{n} recurrent slots: a step holds at most {self.max_tokens} rows")
        d, old, old_base = self._driver, self.slots, self._rec_base
        mem = device_memory(self._plan, self.gpu, self._weight_nbytes, self._positions, n)
        try:
            d.activate()
            d.synchronize()
            try:
                base = d.malloc(mem.recurrent)
            except DriverError as e:
                if e.oom:
                    raise HipcError(
                        f"{self.device_name}: no GPU memory for {n} recurrent slots of "
                        f"{self.slot_bytes} bytes (have {old}); serve fewer sequences at once "
                        "(--max-batch)"
                    ) from None
                raise
            self._allocs.append(("the recurrent states", base))
            d.memset0(base, mem.recurrent)
            moves = ((0, 0, old), (old + 1, n + 1, 1))  # the batch's slots, SOLO's
            for spec, r_old, r_new in zip(
                self._states, self._mem.recurrent_offsets, mem.recurrent_offsets, strict=True
            ):
                if spec.needs_reset:
                    size = spec.nbytes()
                    for a, b, count in moves:
                        src = old_base + r_old + a * size
                        d.d2d(base + r_new + b * size, src, count * size)
            d.synchronize()
            d.free(old_base)
        except DriverError as e:
            raise self._step_error(e, "growing the recurrent states") from None
        self._allocs.remove(("the recurrent states", old_base))
        self._rec_base, self._mem, self.slots = base, mem, n
        self.bases = replace(self.bases, states=self._state_bases(self._states_base, base, mem))
        self._drop_graphs()
        self._place_pad_and_solo(n)

    def _drop_graphs(self) -> None:
        for graph, graph_exec, _ in self._graphs.values():
            with contextlib.suppress(DriverError):
                self._driver.destroy_graph(graph, graph_exec)
        self._graphs.clear()
        self._packed.clear()

    def reset_recurrent(self) -> None:
        self.reset(self.SOLO)

    def snapshot(self, slot: int | None = None) -> int | None:
        """A device copy of `slot`'s recurrent states (None: SOLO's; one buffer,
        device-to-device copies on the step's stream, so it holds what the steps before it
        wrote), or None where the GPU has no memory left for one (the sequence then keeps no
        snapshot there)."""
        parts = self._recurrent(slot)
        offsets, total = aligned_offsets([n for _, n in parts])
        d = self._driver
        try:
            d.activate()
            if self._spare_snapshots:
                buf = self._spare_snapshots.pop()
            else:
                try:
                    buf = d.malloc(total)
                except DriverError as e:
                    if e.oom:
                        return None
                    raise
                self._allocs.append(("a recurrent-state snapshot", buf))
            for (src, n), off in zip(parts, offsets, strict=True):
                d.d2d(buf + off, src, n)
        except DriverError as e:
            raise self._step_error(e, "copying the recurrent states") from None
        return buf

    def restore(self, snapshot: int, slot: int | None = None) -> None:
        parts = self._recurrent(slot)
        offsets, _ = aligned_offsets([n for _, n in parts])
        d = self._driver
        try:
            d.activate()
            for (dst, n), off in zip(parts, offsets, strict=True):
                d.d2d(dst, snapshot + off, n)
        except DriverError as e:
            raise self._step_error(e, "restoring the recurrent states") from None

    def release(self, snapshot: int) -> None:
        """The sequence dropped `snapshot`: its buffer serves the next one (freed at close)."""
        self._spare_snapshots.append(snapshot)

    def forward(
        self, ids: np.ndarray, start: int, all_logits: bool, copy: bool = True
    ) -> np.ndarray:
        """submit + collect; `copy` False: a view of the pinned buffer (collect's)."""
        self.submit(ids, start, all_logits)
        return self.collect(copy)

    def submit(
        self,
        ids: np.ndarray,
        start: int,
        all_logits: bool = False,
        top: int = 0,
        ahead: bool = False,
        draw: tuple[float, float] | None = None,
    ) -> None:
        """Queue one sequence's step (copies in, the launches, the logits' copy out) without
        waiting for it: the host may do other work (detokenizing the last token) while the
        GPU runs; `collect` waits and returns the logits. One step is in flight at most,
        but for `ahead`.
        `top` (1..max_top_k, last row only): the row's top-k picked on the device instead,
        `collect` then returning step_top's TopK (a greedy step copies back one value, not a
        vocabulary of logits).
        `ahead` (a decode step, where `pipelines`): its token is the top-1 pick of the one
        step in flight (submitted with `top`), copied on the device, so it is queued before
        that step is collected and the device never waits for the host between them; `ids`
        is a placeholder. `collect` returns the steps in order.
        `draw` (with top 1, where `draws_on_device`): (1 / temperature, u), the token drawn
        at that temperature instead of the greedy one (submit_step's `draws`)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        T = int(ids.size)
        self._check_step(T, ahead)
        if not 0 <= start <= self.max_context - T:
            raise HipcError(f"start position {start} out of range")
        if top and (all_logits or not 1 <= top <= self.max_top_k):
            raise HipcError(f"submit: top {top} needs the device top-k (at most {self.max_top_k})")
        if ahead and (T != 1 or all_logits):
            raise HipcError("submit: only a one-token decode step goes ahead")
        feed = [(0, 0, 1)] if ahead else []
        if ahead:
            self._check_feed(feed, T)
        rows = T if all_logits else 1
        draws = None if draw is None else self._check_draws([draw], top, 1)
        if T == 1:  # a decode step: scalars into the pinned inputs (no arrays to build)
            self._queue(ids, start, self.SOLO, "decode", 1, 1, slice(0, 1), top, feed, draws)
            return
        pos = np.arange(start, start + T, dtype=np.int32)
        self._queue(ids, pos, np.full(T, self.SOLO, np.int32), "prefill", T, rows,
                    slice(0, rows), top, (), draws)  # fmt: skip

    def step(
        self,
        ids: np.ndarray,
        pos: np.ndarray,
        seq: np.ndarray,
        tables: np.ndarray,
        out_rows: np.ndarray,
    ) -> np.ndarray:
        """Rows of many sequences (CpuBackend.step's contract): row t is token ids[t] at
        position pos[t] of the sequence whose block table is tables[seq[t]] ([sequences,
        kv_table] pool block ids). Returns the logits of out_rows (ascending), [len(out_rows),
        vocab]: a view of the pinned host buffer, valid until the next step (runtime/batch.py's
        callers sample from it first; a copy of 64 rows of a 128k vocabulary is 32 MiB of fresh
        pages every step)."""
        self._queue(*self._batch_step(ids, pos, seq, tables, out_rows))
        return self.collect(copy=False)

    def submit_step(
        self,
        ids: np.ndarray,
        pos: np.ndarray,
        seq: np.ndarray,
        tables: np.ndarray,
        out_rows: np.ndarray,
        top: int = 0,
        feed: Sequence[tuple[int, int, int]] | None = None,
        draws: np.ndarray | None = None,
    ) -> None:
        """Queue step()'s work (`top` 1..max_top_k: step_top's, picked on the device) without
        waiting: the host streams the last step's tokens while the GPU runs this one;
        `collect(copy=False)` returns its logits (a view of the pinned buffer), or with `top`
        its TopK. The arrays are read before this returns (into pinned buffers), so the
        caller may change them while the step runs.

        `feed` (a list, maybe empty) queues this step ahead of the one in flight (where
        `pipelines`; that step picked its tokens on the device): runs (row, out row, count) of
        rows whose ids are that step's top-1 picks of its out rows, copied on the device, so
        this step needs nothing from the host the last one computes and the device never
        waits for the host between them. Those rows' `ids` are placeholders. `collect` then
        returns the steps in order.

        `draws` ([out rows, 2], with top 1, where `draws_on_device`): each out row's
        (1 / temperature, u): 0 picks the greedy token, else the token drawn from
        softmax(logits / temperature) by u, a uniform number in [0, 1) (the host sampler's
        inverse_cdf, in float32)."""
        if top and not 1 <= top <= self.max_top_k:
            raise HipcError(f"submit_step: top {top} needs the device top-k (<= {self.max_top_k})")
        if feed is not None:
            self._check_feed(feed, len(ids))
        if draws is not None:
            draws = self._check_draws(draws, top, len(out_rows))
        self._queue(*self._batch_step(ids, pos, seq, tables, out_rows, ahead=feed is not None),
                    top=top, feed=feed or (), draws=draws)  # fmt: skip

    @property
    def draws_on_device(self) -> int:
        """The most rows a step with top 1 draws at a temperature on the device (`draws`);
        0 where the plan's pick kernel is greedy only (an older artifact) or absent."""
        return self._pick_rows if self.gpu.topk and "pick" in self.gpu.topk else 0

    def _check_draws(self, draws, top: int, n_out: int) -> np.ndarray:
        draws = np.asarray(draws, dtype=np.float32).reshape(-1, 2)
        if top != 1 or len(draws) != n_out or n_out > self.draws_on_device:
            raise HipcError(
                f"draws: one (1 / temperature, u) per out row with top 1, for at most "
                f"{self.draws_on_device} rows (got {len(draws)} for {n_out}, top {top})"
            )
        inv_t, u = draws[:, 0], draws[:, 1]
        if not (
            np.isfinite(inv_t).all() and (inv_t >= 0).all() and (u >= 0).all() and (u < 1).all()
        ):
            raise HipcError("draws: 1 / temperature must be finite and >= 0, u in [0, 1)")
        return draws

    def _check_feed(self, feed: Sequence[tuple[int, int, int]], T: int) -> None:
        if not self.pipelines:
            raise HipcError(f"{self.name} backend: no steps ahead on this driver")
        if len(self._pending) != 1 or not self._pending[0].top:
            raise HipcError("a step is fed only from the one step in flight, picked on the device")
        n_out = self._pending[0].n_out
        for row, src, n in feed:
            if n < 1 or row < 0 or row + n > T or src < 0 or src + n > n_out:
                raise HipcError(f"feed run {(row, src, n)} outside {T} rows / {n_out} picks")

    def _can_pipeline(self) -> bool:
        """Whether a step may be queued ahead of another: the plan has the device top-k and
        launches are not synchronized one by one."""
        return bool(self.gpu.topk) and not self.sync_launches

    def _use_slot(self, k: int) -> None:
        """Point the staging views at host slot k (a step's inputs, its top-k results)."""
        (
            self._inputs_host,
            self._inputs_addr,
            self._ids_host,
            self._pos_host,
            self._seq_host,
            self._top_host,
            self._draw_host,
        ) = self._slot_views[k]

    def step_top(
        self,
        ids: np.ndarray,
        pos: np.ndarray,
        seq: np.ndarray,
        tables: np.ndarray,
        out_rows: np.ndarray,
        k: int,
        logsumexp: bool = False,
    ) -> tuple[np.ndarray, ...]:
        """step() returning, instead of the out_rows' logits, their k (1..TOPK_MAX) largest:
        (ids [n, k] int32, logits [n, k] float32), largest first, of equal values the lower id
        (runtime/topk.py); with `logsumexp` also each row's log-sum-exp [n] (a token's
        log-probability is logit - logsumexp). Arrays the caller owns. Selected on the device
        where the artifact's plan has the top-k kernel (max_top_k > 0), so a step copies back
        rows x k values, not rows x vocab logits (32 MiB at 64 rows of a 128k vocabulary);
        else from the logits on the host, the same result."""
        if not 1 <= k <= TOPK_MAX:
            raise HipcError(f"step_top: k must be 1 to {TOPK_MAX}, got {k}")
        if not self.gpu.topk:  # an artifact from before the kernel: chosen on the host
            top = top_of_logits(self.step(ids, pos, seq, tables, out_rows), k)
        else:
            self._queue(*self._batch_step(ids, pos, seq, tables, out_rows), top=k)
            top = self.collect()
        return top if logsumexp else top[:2]

    @property
    def max_top_k(self) -> int:
        """The most values per row step_top picks on the device (0: the plan has no kernel)."""
        return int(self.gpu.topk["max_k"]) if self.gpu.topk else 0

    def _batch_step(self, ids, pos, seq, tables, out_rows, ahead: bool = False) -> tuple:
        """step()'s checks and table upload; _queue's arguments."""
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        pos = np.ascontiguousarray(pos, dtype=np.int32).reshape(-1)
        seq = np.ascontiguousarray(seq, dtype=np.int32).reshape(-1)
        tables = np.ascontiguousarray(tables, dtype=np.int32)
        out_rows = np.ascontiguousarray(out_rows, dtype=np.int64).reshape(-1)
        T = int(ids.size)
        self._check_step(T, ahead)
        if tables.ndim != 2 or tables.shape[1] != self.kv_table or len(tables) > self.PAD:
            raise HipcError(f"block tables must be [at most {self.PAD} sequences, {self.kv_table}]")
        if len(pos) != T or len(seq) != T or not len(out_rows):
            raise HipcError("a step needs a position and a sequence per row and rows to return")
        if (
            pos.min() < 0
            or pos.max() >= self.max_context
            or seq.min() < 0
            or seq.max() >= len(tables)
        ):
            raise HipcError(f"a step row is past the {self.max_context} positions or the tables")
        if out_rows.min() < 0 or out_rows.max() >= T or np.any(np.diff(out_rows) <= 0):
            raise HipcError(f"out_rows must be ascending rows of the {T}")
        # the kernels trust the tables: a block id outside the pool would be read or written
        # out of bounds, so every entry a row reads (its blocks up to its position) is checked
        last = np.full(len(tables), -1, np.int64)
        np.maximum.at(last, seq, pos // self.kv_block)
        used = tables[np.arange(self.kv_table)[None, :] <= last[:, None]]
        if used.size and (used.min() < 0 or used.max() >= self.kv_blocks):
            raise HipcError(f"a block table names a block outside the pool of {self.kv_blocks}")
        one_sequence = bool((seq == seq[0]).all())
        if self.recurrent:
            # the deltanet kernel steps each run of one sequence's rows (consecutive
            # positions) in its slot, the runs in parallel: a sequence must be one run
            cut = np.flatnonzero((np.diff(seq) != 0) | (np.diff(pos) != 1)) + 1
            if len(cut) + 1 != len(np.unique(seq)):
                raise HipcError(
                    "a step's rows must be one run of consecutive positions per sequence"
                )
        n = len(tables)
        if not np.array_equal(self._tables_host[:n], tables):
            self._tables_host[:n] = tables
            self._upload_tables = n
        if T == 1:
            kind, B, rows = "decode", 1, 1
        elif len(np.unique(seq)) == T:
            # one row per sequence: the batch list, at the bucket's size (padding rows after)
            kind = "batch"
            B = rows = next((b for b in self.buckets if b >= T), T)
        elif self.recurrent and not one_sequence:
            # prefill chunks beside other rows: the batch list (its deltanet kernel steps
            # runs of several sequences; the chunked one takes one sequence's), eagerly
            kind, B = "mixed", T
            rows = 1 if len(out_rows) == 1 and out_rows[0] == T - 1 else T
        else:
            kind, B = "prefill", T
            rows = 1 if len(out_rows) == 1 and out_rows[0] == T - 1 else T
        pick = slice(0, 1) if rows == 1 else out_rows
        return ids, pos, seq, kind, B, rows, pick

    @property
    def buckets(self) -> tuple[int, ...]:
        # read on every step (a decode step's graph is the 1-row bucket's): built once
        if self._buckets is None:
            self._buckets = tuple(b for b in BUCKETS if b <= self.max_tokens)
        return self._buckets

    def _check_step(self, T: int, ahead: bool = False) -> None:
        if self._closed:
            raise HipcError(f"{self.name} backend: used after close()")
        if self._broken:
            raise HipcError(
                f"the GPU failed earlier ({self._broken}); restart the process to use it again"
            )
        if self._pending and not ahead:
            raise HipcError("a step is already in flight: collect() it first")
        if not 1 <= T <= self.max_tokens:
            raise HipcError(f"a step runs 1 to {self.max_tokens} tokens, got {T}")

    def _queue(
        self,
        ids,
        pos,
        seq,
        kind: str,
        B: int,
        rows: int,
        pick,
        top: int = 0,
        feed=(),
        draws=None,
    ) -> None:
        """Copy T rows in (padded to B; `feed`'s rows from the step in flight's picks), launch
        `kind`'s list at B rows, copy out the logits rows `pick` reads (`top`: their top-k
        instead, selected on the device; `draws`: top 1's draws per picked row)."""
        T = len(ids)
        if kind == "decode":
            launches = self.gpu.decode
        elif kind in ("batch", "mixed"):
            launches = self.gpu.batch(B)
        else:
            launches = self.gpu.launches(B)
        use_graph = kind in ("decode", "batch") and B in self.buckets and not self.sync_launches
        where = (
            ("the decode graph" if kind == "decode" else f"the {B}-row batch graph")
            if use_graph
            else f"a {T}-token step"
        )
        # the logits rows to copy back, as runs of consecutive rows (device row, host row,
        # count): the wanted rows only (a prefill chunk's step computes every row's, and a
        # row of a large vocabulary is half a MiB), packed to the front of the host buffer
        if isinstance(pick, slice):
            runs = [(0, 0, rows)]
        else:
            runs, to = [], 0
            for r in np.split(pick, np.flatnonzero(np.diff(pick) != 1) + 1):
                runs.append((int(r[0]), to, len(r)))
                to += len(r)
            pick = slice(0, to)
        d = self._driver
        slot = self._queued % len(self._slot_views)
        self._use_slot(slot)
        try:
            d.activate()
            self._ids_host[:T], self._pos_host[:T], self._seq_host[:T] = ids, pos, seq
            if B > T:
                self._ids_host[T:B], self._pos_host[T:B], self._seq_host[T:B] = 0, 0, self.PAD
            for row, _, n in feed:  # the copies below write their low halves only
                self._ids_host[row : row + n] = 0
            if top == 1:
                n_out = pick.stop - pick.start
                self._draw_host[:n_out] = 0 if draws is None else draws
            # (addresses read once: numpy's .ctypes builds an object per access, microseconds a step)
            d.h2d(self.bases.ids, self._inputs_addr, self._inputs_host.nbytes)
            if feed:
                # the int32 ids of the last step's picks ([rows, k] at its k) into int64 rows
                k = self._pending[-1].top
                picks = self._top_base + 4 * self.max_tokens * k
                for row, src, n in feed:
                    d.d2d_2d(self.bases.ids + 8 * row, 8, picks + 4 * k * src, 4 * k, 4, n)
            if self._upload_tables:
                n, self._upload_tables = self._upload_tables, 0
                stage = self._tables_stages[slot]
                stage[:n] = self._tables_host[:n]
                d.h2d(self.bases.blocks, stage.ctypes.data, 4 * n * self.kv_table)
            if use_graph:
                key = (kind, B)
                if key not in self._graphs:
                    self._capture(key, launches, B, rows)
                d.graph_launch(self._graphs[key][1])
            else:
                self._run(launches, B, rows, self.sync_launches, kind)
            row = 4 * self.vocab
            if top:
                self._queue_top(runs, top)
            else:
                for at, to, n in runs:
                    d.d2h(self._logits_addr + to * row, self.bases.logits + at * row, n * row)
            event = self._events[slot] if self._events else None
            if event is not None:
                d.record(event)
        except _KernelFailed as f:
            self._pending.clear()
            raise self._kernel_error(f.launch, f.err) from None
        except DriverError as e:
            self._pending.clear()
            raise self._step_error(e, where) from None
        n_out = pick.stop - pick.start if isinstance(pick, slice) else len(pick)
        self._pending.append(
            _Pending(launches, B, rows, where, pick, kind, top, slot, event, n_out)
        )
        self._queued += 1

    def _queue_top(self, runs: list[tuple[int, int, int]], k: int) -> None:
        """The top-k kernel over each run of wanted logits rows, then the packed values, ids
        and row stats copied back: for at most PICK_ROWS rows the plan's several-block kernel
        (k = 1: "pick", reading the slot's draws, or an older plan's "greedy"; else "split"),
        else one block a row."""
        n_all = sum(n for _, _, n in runs)
        spec = self.gpu.topk
        split = None
        if n_all <= self._pick_rows:
            split = (spec.get("pick") or spec.get("greedy")) if k == 1 else spec.get("split")
        draws = k == 1 and "pick" in spec
        vals, ids = self._top_base, self._top_base + 4 * self.max_tokens * k
        stats = ids + 4 * self.max_tokens * k
        for at, to, n in runs:
            out = [("u64", self.bases.logits + 4 * at * self.vocab), ("i32", self.vocab)]
            out += [] if k == 1 and split else [("i32", k)]
            out += [("u64", vals + 4 * to * k), ("u64", ids + 4 * to * k), ("u64", stats + 8 * to)]
            if split:
                G = int(split["blocks"])
                words = (5 if draws else 4) if k == 1 else 2 * k + 2
                out += [("u64", self._picks_base + 4 * G * words * to),
                        ("u64", self._pick_counters + 4 * to)]  # fmt: skip
                if draws:
                    out.append(("u64", self._draw_base + 8 * to))
                kernel, grid, block = split["kernel"], (G, n, 1), int(split["block"])
            else:
                kernel, grid, block = spec["kernel"], (n, 1, 1), int(spec["block"])
            args = PackedArgs(out)
            try:
                self._driver.launch(self._functions[kernel], grid, (block, 1, 1), 0, args.address)
            except DriverError as e:
                raise HipcError(f"{kernel}: launch failed: {e}") from None
        host = self._top_host.ctypes.data
        d = self._driver
        d.d2h(host, vals, 4 * n_all * k)
        d.d2h(host + 4 * n_all * k, ids, 4 * n_all * k)
        d.d2h(host + 8 * n_all * k, stats, 8 * n_all)

    def collect(self, copy: bool = True) -> np.ndarray | TopK:
        """Wait for the step `submit` queued; its logits [rows, vocab] (`copy` False: a view
        of the pinned buffer, which the next step overwrites), or step_top's TopK."""
        if not self._pending:
            raise HipcError("no step in flight")
        p = self._pending.popleft()
        launches, B, rows, where, pick, kind, top = p[:7]
        d = self._driver
        try:
            d.activate()
            # the step's own event where one was recorded: a step queued behind it runs on
            if p.event is not None:
                d.wait(p.event)
            else:
                d.synchronize()
        except DriverError as e:
            self._pending.clear()  # a step queued behind it read what it computed
            raise self._locate(e, launches, B, rows, where, kind) from None
        self._use_slot(p.slot)
        if (
            kind == "prefill"
            and not self.graph_captured
            and not self.sync_launches
            and not self._pending
        ):
            # record the decode graph after the first prefill, so that the first decode
            # step (the timed part of a generation) does not pay for capturing it
            try:
                self._capture(("decode", 1), self.gpu.decode, 1, 1)
            except _KernelFailed as f:
                raise self._kernel_error(f.launch, f.err) from None
            except DriverError as e:
                raise self._step_error(e, "the decode graph") from None
        if top:
            n = self._logits_host[pick].shape[0]
            h = self._top_host
            stats = h[2 * n * top : 2 * n * top + 2 * n].reshape(n, 2)
            return TopK(h[n * top : 2 * n * top].view(np.int32).reshape(n, top).copy(),
                        h[: n * top].reshape(n, top).copy(),
                        logsumexp(stats[:, 0], stats[:, 1]))  # fmt: skip
        out = self._logits_host[pick]
        return out.copy() if copy else out

    def _launch(self, launch: Launch, grid: tuple[int, int, int], args: PackedArgs) -> None:
        try:
            self._driver.launch(
                self._functions[launch.kernel],
                grid,
                launch.block,
                launch.shared,
                args.address,
                overlap=launch.overlap and self._driver.overlap_launches,
            )
        except DriverError as e:
            raise _KernelFailed(launch, e) from None

    def _pack(self, launch: Launch, T: int, rows: int) -> PackedArgs:
        resolved = launch.resolve(self.bases, T, rows)
        if any(ctype == "tmap" for ctype, _ in resolved):
            resolved = [(c, self._tensor_map(v) if c == "tmap" else v) for c, v in resolved]
        return PackedArgs(resolved)

    def _tensor_map(self, spec: tuple[int, ...]) -> Any:
        """Encoded once per (address, shape, box): prefill launches reuse them every step."""
        if spec not in self._tmaps:
            try:
                self._tmaps[spec] = self._driver.tensor_map(*spec)
            except DriverError as e:
                raise HipcError(f"{self._driver.api}: cannot encode a tensor map: {e}") from None
        return self._tmaps[spec]

    def _run(
        self, launches: Sequence[Launch], T: int, rows: int, sync_each: bool, kind: str
    ) -> None:
        # Packed once per step shape (the launch list and arguments are fixed for a given T):
        # resolving every launch in Python each step is host time a short step's kernels
        # may not cover
        key = (kind, T, rows)
        packed = self._packed.get(key)
        if packed is None:
            if len(self._packed) >= 32:
                self._packed.clear()
            packed = [(x, x.grid_dims(T, rows), self._pack(x, T, rows)) for x in launches]
            self._packed[key] = packed
        for launch, grid, args in packed:
            self._launch(launch, grid, args)
            if sync_each:
                try:
                    self._driver.synchronize()
                except DriverError as e:
                    raise _KernelFailed(launch, e) from None

    def _capture(self, key: tuple[str, int], launches: Sequence[Launch], T: int, rows: int) -> None:
        d = self._driver
        packed = [(x, x.grid_dims(T, rows), self._pack(x, T, rows)) for x in launches]
        d.begin_capture()
        try:
            for launch, grid, args in packed:
                self._launch(launch, grid, args)
        except BaseException:
            with contextlib.suppress(DriverError):
                d.destroy_graph(d.end_capture(), None)
            raise
        graph = d.end_capture()
        try:
            graph_exec = d.instantiate(graph)
        except DriverError:
            d.destroy_graph(graph, None)
            raise
        self._graphs[key] = (graph, graph_exec, [args for _, _, args in packed])

    # -- errors --------------------------------------------------------------------

    def _context_ok(self) -> bool:
        """False when the context is poisoned: a sticky error comes back from every call."""
        try:
            self._driver.synchronize()
            return True
        except DriverError:
            return False

    def _dead(self, error: str) -> str:
        if self._context_ok():
            return ""
        self._broken = error
        return "; the GPU context is unusable after this error (restart the process)"

    def _kernel_error(self, launch: Launch, err: DriverError) -> HipcError:
        dead = self._dead(f"kernel {launch.kernel}: {err.error}")
        return HipcError(
            f"kernel {launch.kernel} (group {launch.group or '?'}) failed: {err.error}{dead}"
        )

    def _dead_context_error(self, err: DriverError, where: str) -> HipcError:
        self._broken = f"{where}: {err.error}"
        return HipcError(
            f"{where} failed on the GPU: {err.error}; the {self._driver.api} context is "
            "unusable after this error, so the failing kernel cannot be named now: rerun "
            f"with {SYNC_ENV}=1 to name it (and restart the process)"
        )

    def _step_error(self, err: DriverError, where: str) -> HipcError:
        if not self._context_ok():
            return self._dead_context_error(err, where)
        return HipcError(f"{self._driver.api} error in {where}: {err}")

    def _locate(
        self,
        err: DriverError,
        launches: Sequence[Launch],
        T: int,
        rows: int,
        where: str,
        kind: str,
    ) -> HipcError:
        """The step's final synchronize failed: name the kernel if the context allows."""
        if not self._context_ok():
            return self._dead_context_error(err, where)
        try:
            self._run(launches, T, rows, True, kind)
        except _KernelFailed as f:
            return self._kernel_error(f.launch, f.err)
        return HipcError(
            f"{where} failed on the GPU: {err.error} (every kernel ran cleanly when re-run "
            "one launch at a time)"
        )

    # -- teardown ------------------------------------------------------------------

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        d = self._driver

        def attempt(fn, *args) -> None:
            # a poisoned context fails every call: still try each, free what can be freed
            with contextlib.suppress(DriverError):
                fn(*args)

        attempt(d.activate)
        for graph, graph_exec, _ in self._graphs.values():
            attempt(d.destroy_graph, graph, graph_exec)
        self._graphs.clear()
        self._inputs_host = self._ids_host = self._pos_host = self._seq_host = None
        self._inputs_hosts, self._top_hosts, self._tables_stages, self._slot_views = [], [], [], []
        self._tables_host = self._logits_host = self._top_host = None
        for event in self._events:
            attempt(d.destroy_event, event)
        self._events = []
        self._pending.clear()
        for _, ptr in reversed(self._allocs):
            attempt(d.free, ptr)
        self._allocs.clear()
        self._spare_snapshots.clear()
        for ptr in reversed(self._host_allocs):
            attempt(d.host_free, ptr)
        self._host_allocs.clear()
        attempt(d.close)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
