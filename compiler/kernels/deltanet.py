"""deltanet: one Gated DeltaNet step per layer -- conv, gates, delta rule, gated norm.

Anchors on hipc::GatedDeltaRule. Absorbs everything between the layer's in-projections and
its out-projection (graphs/hybrid.py): the causal conv with its SiLU and the split into
q/k/v, the L2 norms, beta = sigmoid(b), g = A * softplus(a [+ dt_bias]) as prologue
(`deltanet:feeder`), and the per-head RMSNorm times SiLU(z) with the flattening Reshape as
epilogue (`deltanet:gate`). The kernel reads the projections' outputs (q/k/v contiguous
[T, C], z, b, a as column views) and its two recurrent states (the conv window and the
[value heads, dk, dv] matrices), and writes the gated output rows for the out-projection.

CPU: templates/cpu/deltanet.cpp.j2: rows of many sequences, each reading and writing its
sequence's slot of the states (`seq`, as attention reads its block table); the conv for all
tokens, then per (sequence, value head) pair (in parallel) the recurrence over its tokens (for several, a block of state columns at a
time so the block stays in L1; measured faster than the chunked form on a CPU).
GPU: the states are pools of slots too, row t's in slot seq[t]. templates/hip/deltanet.hip.j2
for decode steps, batch steps (rows of several sequences) and one sequence's prefill steps
shorter than the chunk: a block per key head (its value heads share its q/k conv channels, so
each conv window has one owner) and run of one sequence's rows, a thread per state column held
in registers, the run's tokens through the recurrence in order. One sequence's steps of a
chunk or more: templates/hip/deltanet_chunk.hip.j2, the chunked form in four launches
(chunk_launches), _solve's Q K^T and K K^T on the target's matrix instruction where the
prelude has one (chunk_mma), the rest SIMT.
Qwen3-Next's projections packed per key head (HF's in_proj_qkvz and in_proj_ba, which the
graph unpacks with Reshape/Split/Concat) are read where they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hipc.compiler.ir import Graph, Node
from hipc.compiler.kernels.base import (
    CPU_INDENT,
    GPU_INDENT,
    FusionError,
    GpuKernel,
    KernelKind,
    Params,
    SelectedKernel,
    Signature,
)

if TYPE_CHECKING:
    from hipc.compiler.codegen.bindings import Binder
    from hipc.compiler.codegen.hip import GpuProgramBuilder
    from hipc.compiler.passes.fuse import FusedGroup, Proposals

# ops between the in-projections and the delta rule that the kernel computes
FEEDERS = frozenset(
    {
        "Reshape",
        "Split",
        "hipc::CausalConv1d",
        "hipc::SiLU",
        "hipc::L2Normalization",
        "Sigmoid",
        "Softplus",
        "Mul",
        "Add",
        "Concat",
    }
)


@dataclass(frozen=True)
class DeltaNetParams(Params):
    NK: int  # key heads
    NV: int  # value heads
    DK: int
    DV: int
    KC: int  # conv taps
    scale: float  # the query's
    l2_eps: float
    norm_eps: float
    v_tiled: bool  # value head h reads key head h % NK (else h / (NV / NK))
    dt_bias: bool  # a separate dt bias (else the a projection added it)
    # Qwen3-Next's in_proj_ba: per key head [b (NV/NK) | a (NV/NK)] in one projection
    ba_packed: bool
    # Qwen3-Next's in_proj_qkvz (HF): per key head [q DK | k DK | v R*DV | z R*DV]
    qkvz_packed: bool
    chunk: int  # prefill tokens staged per block (q, k, v, gates) per head
    conv_wtype: str  # the conv weight's storage type (widened to float32 per call)

    def tag(self) -> str:
        return f"k{self.NK}v{self.NV}d{self.DK}x{self.DV}c{self.KC}"


CONV_WTYPES = ("float32", "bfloat16", "float16")

# seq: each row's sequence, whose states are that slot of conv_state / ssm_state
CPU = Signature.parse("""
int T, const int32_t* seq, const float* x, int ldx, const float* z, int ldz, const float* b, int ldb,
const float* a, int lda, const void* conv_w, const float* A, const float* dt_bias,
const float* norm_w, float* conv_state, float* ssm_state, float* y, int ldy
""")

GPU_ARGS = """
int T, const float* __restrict__ x, int ldx, const float* __restrict__ z, int ldz,
const float* __restrict__ b, int ldb, const float* __restrict__ a, int lda, const void* conv_w,
const float* __restrict__ A, const float* __restrict__ dt_bias, const float* __restrict__ norm_w,
float* conv_state, float* ssm_state, float* __restrict__ y, int ldy,
const int32_t* __restrict__ pos, const int32_t* __restrict__ seq
"""
GPU = Signature.parse(GPU_ARGS)
# the chunked prefill's kernels (templates/hip/deltanet_chunk.hip.j2): the GPU signature and
# the scratch rows they share
CHUNK_GPU = Signature.parse(GPU_ARGS.rstrip() + ", float* __restrict__ work\n")
CHUNK_WORK = "deltanet_work"
CHUNK_THREADS = 256  # _solve's products are a 16 x 16 grid of thread tiles, _scan's block
CHUNK_STAGE = 64  # K / Q columns staged in shared memory at a time
MAX_GPU_THREADS = 1024
# State rows a lane holds in registers before a column is split over more lanes. Measured on
# the H200 at the 35B shape (DK = 128, docs/benchmarks/bench_gpu_deltanet.py): a decode step
# takes 12.6 us with one lane per column (128 rows, 256 threads) against 13.9 us with two
# (64 rows each, 512 threads), so DK = 128 keeps one lane; DK = 256 splits over two.
MAX_GPU_ROWS = 128


def gpu_lanes(p: DeltaNetParams, lanes: int | None = None) -> int:
    """Lanes per state column: `lanes` where given (tests and benchmarks try each split), else
    split while a lane would hold more than MAX_GPU_ROWS rows and the block stays within
    MAX_GPU_THREADS."""
    if lanes is not None:
        if p.DK % lanes or lanes & (lanes - 1):
            raise ValueError(f"{lanes} lanes per state column do not split DK = {p.DK}")
        return lanes
    lanes, cols = 1, (p.NV // p.NK) * p.DV
    while p.DK // lanes > MAX_GPU_ROWS and p.DK % (2 * lanes) == 0:
        if cols * 2 * lanes > MAX_GPU_THREADS:
            break
        lanes *= 2
    return lanes


def gpu_threads(p: DeltaNetParams, wave: int, lanes: int | None = None) -> int:
    """The GPU block: `gpu_lanes` per state column of the key head's value heads, whole waves."""
    return -(-(p.NV // p.NK) * p.DV * gpu_lanes(p, lanes) // wave) * wave


def gpu_kernel(
    fn: str, p: DeltaNetParams, wave: int, nodes: list[str], lanes: int | None = None
) -> GpuKernel:
    """The layer's token-serial GPU kernel (templates/hip/deltanet.hip.j2): grid = key heads."""
    threads = gpu_threads(p, wave, lanes)
    ctx = dict(
        nodes=nodes, threads=threads, lanes=gpu_lanes(p, lanes), params=GPU.render(GPU_INDENT),
        **p.context(),
    )  # fmt: skip
    return GpuKernel(fn, "deltanet", ctx, [p.NK], threads)


def chunked(p: DeltaNetParams) -> bool:
    """Whether prefill steps of p.chunk tokens or more run the chunked kernels: chunks of a
    multiple of 16 up to CHUNK_STAGE (the solve's thread tiles, its A in the staging buffer),
    at least as long as the conv window, and DV + DK columns for the solve's threads."""
    fits = p.DV + p.DK <= MAX_GPU_THREADS  # _solve: a thread per right-hand column
    return fits and p.chunk % 16 == 0 and 16 <= p.chunk <= CHUNK_STAGE and p.chunk >= p.KC - 1


SCAN_COLUMNS = 8


def chunk_columns(p: DeltaNetParams, most: int = SCAN_COLUMNS) -> int:
    """State columns one _scan block carries (columns of S evolve apart): `most` where DV
    allows. 8 by default: at the 35B shape (32 value heads x 16 blocks) the scan of a 4096-token
    step took 2.8 ms on the H200 against 3.7 with 16 columns and 4.2 with 32 (fewer, longer
    blocks: the chunks are sequential, so more blocks is the parallelism there is)."""
    return next(b for b in (32, 16, 8, 4, 2, 1) if b <= most and p.DV % b == 0)


def chunk_work_bytes(p: DeltaNetParams, T: int) -> int:
    """Bytes of `work` for a T-token step (rows padded to whole chunks where per chunk)."""
    C = 2 * p.NK * p.DK + p.NV * p.DV
    TP = -(-T // p.chunk) * p.chunk
    return 4 * (T * C + 2 * T * p.NV + TP * p.NV * (1 + p.DV + p.DK + p.chunk))


def chunk_mma(arch: str) -> str:
    """The matrix instruction _solve's Q K^T and K K^T use on `arch` through the prelude's
    hipc_mma_* (the prefill GEMM's: mma.sync on NVIDIA, WMMA on RDNA3, MFMA on CDNA), or ""
    for SIMT (gfx12 and what else has no hipc_mma_* yet)."""
    from hipc.compiler.kernels.linear import MMA_TILES

    tile = MMA_TILES.get(arch)
    return tile.instruction if tile else ""


def scan_mma_fits(p: DeltaNetParams, mma: str, columns: int = SCAN_COLUMNS) -> bool:
    """Whether _scan can run on `mma` too (its tiles: 16 state rows, the instruction's N
    columns -- 8 for mma.sync, 16 for WMMA/MFMA)."""
    n = 8 if mma.startswith("mma.sync") else 16
    return bool(mma) and p.DK % 16 == 0 and chunk_columns(p, columns) % n == 0


# _scan on mma.sync with 32 state columns a block where it fits. On the H200 (bench_gpu_deltanet.py,
# the 35B linear layer, session 10) 0.637 us a token and layer at 4,096 tokens (0.617 at 512)
# against 0.808 (0.823) for the SIMT scan of 8 columns, the default before; on mma with 8
# columns it took 0.904. WMMA / MFMA (AMD) are not measured: they keep the SIMT scan.
SCAN_MMA_COLUMNS = 32


def scan_on_mma(p: DeltaNetParams, mma: str) -> bool:
    """Whether compiled models run _scan on `mma` (chunk_mma's), SCAN_MMA_COLUMNS wide."""
    return mma.startswith("mma.sync") and scan_mma_fits(p, mma, SCAN_MMA_COLUMNS)


def gpu_chunk_kernel(
    fn: str,
    p: DeltaNetParams,
    wave: int,
    nodes: list[str],
    mma: str = "",
    columns: int | None = None,
    scan_mma: bool | None = None,
) -> GpuKernel:
    """The chunked prefill (templates/hip/deltanet_chunk.hip.j2): {fn}_prep (grid T x key
    heads), _solve (value heads x chunks), _scan (value heads x DV / its columns), _norm (T).
    `mma`: chunk_mma's instruction (the program's prelude must define its HIPC_MMA_*);
    `columns`: chunk_columns' most per _scan block; `scan_mma`: _scan on `mma` too
    (scan_mma_fits). Either left out: as compiled (scan_on_mma); benchmarks try others."""
    if scan_mma is None:
        scan_mma = scan_on_mma(p, mma)
    if columns is None:
        wide = scan_mma and scan_mma_fits(p, mma, SCAN_MMA_COLUMNS)
        columns = SCAN_MMA_COLUMNS if wide else SCAN_COLUMNS
    if scan_mma and not scan_mma_fits(p, mma, columns):
        raise ValueError(f"{fn}: _scan does not fit {mma or 'SIMT'} at DK {p.DK}, DV {p.DV}")
    nch = 2 * p.DK + (p.NV // p.NK) * p.DV
    ctx = dict(
        nodes=nodes, L=p.chunk, BV=chunk_columns(p, columns), SL=CHUNK_STAGE, mma=mma,
        scan_mma=scan_mma,
        prep_threads=max(wave, min(256, -(-nch // wave) * wave)),
        solve_threads=max(CHUNK_THREADS, -(-(p.DV + p.DK) // wave) * wave),
        scan_threads=CHUNK_THREADS, norm_threads=CHUNK_THREADS,
        params=CHUNK_GPU.render(GPU_INDENT), **p.context(),
    )  # fmt: skip
    return GpuKernel(fn, "deltanet_chunk", ctx, [p.NV], CHUNK_THREADS)


def chunk_launches(p: DeltaNetParams, k: GpuKernel) -> list[tuple[str, list, int]]:
    """(kernel, grid (launch-plan expressions in T), threads) of the chunked prefill `k`, in
    launch order."""
    c = k.ctx
    return [
        (f"{k.fn}_prep", ["T", p.NK], c["prep_threads"]),
        (f"{k.fn}_solve", [p.NV, f"cdiv(T,{p.chunk})"], c["solve_threads"]),
        (f"{k.fn}_scan", [p.NV, p.DV // c["BV"]], c["scan_threads"]),
        (f"{k.fn}_norm", ["T"], c["norm_threads"]),
    ]


def _is_projection(graph: Graph, value: str) -> bool:
    """A Linear's output, or a column view of one (the Split after merged projections)."""
    p = graph.producer(value)
    if p is None:
        return False
    if p.op == "Split":
        p = graph.producer(p.inputs[0])
    return p is not None and p.op == "hipc::Linear"


def _feeders(graph: Graph, anchor: Node) -> list[Node]:
    """The nodes between the projections (or weights) and the delta rule, in graph order."""
    found: dict[str, Node] = {}
    stack = list(anchor.inputs[:5])
    while stack:
        v = stack.pop()
        p = graph.producer(v)
        if p is None or p.name in found or _is_projection(graph, v) or p.op not in FEEDERS:
            continue
        found[p.name] = p
        stack.extend(i for i in p.inputs if i not in graph.initializers and i not in graph.states)
    return list(found.values())


def _packed_half(graph: Graph, value: str) -> tuple[str, int] | None:
    """Reshape(Split(Reshape(projection)).out[i]): (the projection, i), else None."""
    flat = graph.producer(value)
    split = flat and flat.op == "Reshape" and graph.producer(flat.inputs[0])
    heads = split and split.op == "Split" and graph.producer(split.inputs[0])
    if not heads or heads.op != "Reshape" or not _is_projection(graph, heads.inputs[0]):
        return None
    return heads.inputs[0], split.outputs.index(flat.inputs[0])


def _qkvz_source(graph: Graph, value: str) -> tuple[str, Node] | None:
    """Concat(Reshape(s.0), Reshape(s.1), Reshape(s.2)) with s = Split(Reshape(projection)) in
    four parts (graphs/hybrid.py undoing Qwen3-Next's per-key-head packing): (the
    projection, s), else None."""
    cat = graph.producer(value)
    if cat is None or cat.op != "Concat" or len(cat.inputs) != 3:
        return None
    parts = [graph.producer(i) for i in cat.inputs]
    if any(r is None or r.op != "Reshape" for r in parts):
        return None
    split = graph.producer(parts[0].inputs[0])
    if split is None or split.op != "Split" or len(split.outputs) != 4:
        return None
    if [r.inputs[0] for r in parts] != list(split.outputs[:3]):
        return None
    heads = graph.producer(split.inputs[0])
    if heads is None or heads.op != "Reshape" or not _is_projection(graph, heads.inputs[0]):
        return None
    return heads.inputs[0], split


def _gate_epilogue(graph: Graph, anchor: Node, p: Proposals) -> list[Node] | None:
    """RMSNormalization(o) * SiLU(Reshape(z)) -> Reshape(flat): the nodes, or None."""
    norm = p.only_user(anchor.outputs[0])
    mul = norm and norm.op == "RMSNormalization" and p.only_user(norm.outputs[0])
    if not mul or mul.op != "Mul":
        return None
    other = next(i for i in mul.inputs if i != norm.outputs[0])
    silu = graph.producer(other)
    heads = silu and silu.op == "hipc::SiLU" and graph.producer(silu.inputs[0])
    flat = p.only_user(mul.outputs[0])
    if not heads or heads.op != "Reshape" or not flat or flat.op != "Reshape":
        return None
    return [norm, heads, silu, mul, flat]


class DeltaNet(KernelKind):
    name = "deltanet"
    anchors = frozenset({"hipc::GatedDeltaRule"})
    roles = frozenset({"deltanet:feeder", "deltanet:gate"})
    cpu_signature = CPU

    def propose(self, graph: Graph, n: Node, p: Proposals) -> None:
        feeders = _feeders(graph, n)
        conv = next((f for f in feeders if f.op == "hipc::CausalConv1d"), None)
        if conv is not None:
            rest = [f for f in feeders if f is not conv]
            p.propose(n, conv, "deltanet:feeder", conv.outputs[0], side="prologue", brings=rest)
        gate = _gate_epilogue(graph, n, p)
        if gate is not None:
            p.propose(n, gate[0], "deltanet:gate", n.outputs[0], brings=gate[1:])

    def select(self, g: Graph, grp: FusedGroup) -> SelectedKernel:
        d = grp.anchor
        by_op: dict[str, list[Node]] = {}
        for node in grp.nodes:
            by_op.setdefault(node.op, []).append(node)
        convs = by_op.get("hipc::CausalConv1d", [])
        norms = [n for n in grp.epilogue if n.op == "RMSNormalization"]
        if len(convs) != 1 or len(norms) != 1:
            raise FusionError(
                f"{grp.name}: the deltanet kernel needs its conv and its gated norm "
                "(a layout it does not read: Qwen3-Next's per-key-head packed projections?)"
            )
        conv, norm = convs[0], norms[0]
        x, qkvz = conv.inputs[0], None
        if not _is_projection(g, x):
            qkvz = _qkvz_source(g, x)
            if qkvz is None:
                raise FusionError(
                    f"{grp.name}: q/k/v must come from one projection, or packed per key head "
                    "as Qwen3-Next's in_proj_qkvz"
                )
            x = qkvz[0]
        conv_wtype = g.values[conv.inputs[1]].dtype
        if conv_wtype not in CONV_WTYPES:
            raise FusionError(
                f"{grp.name}: conv weight {conv.inputs[1]} is {conv_wtype}; the deltanet "
                f"kernel reads {', '.join(CONV_WTYPES)}"
            )
        beta = g.producer(d.inputs[4])
        if beta is None or beta.op != "Sigmoid":
            raise FusionError(f"{grp.name}: beta must be sigmoid(b)")
        gmul = g.producer(d.inputs[3])
        soft = gmul and next(
            (q for i in gmul.inputs if (q := g.producer(i)) and q.op == "Softplus"), None
        )
        if gmul is None or gmul.op != "Mul" or soft is None:
            raise FusionError(f"{grp.name}: the decay must be A * softplus(a + dt_bias)")
        A = next(i for i in gmul.inputs if i != soft.outputs[0])
        a, dt = soft.inputs[0], ("none", None)
        add = g.producer(a)
        if add is not None and add.op == "Add":
            bias = next((i for i in add.inputs if i in g.initializers), None)
            if bias is None:
                raise FusionError(f"{grp.name}: dt_bias must be a weight")
            a = next(i for i in add.inputs if i != bias)
            dt = ("weight", bias)
        b_src, packed = beta.inputs[0], None
        if not _is_projection(g, a):
            packed = (_packed_half(g, b_src), _packed_half(g, a))
            if (
                None in packed
                or packed[0][0] != packed[1][0]
                or (packed[0][1], packed[1][1]) != (0, 1)
            ):
                raise FusionError(f"{grp.name}: b and a must be projections, or [b | a] packed")
            b_src = a = packed[0][0]
        silu_z = next(n for n in grp.epilogue if n.op == "hipc::SiLU")
        z = g.producer(silu_z.inputs[0]).inputs[0]
        if qkvz is not None:
            if z != qkvz[1].outputs[3]:
                raise FusionError(f"{grp.name}: z must be the packed projection's fourth part")
            z = x
        flat = grp.epilogue[-1]
        _, NK, DK = g.values[d.inputs[0]].shape
        _, NV, DV = g.values[d.inputs[2]].shape
        C, KC = g.values[conv.inputs[1]].shape[0], g.values[conv.inputs[1]].shape[-1]
        if C != 2 * NK * DK + NV * DV:
            raise FusionError(f"{grp.name}: conv channels {C} are not q, k, v")
        for v in (a, b_src, z):
            if not _is_projection(g, v):
                raise FusionError(f"{grp.name}: {v} must be a projection's output")
        l2 = by_op.get("hipc::L2Normalization", [])
        refs: dict[str, Any] = {
            "x": ("act", x),
            "z": ("act", z),
            "b": ("act", b_src),
            "a": ("act", a),
            "conv_w": ("weight", conv.inputs[1]),
            "A": ("weight", A),
            "dt_bias": dt,
            "norm_w": ("weight", norm.inputs[1]),
            "conv_state": ("state", conv.inputs[2]),
            "ssm_state": ("state", d.inputs[5]),
            "y": ("act", flat.outputs[0]),
        }
        params = DeltaNetParams(
            NK=int(NK),
            NV=int(NV),
            DK=int(DK),
            DV=int(DV),
            KC=int(KC),
            scale=float(d.attrs["scale"]),
            l2_eps=float(l2[0].attrs["epsilon"]) if l2 else 0.0,
            norm_eps=float(norm.attrs["epsilon"]),
            v_tiled=bool(d.attrs.get("v_tiled")),
            dt_bias=dt[0] == "weight",
            conv_wtype=conv_wtype,
            ba_packed=packed is not None,
            qkvz_packed=qkvz is not None,
            chunk=int(d.attrs.get("chunk_size") or 64),
        )
        return SelectedKernel(grp.name, grp.node_names, self, params, refs)

    def cpu_kernel(self, k: SelectedKernel, activations: str) -> tuple[str, dict[str, Any]]:
        return "cpu/deltanet.cpp.j2", dict(params=CPU.render(CPU_INDENT))

    def cpu_call(self, k: SelectedKernel, b: Binder) -> dict[str, Any]:
        return {"T": b.int("T"), "seq": b.input("seq"), **self._args(k, b)}

    @staticmethod
    def _args(k: SelectedKernel, b: Binder) -> dict[str, Any]:
        r = k.refs
        acts = ("x", "z", "b", "a", "y")
        return {
            **{n: b.act(r[n][1]) for n in acts},
            **{f"ld{n}": b.int(b.ld(r[n][1])) for n in acts},
            **{n: b.ref(r[n]) for n in ("conv_w", "A", "dt_bias", "norm_w")},
            **{n: b.ref(r[n]) for n in ("conv_state", "ssm_state")},
        }

    # -- GPU --

    def gpu_scratch(self, k: SelectedKernel, g: GpuProgramBuilder) -> dict[str, int]:
        p: DeltaNetParams = k.params
        if not chunked(p) or g.max_tokens < p.chunk:
            return {}
        return {CHUNK_WORK: chunk_work_bytes(p, g.max_tokens)}

    def gpu(self, k: SelectedKernel, b: Binder, g: GpuProgramBuilder) -> None:
        p: DeltaNetParams = k.params
        dk = gpu_kernel(k.fn, p, g.target.wave, k.nodes)
        if dk.threads > MAX_GPU_THREADS:
            raise FusionError(
                f"{k.group}: {p.NV // p.NK} value heads x {p.DV} per key head need {dk.threads} "
                f"threads, over the GPU deltanet block's {MAX_GPU_THREADS}"
            )
        fn = g.kernel(dk)
        # rows of many sequences: each run of one sequence's rows in its slot seq[t] (the
        # serial kernel, a block per key head and row; the chunked ones: one sequence's step)
        args = {"T": b.int("T"), **self._args(k, b), "pos": b.input("pos"), "seq": b.input("seq")}
        grid = [*dk.grid, "T"]
        g.launch("decode", k.group, fn, grid, [dk.threads], GPU, args, overlap=True)
        if not self.gpu_scratch(k, g):
            g.launch("prefill", k.group, fn, grid, [dk.threads], GPU, args)
            return
        # one sequence's steps shorter than a chunk: token by token; the others chunked (the
        # last chunk of a step may be short: its padding rows write nothing). The batch step
        # (rows of several sequences, runs of any length) serial whatever its size.
        L = p.chunk
        if L > 2:
            g.launch("prefill", k.group, fn, grid, [dk.threads], GPU, args, tokens=(2, L - 1),
                     batch=False)  # fmt: skip
        g.launch("batch", k.group, fn, grid, [dk.threads], GPU, args, overlap=True)
        mma = chunk_mma(g.target.arch)
        ck = gpu_chunk_kernel(f"{k.fn}_chunk", p, g.target.wave, k.nodes, mma)
        g.kernel(ck)
        cargs = {**args, "work": b.scratch(g.scratch(CHUNK_WORK))}
        for kernel, grid, threads in chunk_launches(p, ck):
            g.launch("prefill", k.group, kernel, grid, [threads], CHUNK_GPU, cargs,
                     tokens=(L, g.max_tokens), batch=False)  # fmt: skip


KIND = DeltaNet()
