"""linear: y = [norm](x) W^T [+ b], with a residual, GLU, split or soft-cap epilogue.

Anchors on hipc::Linear. Accepts an RMSNorm prologue (applied while rows are loaded) and
one epilogue: residual Add (written in place into the residual stream), RMSNorm -> residual
Add (Gemma's post-norms: the row is normalized first), Mul by Sigmoid(g) -> residual Add
(Qwen2-MoE's gated shared expert: res + sigmoid(g[t]) * row, g one value per token),
Split -> act * Mul with equal halves (gate/up, act SiLU or tanh-GELU: only the product is
written), Split (q/k/v stay column views of one buffer), or SoftCap (Gemma-2's final logits).

CPU: one function over T tokens (templates/cpu/linear.cpp.j2). GPU: a GEMV for decode
(templates/hip/linear_gemv.hip.j2) and, for prefill, the matrix-instruction GEMMs for bf16
and quantized weights (linear_mma.hip.j2, sm_90's linear_wgmma.hip.j2), the float32 GEMM
for float32 weights (linear_sgemm.hip.j2: K split where there are few output tiles, then a
`_sum` kernel) or the tiled SIMT GEMM for the rest (linear_gemm.hip.j2), preceded by a
one-value-per-token `_stats` kernel when there is a norm.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hipc.base.errors import HipcError
from hipc.compiler.codegen.environment import WEIGHT_SUFFIX
from hipc.compiler.ir import Graph, Node, row_bytes
from hipc.compiler.kernels.base import (
    CPU_INDENT,
    GPU_INDENT,
    FusionError,
    GpuKernel,
    KernelKind,
    Params,
    SelectedKernel,
    Signature,
    weight_suffix,
)

if TYPE_CHECKING:
    from hipc.compiler.codegen.bindings import Binder
    from hipc.compiler.codegen.hip import GpuProgramBuilder
    from hipc.compiler.passes.fuse import FusedGroup, Proposals
    from hipc.compiler.targets import GpuTarget


@dataclass(frozen=True)
class LinearParams(Params):
    wtype: str  # the weight's storage type (float32, bfloat16, q4_1 ...)
    N: int  # weight rows (outputs; gate + up rows with the GLU epilogue)
    K: int  # inputs
    norm_eps: float  # RMSNorm prologue's epsilon; 0.0: no norm
    epilogue: str  # "none" | "residual" | "glu"
    bias: bool
    # switches (left out of the kernel's name and plan at their default; see Params.items)
    act: str = "silu"  # the GLU's activation: "silu" | "gelu_tanh" (Gemma's GeGLU)
    post_norm_eps: float = 0.0  # RMSNorm of the row before the residual add; 0.0: none
    softcap: float = 0.0  # y = cap * tanh(y / cap); 0.0: none
    gated: bool = False  # residual epilogue scaled per token: res + sigmoid(gate[t]) * row
    layout: str = "gguf"  # the weight's blocks: as in the file, or "lanes" (passes/lanes.py)

    def tag(self) -> str:
        return (
            f"{self.wtype}_{self.N}x{self.K}_{self.epilogue}"
            + ("_lanes" if self.layout == "lanes" else "")
            + ("_rms" if self.norm_eps else "")
            + ("_sig" if self.gated else "")
            + ("_gelu" if self.act == "gelu_tanh" else "")
            + ("_postrms" if self.post_norm_eps else "")
            + ("_cap" if self.softcap else "")
        )

    @property
    def n_out(self) -> int:
        """Outputs written: half the rows with the GLU epilogue."""
        return self.N // 2 if self.epilogue == "glu" else self.N


CPU = Signature.parse("""
int T, const float* x, const void* w, const float* norm_w, const float* bias,
const float* res, float* y
""")
# with a post-norm: its scale after the others (the functions without one keep their list)
CPU_POST_NORM = Signature.parse("""
int T, const float* x, const void* w, const float* norm_w, const float* bias,
const float* res, float* y, const float* post_norm_w
""")
# with a sigmoid gate: one logit per token, `ldg` floats apart (a column of a wider Linear)
CPU_GATED = Signature.parse("""
int T, const float* x, const void* w, const float* norm_w, const float* bias,
const float* res, float* y, const float* gate, int ldg
""")
GEMV = Signature.parse("""
const float* __restrict__ x, const void* __restrict__ W, const float* __restrict__ norm_w,
const float* __restrict__ bias, const float* res, float* y
""")
# the SIMT and the matrix-instruction GEMM take the same arguments
GEMM = Signature.parse("""
const float* __restrict__ x, int T, const void* __restrict__ W, const float* __restrict__ norm_w,
const float* __restrict__ inv_rms, const float* __restrict__ bias, const float* res, float* y
""")
# with the gated residual: the per-token gate logits, `ldg` floats apart, after the others
_GATE = "\nconst float* __restrict__ gate, int ldg"
GEMV_GATED = Signature.parse(
    """
const float* __restrict__ x, const void* __restrict__ W, const float* __restrict__ norm_w,
const float* __restrict__ bias, const float* res, float* y"""
    + _GATE
)
GEMM_GATED = Signature.parse(
    """
const float* __restrict__ x, int T, const void* __restrict__ W, const float* __restrict__ norm_w,
const float* __restrict__ inv_rms, const float* __restrict__ bias, const float* res, float* y"""
    + _GATE
)
# the float32 GEMM split over K: GEMM's arguments and the partial sums' scratch after them
SGEMM = Signature.parse(
    """
const float* __restrict__ x, int T, const void* __restrict__ W, const float* __restrict__ norm_w,
const float* __restrict__ inv_rms, const float* __restrict__ bias, const float* res, float* y,
float* __restrict__ part"""
)
SGEMM_GATED = Signature.parse(
    """
