"""The cpu backend: the artifact's shared library through ctypes, buffers in NumPy.

Weights stay memory-mapped from weights.safetensors (the OS pages them in once);
the activation arena and the KV pools are allocated once per engine.

KV states are pools of `kv_block`-position blocks ([n_blocks * kv_block, heads, dim] per
layer); recurrent states (linear attention's conv windows and matrices) are pools of slots
([slots, ...]), one per sequence of a step: row t's sequence seq[t] is also its slot. `step()`
runs rows of many sequences, each row with its position and its sequence's block table and
slot; `forward()` is the one-sequence view over it (block b of the sequence is pool block b,
slot 0), which `hipc generate`, `hipc verify` and the GPU-shaped engine interface use.

Threads: `threads`, else $OMP_NUM_THREADS, else every core this process may run on.
A decode step is ~200 OpenMP parallel regions, each ending in a barrier. libgomp's
default is to spin ~300,000 pause instructions at a barrier before sleeping; when other
processes hold the cores, a spinning thread burns the time slice its descheduled peer
needs, and SmolLM2's decode fell to 0.5-2 tok/s (2 cores at load ~10, with and
without two busy competitors: docs/benchmarks/cpu-busy.md). So unless the user chose a
wait policy (OMP_WAIT_POLICY or GOMP_SPINCOUNT), the spin is cut to SPIN_COUNT before
the library, and with it libgomp, is loaded: ~34 tok/s on that machine, near what
passive waiting gives, while threads that arrive together (an idle machine) still meet
within the spin instead of paying a futex wake-up per barrier.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from hipc.base.cpu_features import cpu_features
from hipc.base.errors import HipcError
from hipc.base.launch_plan import TOPK_MAX, TargetPlan, states
from hipc.base.safetensors_file import SafetensorsFile
from hipc.base.version import ABI_VERSION
from hipc.runtime.artifact import Artifact
from hipc.runtime.topk import top_of_logits

# ~1000 pause instructions: tens of microseconds on current x86 cores
SPIN_COUNT = "1000"


class CpuBackend:
    name = "cpu"

    def __init__(
        self,
        artifact: Artifact,
        threads: int | None = None,
        max_context: int | None = None,
        kv_blocks: int | None = None,
    ) -> None:
        """kv_blocks: blocks in each KV pool (default and minimum: one sequence of
        max_context positions)."""
        info = artifact.manifest["targets"].get("cpu")
        if info is None:
            raise HipcError(
                f"{artifact.path}: no cpu code object (targets: {', '.join(artifact.targets)}); "
                f"compile with: hipc compile MODEL --target cpu"
            )
        have = cpu_features()
        missing = set(info.get("cpu_features", [])) - have
        if missing and have:
            raise HipcError(
                f"{artifact.path}: compiled for CPU features this machine lacks ({', '.join(sorted(missing))}); "
                "recompile here with: hipc compile MODEL --target cpu"
            )
        if threads:
            os.environ["OMP_NUM_THREADS"] = str(threads)
        if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
            # NOTE: read once, when libgomp initializes: a process that loaded it before
            # (a second engine, torch) keeps its first settings
            os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
        try:
            self.lib = ctypes.CDLL(str(artifact.file(info["code_object"])))
        except OSError as e:
            raise HipcError(f"{artifact.file(info['code_object'])}: cannot load ({e})") from None
        for symbol in ("hipc_abi_version", "hipc_isa", "hipc_forward", "hipc_kv_block"):
            if not hasattr(self.lib, symbol):
                raise HipcError(
                    f"{artifact.file(info['code_object'])}: no {symbol} in the code object; "
                    "it and plan.json disagree (recompile the artifact)"
                )
        if self.lib.hipc_abi_version() != ABI_VERSION:
            raise HipcError(
                f"{artifact.path}: kernel ABI {self.lib.hipc_abi_version()}, runtime expects {ABI_VERSION}"
            )
        self.lib.hipc_isa.restype = ctypes.c_char_p
        self.isa = self.lib.hipc_isa().decode()
        f = self.lib.hipc_forward
        p, i = ctypes.c_void_p, ctypes.c_int
        f.argtypes = [p, i, p, p, p, p, i, p, p, p, p]
        f.restype = ctypes.c_int
        self._forward = f

        plan = artifact.plan
        cpu = TargetPlan.from_json(plan, "cpu")
        if cpu.entry != "hipc_forward" or cpu.abi_version != ABI_VERSION:
            raise HipcError(
                f"{artifact.path}/plan.json: cpu entry {cpu.entry!r} ABI {cpu.abi_version}, "
                f"this runtime calls hipc_forward ABI {ABI_VERSION} (recompile the artifact)"
            )
        st = SafetensorsFile(artifact.file("weights.safetensors"))
        self.weights = []
        for w in plan["weights"]:
            if w["name"] not in st.entries:
                raise HipcError(f"{st.path}: tensor {w['name']!r} missing")
            self.weights.append(st.raw(w["name"]))
        self._W = (ctypes.c_void_p * len(self.weights))(*[a.ctypes.data for a in self.weights])
        self.max_tokens = plan["max_tokens"]
        self.vocab = plan["vocab_size"]
        self.arena = np.zeros(cpu.arena_bytes // 4, np.float32)
        # attention reads only positions the sequence wrote, so a shorter cache is safe as
        # long as the engine admits no more than it holds
        self.max_context = max_context or int(plan["max_context"])
        self.kv_block = int(self.lib.hipc_kv_block())
        if cpu.kv_block != self.kv_block:
            raise HipcError(
                f"{artifact.path}/plan.json: KV block {cpu.kv_block}, the code object's is "
                f"{self.kv_block} (recompile the artifact)"
            )
        # block-table entries per sequence: the compiled context's (the kernels' stride)
        self.kv_table = -(-int(plan["max_context"]) // self.kv_block)
        one_sequence = -(-self.max_context // self.kv_block)
        self.kv_blocks = max(kv_blocks or one_sequence, one_sequence)
        self.states = states(plan)
        self.recurrent = any(not s.positional for s in self.states)
        # the cpu program's states are float32 whatever the kind (one layout per artifact);
        # a KV state is a pool of blocks, a recurrent one a pool of slots, as many as the KV
        # pool holds whole sequences (more on demand: `ensure_slots`)
        self.slots = max(1, self.kv_blocks * self.kv_block // self.max_context)
        self.kv = [
            np.zeros(
                s.shape_for(self.kv_blocks * self.kv_block)
                if s.positional
                else (self.slots, *s.shape),
                np.float32,
            )
            for s in self.states
        ]
        self._pointers()
        self._solo = np.arange(self.kv_table, dtype=np.int32) % self.kv_blocks

    def _pointers(self) -> None:
        self._KV = (ctypes.c_void_p * len(self.kv))(*[a.ctypes.data for a in self.kv])

    def ensure_slots(self, n: int) -> None:
        """At least `n` recurrent slots (the batch's sequences); existing slots kept."""
        if n <= self.slots:
            return
        for i, s in enumerate(self.states):
            if not s.positional:
                grown = np.zeros((n, *s.shape), np.float32)
                grown[: self.slots] = self.kv[i]
                self.kv[i] = grown
        self.slots = n
        self._pointers()

    @property
    def kv_bytes(self) -> int:
        return sum(a.nbytes for a in self.kv)

    @property
    def block_bytes(self) -> int:
        """Bytes one KV block takes over every layer's pools."""
        return sum(a.nbytes for s, a in zip(self.states, self.kv, strict=True) if s.positional) // (
            self.kv_blocks
        )

    @property
    def slot_bytes(self) -> int:
        """Bytes one sequence's recurrent states take (a slot, or a snapshot)."""
        return sum(a[0].nbytes for a in self._recurrent())

    def reset(self, slot: int | None = None) -> None:
        """A new sequence (in `slot`; None: every slot): apply each state's reset rule (zero
        the recurrent ones; a KV cache's positions are written before they are read, so it is
        left as it is)."""
        for a in self._recurrent():
            a[slice(None) if slot is None else slot].fill(0)

    # -- recurrent states (runtime/recurrent.py and runtime/batch.py take and restore
    # snapshots; slot 0 is the one-sequence view's) --

    def _recurrent(self) -> list[np.ndarray]:
        return [a for s, a in zip(self.states, self.kv, strict=True) if s.needs_reset]

    def reset_recurrent(self) -> None:
        self.reset()

    def snapshot(self, slot: int = 0) -> list[np.ndarray]:
        return [a[slot].copy() for a in self._recurrent()]

    def restore(self, snapshot: list[np.ndarray], slot: int = 0) -> None:
        for dst, src in zip(self._recurrent(), snapshot, strict=True):
            np.copyto(dst[slot], src)  # in place: hipc_forward holds these pointers

    def forward(
        self, ids: np.ndarray, start: int, all_logits: bool, copy: bool = True
    ) -> np.ndarray:
        """One sequence's tokens at start..: its block b is pool block b. (The logits are a
        new array whatever `copy` says: the kernels write them there.)"""
        T = len(ids)
        if start < 0 or start + T > self.max_context:
            raise HipcError(
                f"positions {start}..{start + T - 1} are past the {self.max_context} this engine holds"
            )
        pos = np.arange(start, start + T, dtype=np.int32)
        rows = np.arange(T, dtype=np.int32) if all_logits else np.array([T - 1], np.int32)
        # step()'s checks are of the caller's tables and runs; the solo table and one
        # sequence's rows pass them by construction, and a decode token's Python is ~30 us
        # of a SmolLM2 step's ~3 ms without them (~45 us with)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        return self._run(ids, pos, np.zeros(T, np.int32), self._solo[None, :], rows)

    def step(
        self,
        ids: np.ndarray,
        pos: np.ndarray,
        seq: np.ndarray,
        tables: np.ndarray,
        out_rows: np.ndarray,
    ) -> np.ndarray:
        """Rows of many sequences: row t is token ids[t] at position pos[t] of the sequence
        whose block table is tables[seq[t]] ([sequences, kv_table] pool block ids). Returns
        the logits of out_rows (ascending), [len(out_rows), vocab]."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        pos = np.ascontiguousarray(pos, dtype=np.int32)
        seq = np.ascontiguousarray(seq, dtype=np.int32)
        tables = np.ascontiguousarray(tables, dtype=np.int32)
        out_rows = np.ascontiguousarray(out_rows, dtype=np.int32)
        T = len(ids)
        if tables.ndim != 2 or tables.shape[1] != self.kv_table:
            raise HipcError(f"block tables must be [sequences, {self.kv_table}]")
        if T and (pos.max() >= self.max_context or seq.max() >= len(tables)):
            raise HipcError(f"a step row is past the {self.max_context} positions or the tables")
        # the kernels trust the tables: a block id outside the pool would be read or written
        # out of bounds, so every entry a row reads (its blocks up to its position) is checked
        last = np.full(len(tables), -1, np.int64)
        np.maximum.at(last, seq, pos // self.kv_block)
        used = tables[np.arange(self.kv_table)[None, :] <= last[:, None]]
        if used.size and (used.min() < 0 or used.max() >= self.kv_blocks):
            raise HipcError(f"a block table names a block outside the pool of {self.kv_blocks}")
        if T and self.recurrent:
            # the deltanet kernel steps each sequence's rows as one run in its slot
            starts = np.flatnonzero(np.diff(seq)) + 1
            if seq.max() >= self.slots or len(starts) + 1 != len(np.unique(seq)):
                raise HipcError(
                    f"a step's rows must be runs of one sequence each, in slots below {self.slots}"
                )
        return self._run(ids, pos, seq, tables, out_rows)

    def _run(self, ids, pos, seq, tables, out_rows) -> np.ndarray:
        """hipc_forward on checked, contiguous arrays of the dtypes it reads."""
        T = len(ids)
        out = np.empty((len(out_rows), self.vocab), np.float32)
        rc = self._forward(
            ids.ctypes.data,
            T,
            pos.ctypes.data,
            seq.ctypes.data,
            tables.ctypes.data,
            out_rows.ctypes.data,
            len(out_rows),
            self._W,
            self.arena.ctypes.data,
            self._KV,
            out.ctypes.data,
        )
        if rc != 0:
            raise HipcError(
                f"hipc_forward rejected a step of {T} rows at positions "
                f"{int(pos.min()) if T else 0}..{int(pos.max()) if T else 0}"
            )
        return out

    # step_top picks on the host here: the caller gains nothing over step()'s logits
    max_top_k = 0

    def step_top(self, ids, pos, seq, tables, out_rows, k: int, logsumexp: bool = False):
        """step() returning the out_rows' k largest logits (GpuBackend.step_top's contract;
        here chosen from the logits on the host)."""
        if not 1 <= k <= TOPK_MAX:
            raise HipcError(f"step_top: k must be 1 to {TOPK_MAX}, got {k}")
        top = top_of_logits(self.step(ids, pos, seq, tables, out_rows), k)
        return top if logsumexp else top[:2]

    def close(self) -> None:
        self.kv.clear()
        self.weights.clear()
