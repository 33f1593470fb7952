"""Render the HIP program for one GPU arch and the launch lists the runtime replays.

One source holds every kernel (deduplicated by name); the plan section lists, for decode
(one token, GEMV-shaped kernels), prefill (T tokens, GEMM-shaped kernels) and batch (T rows
of T different sequences: prefill's list, with the attention kernel made for such rows),
each launch's kernel, grid/block and argument bindings (the launch plan: hipc.base.launch_plan). Each
kernel kind (compiler/kernels) adds its kernels and launches through GpuProgramBuilder;
Python decides names, geometry and bindings, the templates only place them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hipc.base.errors import HipcError
from hipc.base.launch_plan import KV_BLOCK, TOPK_MAX
from hipc.base.version import HIPC_VERSION
from hipc.compiler.codegen.bindings import Binder, Binding
from hipc.compiler.codegen.environment import render, template_text
from hipc.compiler.kernels.base import FusionError, Signature
from hipc.compiler.kernels.linear import BATCH_GEMV_ROWS, MMA_TILES, WGMMA_ARCHS
from hipc.compiler.passes.select import weight_order

if TYPE_CHECKING:
    from hipc.compiler.kernels.base import GpuKernel, SelectedKernel
    from hipc.compiler.pipeline import Compilation
    from hipc.compiler.targets import GpuTarget


TOPK_KERNEL = "hipc_topk"
TOPK_BLOCK = 1024  # threads per row: the row is read ~6 times (max, sum, selection passes)
# the row top-k on several blocks a row (hipc_topk_pick for k = 1: the greedy pick or a draw
# at a temperature; hipc_topk_split for more): each thread GREEDY_PER_THREAD values at most,
# each block GREEDY_BLOCK threads, so a 128k vocabulary is 63 blocks
GREEDY_BLOCK = 256
GREEDY_PER_THREAD = 8


def greedy_geometry(vocab: int) -> tuple[int, int]:
    """(blocks a row, values a thread at most) of the several-block kernels: as many blocks
    as GREEDY_PER_THREAD values a thread needs, at most one per thread of the merging block."""
    per_thread = max(GREEDY_PER_THREAD, -(-vocab // (GREEDY_BLOCK * GREEDY_BLOCK)))
    return -(-vocab // (GREEDY_BLOCK * per_thread)), per_thread


@dataclass
class HipProgram:
    source: str
    plan: dict[str, Any]


class GpuProgramBuilder:
    """The kernels and the decode/prefill launch lists of one GPU target, as kinds add them."""

    def __init__(
        self,
        target: GpuTarget,
        max_tokens: int,
        max_ctx: int,
        kv_storage: str,
        kernels: list[SelectedKernel],
        prefill_precision: str = "bf16",
        activations: str = "int16",
        quant_layout: str = "split",
        is_output: Callable[[str], bool] = lambda value: False,
    ) -> None:
        self.target, self.max_tokens = target, max_tokens
        self.is_output = is_output  # whether an activation is a graph output (Binder.is_output)
        self.prefill_precision = prefill_precision  # CompileOptions.prefill_precision
        self.activations = activations  # how quantized GEMVs round x (CompileOptions)
        self.quant_layout = (
            quant_layout  # how the artifact stores quantized blocks (CompileOptions)
        )
        self.max_ctx, self.kv_storage = max_ctx, kv_storage
        self.selected = kernels  # every kernel of the program (kinds look up their neighbours)
        self.memo: dict[str, Any] = {}  # what a kind works out once per program from `selected`
        self.kernels: dict[str, str] = {}
        self.steps: dict[str, list[dict]] = {"decode": [], "prefill": [], "batch": []}
        # batch steps of up to this many rows run the linears' weights-once GEMV where they
        # have one (HIPC_BATCH_GEMV_ROWS overrides: 0 keeps the prefill GEMMs, as benchmarks
        # compare); a kind adding a prefill launch whose batch copy serves only larger steps
        # sets batch_min for it
        env = os.environ.get("HIPC_BATCH_GEMV_ROWS")
        self.batch_gemv_rows = int(env) if env else BATCH_GEMV_ROWS
        self.batch_gemv_rows_set = bool(env)  # for every linear, LM heads included
        # and their attention takes a KV head's query heads per block (HIPC_BATCH_ATTN_GROUP=0:
        # one head per block, as before, for benchmarks)
        self.batch_attn_group = os.environ.get("HIPC_BATCH_ATTN_GROUP") != "0"
        # and the split-context attention from attention.BATCH_SPLIT_ROWS rows
        # (HIPC_BATCH_ATTN_SPLIT=0: the kernels above at every size, for benchmarks)
        self.batch_attn_split = os.environ.get("HIPC_BATCH_ATTN_SPLIT") != "0"
        # with its loads as attention.BATCH_LOADS measured for the target (HIPC_BATCH_ATTN_LOADS=0:
        # a pass's loads then its math, session 10's form, for benchmarks)
        self.batch_attn_loads = os.environ.get("HIPC_BATCH_ATTN_LOADS") != "0"
        # HIPC_BATCH_GEMV_XPIPE=1: every batch GEMV loads x a batch ahead (being measured)
        self.batch_gemv_xpipe = os.environ.get("HIPC_BATCH_GEMV_XPIPE") == "1"
        # HIPC_BATCH_GEMV_TUNED=0: linear_gemvm everywhere with session 7's geometry (gemvm_plain,
        # none of GEMVM_MEASURED's / GEMVM_DEFAULT's), for benchmarks comparing the two
        self.batch_gemv_tuned = os.environ.get("HIPC_BATCH_GEMV_TUNED") != "0"
        self.batch_min = 1
        # The scratch buffer: one region per name the kinds ask for (KernelKind.gpu_scratch),
        # as large as the largest ask, in order of first ask, each 256-byte aligned. Kernels of
        # a step run one after another, so every layer reuses its kind's region; the buffer is
        # zeroed at load (the decode attention's counters rely on it).
        sizes: dict[str, int] = {}
        for k in kernels:
            for name, nbytes in k.kind.gpu_scratch(k, self).items():
                sizes[name] = max(sizes.get(name, 0), nbytes)
        self._scratch: dict[str, int] = {}
        end = 0
        for name, nbytes in sizes.items():
            self._scratch[name] = -(-end // 256) * 256
            end = self._scratch[name] + nbytes
        self.scratch_bytes = end

    def scratch(self, name: str) -> int:
        """The byte offset of scratch region `name` (asked for in gpu_scratch)."""
        return self._scratch[name]

    def kernel(self, k: GpuKernel) -> str:
        """Render `k` once (kernels are shared by name); its name."""
        if k.fn not in self.kernels:
            ctx = {"fn": k.fn, "wave": self.target.wave, **k.ctx}
            self.kernels[k.fn] = render(f"hip/{k.template}.hip.j2", **ctx)
        return k.fn

    def launch(
        self,
        step: str,
        group: str,
        kernel: str,
        grid: list,
        block: list,
        signature: Signature,
        bindings: dict[str, Binding],
        shared: int = 0,
        overlap: bool = False,
        tokens: tuple[int, int] | None = None,
        batch: bool = True,
    ) -> None:
        """A launch of `step`; a prefill launch goes into the batch step too unless `batch`
        is False (the batch step is the prefill list with its own kernel where a kind has one
        for rows of many sequences, one row each)."""
        launch = {
            "group": group,
            "kernel": kernel,
            "grid": grid,
            "block": block,
            "shared": shared,
            "args": signature.order(bindings, kernel),
        }
        if overlap:
            # the kernel waits for the one before (hipc_wait_prior) before touching its outputs,
            # so the runtime may launch it early where the GPU allows (programmatic launch)
            launch["overlap"] = True
        if tokens is not None:
            launch["tokens"] = list(tokens)  # only in steps of this many tokens
        self.steps[step].append(launch)
        if step == "prefill" and batch:
            lo, hi = tokens or (1, self.max_tokens)
            if self.batch_min > lo:
                launch = {**launch, "tokens": [self.batch_min, hi]}
            if self.batch_min <= hi:
                self.steps["batch"].append(launch)


def render_hip_program(c: Compilation, gpu: GpuTarget) -> HipProgram:
    for k in c.kernels:
        if lacks := [s for s in k.params.switched_on() if s in k.kind.gpu_lacks]:
            raise FusionError(
                f"{k.group}: the GPU {k.kind.name} kernels have no {', '.join(lacks)} yet "
                "(the cpu target has)"
            )
    memory = c.memory
    binder = Binder(memory, weight_order(c.kernels), [s.name for s in c.states])
    g = GpuProgramBuilder(
        gpu,
        memory.max_tokens,
        c.max_ctx,
        c.kv_storage,
        c.kernels,
        c.options.prefill_precision,
        c.options.activations,
        c.options.quant_layout,
        binder.is_output,
    )
    for k in c.kernels:
        k.kind.gpu(k, binder, g)
    # every program's row top-k (GpuBackend.step_top): rows x k values copied back, not logits
    greedy_blocks, per_thread = greedy_geometry(c.model.config.vocab_size)
    g.kernels[TOPK_KERNEL] = render(
        "hip/topk.hip.j2",
        fn=TOPK_KERNEL,
        wave=gpu.wave,
        max_k=TOPK_MAX,
        greedy_block=GREEDY_BLOCK,
        greedy_per_thread=per_thread,
    )
    source = program_source(
        c.model.name, HIPC_VERSION, gpu.arch, list(g.kernels.values()), c.options.quant_layout
    )
    plan = {
        "wave": gpu.wave,
        "arena_bytes": memory.arena_bytes,
        "scratch_bytes": g.scratch_bytes,
        "kv_block": KV_BLOCK,
        "steps": g.steps,
        "topk": {
            "kernel": TOPK_KERNEL,
            "block": TOPK_BLOCK,
            "max_k": TOPK_MAX,
            **{
                form: {
                    "kernel": f"{TOPK_KERNEL}_{form}",
                    "block": GREEDY_BLOCK,
                    "blocks": greedy_blocks,
                }
                for form in ("pick", "split")
            },
        },
    }
    return HipProgram(source, plan)


# The GEMVs' weight loads (prelude: hipc_load_weights16: the quantized and bf16 decode GEMVs,
# the MoE experts', the batch GEMVs') on NVIDIA sm_80+ stream with L2 priority evict_first, so
# the 4+ GB a token passes through L2 evict each other and leave what is read again (code,
# activations, the KV cache). Three H100s (bench_gpu_variants.py, session 26): the 8B Q4_K_M
# decode +1.1-1.9% at tg128 and +1.8-2.7% after 512 positions (the Q4_K qkv 8.68 -> 8.01 us),
# Q4_0 +0.0-1.1% (within its rounds' spread); bf16, MoE and batched decode not measured with it.
WEIGHT_CACHE_DEFAULT = "L2::evict_first"
# HIPC_WEIGHT_CACHE (compile time, for benchmarks): the loads' PTX cache qualifiers instead,
# '.'-joined ("none": plain loads), e.g. "L1::no_allocate.L2::evict_first.L2::256B".
WEIGHT_CACHE_ENV = "HIPC_WEIGHT_CACHE"
WEIGHT_CACHE_HINTS = ("L1::no_allocate", "L1::evict_first", "L2::64B", "L2::128B", "L2::256B")
WEIGHT_POLICIES = ("L2::evict_first", "L2::evict_last")


def weight_cache(target: str) -> tuple[str, str]:
    """The weight loads' (PTX qualifier suffix, L2 policy) for `target` ("" each: plain)."""
    from hipc.compiler.targets import GpuTarget

    if GpuTarget(target).sm < 80:  # (createpolicy: sm_80+; AMD reads plain loads)
        return "", ""
    text = os.environ.get(WEIGHT_CACHE_ENV, WEIGHT_CACHE_DEFAULT)
    hints = [] if text == "none" else [h for h in text.split(".") if h]
    policies = [h for h in hints if h in WEIGHT_POLICIES]
    quals = [h for h in hints if h in WEIGHT_CACHE_HINTS]
    if (
        len(policies) + len(quals) != len(hints)
        or len(set(hints)) != len(hints)
        or len(policies) > 1
    ):
        raise HipcError(
            f"{WEIGHT_CACHE_ENV}: {text!r} is not 'none' or '.'-joined qualifiers of "
            f"{', '.join(WEIGHT_CACHE_HINTS)} and at most one of {', '.join(WEIGHT_POLICIES)}"
        )
    # PTX's order: L1 priority, the policy operand's hint, prefetch size
    l1 = [h for h in quals if h.startswith("L1::")]
    sizes = [h for h in quals if h.startswith("L2::")]
    ordered = l1 + ["L2::cache_hint"] * len(policies) + sizes
    return "".join(f".{h}" for h in ordered), "".join(policies)


def program_source(
    name: str, hipc_version: str, target: str, kernels: list[str], quant_layout: str = "split"
) -> str:
    """One compilable HIP source: the prelude for `target`, then the rendered kernels.
    `quant_layout`: how the artifact stores quantized blocks (CompileOptions.quant_layout)."""
    from hipc.compiler.targets import GpuTarget

    tile = MMA_TILES.get(target)
    return render(
        "hip/program.hip.j2",
        name=name,
        qsplit=int(quant_layout == "split"),
        hipc_version=hipc_version,
        target=target,
        wave=GpuTarget(target).wave,
        mma_macro=tile.macro if tile else None,
        wgmma=target in WGMMA_ARCHS,
        weight_cache=weight_cache(target),
        prelude=template_text("hip/prelude.h").replace("#pragma once", ""),
        kernels=kernels,
    )