const float* __restrict__ x, int T, const void* __restrict__ W, const float* __restrict__ norm_w,
const float* __restrict__ inv_rms, const float* __restrict__ bias, const float* res, float* y"""
    + _GATE
    + ", float* __restrict__ part"
)
# its second pass: the parts added in order, then the epilogue
SGEMM_SUM = Signature.parse(
    "int T, const float* __restrict__ part, const float* __restrict__ bias, const float* res, float* y"
)
SGEMM_SUM_GATED = Signature.parse(
    "int T, const float* __restrict__ part, const float* __restrict__ bias, const float* res, float* y"
    + _GATE
)
STATS = Signature.parse("const float* __restrict__ x, int T, float* inv_rms")
# sm_90a: x rounded to bf16 (norm applied) into scratch, then the GEMM reads it and W by TMA
XB = Signature.parse(
    "const float* __restrict__ x, const float* __restrict__ norm_w, uint16_t* __restrict__ xb"
)
WGMMA = Signature.parse("""
const __grid_constant__ hipc_tmap xmap, const __grid_constant__ hipc_tmap wmap, int T,
const float* __restrict__ bias, const float* res, float* y
""")
# sm_90a, quantized W: its blocks to bf16 rows in scratch, which the GEMM then reads by TMA
DEQUANT = Signature.parse("const void* __restrict__ W, uint16_t* __restrict__ wb")


class Linear(KernelKind):
    name = "linear"
    anchors = frozenset({"hipc::Linear"})
    roles = frozenset(
        {
            "prologue:rmsnorm",
            "epilogue:residual",
            "epilogue:norm-residual",
            "epilogue:gated-residual",
            "epilogue:glu",
            "epilogue:split",
            "epilogue:softcap",
        }
    )
    cpu_signature = CPU
    gpu_lacks = frozenset({"act", "post_norm_eps", "softcap"})

    def propose(self, graph: Graph, n: Node, p: Proposals) -> None:
        x = graph.producer(n.inputs[0])
        if x is not None and x.op == "RMSNormalization":
            users = p.users(x.outputs[0])
            why = (
                None
                if len(users) == 1
                else f"its output is also read by {', '.join(u.name for u in users if u is not n)}"
            )
            p.propose(n, x, "prologue:rmsnorm", x.outputs[0], why, side="prologue")
        user = p.only_user(n.outputs[0])
        if user is None:
            users = p.users(n.outputs[0])
            if users:
                p.propose(
                    n,
                    users[0],
                    "epilogue",
                    n.outputs[0],
                    f"{n.outputs[0]} has {len(users)} readers",
                )
        elif user.op == "Add":
            p.propose(n, user, "epilogue:residual", n.outputs[0])
        elif user.op == "RMSNormalization":
            add = p.only_user(user.outputs[0])
            if add is not None and add.op == "Add":
                p.propose(n, user, "epilogue:norm-residual", n.outputs[0], brings=[add])
            else:
                p.propose(
                    n, user, "epilogue:norm-residual", n.outputs[0], "no residual Add after it"
                )
        elif user.op == "hipc::SoftCap":
            p.propose(n, user, "epilogue:softcap", n.outputs[0])
        elif user.op == "Mul":
            gate = _sigmoid_gate(user, n.outputs[0], p)
            add = p.only_user(user.outputs[0])
            if gate is not None and add is not None and add.op == "Add":
                p.propose(n, user, "epilogue:gated-residual", n.outputs[0], brings=[gate, add])
            else:
                why = "only sigmoid(g) * y followed by a residual Add fuses as a Mul epilogue"
                p.propose(n, user, "epilogue", n.outputs[0], why)
        elif user.op == "Split":
            glu = _glu_after(user, p)
            if glu:
                p.propose(n, user, "epilogue:glu", n.outputs[0], brings=glu)
            else:
                p.propose(n, user, "epilogue:split", n.outputs[0])
        else:
            p.propose(
                n, user, "epilogue", n.outputs[0], f"no {user.op} epilogue in the linear kernels"
            )

    def select(self, g: Graph, grp: FusedGroup) -> SelectedKernel:
        lin = grp.anchor
        x, w = lin.inputs[0], lin.inputs[1]
        N, K = g.values[w].shape
        refs: dict[str, Any] = {
            "w": ("weight", w),
            "norm_w": ("none", None),
            "bias": ("none", None),
            "res": ("none", None),
        }
        eps = 0.0
        norm = grp.node_with_role("prologue:rmsnorm")
        if norm is not None:
            x, eps = norm.inputs[0], float(norm.attrs["epsilon"])
            refs["norm_w"] = ("weight", norm.inputs[1])
        refs["x"] = ("act", x)
        if len(lin.inputs) > 2:
            refs["bias"] = ("weight", lin.inputs[2])
        y = lin.outputs[0]
        epilogue = "none"  # also with a split: the parts are column views of y
        act, post_eps, softcap, gated = "silu", 0.0, 0.0, False
        post = [n for n in grp.epilogue if grp.roles.get(n.name) == "epilogue:norm-residual"]
        if (add := grp.node_with_role("epilogue:residual")) is not None:
            epilogue, y = "residual", add.outputs[0]
            refs["res"] = ("act", next(i for i in add.inputs if i != lin.outputs[0]))
        elif post:
            norm_after, add = post
            epilogue, y = "residual", add.outputs[0]
            refs["res"] = ("act", next(i for i in add.inputs if i != norm_after.outputs[0]))
            post_eps = float(norm_after.attrs["epsilon"])
            refs["post_norm_w"] = ("weight", norm_after.inputs[1])
        elif (mul := grp.node_with_role("epilogue:gated-residual")) is not None:
            sig, add = (next(n for n in grp.epilogue if n.op == op) for op in ("Sigmoid", "Add"))
            epilogue, y, gated = "residual", add.outputs[0], True
            refs["res"] = ("act", next(i for i in add.inputs if i != mul.outputs[0]))
            refs["gate"] = ("act", sig.inputs[0])
        elif grp.node_with_role("epilogue:glu") is not None:
            epilogue, y = "glu", grp.epilogue[-1].outputs[0]
            act = _glu_activation(grp.epilogue[-2], grp.name)
        elif (cap := grp.node_with_role("epilogue:softcap")) is not None:
            y, softcap = cap.outputs[0], float(cap.attrs["cap"])
        refs["y"] = ("act", y)
        params = LinearParams(
            wtype=g.values[w].dtype,
            N=int(N),
            K=int(K),
            norm_eps=eps,
            epilogue=epilogue,
            bias=len(lin.inputs) > 2,
            act=act,
            post_norm_eps=post_eps,
            softcap=softcap,
            gated=gated,
        )
        return SelectedKernel(grp.name, grp.node_names, self, params, refs)

    # -- CPU --

    def cpu_signature_of(self, k: SelectedKernel) -> Signature:
        if k.params.gated:
            return CPU_GATED
        return CPU_POST_NORM if k.params.post_norm_eps else CPU

    def cpu_kernel(self, k: SelectedKernel, activations: str) -> tuple[str, dict[str, Any]]:
        ws = weight_suffix(k, "CPU")
        layout = "lanes_" if k.params.layout == "lanes" else ""
        mm = ("a16_" if activations == "int16" else "") + layout + ws
        params = self.cpu_signature_of(k).render(CPU_INDENT)
        return "cpu/linear.cpp.j2", dict(wsuffix=ws, mm=mm, params=params)

    def cpu_call(self, k: SelectedKernel, b: Binder) -> dict[str, Any]:
        p: LinearParams = k.params
        r = k.refs
        last_only = b.is_output(r["y"][1])
        if b.ld(r["x"][1]) != p.K:
            raise FusionError(f"{k.group}: input rows are strided ({b.ld(r['x'][1])} != {p.K})")
        args = {
            "T": b.int("rows" if last_only else "T"),
            "x": b.act(r["x"][1], row_skip=last_only),
            "w": b.ref(r["w"]),
            "norm_w": b.ref(r["norm_w"]),
            "bias": b.ref(r["bias"]),
            "res": b.ref(r["res"]),
            "y": b.act(r["y"][1]),
        }
        if p.post_norm_eps:
            args["post_norm_w"] = b.ref(r["post_norm_w"])
        if p.gated:
            args["gate"] = b.act(r["gate"][1])
            args["ldg"] = b.int(b.ld(r["gate"][1]))
        return args

    # -- GPU --

    def gpu_scratch(self, k: SelectedKernel, g: GpuProgramBuilder) -> dict[str, int]:
        p: LinearParams = k.params
        if wgmma_gemm(p, g.target, g.prefill_precision == "split", False):
            # the sm_90a GEMM's input: x (normalized) in bf16, rows of K, from its _xb kernel
            return {"xb": 2 * g.max_tokens * p.K}
        # the prefill GEMM's norm: 1 / rms per token, from the _stats kernel before it
        need = {"inv_rms": 4 * g.max_tokens} if p.norm_eps else {}
        st = select_sgemm(p, min(g.max_tokens, 512))
        if st is not None and st.splits > 1:
            # the float32 GEMM's partial sums, a row of N per split and token
            need["sgemm_part"] = 4 * st.splits * g.max_tokens * p.N
        if dequant_steps(k, g):
            # long steps: x in bf16 as above, and W dequantized to bf16 rows
            need |= {"xb": 2 * g.max_tokens * p.K, "wdq": 2 * p.N * p.K}
        if gemvm_eligible(p, g.target):
            # the batch GEMV's (normalized) bf16 rows: steps of up to 64
            need["xb"] = max(need.get("xb", 0), 2 * min(g.max_tokens, 8 * GEMVM_TILES[-1]) * p.K)
        return need

    def gpu(self, k: SelectedKernel, b: Binder, g: GpuProgramBuilder) -> None:
        p: LinearParams = k.params
        r = k.refs
        weight_suffix(k, "HIP")
        if p.K > MAX_GEMV_K:
            raise FusionError(
                f"{k.group}: K={p.K} exceeds the GEMV's shared-memory row ({MAX_GEMV_K})"
            )
        last_only = b.is_output(r["y"][1])
        x = b.act(r["x"][1], row_skip=last_only)
        common = {
            "x": x,
            "W": b.ref(r["w"]),
            "norm_w": b.ref(r["norm_w"]),
            "bias": b.ref(r["bias"]),
            "res": b.ref(r["res"]),
            "y": b.act(r["y"][1]),
        }
        if p.gated:
            common["gate"] = b.act(r["gate"][1])
            common["ldg"] = b.int(b.ld(r["gate"][1]))
        dk = decode_gemv(
            k.fn, p, g.target, k.nodes, activations=g.activations, quant_layout=g.quant_layout
        )
        g.launch("decode", k.group, g.kernel(dk), dk.grid, [dk.threads], gemv_signature(p),
                 common, shared=dk.shared, overlap=True)  # fmt: skip
        split = g.prefill_precision == "split"
        rows = "rows" if last_only else "T"
        # batch steps of up to `small` rows run the weights-once GEMV (linear_gemvm), larger
        # ones the prefill GEMM below (its batch copies start at small + 1)
        small = self._gemvm_launches(k, b, g, common, x, rows)
        g.batch_min = small + 1
        try:
            self._prefill_launches(k, b, g, common, x, rows, split)
        finally:
            g.batch_min = 1

    def _prefill_launches(self, k, b, g, common, x, rows: str, split: bool) -> None:
        p: LinearParams = k.params
        if wgmma_gemm(p, g.target, split, False):
            y_bf16 = k.group in self._handoffs(b, g)
            self._wgmma_buckets(k, b, g, common, x, rows, 1, y_bf16)
            return
        long = dequant_steps(k, g)
        short = (1, DEQUANT_MIN_TOKENS - 1) if long else None
        # the float32 GEMM loads x rows as float4s: a row view that is not 16-byte aligned
        # (never seen) takes the SIMT kernel
        simt = x.get("offset", 0) % 16 != 0
        pg = prefill_gemm(k.fn, p, g.target, k.nodes, simt=simt, split=split,
                          tokens=min(g.max_tokens, 512))  # fmt: skip
        gemm = g.kernel(pg)
        inv_rms = b.scratch(g.scratch("inv_rms")) if p.norm_eps else b.null()
        if p.norm_eps:
            g.launch("prefill", k.group, f"{gemm}_stats", [rows], [256], STATS,
                     {"x": x, "T": b.int(rows), "inv_rms": inv_rms}, tokens=short)  # fmt: skip
        splits = pg.ctx.get("splits", 1)
        grid = [-(-p.n_out // pg.block_outputs), f"cdiv({rows},{pg.block_tokens})"]
        args = {**common, "T": b.int(rows), "inv_rms": inv_rms}
        if splits == 1:
            g.launch("prefill", k.group, gemm, grid, [pg.threads], gemm_signature(p), args,
                     shared=pg.shared, tokens=short)  # fmt: skip
        else:
            part = b.scratch(g.scratch("sgemm_part"))
            sig, sum_sig = (SGEMM_GATED, SGEMM_SUM_GATED) if p.gated else (SGEMM, SGEMM_SUM)
            g.launch("prefill", k.group, gemm, [*grid, splits], [pg.threads], sig,
                     {**args, "part": part}, tokens=short)  # fmt: skip
            names = ("T", "bias", "res", "y", "gate", "ldg")
            sums = {n: args[n] for n in names if n in args} | {"part": part}
            g.launch("prefill", k.group, f"{gemm}_sum", [rows], [256], sum_sig, sums,
                     tokens=short)  # fmt: skip
        if long:
            # the steps of DEQUANT_MIN_TOKENS and more: W to bf16 rows, then the bf16 GEMM
            wdq = b.scratch(g.scratch("wdq"))
            dk = dequant_kernel(k.fn, p)
            g.launch("prefill", k.group, g.kernel(dk), dk.grid, [dk.threads], DEQUANT,
                     {"W": common["W"], "wb": wdq}, tokens=(DEQUANT_MIN_TOKENS, g.max_tokens))  # fmt: skip
            self._wgmma_buckets(k, b, g, {**common, "W": wdq}, x, rows, DEQUANT_MIN_TOKENS, False)

    def _wgmma_buckets(self, k, b, g, common, x, rows: str, first: int, y_bf16: bool) -> None:
        """The sm_90a GEMM's launches for steps of `first` tokens and more (wgmma_buckets)."""
        p: LinearParams = k.params
        for tile, tokens in wgmma_buckets(p, first, g.max_tokens):
            pg = prefill_gemm(k.fn, p, g.target, k.nodes, wgmma=tile, y_bf16=y_bf16)
            self._wgmma_launches(k, b, g, pg, tile, common, x, rows, tokens)

    def _gemvm_launches(self, k, b, g, common, x, rows: str) -> int:
        """The batch step's launches of the weights-once GEMV, one kernel per size class of
        8, 16, 32, 64 rows up to the program's limit (GpuProgramBuilder.batch_gemv_rows);
        returns the largest step they serve (0: none, the linear is not eligible)."""
        p: LinearParams = k.params
        most = min(gemvm_rows(p, g.batch_gemv_rows, g.batch_gemv_rows_set), g.max_tokens)
        # a short wgmma tile listed for steps the GEMV would take measured faster there: the
        # GEMV keeps the buckets below (half the size: the runtime's buckets double). A GLU
        # linear and the linear reading its bf16 output (_handoffs) leave the GEMV together:
        # the GLU GEMM writes bf16 where the GEMV reader would read float32
        pairs = self._handoffs(b, g)  # writer group -> its bf16 reader's
        linked = {k.group, pairs.get(k.group)} | {w for w, r in pairs.items() if r == k.group}
        faster = [n for q in g.selected if q.kind is self and q.group in linked
                  for n in wgmma_short(q.params) if n <= most]  # fmt: skip
        split = g.prefill_precision == "split"
        if faster and wgmma_gemm(p, g.target, split, False) and not g.batch_gemv_rows_set:
            most = min(faster) // 2
        # --prefill-precision split promises float32-class linears: the GEMV's bf16 x is not
        if most < 2 or g.prefill_precision == "split" or not gemvm_eligible(p, g.target):
            return 0
        xv = k.refs["x"][1]
        if b.ld(xv) != p.K or x.get("offset", 0) % 16:  # 16-byte loads of x rows
            return 0
        # an attention writer hands x over in bf16 in every batch step (its bf16_reader), where
        # a GLU linear does so only from its own GEMM's launches (larger steps than these)
        writers = self._bf16_writers(k, b, g)
        bf16_in = any(w.group in writers and w.kind is not self for w in g.selected)
        lo = 1
        for nt in GEMVM_TILES:
            if lo > most:
                break
            hi = min(8 * nt, most)
            geometry = gemvm_geometry(p, nt) if g.batch_gemv_tuned else gemvm_plain(p, nt)
            if g.batch_gemv_xpipe and "split" not in geometry:
                geometry["xpipe"] = True
            if bf16_in:
                geometry["xb"] = True
            gk = gemvm_kernel(k.fn, p, g.target, k.nodes, nt, geometry)
            fn = g.kernel(gk)
            args = common
            if bf16_in:  # the bf16 rows the _xb pass would have written, there already
                args = {**common, "norm_w": b.null()}
            elif gk.ctx["xb"]:  # x as bf16 rows (normalized) from the _xb pass before it
                xb = b.scratch(g.scratch("xb"))
                args = {**common, "x": xb, "norm_w": b.null()}
                g.launch("batch", k.group, f"{fn}_xb", [rows], [256], XB,
                         {"x": x, "norm_w": common["norm_w"], "xb": xb}, overlap=True,
                         tokens=(lo, hi))  # fmt: skip
            g.launch("batch", k.group, fn, gk.grid, [gk.threads], GEMM,
                     {**args, "T": b.int(rows), "inv_rms": b.null()}, overlap=True,
                     tokens=(lo, hi))  # fmt: skip
            lo = hi + 1
        return lo - 1

    def _bf16_writers(self, k, b: Binder, g: GpuProgramBuilder) -> list[str]:
        """The groups that write linear `k`'s input in bf16 for it (_handoffs)."""
        return [w for w, r in self._handoffs(b, g).items() if r == k.group]

    def _handoffs(self, b: Binder, g: GpuProgramBuilder) -> dict[str, str]:
        """Writer group -> the group that reads its output in bf16, once a program: GLU linears
        (bf16_reader) and any kind with a `bf16_reader(k, b, g)` of its own (the attention)."""
        if "linear.bf16" not in g.memo:
            pairs = (
                (w, bf16_reader(w, b, g) if w.kind is self else w.kind.bf16_reader(w, b, g))
                for w in g.selected
                if w.kind is self or hasattr(w.kind, "bf16_reader")
            )
            g.memo["linear.bf16"] = {w.group: r.group for w, r in pairs if r is not None}
        return g.memo["linear.bf16"]

    def _wgmma_launches(
        self, k, b, g, pg: GpuKernel, t: WgmmaTile, common, x, rows: str, tokens
    ) -> None:
        """The sm_90a GEMM's two launches: x -> bf16 (norm applied) into scratch, then the
        GEMM over it and W through tensor maps; `tokens`: the step sizes they run at."""
        p: LinearParams = k.params
        gemm = g.kernel(pg)
        if k.group in self._handoffs(b, g).values():
            xb = x  # its writer left x in bf16 (bf16_reader): TMA reads it as it is
        else:
            xb = b.scratch(g.scratch("xb"))
            g.launch("prefill", k.group, f"{gemm}_xb", [rows], [256], XB,
                     {"x": x, "norm_w": common["norm_w"], "xb": xb}, tokens=tokens)  # fmt: skip
        maps = {  # a multicast cluster's CTAs copy 1/cm of each x tile each
            "xmap": {
                "kind": "tmap",
                "of": xb,
                "dims": [p.K, g.max_tokens],
                "box": [64, t.bm // t.cm],
            },
            "wmap": {"kind": "tmap", "of": common["W"], "dims": [p.K, p.N], "box": [64, t.bn // 2]},
        }
        _, ny, nz = t.grid(1, p.n_out, p.epilogue == "glu")  # along tokens: per step, below
        g.launch(
            "prefill",
            k.group,
            gemm,
            [f"cdiv({rows},{t.bm * t.ct})", ny, nz],
            [pg.threads],
            WGMMA,
            {**maps, "T": b.int(rows), "bias": common["bias"], "res": common["res"],
             "y": common["y"]},
            shared=pg.shared,
            overlap=t.pdl,
            tokens=tokens,
        )  # fmt: skip


def bf16_reader(k: SelectedKernel, b: Binder, g: GpuProgramBuilder) -> SelectedKernel | None:
    """The linear that is the only reader of GLU linear `k`'s output, where both prefill on
    the sm_90a GEMM and the reader has no norm: `k` then writes that output in bf16 (the same
    rounding the reader's _xb pass would do, so the results are bit for bit the same) and the
    reader's TMA loads it directly, without its _xb pass (on the H200 at the 8B shape that pass
    read 4 and wrote 2 bytes per value of the widest activation). Decode steps are unchanged:
    their GEMVs write and read the buffer in float32."""
    p = k.params
    if not isinstance(p, LinearParams) or p.epilogue != "glu" or p.n_out % 8:
        return None
    if not wgmma_gemm(p, g.target, g.prefill_precision == "split", False):
        return None
    return wgmma_bf16_reader(k, k.refs["y"], p.n_out, b, g)


def wgmma_bf16_reader(
    k: SelectedKernel, y, width: int, b: Binder, g: GpuProgramBuilder
) -> SelectedKernel | None:
    """The linear that is the only reader of activation `y` (rows of `width` values, written by
    `k`) where it prefills on the sm_90a GEMM with no norm: `k` may then write y in bf16 in
    prefill steps (rows `width` bf16 apart) for that GEMM's TMA to load as it is, without its
    _xb pass. None where y is a graph output, its rows are not `width` apart, or its address
    does not suit TMA (16-byte aligned)."""
    split = g.prefill_precision == "split"
    if b.is_output(y[1]) or b.ld(y[1]) != width or b.act(y[1])["offset"] % 16:
        return None
    readers = [r for r in g.selected if r is not k and y in r.refs.values()]
    if len(readers) != 1 or not isinstance(readers[0].params, LinearParams):
        return None
    r = readers[0]
    q: LinearParams = r.params
    if r.refs["x"] != y or q.norm_eps or width != q.K or b.is_output(r.refs["y"][1]):
        return None
    return r if wgmma_gemm(q, g.target, split, False) else None


def gemv_signature(p: LinearParams) -> Signature:
    return GEMV_GATED if p.gated else GEMV


def gemm_signature(p: LinearParams) -> Signature:
    return GEMM_GATED if p.gated else GEMM


GLU_ACTIVATIONS = {"hipc::SiLU", "Gelu"}  # act(gate) * up epilogues the templates have


def _glu_after(split: Node, p: Proposals) -> list[Node]:
    """[act, Mul] for Split -> act(a) * b with equal halves, else []."""
    sizes = list(split.attrs["split"])
    if len(sizes) == 2 and sizes[0] == sizes[1]:
        a, b = split.outputs
        act = p.only_user(a)
        if act is not None and act.op in GLU_ACTIVATIONS:
            mul = p.only_user(act.outputs[0])
            if (
                mul is not None
                and mul.op == "Mul"
                and set(mul.inputs) == {act.outputs[0], b}
                and p.only_user(b) is mul
            ):
                return [act, mul]
    return []


def _sigmoid_gate(mul: Node, y: str, p: Proposals) -> Node | None:
    """The Sigmoid in Mul(Sigmoid(g), y) when the Mul is its only reader and g is one value
    per token ([tokens, 1]: Qwen2-MoE's shared-expert gate), else None."""
    other = next((i for i in mul.inputs if i != y), None)
    sig = p.graph.producer(other) if other is not None and list(mul.inputs).count(y) == 1 else None
    if sig is None or sig.op != "Sigmoid" or p.only_user(sig.outputs[0]) is not mul:
        return None
    shape = p.graph.values[sig.inputs[0]].shape
    return sig if len(shape) == 2 and shape[1] == 1 else None


def glu_activation(node: Node) -> str | None:
    """The templates' name of a GLU's activation ("silu", "gelu_tanh"), None if they have
    none for it (also the glu kind's, compiler/kernels/glu.py)."""
    if node.op == "hipc::SiLU":
        return "silu"
    if node.op == "Gelu" and node.attrs.get("approximate") == "tanh":
        return "gelu_tanh"
    return None


def _glu_activation(node: Node, group: str) -> str:
    act = glu_activation(node)
    if act is None:
        raise FusionError(f"no GLU epilogue with {node.op} {dict(node.attrs)} ({group})")
    return act


KIND = Linear()


# -- GPU geometry --------------------------------------------------------------------------

GEMV_WAVES = 8  # 8 waves: more rows in flight per SM when x (K floats) fills shared memory
# Before its wait a small GEMV (latency-bound: SmolLM2's) pulls its rows towards L2, so
# the loads after the wait hit L2. Big ones stream at bandwidth anyway: on the H200
# prefetching their row heads cost 4-7% of an 8B decode step.
GEMV_PREFETCH_MAX = 16 << 20
MAX_GEMV_K = 16384  # the GEMV stages x in shared memory: 64 KiB, the smallest limit (AMD LDS)
SIMT_TILE = 64  # the SIMT GEMM's tokens and outputs per block
SMS = 132  # H100/H200 SXM multiprocessors: the wave size the tile choices round to


@dataclass(frozen=True)
class MmaTile:
    """One platform's matrix instruction and the prefill GEMM geometry built on it."""

    macro: str  # HIPC_MMA_* defined for the prelude
    instruction: str  # as the disassembly names it (for the kernel's header comment)
    bm: int  # tokens per block
    bn: int  # weight rows per block (outputs, or gate + up rows with the GLU epilogue)
    bk: int  # K per shared-memory stage
    wm: int  # waves along tokens
    wn: int  # waves along outputs
    min_blocks: int = 1  # NVIDIA: blocks per SM to fit registers for (__launch_bounds__)
    a_regs: int = 4  # 32-bit registers per lane of one 16 x 16 A fragment

    def fields(self) -> dict:
        """The geometry the mma GEMM templates (linear_mma, moe_mma) place."""
        return dict(instruction=self.instruction, bm=self.bm, bn=self.bn, bk=self.bk,
                    wm=self.wm, wn=self.wn, min_blocks=self.min_blocks)  # fmt: skip

    def threads(self, wave: int) -> int:
        return self.wm * self.wn * wave

    def shared_bytes(self, split: bool, quant: bool = False) -> int:
        """Two stages of x (hi and, split, lo: bm rows each) and W (bn rows), bf16, rows
        padded by 8; quantized weights add each stage's 16-weight groups: (scale, offset)
        per W row and the sum of x per token, float32."""
        groups = self.bk // 16
        extra = 2 * (2 * self.bn + self.bm) * groups * 4 if quant else 0
        return 2 * ((2 if split else 1) * self.bm + self.bn) * (self.bk + 8) * 2 + extra


# 128 x 128 blocks of 256 threads everywhere: 8 warps of 64 x 32 on NVIDIA and RDNA, 4 wave64s of
# 64 x 64 on CDNA (64 accumulator floats per lane in every case), within AMD's 64 KiB of LDS. RDNA
# stages 16 deep, not 32: its A/B fragments are 8 VGPRs each, and with two k steps in flight clang
# spills past 256 VGPRs. gfx12 (gfx1201)'s WMMA takes 8 k a lane (its operand layout differs, the
# prelude's HIPC_MMA_WMMA12): the same geometry.
# On the H200 (bf16 GLU, T=512, 8000 x 4080, TFLOP/s of useful work): 70 for one 128 x 128 block
# per SM, 90 with registers capped for two (a few bytes spill), 74 staging 64 deep, 102 for
# 128 x 256 blocks (warps of 64 x 64) -- which leave SMs idle when there are few output blocks, so
# they are only taken for wide layers (WIDE_BLOCKS or more column blocks: gate/up, the LM head).
_NV = MmaTile("HIPC_MMA_NV", "mma.sync.m16n8k16 bf16", 128, 128, 32, 2, 4, min_blocks=2)
_NV_WIDE = MmaTile("HIPC_MMA_NV", "mma.sync.m16n8k16 bf16", 128, 256, 32, 2, 4)
_WMMA = MmaTile("HIPC_MMA_WMMA", "v_wmma_f32_16x16x16_bf16", 128, 128, 16, 2, 4, a_regs=8)
_MFMA = MmaTile("HIPC_MMA_MFMA", "v_mfma_f32_16x16x16_bf16", 128, 128, 32, 2, 2, a_regs=2)
_WMMA12 = MmaTile("HIPC_MMA_WMMA12", "v_wmma_f32_16x16x16_bf16 (gfx12)", 128, 128, 16, 2, 4)
MMA_TILES = {
    "sm_80": _NV,
    "sm_89": _NV,
    "sm_90": _NV,
    "gfx1100": _WMMA,
    "gfx1101": _WMMA,
    "gfx1151": _WMMA,
    "gfx1201": _WMMA12,
    "gfx90a": _MFMA,
    "gfx942": _MFMA,
}
MMA_WIDE_TILES = {"sm_80": _NV_WIDE, "sm_89": _NV_WIDE, "sm_90": _NV_WIDE}
WIDE_BLOCKS = 64


def mma_tile(target: GpuTarget, p: LinearParams, split: bool = False) -> MmaTile | None:
    """The matrix-instruction GEMM for a linear's prefill, or None for the SIMT one.

    bf16 weights feed the instruction as stored; quantized ones as their integer quants (exact
    in bf16), each 16-deep partial product scaled in float32 (linear_mma.hip.j2). f16 would
    need x split in f16, whose range (65504) activations can exceed. K % 8 == 0 because W is
    loaded 8 weights at a time. Where AMD's 64 KiB of LDS has no room for the quantized tiles'
    scales beside the stages (CDNA's 32-deep ones with x split), SIMT there.
    """
    tile = MMA_TILES.get(target.arch)
    quant = WEIGHT_SUFFIX.get(p.wtype) in QUANT_TYPES
    if tile is None or (p.wtype != "bfloat16" and not quant) or p.K % 8:
        return None
    if quant:
        # the groups' scales and partial products take registers: the narrow tile (the wide
        # one's 128 accumulators per lane spill beside them), one block per SM
        tile = replace(tile, min_blocks=1)
        if not target.arch.startswith("sm_") and tile.shared_bytes(split, quant=True) > 64 << 10:
            return None
        return tile
    wide = MMA_WIDE_TILES.get(target.arch)
    glu = p.epilogue == "glu"
    if wide and -(-p.n_out // (wide.bn // 2 if glu else wide.bn)) >= WIDE_BLOCKS:
        return wide
    return tile


@dataclass(frozen=True)
class SgemmTile:
    """The float32 GEMM's geometry (linear_sgemm.hip.j2): bm tokens x bn weight rows per block
    (with the GLU epilogue bn // 2 gate rows and their up rows), 8 x 8 products per thread, K
    split `splits` ways (grid z) with a `_sum` kernel adding the parts in a fixed order."""

    bm: int = 64
    bn: int = 64
    splits: int = 1

    @property
    def threads(self) -> int:
        return self.bm * self.bn // 64

    @property
    def name(self) -> str:
        return f"s{self.bm}x{self.bn}" + (f"k{self.splits}" if self.splits > 1 else "")

    def ks(self, K: int) -> int:
        """K per split: a multiple of the 16-deep slice."""
        return -(-K // (16 * self.splits)) * 16


# Why a float32 GEMM of its own: a GGUF's MoE router (ffn_gate_inp) stays float32, and its
# top-k must be the reference's, so neither bf16 W nor the bf16 hi + lo split of x will do. On
# the H200 the 64 x 64 SIMT kernel (linear_gemm) took 211 us alone (290 us a layer in the
# hybrid's step profile) for Qwen3.5-35B-A3B's 257 x 2048 router at 512 tokens: 40 blocks for
# 132 SMs, scalar loads, 4 x 4 products a thread. linear_sgemm keeps float32 arithmetic and
# fixes all three: float4 loads, 8 x 8 products a thread, and K split (doubling) until there
# are SGEMM_BLOCKS blocks, each split at least SGEMM_MIN_KS deep.
# Measured on the H200 (bench_gpu_gemm.py --f32, session 10 call 3; docs/benchmarks/
# gpu-h200-hybrid.md), us with the _sum pass: about 2.4 blocks per SM is the sweet spot --
# 257 x 2048 at 512 tokens (40 tiles) 77 / 46 / 36 / 44 for 2 / 4 / 8 / 16 splits, 129 x 2048
# (24 tiles) 42 / 28 / 21 for 4 / 8 / 16, 257 x 4096 63 / 72 for 8 / 16; at 128 tokens every
# shape wants 16 splits (10 and 6 tiles). So: splits while under 2 x SMS blocks, 128 of K
# apiece at least (the 129-wide router's best: 16 splits of 128). The 128 x 64 and 64 x 32
# tiles were within 10% at these shapes except 257 x 4096 at 512 tokens (128 x 64 with 16
# splits: 54 us against 63); not taken, one shape.
SGEMM_BLOCKS = 2 * SMS
SGEMM_MIN_KS = 128
SGEMM_MAX_SPLITS = 16


def select_sgemm(p: LinearParams, tokens: int) -> SgemmTile | None:
    """The float32 GEMM for float32 weights (None: another kernel; K % 4 for float4 rows),
    its K split for a step of `tokens` tokens."""
    if p.wtype != "float32" or p.K % 4:
        return None
    tile = SgemmTile()
    bn_out = tile.bn // 2 if p.epilogue == "glu" else tile.bn
    blocks = -(-p.n_out // bn_out) * -(-tokens // tile.bm)
    splits = 1
    while (
        blocks * splits < SGEMM_BLOCKS
        and splits < SGEMM_MAX_SPLITS
        and p.K // (2 * splits) >= SGEMM_MIN_KS
    ):
        splits *= 2
    return replace(tile, splits=splits)


@dataclass(frozen=True)
class WgmmaTile:
    """The sm_90a GEMM's geometry: bm tokens (64 per consumer warp group) x bn weight rows
    (one wgmma.m64n<bn>k16 per consumer and 16-deep k step) per block, K 64 deep per stage;
    cm blocks along the outputs in one cluster share each x tile (TMA multicast), sk splits
    of K (grid z, the sk CTAs of a cluster, summed through shared memory in a fixed order); pdl:
    launched to overlap its _xb kernel (W's first stages requested before x is ready)."""

    bm: int
    bn: int
    stages: int  # shared-memory stages: as many as fit the 227 KiB a block may have
    regs: tuple[int, int] | None = None  # setmaxnreg: producer, consumers (None: leave them)
    cm: int = 1
    sk: int = 1
    pdl: bool = False
    ct: int = 1  # blocks along the tokens in one cluster sharing each W tile (grid z)

    def __post_init__(self) -> None:
        # a cluster is at most 8 CTAs (the portable size); a K split's CTAs finish equal shares
        # of the output column groups of 8 (bn / 16 with a GLU epilogue, whose bn is gate + up)
        if self.cm * self.ct * self.sk > 8 or (self.bn // 16) % self.sk:
            raise ValueError(f"{self.name}: no such wgmma tile")

    @property
    def threads(self) -> int:
        return 128 * (self.bm // 64 + 1)

    @property
    def name(self) -> str:
        return (
            f"wg{self.bm}x{self.bn}"
            + (f"c{self.cm}" if self.cm > 1 else "")
            + (f"t{self.ct}" if self.ct > 1 else "")
            + (f"k{self.sk}" if self.sk > 1 else "")
            + ("p" if self.pdl else "")
        )

    def shared_bytes(self) -> int:
        # the stages, their 2 barriers each, and slack to align the first to 1024 bytes
        return self.stages * (self.bm + self.bn) * 128 + 16 * self.stages + 1024

    def grid(self, tokens: int, n_out: int, glu: bool) -> tuple[int, int, int]:
        """Blocks along tokens (in pairs of ct, the pair's second in z), outputs (a multiple
        of cm: a last cluster's extra blocks load zeros and write nothing), K splits x ct."""
        tn = -(-n_out // (self.bn // 2 if glu else self.bn))
        return -(-tokens // (self.bm * self.ct)), -(-tn // self.cm) * self.cm, self.sk * self.ct


# 3 warp groups (384 threads): registers 40 for the producer, 232 for the consumers (64 x 256
# accumulators are 128 floats a thread).
_R = (40, 232)
WGMMA_TILES = (
    WgmmaTile(128, 256, 4, _R),
    WgmmaTile(128, 192, 5, _R),
    WgmmaTile(128, 128, 6, _R),
    WgmmaTile(64, 256, 5, None),
)
# Variants measured against the tiles above by bench_gpu_gemm.py (select_wgmma takes one only
# through WGMMA_MEASURED): multicast pairs along the outputs (c: x read from L2 once per pair)
# or along the tokens (t: W once per pair), K split (k2-k8) for steps with fewer output tiles
# than SMs, launches overlapping the _xb pass (p), and widths that fill the last wave better;
# select_wgmma takes the 64-token ones for short steps through WGMMA_SHORT.
WGMMA_VARIANTS = (
    # 224 wide (5 stages of 44 KiB): 128 column blocks for the 8B gate/up, 4 waves at 512 tokens
    WgmmaTile(128, 224, 5, _R),
    # 176 wide (5 stages of 38 KiB): 163 x 4 = 652 gate/up blocks at 512 tokens, 4.94 waves of
    # 132 where 128 x 192's 600 are 4.55 (its last wave half empty); not yet measured
    WgmmaTile(128, 176, 5, _R),
    WgmmaTile(128, 224, 5, _R, cm=2),
    WgmmaTile(128, 224, 5, _R, ct=2),
    WgmmaTile(128, 256, 4, _R, cm=2),
    WgmmaTile(128, 192, 5, _R, cm=2),
    WgmmaTile(128, 128, 6, _R, cm=2),
    WgmmaTile(128, 256, 4, _R, ct=2),
    WgmmaTile(128, 192, 5, _R, ct=2),
    WgmmaTile(128, 256, 4, _R, sk=2),
    WgmmaTile(128, 256, 4, _R, cm=2, sk=2),
    WgmmaTile(128, 256, 4, _R, ct=2, sk=2),
    WgmmaTile(128, 256, 4, _R, cm=2, pdl=True),
    WgmmaTile(128, 256, 4, _R, sk=2, pdl=True),
    WgmmaTile(128, 256, 4, _R, ct=2, pdl=True),
    # Batch steps (33-64 rows; 17-32 where a linear leaves the batch GEMV): one 64-token consumer
    # and enough blocks to keep the 132 SMs streaming W, by narrower tiles or K split 2-8 ways;
    # as many stages as fit, for the bytes in flight. Blocks at the 8B shapes: qkv 6144 rows /
    # 192 x 4 = 128, / 96 x 2 = 128; o and down 4096 / 128 x 4, / 64 x 2, / 256 x 8 = 128;
    # gate/up 14336 outputs / 112 = 128 (and / 128 = 112 with wg64x256 above).
    WgmmaTile(64, 192, 7, None, sk=4),
    WgmmaTile(64, 192, 7, None, sk=4, pdl=True),
    WgmmaTile(64, 96, 11, None, sk=2),
    WgmmaTile(64, 128, 9, None, sk=4),
    WgmmaTile(64, 128, 9, None, sk=2),
    WgmmaTile(64, 64, 13, None, sk=2),
    WgmmaTile(64, 256, 5, None, sk=8),
    WgmmaTile(64, 224, 6, None),
    WgmmaTile(64, 224, 6, None, pdl=True),
    WgmmaTile(64, 256, 5, None, pdl=True),
    # 4 stages (90 KiB): two blocks an SM, 256 for gate/up (two pipelines per SM in one wave)
    WgmmaTile(64, 112, 4, None),
)
WGMMA_ARCHS = frozenset({"sm_90"})
# Steps of up to this many tokens get their own tiles where the chunk is longer (launch "tokens")
SHORT_STEP = 1024
# time per output element relative to 128 x 256 (measured on the H200: docs/benchmarks/gpu-prefill.md)
WGMMA_COST = {
    (128, 256): 1.0,
    (128, 192): 1.04,
    (128, 128): 1.12,
    (64, 256): 1.15,
}


# The variant per Llama-3-8B layer shape (N, K, epilogue) and step size, from bench_gpu_gemm.py
# on the H200 (docs/benchmarks/gpu-prefill.md, "Cluster variants", 2026-12-03: every tile and
# cluster variant, _xb included). A variant other than the wave model's plain tile is listed
# only where it measured more than 3% faster than the best plain tile (one run: closer margins
# are noise); elsewhere the entry is the fastest plain tile.
WGMMA_MEASURED: dict[tuple[int, int, str], dict[int, str]] = {
    (6144, 4096, "none"): {512: "wg128x192", 2048: "wg128x256", 4096: "wg128x256"},  # qkv
    (4096, 4096, "residual"): {512: "wg128x128", 2048: "wg128x256t2", 4096: "wg128x256c2p"},  # o
    (28672, 4096, "glu"): {512: "wg128x192", 2048: "wg128x256", 4096: "wg128x256"},  # gate/up
    (4096, 14336, "residual"): {512: "wg128x128", 2048: "wg128x256", 4096: "wg128x256"},  # down
}
# Tiles for short steps (the batch steps: runtime buckets of 32 and 64 rows) per shape: step size
# -> the variant for steps of up to that many tokens (above the next smaller listed size). A size
# within the batch GEMV's reach (BATCH_GEMV_ROWS) also takes those steps off the GEMV: the GEMM
# measured faster there. Shapes not listed keep their tile for 512-token steps. HIPC_WGMMA_SHORT
# names a JSON file of entries to use instead ({"N,K,epilogue": {"64": variant}}: benchmarks
# time a selection without a new wheel).
# Session 10 (bench_gpu_gemm.py --tokens 32,64 --cold on the H200: W from memory every launch,
# the _xb pass included; docs/benchmarks/gpu-h200.md "Session 10, bgemm"), us at 32 / 64 tokens
# against the 512-token tile the batch steps ran before, and the batch GEMV at 32 rows (the
# 32-row step's profile, its _xb pass added where it has one): qkv 21.9 / 22.2 (wg128x192 37.4 /
# 39.1, GEMV 31.1); o 16.9 / 17.6 (wg128x128 27.4 / 28.3, GEMV 19.3; o reads the attention's
# bf16 rows in a model, ~5 us of _xb less); gate/up 68.9 / 68.1 (wg128x192 91.3 / 90.2, GEMV
# 77.0; wg64x224 without PDL 68.1 / 69.3, wg64x112 68.6 / 68.1: within 1.5%, one tile for both
# sizes); down 42.0 / 42.3 (wg128x128 77.6 / 77.7, GEMV 55.3; wg64x64k2 42.9 / 42.5); the LM head
# 259.4 / 265.1 (wg128x256 281.8 / 281.8; wg64x256 259.1 / 267.4). Copy ceiling 4.29 TB/s: down
# at 2.77 TB/s of W, gate/up 3.45, the head 3.96.
WGMMA_SHORT: dict[tuple[int, int, str], dict[int, str]] = {
    (6144, 4096, "none"): {32: "wg64x96k2", 64: "wg64x96k2"},  # qkv
    (4096, 4096, "residual"): {32: "wg64x192k4p", 64: "wg64x192k4p"},  # o
    (28672, 4096, "glu"): {32: "wg64x224p", 64: "wg64x224p"},  # gate/up
    (4096, 14336, "residual"): {32: "wg64x192k4p", 64: "wg64x192k4p"},  # down
    (128256, 4096, "none"): {32: "wg64x256p", 64: "wg64x256p"},  # LM head
}
WGMMA_BY_NAME = {t.name: t for t in WGMMA_TILES + WGMMA_VARIANTS}


def wgmma_short(p: LinearParams) -> dict[int, str]:
    """Linear `p`'s short-step tiles (WGMMA_SHORT, or HIPC_WGMMA_SHORT's file)."""
    path = os.environ.get("HIPC_WGMMA_SHORT")
    if path:
        table = json.loads(Path(path).read_text())
        entry = table.get(f"{p.N},{p.K},{p.epilogue}", {})
        return {int(n): v for n, v in entry.items()}
    return WGMMA_SHORT.get((p.N, p.K, p.epilogue), {})


def select_wgmma(p: LinearParams, tokens: int) -> WgmmaTile:
    """The measured variant for a listed shape: for steps up to a short-step size listed
    (wgmma_short) the smallest such size's; else WGMMA_MEASURED's at the step size nearest
    `tokens`, by ratio, the smaller on a tie. Else the plain tile with the least estimated
    time at `tokens` tokens: waves of SMS blocks, each block's time its output elements x the
    tile's cost."""
    short = [n for n in sorted(wgmma_short(p)) if tokens <= n]
    if short:
        return WGMMA_BY_NAME[wgmma_short(p)[short[0]]]
    measured = WGMMA_MEASURED.get((p.N, p.K, p.epilogue))
    if measured:
        steps = sorted(measured)
        near = min(steps, key=lambda n: (max(n / tokens, tokens / n), n))
        return WGMMA_BY_NAME[measured[near]]
    glu = p.epilogue == "glu"

    def time(t: WgmmaTile) -> float:
        x, y, z = t.grid(tokens, p.n_out, glu)
        return -(-(x * y * z) // SMS) * t.bm * t.bn * WGMMA_COST[t.bm, t.bn] / t.sk

    return min(WGMMA_TILES, key=time)


def wgmma_buckets(
    p: LinearParams, first: int, max_tokens: int
) -> list[tuple[WgmmaTile, tuple[int, int] | None]]:
    """The sm_90a tiles for steps of `first` to `max_tokens` tokens, each with the step sizes
    it runs at (None: all of them): the short-step tiles up to each listed size (wgmma_short),
    then the tile for 512-token steps up to SHORT_STEP and, where the chunk is longer, the one
    for `max_tokens`; neighbours with the same tile as one."""
    lo = select_wgmma(p, min(max_tokens, 512))
    hi = select_wgmma(p, max_tokens)
    start, buckets = first, []
    for n in sorted(wgmma_short(p)):
        if first <= n < max_tokens:
            buckets.append((select_wgmma(p, n), (start, n)))
            start = n + 1
    if lo == hi:
        buckets.append((lo, (start, max_tokens)))
    else:
        buckets += [(lo, (start, SHORT_STEP)), (hi, (SHORT_STEP + 1, max_tokens))]
    merged: list = []
    for tile, (a, z) in buckets:
        if merged and merged[-1][0] == tile:
            merged[-1] = (tile, (merged[-1][1][0], z))
        else:
            merged.append((tile, (a, z)))
    if len(merged) == 1 and first == 1:
        return [(merged[0][0], None)]
    return merged


def wgmma_gemm(p: LinearParams, target: GpuTarget, split: bool, simt: bool) -> bool:
    """Whether a linear's prefill runs on the sm_90a GEMM as its weights are stored: bf16
    weights (quantized ones reach it through dequant_wgmma) and the GEMM's other terms."""
    return p.wtype == "bfloat16" and _wgmma_takes(p, target, split or simt)


def _wgmma_takes(p: LinearParams, target: GpuTarget, split: bool) -> bool:
    """The sm_90a GEMM's terms beside the weight type: bf16 activations (not
    --prefill-precision split, nor the SIMT kernel forced), rows of 16-byte multiples (TMA's
    global stride), no gated-residual epilogue."""
    return target.arch in WGMMA_ARCHS and not (split or p.gated) and p.K % 8 == 0


# sm_90a prefill steps of at least this many tokens dequantize a quantized W to bf16 rows (one
# extra pass: 2 bytes written and read per weight) and multiply on the bf16 wgmma GEMM; shorter
# steps (batch steps of a few sequences) keep the mma GEMM on the quants, whose cost grows with
# the tokens where the pass's does not. An estimate from the 8B Q4_0 figures (mma GEMM 4,646
# tok/s at 512; the pass ~8 ms a step for 15 GB of bf16), not a measured crossover.
DEQUANT_MIN_TOKENS = 128


def dequant_wgmma(p: LinearParams, target: GpuTarget, split: bool) -> bool:
    """Whether a quantized linear's long prefill steps may run dequantize + the sm_90a GEMM
    (its terms as for bf16 weights: wgmma_gemm)."""
    return WEIGHT_SUFFIX.get(p.wtype) in QUANT_TYPES and _wgmma_takes(p, target, split)


def dequant_steps(k: SelectedKernel, g: GpuProgramBuilder) -> bool:
    """dequant_wgmma for linear `k` in this program: its prefill chunk reaches
    DEQUANT_MIN_TOKENS and it writes every token's row (not a last-row-only LM head, whose
    one row a step is no matrix product worth a pass over a vocabulary-sized W)."""
    return (
        g.max_tokens >= DEQUANT_MIN_TOKENS
        and dequant_wgmma(k.params, g.target, g.prefill_precision == "split")
        and not g.is_output(k.refs["y"][1])
    )


def dequant_kernel(fn: str, p: LinearParams) -> GpuKernel:
    """`fn`'s dequantize pass (templates/hip/linear_dequant.hip.j2): one thread per 8 weights."""
    ws = WEIGHT_SUFFIX[p.wtype]
    ctx = dict(
        wtype=p.wtype,
        wsuffix=ws,
        N=p.N,
        K=p.K,
        block_values=QUANT_TYPES[ws].block_values,
        min_tokens=DEQUANT_MIN_TOKENS,
        params=DEQUANT.render(GPU_INDENT),
    )
    return GpuKernel(f"{fn}_dq", "linear_dequant", ctx, [-(-p.N * p.K // 8 // 256)], 256)


def prefill_gemm(
    fn: str,
    p: LinearParams,
    target: GpuTarget,
    nodes: list[str],
    simt: bool = False,
    split: bool = False,
    tokens: int = 512,
    wgmma: WgmmaTile | None = None,
    y_bf16: bool = False,
    sgemm: SgemmTile | None = None,
) -> GpuKernel:
    """`fn`: the linear's kernel stem. `simt` forces the SIMT kernel (the GPU tests time one
    against the other). `split`: the matrix-instruction GEMM multiplies x as bf16 hi + lo
    (--prefill-precision split) instead of bf16(x) once. `tokens`: the prefill chunk the
    sm_90a tile is chosen for; `wgmma` forces that tile (benchmarks). `y_bf16`: the sm_90a
    GEMM writes y in bf16 (its reader loads it by TMA: bf16_reader). `sgemm` forces the
    float32 GEMM's tile (benchmarks); float32 weights get select_sgemm's for `tokens`."""
    wave = target.wave
    common = dict(
        nodes=nodes,
        wsuffix=WEIGHT_SUFFIX[p.wtype],
        n_out=p.n_out,
        wave=wave,
        params=gemm_signature(p).render(GPU_INDENT),
        stats_params=STATS.render(0),
        **p.context(),
    )
    if wgmma is not None or wgmma_gemm(p, target, split, simt):
        t = wgmma or select_wgmma(p, tokens)
        bn_out = t.bn // 2 if p.epilogue == "glu" else t.bn
        ctx = dict(
            common,
            params=WGMMA.render(GPU_INDENT),
            xb_params=XB.render(0),
            bm=t.bm,
            bn=t.bn,
            stages=t.stages,
            regs=t.regs,
            threads=t.threads,
            bn_out=bn_out,
            cm=t.cm,
            ct=t.ct,
            sk=t.sk,
            cluster=t.cm * t.ct * t.sk,
            pdl=t.pdl,
            y_bf16=y_bf16,
            dequantized=f"{fn}_dq" if p.wtype != "bfloat16" else "",
        )
        return GpuKernel(
            f"{fn}_{t.name}" + ("_yb" if y_bf16 else ""),
            "linear_wgmma",
            ctx,
            [],
            t.threads,
            t.shared_bytes(),
            bn_out,
            t.bm,
        )
    st = sgemm or (None if simt else select_sgemm(p, tokens))
    if st is not None:
        bn_out = st.bn // 2 if p.epilogue == "glu" else st.bn
        sig, sum_sig = (SGEMM_GATED, SGEMM_SUM_GATED) if p.gated else (SGEMM, SGEMM_SUM)
        ctx = dict(
            common,
            params=(sig if st.splits > 1 else gemm_signature(p)).render(GPU_INDENT),
            sum_params=sum_sig.render(GPU_INDENT),
            bm=st.bm,
            bn=st.bn,
            bn_out=bn_out,
            threads=st.threads,
            splits=st.splits,
            ks=st.ks(p.K),
        )
        return GpuKernel(f"{fn}_{st.name}", "linear_sgemm", ctx, [], st.threads, 0, bn_out, st.bm)
    tile = None if simt else mma_tile(target, p, split)
    if tile is None:
        return GpuKernel(f"{fn}_gemm", "linear_gemm", common, [], 256, 0, SIMT_TILE, SIMT_TILE)
    bn_out = tile.bn // 2 if p.epilogue == "glu" else tile.bn
    ws = WEIGHT_SUFFIX[p.wtype]
    quant = ws in QUANT_TYPES
    shared = tile.shared_bytes(split, quant)
    ctx = dict(
        common,
        quant=quant,
        has_offset=ws in OFFSET_TYPES,
        block_values=QUANT_TYPES[ws].block_values if quant else 0,
        **tile.fields(),
        bn_out=bn_out,
        split=split,
        shared=shared,
    )
    threads = tile.threads(wave)
    name = f"{fn}_mma_split" if split else f"{fn}_mma"
    return GpuKernel(name, "linear_mma", ctx, [], threads, shared, bn_out, tile.bm)


@dataclass(frozen=True)
class QuantGemv:
    """A quantized GEMV's geometry: waves per block, weight rows per wave and group (with
    the GLU epilogue gate and up rows: rows // 2 outputs), the 32-weight blocks per lane
    and row whose loads are in flight together (16 bytes of quants each, 32 for q8_0), and
    at most how many blocks: each stages x once, then its waves stream group after group,
    so fewer blocks stage x fewer times; registers are capped for min_blocks blocks per SM
    (NVIDIA), so that max_blocks of them are resident at once on an H200's 132 SMs."""

    waves: int = 8
    rows: int = 2
    unroll: int = 4
    max_blocks: int = 256
    min_blocks: int = 2
    # batches of loads a wave holds in registers (a ring, loaded before the wait), and
    # rounds of x each thread loads at once when staging it
    stages: int = 2
    xq_chunk: int = 4
    preload: int = 0  # ring buffers filled before the wait (0: all of them)
    l2_prefetch: bool = False  # and the wave's rows pulled towards L2 (small matrices)
    unit64: bool = False  # Q4_K, Q6_K: 64-weight units (prelude: hipc_unit_q4_k64, q6_k64)
    # a residual epilogue's first rows read right after the wait, before x is staged
    # (QUANT_GEMV_LARGE_DOWN)
    early_res: bool = False
    # items after the ring pulled towards L2 once x's loads are issued (split layout only)
    after_prefetch: int = 0


# Small matrices (SmolLM2's, latency-bound): 8-wave blocks of 2-row groups, two per SM (16
# waves where rows are >= QUANT_GEMV_LONG_K), the next batch copied in (stages 1: the loop
# measured before the ring; the ring is not measured at these shapes). Large ones
# (QUANT_GEMV_LARGE_BYTES and up): 16-wave blocks of 2-row groups, one per SM, a ring of 3
# batches of 2 units per row (gate/up: 4 batches), x staged in one round trip where it takes
# <= 8 rounds.
# On the H200 (bench_gpu_gemv.py, int8 activations, 2026-12-03 mid call; copy 4.29 TB/s) the
# 8B Q4_0 layer took qkv 5.3, o 4.3, gate/up 16.9 (3.90 TB/s), down 11.2 us where the loop
# before (16 x 2 rows x 4 units, one batch copied in) took 6.0, 4.2, 18.2, 11.6; rings capped
# at 64 registers (so that the next kernel's block fits beside: PDL) were slower in every
# shape and in 32-layer chains (50.8 us a layer against 39.9): bytes in flight per lane
# matter more than the overlap. q8_0 blocks are twice the bytes: half the unroll.
QUANT_GEMV_SMALL = QuantGemv(8, 2, 4, 256, 2, 1)
QUANT_GEMV_LONG = QuantGemv(16, 2, 4, 128, 1, 1)  # small matrices of long rows (copy loop)
# And they pull the 2 items after their ring towards L2 once x's loads are issued (after_prefetch):
# the ring lands while x stages, its refills wait on x, and the memory would idle between. In
# the 8B Q4_0 decode graph (bench_gpu_variants.py, H100, session 22 call 3, alternating rounds)
# 537.4 / 537.6 tok/s at tg128 against 514.4 / 517.8 without, 508.7 / 509.1 at 512 positions
# against 489.9 / 492.0; issued before x's loads they queued ahead of them (x staged in 5.1
# us instead of 3.9 on the gate/up) and lost 2% (call 2).
QUANT_GEMV_LARGE = QuantGemv(16, 2, 2, 132, 1, 3, 8, after_prefetch=2)
QUANT_GEMV_LARGE_GLU = QuantGemv(16, 2, 2, 132, 1, 4, 8, after_prefetch=2)
# Down projections read their residual rows right after the wait (early_res). In the 8B Q4_0
# decode graph (profile_gpu_decode.py --swap, position 64, H200, 2026-12-04 call 1) that took
# 62.5 and 65.7 us off a 1.630 ms step where the same geometry without it read -6.7 and +1.3;
# on the 4096 x 4096 o it read -23.1 / -36.3 against -21.4 / -26.1 (noise): not adopted there.
QUANT_GEMV_LARGE_DOWN = replace(QUANT_GEMV_LARGE, early_res=True)
QUANT_GEMV_LARGE_BYTES = 4 << 20
QUANT_GEMV_LONG_K = 1536
XQ_BLOCK_BYTES = {"int16": 80, "int8": 48}


def xq_bytes(K: int, activations: str) -> int:
    """Shared bytes of x staged by a quantized GEMV: K / 32 blocks and 16 bytes of padding
    after every 8 (prelude: hipc_xqs, against bank conflicts of the 128-weight units)."""
    return K // 32 * XQ_BLOCK_BYTES[activations] + 16 * -(-K // 256)


@dataclass(frozen=True)
class QuantType:
    """A quantized type as the GPU kernels see it (prelude: hipc_qmat_*, hipc_unit_*)."""

    block_values: int  # weights per block
    block_bytes: int
    quant_bytes: int  # of which quants (the split layout's first region)
    unit_values: int  # weights a GEMV lane takes per step and row


QUANT_TYPES = {
    "q4_0": QuantType(32, 18, 16, 32),
    "q4_1": QuantType(32, 20, 16, 32),
    "q8_0": QuantType(32, 34, 32, 32),
    "q6_k": QuantType(256, 210, 192, 128),
    "q3_k": QuantType(256, 110, 96, 128),
    "q2_k": QuantType(256, 84, 64, 128),
    "q5_0": QuantType(32, 22, 16, 32),
    "q5_1": QuantType(32, 24, 16, 32),
    "q4_k": QuantType(256, 144, 128, 128),
    "q5_k": QuantType(256, 176, 160, 128),
    "iq4_nl": QuantType(32, 18, 16, 32),
    "iq4_xs": QuantType(256, 136, 128, 128),
}
# the types whose chunks (prelude: hipc_qchunk8) have an offset: w = s q + o per 16 weights
OFFSET_TYPES = ("q4_1", "q5_1", "q4_k", "q5_k", "q2_k")
# A K-quant unit is 21-27 registers (64-96 bytes of quants). Q4_K/Q5_K: groups of 4 rows,
# one unit each, the next copied in (stages 1), 8 waves a block, one block per SM; Q6_K: groups
# of 2 rows, a ring of 3 units each. On the H200 (bench_gpu_gemv.py, int8, mid call) Q6_K LM
# head 103.7 us (4.16 TB/s), down 19.9 where the 4-row copy loop took 107.2 and 21.2; Q4_K
# gate/up 19.2, down 16.0, o 6.0 with the copy loop where 2-row rings took 24.7, 18.0, 6.2
# and 4-row ones 21.9, 18.0, 6.1.
QUANT_GEMV_KQUANT = QuantGemv(8, 4, 1, 132, 1, 1)
QUANT_GEMV_Q6_K = QuantGemv(8, 2, 1, 132, 1, 3, 8)
# Q3_K: half a super-block is 55 bytes in 21 registers (the whole hmask: the other half's bits
# too), so 16-wave blocks: 1-row rings of 3 units, gate/up 2-row rings of 2. On an H100
# (bench_gpu_gemv.py, int8, session 21 call 4; copy 3.05 TB/s) the 8B Q3_K gate/up took 20.1 us
# (2.51 TB/s; Q4_K's 23.6 us is 2.80) where Q6_K's 8-wave 2-row ring of 3 took 21.4, and q+k
# 5.8 against 6.4; in the 8B Q3_K_M decode graph 502.1 / 504.9 / 503.2 tok/s against 472.8 /
# 472.0 / 472.9 in alternating rounds (call 5). Unmeasured: the small classes.
QUANT_GEMV_Q3_K = QuantGemv(16, 1, 1, 132, 1, 3, 8)
QUANT_GEMV_Q3_K_GLU = QuantGemv(16, 2, 1, 132, 1, 2, 8)
# Q5_K's non-GLU GEMVs: 16-wave 1-row rings of 2 units (a Q5_K unit is 22 registers). Session
# 29 (H200, the 8B Q5_K_M decode graph traced at 32 positions) moved them from the 4-row copy
# loop to Q3_K's rings of 3: down 23.0 -> 16.5 us, o 8.9 -> 6.1, qkv 9.3 -> 7.3, decode 432.4 ->
# 476.0 tok/s (2-row rings of 2 were slower, 369.3; the gate/up keeps the copy loop: on rings
# the whole step was slower, 394.9). Rings of 3 left ptxas a 32-byte stack frame in the down and
# 132 bytes of spills in the o; rings of 2 have neither and, session 30 on an H100, decode
# 385.5 / 385.5 -> 409.5 / 404.8 tok/s (two alternating rounds; down 19.0 -> 18.4 us, o 6.9 ->
# 5.8, qkv 7.5 -> 6.8).
QUANT_GEMV_Q5_K = QuantGemv(16, 1, 1, 132, 1, 2, 8)


@dataclass(frozen=True)
class QuantGemvBulk:
    """The bulk-copy GEMV's geometry (templates/hip/linear_gemv_qbulk, NVIDIA sm_90): tiles of
    `tile_rows` weight rows (a GLU tile: half gate, half up) copied whole into a ring of
    `stages` shared-memory stages by cp.async.bulk, `waves` waves a block multiplying one
    output row each at a time, at most `max_blocks` blocks; registers and shared memory
    sized for `min_blocks` blocks per SM (2: the next kernel's block fits beside, its first
    tiles in flight before its wait)."""

    waves: int = 8
    tile_rows: int = 8
    stages: int = 4
    max_blocks: int = 132
    min_blocks: int = 2
    unroll: int = 2
    xq_chunk: int = 8
    rows_per_wave: int = 1  # outputs a wave multiplies at once
    unit64: bool = (
        False  # Q4_K, Q6_K: 64-weight units (prelude: hipc_unit_q4_k64; no bank conflicts)
    )


# bytes per block of each region of the split layout (prelude: hipc_qmat_*), quants first
QUANT_REGIONS = {
    "q4_0": (16, 2),
    "q4_1": (16, 4),
    "q8_0": (32, 2),
    "q5_0": (16, 4, 2),
    "q5_1": (16, 4, 4),
    "q4_k": (128, 16),
    "q5_k": (160, 16),
    "q6_k": (192, 16, 2),
    "q3_k": (96, 12, 2),
    "q2_k": (64, 16, 4),
    "iq4_nl": (16, 2),
    "iq4_xs": (128, 4, 4),
}


@dataclass(frozen=True)
class BulkSpec:
    """A bulk-copy GEMV geometry by its budget, for any matrix: stages of at most `kib` KiB,
    `waves` waves at most a block sized for `per_sm` blocks per SM (bench_gpu_gemv.py's bulk*
    variants are these)."""

    kib: int
    stages: int
    waves: int
    per_sm: int
    rows_per_wave: int = 1
    unit64: bool = False

    def geometry(self, wsuffix: str, K: int, glu: bool) -> QuantGemvBulk:
        """A multiple of `waves` outputs a tile (a wave an output), else a power of two of
        them (the waves splitting each output's units), within `kib` KiB a stage."""
        qt = QUANT_TYPES[wsuffix]
        out_bytes = (2 if glu else 1) * (K // qt.block_values * qt.block_bytes)
        tp = max(1, self.kib * 1024 // out_bytes)
        tp = tp // self.waves * self.waves if tp >= self.waves else 1 << (tp.bit_length() - 1)
        return QuantGemvBulk(
            self.waves,
            tp * (2 if glu else 1),
            self.stages,
            132,
            self.per_sm,
            rows_per_wave=self.rows_per_wave,
            unit64=self.unit64,
        )


# The bulk-copy GEMV where it is the default: (weight type, matrix class) -> its BulkSpec; a
# class is "glu", "long" (K >= BULK_LONG_K: a down projection) or "short". Empty: on an H100
# (bench_gpu_gemv.py's bulk* variants, e.g. bulk24x4m2 is BulkSpec(24, 4, 8, 2); session 23
# call 1) every bulk geometry was slower than the register GEMV but on the Q4_K q+k (6.4
# against 6.7 us), and 32-layer chains of them 29-67% slower a layer (Q4_0 61.5-79.8 against
# 47.8 us): a stage is refilled once every wave has read it, and a block's stages hold fewer
# bytes in flight than the register rings.
QUANT_GEMV_BULK: dict[tuple[str, str], BulkSpec] = {}
BULK_LONG_K = 8192
# HIPC_QUANT_GEMV_BULK (compile time, for benchmarks timing the bulk-copy GEMV inside the
# decode graph): "TYPE:CLASS=kib,stages,waves,per_sm[,rN][,k64];..." adds those entries to
# QUANT_GEMV_BULK (rN: rows_per_wave N; k64: unit64); TYPE "q" stands for the 32-weight types.
BULK_ENV = "HIPC_QUANT_GEMV_BULK"
_BULK_CLASSES = ("glu", "long", "short")


def env_entries(name: str) -> Iterator[tuple[str, str, str, str]]:
    """The entries "FAMILY:CLASS=VALUE;..." of a benchmark's override variable (BULK_ENV,
    TABLE_ENV): (the entry, family, class, value)."""
    for item in filter(None, os.environ.get(name, "").split(";")):
        key, _, value = item.partition("=")
        family, _, cls = key.strip().partition(":")
        yield item, family, cls, value


def bulk_overrides() -> dict[tuple[str, str], BulkSpec]:
    """BULK_ENV's entries, by (weight type, class); HipcError naming an entry it cannot read."""
    out = {}
    for item, wsuffix, cls, spec in env_entries(BULK_ENV):
        fields = spec.split(",")
        flags = fields[4:]
        rows = [f[1:] for f in flags if f[:1] == "r"]
        if (
            (wsuffix != "q" and wsuffix not in QUANT_REGIONS)
            or cls not in _BULK_CLASSES
            or len(fields) < 4
            or not all(f.isdigit() for f in fields[:4])
            or len(rows) > 1
            or not all(n.isdigit() for n in rows)
            or any(f != "k64" and f[:1] != "r" for f in flags)
        ):
            raise HipcError(
                f"{BULK_ENV}: bad entry {item!r} (TYPE:CLASS=kib,stages,waves,per_sm[,rN][,k64])"
            )
        parsed = BulkSpec(*map(int, fields[:4]), int(rows[0]) if rows else 1, "k64" in flags)
        for ws in (
            (t for t in QUANT_REGIONS if QUANT_TYPES[t].unit_values == 32)
            if wsuffix == "q"
            else (wsuffix,)
        ):
            out[ws, cls] = parsed
    return out


def bulk_default(
    wsuffix: str, N: int, K: int, glu: bool, target: GpuTarget
) -> QuantGemvBulk | None:
    """The bulk-copy geometry quant_gemv's table gives this matrix, if any and if it fits."""
    cls = "glu" if glu else "long" if K >= BULK_LONG_K else "short"
    spec = {**QUANT_GEMV_BULK, **bulk_overrides()}.get((wsuffix, cls))
    if spec is None or not bulk_gemv_fits(wsuffix, K, target):
        return None
    return spec.geometry(wsuffix, K, glu)


def unit_of(wsuffix: str, unit64: bool) -> dict:
    """The GEMV unit of a weight type (prelude: hipc_unit_*): its name and weights."""
    if unit64 and wsuffix in ("q4_k", "q6_k"):
        return {"unit": f"{wsuffix}64", "unit_values": 64}
    return {"unit": wsuffix, "unit_values": QUANT_TYPES[wsuffix].unit_values}


def bulk_gemv_fits(wsuffix: str, K: int, target: GpuTarget) -> bool:
    """cp.async.bulk copies 16-byte aligned multiples of 16 bytes: every region's bytes per
    row must be one (then every tile's ranges are); NVIDIA sm_90 and later only."""
    if target.sm < 90 or wsuffix not in QUANT_REGIONS:
        return False
    bpr = K // QUANT_TYPES[wsuffix].block_values
    return all(bpr * rb % 16 == 0 for rb in QUANT_REGIONS[wsuffix])


# quant_gemv's table: (family, matrix class) -> geometry. Families: "q" (the 32-weight types),
# "q4_k", "q5_k", "iq4_xs", "q3_k" and "q2_k" (128-weight units), "q6_k". Classes: "small" (under QUANT_GEMV_LARGE_BYTES,
# rows shorter than QUANT_GEMV_LONG_K), "small_long" (under, rows that long), and at or over it
# "glu" (gate/up), "long" (rows of QUANT_GEMV_LONG_ROWS and more: a down projection),
# "narrow" (no more outputs than inputs: an attention's o) and "short" (the rest: qkv, an LM
# head). bench_gpu_gemv.py's pick:* variants time other tables whole.
QUANT_GEMV_LONG_ROWS = 8192
# Q4_K and Q6_K down projections: 16-wave blocks of 2-row rings of two 64-weight units
# (QUANT_GEMV_K64). On the H200 (bench_gpu_gemv.py, int8, session 10 call 1; copy 4.28 TB/s)
# the 8B Q4_K down took 14.1 us where QUANT_GEMV_KQUANT took 15.5, Q6_K down 16.3 where
# QUANT_GEMV_Q6_K took 18.6, and the Q4_K_M layer chains with them 45.7 / 52.2 us where the
# table before took 49.0 / 58.5 (docs/benchmarks/gpu-h200.md, "Session 10, qdec"). The same
# geometry lost on the Q4_K qkv (7.6 against 7.1 us) and gate/up (22.6 against 18.7), and
# won the 4096 x 4096 o (5.0 against 5.7): the "narrow" class, which qkv is not in.
# Q5_K and IQ4_XS have no 64-weight unit (unit_of): IQ4_XS keeps QUANT_GEMV_KQUANT (not
# measured), Q5_K takes QUANT_GEMV_Q5_K.
QUANT_GEMV_K64 = QuantGemv(16, 2, 1, 132, 1, 2, 8, unit64=True)
# and, as the Q4_0 downs (QUANT_GEMV_LARGE_DOWN), they read their residual rows right after the
# wait: in the 8B Q4_K_M decode graph (profile_gpu_decode.py --swap, position 64, H200,
# 2026-12-04 call 2, a 1.895 ms step) -29.0 / -28.5 us a step on the Q4_K downs and -50.4 /
# -49.4 on the Q6_K ones, where QUANT_GEMV_K64 re-rendered read +0.7 / +2.6 and -5.1 / -4.1.
QUANT_GEMV_K64_DOWN = replace(QUANT_GEMV_K64, early_res=True)
_CLASSES = ("small", "small_long", "short", "narrow", "long", "glu")
QUANT_GEMV_TABLE: dict[tuple[str, str], QuantGemv] = {
    ("q", "small"): QUANT_GEMV_SMALL,
    ("q", "small_long"): QUANT_GEMV_LONG,
    ("q", "short"): QUANT_GEMV_LARGE,
    ("q", "narrow"): QUANT_GEMV_LARGE,
    ("q", "long"): QUANT_GEMV_LARGE_DOWN,
    ("q", "glu"): QUANT_GEMV_LARGE_GLU,
    **{("q4_k", c): QUANT_GEMV_KQUANT for c in _CLASSES},
    **{("q5_k", c): QUANT_GEMV_KQUANT for c in _CLASSES},
    **{("iq4_xs", c): QUANT_GEMV_KQUANT for c in _CLASSES},
    # Q2_K: half a super-block is 44 bytes in 11 registers, under Q4_K's 20: its copy loop of
    # 4-row groups (not timed)
    **{("q2_k", c): QUANT_GEMV_KQUANT for c in _CLASSES},
    **{("q6_k", c): QUANT_GEMV_Q6_K for c in _CLASSES},
    # (the small classes take gate/up pairs too: 2-row groups)
    **{("q3_k", c): QUANT_GEMV_Q3_K_GLU for c in ("small", "small_long", "glu")},
    **{("q3_k", c): QUANT_GEMV_Q3_K for c in ("short", "narrow", "long")},
    **{("q5_k", c): QUANT_GEMV_Q5_K for c in ("short", "narrow", "long")},
    ("q4_k", "long"): QUANT_GEMV_K64_DOWN,
    ("q4_k", "narrow"): QUANT_GEMV_K64,
    ("q6_k", "long"): QUANT_GEMV_K64_DOWN,
}


def gemv_class(wsuffix: str, N: int, K: int, glu: bool) -> tuple[str, str]:
    """The (family, matrix class) of QUANT_GEMV_TABLE an [N, K] matrix falls in."""
    qt = QUANT_TYPES[wsuffix]
    family = wsuffix if qt.unit_values > 32 else "q"
    if N * (K // qt.block_values) * qt.block_bytes < QUANT_GEMV_LARGE_BYTES:
        return family, "small_long" if K >= QUANT_GEMV_LONG_K else "small"
    if glu:
        return family, "glu"
    return family, "long" if K >= QUANT_GEMV_LONG_ROWS else "narrow" if N <= K else "short"


# HIPC_QUANT_GEMV_TABLE (compile time, for benchmarks timing geometries inside the decode
# graph): "FAMILY:CLASS=waves,rows,unroll,max_blocks,min_blocks,stages,xq_chunk[,k64][,pN][,aN][,r][,l];..."
# replaces those entries of QUANT_GEMV_TABLE (k64: QuantGemv.unit64).
TABLE_ENV = "HIPC_QUANT_GEMV_TABLE"


def parse_geometry(text: str) -> QuantGemv | None:
    """ "waves,rows,unroll,max_blocks,min_blocks,stages,xq_chunk[,k64][,pN][,aN][,r][,l]" ->
    its QuantGemv (k64: unit64; pN: preload N; aN: after_prefetch N; r: early_res; l:
    l2_prefetch); None when it is not that."""
    fields = text.split(",")
    flags = fields[7:]
    counted = {c: [f[1:] for f in flags if f[:1] == c] for c in "pa"}
    if (
        len(fields) < 7
        or len(set(flags)) != len(flags)
        or any(f not in ("k64", "r", "l") and f[:1] not in counted for f in flags)
        or any(len(v) > 1 or not all(n.isdigit() for n in v) for v in counted.values())
    ):
        return None
    try:
        ints = [int(v) for v in fields[:7]]
    except ValueError:
        return None
    return QuantGemv(
        *ints,
        preload=int(counted["p"][0]) if counted["p"] else 0,
        after_prefetch=int(counted["a"][0]) if counted["a"] else 0,
        unit64="k64" in flags,
        early_res="r" in flags,
        l2_prefetch="l" in flags,
    )


def table_overrides() -> dict[tuple[str, str], QuantGemv]:
    out = {}
    for item, family, cls, geometry in env_entries(TABLE_ENV):
        g = parse_geometry(geometry)
        if (family, cls) not in QUANT_GEMV_TABLE or g is None:
            raise HipcError(
                f"{TABLE_ENV}: bad entry {item!r} (FAMILY:CLASS=7 ints[,k64][,pN][,aN][,r][,l])"
            )
        out[family, cls] = g
    return out


def quant_gemv(
    wsuffix: str,
    N: int,
    K: int,
    glu: bool = False,
    table: dict[tuple[str, str], QuantGemv] | None = None,
) -> QuantGemv:
    """The geometry of a quantized GEMV of an [N, K] matrix (`glu`: gate/up row pairs), from
    `table` (default QUANT_GEMV_TABLE)."""
    if table is None:
        overrides = table_overrides()
        table = {**QUANT_GEMV_TABLE, **overrides} if overrides else QUANT_GEMV_TABLE
    g = table[gemv_class(wsuffix, N, K, glu)]
    if wsuffix in ("q5_0", "q5_1"):  # a sixth register per unit: 4 units in flight, no spills
        # (a copy loop: the L2 pull measured no gain on the K-quants' copy loops)
        g = replace(
            g, rows=2, unroll=2, stages=1, min_blocks=min(g.min_blocks, 2), after_prefetch=0
        )
    if wsuffix == "q8_0":  # 9 registers a unit
        g = replace(g, unroll=max(1, g.unroll // 2))
    return g


def stream_blocks(groups: int, waves: int, max_blocks: int) -> int:
    """Blocks for `groups` units of work streamed by `waves` waves a block: as few groups per
    wave as max_blocks allows, then as few blocks as give every wave that many."""
    per_wave = -(-groups // (waves * max_blocks))
    return -(-groups // (waves * per_wave))


def decode_gemv(
    fn: str,
    p: LinearParams,
    target: GpuTarget,
    nodes: list[str],
    quant: QuantGemv | QuantGemvBulk | None = None,
    activations: str = "int16",
    quant_layout: str = "split",
    next_prefetch: tuple[tuple[int, int], ...] = (),
) -> GpuKernel:
    """The GEMV of one linear. `quant` overrides quant_gemv's geometry (bench_gpu_gemv.py
    times several); `activations` (CompileOptions.activations) is how a quantized GEMV
    rounds x: int16 (int8 hi + lo planes) or int8 (one plane). `next_prefetch`: (offset from
    W, bytes) spans the quantized GEMV pulls towards L2 before its wait, spread over its grid
    (gemv_swap.py's experiments: another kernel's first weights)."""
    wave = target.wave
    ws = WEIGHT_SUFFIX[p.wtype]
    glu = p.epilogue == "glu"
    rows_per_block = GEMV_WAVES * (1 if glu else 2)
    if ws in QUANT_TYPES and quant is None and quant_layout == "split":
        quant = bulk_default(ws, p.N, p.K, glu, target)
    if ws in QUANT_TYPES and isinstance(quant, QuantGemvBulk):
        return bulk_gemv(fn, p, target, nodes, quant, activations)
    if ws in QUANT_TYPES:
        qt = QUANT_TYPES[ws]
        g = quant or quant_gemv(ws, p.N, p.K, glu)
        unit = unit_of(ws, g.unit64)
        groups = -(-p.n_out // (g.rows // 2 if glu else g.rows))
        steps = -(-(p.K // unit["unit_values"]) // wave)
        rounds = -(-(p.K // 4) // (g.waves * wave))
        blocks = stream_blocks(groups, g.waves, g.max_blocks)
        ctx = dict(
            nodes=nodes,
            wave=wave,
            wsuffix=ws,
            n_out=p.n_out,
            waves=g.waves,
            rows=g.rows,
            unroll=g.unroll,
            blocks=blocks,
            min_blocks=g.min_blocks,
            batches=-(-steps // g.unroll),
            stages=g.stages,
            preload=min(g.preload or g.stages, g.stages),
            l2_prefetch=g.l2_prefetch,
            # (its addresses are the split layout's regions)
            after_prefetch=g.after_prefetch if quant_layout == "split" else 0,
            scale_bytes=QUANT_REGIONS[ws][1],
            next_prefetch=list(next_prefetch),
            early_res=g.early_res and p.epilogue == "residual",
            xq_chunk=max(1, min(g.xq_chunk, rounds)),
            lo=activations == "int16",
            params=gemv_signature(p).render(GPU_INDENT),
            **{**qt.__dict__, **unit},
            **p.context(),
        )
        shared = xq_bytes(p.K, activations)
        return GpuKernel(f"{fn}_gemv", "linear_gemv_q", ctx, [blocks], g.waves * wave, shared)
    ctx = dict(
        nodes=nodes,
        wave=wave,
        wsuffix=ws,
        n_out=p.n_out,
        waves=GEMV_WAVES,
        rows_per_block=rows_per_block,
        prefetch=gemv_prefetch(row_bytes(p.wtype, p.K), p.N),
        params=gemv_signature(p).render(GPU_INDENT),
        **p.context(),
    )
    shared = 4 * p.K if p.norm_eps else 0  # the normalized x, staged
    return GpuKernel(
        f"{fn}_gemv",
        "linear_gemv",
        ctx,
        [-(-p.n_out // rows_per_block)],
        GEMV_WAVES * wave,
        shared,
    )


def bulk_gemv(
    fn: str,
    p: LinearParams,
    target: GpuTarget,
    nodes: list[str],
    g: QuantGemvBulk,
    activations: str,
) -> GpuKernel:
    """The bulk-copy GEMV (templates/hip/linear_gemv_qbulk.hip.j2) of a quantized linear."""
    ws = WEIGHT_SUFFIX[p.wtype]
    if not bulk_gemv_fits(ws, p.K, target):
        raise ValueError(f"{fn}: no bulk-copy GEMV for {ws} K={p.K} on {target.arch}")
    qt = QUANT_TYPES[ws]
    glu = p.epilogue == "glu"
    if glu and g.tile_rows % 2:
        raise ValueError(f"{fn}: a GLU tile holds gate and up rows: tile_rows must be even")
    tp = g.tile_rows // 2 if glu else g.tile_rows
    # fewer passes of rows_per_wave outputs a tile than waves: the waves of a pass split its
    # units
    passes = -(-tp // g.rows_per_wave)
    ksplit = g.waves // passes if passes < g.waves else 1
    if ksplit > 1 and (g.waves % passes or tp % g.rows_per_wave):
        raise ValueError(
            f"{fn}: {g.waves} waves do not split a tile of {tp} outputs in passes of "
            f"{g.rows_per_wave} evenly"
        )
    tiles = -(-p.n_out // tp)
    blocks = min(g.max_blocks, tiles)
    stage_bytes = g.tile_rows * (p.K // qt.block_values) * qt.block_bytes
    xq_shared = -(-xq_bytes(p.K, activations) // 128) * 128
    rounds = -(-(p.K // 4) // (g.waves * target.wave))
    unit = unit_of(ws, g.unit64)
    ctx = dict(
        nodes=nodes,
        wave=target.wave,
        wsuffix=ws,
        n_out=p.n_out,
        waves=g.waves,
        tile_rows=g.tile_rows,
        ksplit=ksplit,
        rows_per_wave=g.rows_per_wave,
        stages=g.stages,
        blocks=blocks,
        min_blocks=g.min_blocks,
        unroll=g.unroll,
        stage_bytes=stage_bytes,
        xq_bytes=xq_shared,
        regions=list(QUANT_REGIONS[ws]),
        xq_chunk=max(1, min(g.xq_chunk, rounds)),
        lo=activations == "int16",
        params=gemv_signature(p).render(GPU_INDENT),
        **{**qt.__dict__, **unit},
        **p.context(),
    )
    shared = xq_shared + g.stages * stage_bytes
    return GpuKernel(
        f"{fn}_gemv", "linear_gemv_qbulk", ctx, [blocks], g.waves * target.wave, shared
    )


def gemv_prefetch(row: int, rows: int) -> int:
    """Bytes of each weight row a GEMV prefetches before its wait: all or nothing."""
    return row if row * rows <= GEMV_PREFETCH_MAX else 0


# -- the batch step's weights-once GEMV (linear_gemvm.hip.j2) ------------------------------

# n tiles of 8 rows per kernel: steps of 1-8, 9-16, 17-32 and 33-64 rows (each size class its
# own kernel, so a bucket's rows are never padded past the next multiple of 8)
GEMVM_TILES = (1, 2, 4, 8)
# k chunks (32 deep) a warp loads at once, by n tiles: the x fragments of a chunk take 4 registers
# per tile, so wider steps hold fewer chunks of weights in flight. On the H200 (bench_batch_kernels,
# 8B shapes, 2-8 rows) 2 chunks beat 4 by 2-40% everywhere but qkv (o 1.91 against 1.85 TB/s,
# down 1.65 / 1.66, gate/up 3.50 / 3.33, head 3.97 / 3.82).
GEMVM_UNROLL = {1: 2, 2: 2, 4: 2, 8: 1}
GEMVM_WARPS = 8  # warps per block, splitting K between them over the block's 16 weight rows
# Batch steps of up to this many rows take the GEMV; larger ones the prefill GEMM. On the H200
# (bench_smallm.py, session 8: 32 layers of the 8B qkv, o, gate/up and down as one graph, ms)
# with the geometries below against the wgmma GEMMs: 8 rows 4.15 / 6.63, 16 rows 4.45 / 6.74,
# 32 rows 5.42 / 6.91; at 64 rows the GEMMs' 7.11 beat any GEMV mix (7.23; down 83 us a layer
# on the GEMM, 140 on the best GEMV). Shapes with a short wgmma tile listed at 32 tokens
# (WGMMA_SHORT: session 10's 64-token tiles) take the GEMM from 17 rows.
BATCH_GEMV_ROWS = 32
# Linears with this many weight rows or more (LM heads) keep the batch GEMV to 8-row steps: at
# 16-64 rows the wgmma GEMM streams the 8B head at 4.0 TB/s (bench_batch_gemv.py profile, 32
# rows) where linear_gemvm fell to 3.7 / 2.9 / 1.9 TB/s at 16 / 32 / 64 (bench_batch_kernels.py).
GEMVM_WIDE_ROWS = 65536


def gemvm_rows(p: LinearParams, rows: int, forced: bool = False) -> int:
    """The largest batch step linear `p` runs on the batch GEMV, given the program's limit
    `rows` (BATCH_GEMV_ROWS, or HIPC_BATCH_GEMV_ROWS when `forced`: then for every linear)."""
    if forced or p.N < GEMVM_WIDE_ROWS:
        return rows
    return min(rows, 8)


# Geometry overrides by (N, K, epilogue) and n tiles, from bench_batch_kernels.py and
# bench_smallm.py on the H200: warps, unroll, mt (16-row tiles per block), xpipe (x a batch
# ahead), xb (x through _xb without a norm); or `split`: batch_gemv_split's arguments (the
# shared-x kernel, linear_gemvs) in place of linear_gemvm's. Session 8 (bench_smallm, us per
# launch at 8 / 16 / 32 rows): qkv keeps 4 warps x 4 chunks at 8 rows and the plain geometry
# above (16: 22.1 against 27-29 with x ahead or two tiles); gate/up the plain one at 8 rows (68.5
# against 69.9 with x ahead), the shared-x kernel at 16 (8 warps: 71.9 against 74.4) and 32
# (4 warps of 2 tiles, x by cp.async: 77.3 against 90.9); the LM head as before (not measured
# with x ahead).
GEMVM_MEASURED: dict[tuple[int, int, str], dict[int, dict]] = {
    (6144, 4096, "none"): {1: dict(warps=4, unroll=4, xpipe=True), 2: {}, 4: {}},  # qkv
    (28672, 4096, "glu"): {  # gate/up
        1: {},
        2: {"split": dict(warps=8, mt=1, unroll=4, xasync=True)},
        4: {"split": dict(warps=4, mt=2, unroll=4, xasync=True)},
    },
    (128256, 4096, "none"): {1: {}},  # the LM head
}


# The geometry of an unlisted shape by n tiles (GEMVM_MEASURED's form; a `split` entry without
# `splits` gets gemvs_splits' count). Session 8 (bench_smallm, the 8B o and down, us at 8 / 16 /
# 32 rows): x a batch ahead at 8 rows (down 45.2 against 71.9, o 16.3 / 16.6), and two 16-row
# tiles a block too from 16 rows (down 49.0 / 100.0 and 62.8 / 157.9, o 17.6 / 17.8 and
# 20.7 / 21.2); a 32-layer chain of the four linears with these picks: 4.15 / 4.45 / 5.42 ms
# against linear_gemvm's plain geometry 4.88 / 6.09 / 8.96.
GEMVM_DEFAULT: dict[int, dict] = {
    1: {"xpipe": True},
    2: {"mt": 2, "xpipe": True},
    4: {"mt": 2, "xpipe": True},
    8: {"warps": 4, "mt": 2, "xpipe": True},  # (unmeasured: steps of 64 rows take the GEMMs)
}


def gemvm_geometry(p: LinearParams, nt: int) -> dict:
    """batch_gemv's geometry arguments for a linear at n tiles `nt` (defaults where unmeasured)."""
    measured = GEMVM_MEASURED.get((p.N, p.K, p.epilogue), {})
    geometry = dict(measured[nt] if nt in measured else GEMVM_DEFAULT.get(nt, {}))
    if "split" in geometry:
        geometry["split"] = dict(geometry["split"])
    return geometry


def gemvm_plain(p: LinearParams, nt: int) -> dict:
    """Session 7's geometry (linear_gemvm, x read as used, one tile a block; qkv 4 warps x 4
    chunks at 8 rows): what HIPC_BATCH_GEMV_TUNED=0 compiles, for comparisons."""
    return dict(warps=4, unroll=4) if (p.N, p.K, p.epilogue, nt) == (6144, 4096, "none", 1) else {}


def gemvs_splits(p: LinearParams, warps: int, mt: int, unroll: int, factor: float = 1.0) -> int:
    """K splits of linear_gemvs for about 8 resident warps per SM (a 4-warp block of ~250
    registers: 2 an SM) on SMS multiprocessors, times `factor`; each split at least two batches
    of `unroll` chunks."""
    outs = (8 if p.epilogue == "glu" else 16) * mt * warps
    blocks = -(-p.n_out // outs)
    want = max(1, round(SMS * 8 / warps / blocks * factor))
    return max(1, min(want, (p.K // 32) // (2 * unroll)))


def gemvm_kernel(
    fn: str, p: LinearParams, target: GpuTarget, nodes: list[str], nt: int, geometry: dict
) -> GpuKernel:
    """The batch GEMV of a geometry (gemvm_geometry's): batch_gemv_split's where it has a
    `split` entry, else batch_gemv's."""
    geometry = dict(geometry)
    split = geometry.pop("split", None)
    if split is not None:
        split = dict(split)
        if "splits" not in split:
            split["splits"] = gemvs_splits(p, split["warps"], split["mt"], split["unroll"])
        return batch_gemv_split(fn, p, target, nodes, nt, **split, xb=geometry.get("xb"))
    return batch_gemv(fn, p, target, nodes, nt, **geometry)


def gemvm_eligible(p: LinearParams, target: GpuTarget) -> bool:
    """Whether a linear has the weights-once batch GEMV: bf16 weights on NVIDIA's mma.sync
    (sm_80+), rows of whole 16-byte loads; no gated residual (one gate per row)."""
    tile = MMA_TILES.get(target.arch)
    return (
        tile is not None
        and tile.macro == "HIPC_MMA_NV"
        and p.wtype == "bfloat16"
        and p.K % 8 == 0
        and not p.gated
    )


def batch_gemv(
    fn: str,
    p: LinearParams,
    target: GpuTarget,
    nodes: list[str],
    nt: int,
    warps: int = GEMVM_WARPS,
    unroll: int | None = None,
    mt: int = 1,
    xb: bool | None = None,
    xpipe: bool = False,
) -> GpuKernel:
    """The weights-once GEMV of a batch step of up to 8 * nt rows (`warps`, `unroll`, `mt`
    tiles of 16 weight rows per block, `xb` x through the _xb pass even without a norm, `xpipe`
    x loaded a batch ahead like the weights: other geometries for benchmarks)."""
    glu = p.epilogue == "glu"
    ctx = dict(
        nodes=nodes,
        wave=target.wave,
        n_out=p.n_out,
        nt=nt,
        mt=mt,
        warps=warps,
        unroll=unroll or GEMVM_UNROLL[nt],
        xb=bool(p.norm_eps) if xb is None else xb,
        xpipe=xpipe,
        params=GEMM.render(GPU_INDENT),
        xb_params=XB.render(0),
        **p.context(),
    )
    outs = (8 if glu else 16) * mt
    return GpuKernel(
        f"{fn}_gemvm{nt}",
        "linear_gemvm",
        ctx,
        [-(-p.n_out // outs)],
        warps * target.wave,
        0,
        outs,
        8 * nt,
    )


def batch_gemv_split(
    fn: str,
    p: LinearParams,
    target: GpuTarget,
    nodes: list[str],
    nt: int,
    warps: int = 4,
    mt: int = 2,
    unroll: int = 4,
    splits: int = 1,
    piece: int | None = None,
    xb: bool | None = None,
    xasync: bool | int = False,
) -> GpuKernel:
    """The batch GEMV with x shared by the block (linear_gemvs.hip.j2): `warps` warps of `mt`
    16-row weight tiles each walk the same k, a piece of `piece` 32-deep chunks of every row's x
    staged once in shared memory for all of them, `unroll` chunks of weights in flight per warp;
    K cut into `splits` runs (grid.y), the last block of a column adding the runs' partials in
    order; `xasync`: x in 2 (True) or 3 buffers filled by cp.async (float32 x kept as stored,
    rounded as read), so the next piece (pieces) land while this one is used; 3 buffers need
    one barrier a piece where 2 need two. A candidate beside batch_gemv ("base")."""
    piece = piece or unroll
    xb = bool(p.norm_eps) if xb is None else xb
    xasync = int(xasync) and max(2, int(xasync))  # True: 2 buffers
    if xasync not in (0, 2, 3):
        raise ValueError(f"batch_gemv_split: xasync {xasync} (2 or 3 buffers)")
    x_bytes = max(1, xasync) * piece * nt * 32 * (16 if xb or not xasync else 32)
    if piece % unroll or x_bytes + 16 > 48 * 1024:  # (+ the block's last-block flag)
        raise ValueError(
            f"batch_gemv_split: piece {piece} (a multiple of unroll {unroll}), x {x_bytes} bytes"
        )
    glu = p.epilogue == "glu"
    ctx = dict(
        nodes=nodes,
        wave=target.wave,
        n_out=p.n_out,
        nt=nt,
        mt=mt,
        warps=warps,
        unroll=unroll,
        splits=splits,
        piece=piece,
        xb=xb,
        xasync=xasync,
        params=GEMM.render(GPU_INDENT),
        xb_params=XB.render(0),
        **p.context(),
    )
    outs = (8 if glu else 16) * mt * warps
    return GpuKernel(
        f"{fn}_gemvs{nt}",
        "linear_gemvs",
        ctx,
        [-(-p.n_out // outs), splits],
        warps * target.wave,
        0,
        outs,
        8 * nt,
    )
