"""attention: RoPE (+ per-head q/k RMSNorm) + KV-cache write + causal softmax attention.

Anchors on hipc::CachedAttention. Absorbs its feeders (Reshape, a symmetric Clip of q, k
and v alike (OLMoE's clip_qkv), per-head RMSNorm, RoPE between the q/k/v projections and
the attention) and the Reshape that flattens its output.
The KV cache is a position-indexed state: the kernel writes the step's keys and values at
their positions and reads positions 0..p (or a sliding window).

CPU: one function, both phases (templates/cpu/attention.cpp.j2). GPU: prefill as two
kernels (rope_kv.hip.j2 writes the cache, attention.hip.j2 attends: keys one block writes
are read by others), decode as one split-K kernel (attention_decode.hip.j2).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from hipc.base.errors import HipcError
from hipc.base.launch_plan import KV_BLOCK
from hipc.compiler.ir import Constant, Graph, Node
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
from hipc.compiler.kernels.linear import MMA_TILES, SHORT_STEP, WGMMA_ARCHS, wgmma_bf16_reader

if TYPE_CHECKING:
    from hipc.compiler.codegen.bindings import Binder
    from hipc.compiler.codegen.hip import GpuProgramBuilder
    from hipc.compiler.passes.fuse import FusedGroup, Proposals
    from hipc.compiler.targets import GpuTarget

FEEDERS = {"Reshape", "Clip", "RMSNormalization", "RotaryEmbedding", "Split"}


@dataclass(frozen=True)
class AttentionParams(Params):
    NH: int  # query heads
    NKV: int  # key/value heads (grouped-query: NH / NKV queries share one)
    D: int  # head dim
    scale: float
    window: int  # sliding window (0: none)
    interleaved: bool  # RoPE pairs (2i, 2i+1) instead of (i, i + D/2)
    norm_eps: float  # per-head q/k RMSNorm's epsilon; 0.0: none
    softcap: float = 0.0  # scores -> cap * tanh(scores / cap) before the softmax (Gemma-2)
    clip: float = 0.0  # q, k, v clamped to [-clip, clip] as they are read (OLMoE); 0.0: none
    rot: int = 0  # RoPE on the first `rot` dims only (Qwen3-Next/3.5's partial rotary); 0: D
    # Qwen3-Next/3.5: q's rows hold each head's query then its output gate (head stride 2D),
    # and the output is multiplied by sigmoid(gate)
    out_gate: bool = False

    def tag(self) -> str:
        return f"h{self.NH}kv{self.NKV}d{self.D}"


CPU = Signature.parse("""
int T, const int32_t* pos, const int32_t* seq, const int32_t* blocks, const float* q, int ldq, const float* k, int ldk, const float* v,
int ldv, const float* q_norm_w, const float* k_norm_w, const float* cos_t,
const float* sin_t, float* k_cache, float* v_cache, float* out
""")


def rope_kv_signature(kv: str) -> Signature:
    return Signature.parse(f"""
const float* __restrict__ k, int ldk, const float* __restrict__ v, int ldv, const int* pos,
const int* seq, const int* blocks, const float* __restrict__ k_norm_w, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
{kv}* k_cache, {kv}* v_cache
""")


def prefill_signature(kv: str) -> Signature:
    return Signature.parse(f"""
const float* __restrict__ q, int ldq, const int* pos, const int* seq, const int* blocks,
const float* __restrict__ q_norm_w, const float* __restrict__ cos_t, const float* __restrict__ sin_t, const {kv}* __restrict__ k_cache,
const {kv}* __restrict__ v_cache, float* out
""")


def batch_signature(kv: str) -> Signature:
    """The batch step's split-context attention: the SIMT one's arguments, then its partial
    sums and a counter per row and KV head (attention_batch.hip.j2)."""
    return Signature.parse(f"""
const float* __restrict__ q, int ldq, const int* pos, const int* seq, const int* blocks,
const float* __restrict__ q_norm_w, const float* __restrict__ cos_t, const float* __restrict__ sin_t, const {kv}* __restrict__ k_cache,
const {kv}* __restrict__ v_cache, float* partial, unsigned* counters, float* out
""")


def flash_signature(kv: str) -> Signature:
    """The matrix-instruction prefill attention: the SIMT one's arguments and T (its grid
    covers query blocks, so rows past T are skipped in-kernel)."""
    return Signature.parse(f"""
const float* __restrict__ q, int ldq, int T, const int* pos, const int* seq, const int* blocks,
const float* __restrict__ q_norm_w,
const float* __restrict__ cos_t, const float* __restrict__ sin_t, const {kv}* __restrict__ k_cache,
const {kv}* __restrict__ v_cache, float* out
""")


def decode_signature(kv: str) -> Signature:
    return Signature.parse(f"""
const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v, const int* pos,
const int* seq, const int* blocks, const float* __restrict__ q_norm_w, const float* __restrict__ k_norm_w, const float* __restrict__ cos_t,
const float* __restrict__ sin_t, {kv}* k_cache, {kv}* v_cache, float* partial,
unsigned* counters, float* __restrict__ out
""")


class Attention(KernelKind):
    name = "attention"
    anchors = frozenset({"hipc::CachedAttention"})
    roles = frozenset({"attention:feeder", "attention:flatten", "attention:gate"})
    cpu_signature = CPU
    gpu_lacks = frozenset({"softcap"})

    def propose(self, graph: Graph, n: Node, p: Proposals) -> None:
        for v in n.inputs[:3]:
            for node, why in _feeder_chain(graph, v, p):
                p.propose(n, node, "attention:feeder", node.outputs[0], why, side="prologue")
        user = p.only_user(n.outputs[0])
        if user is not None and user.op == "Reshape":
            p.propose(n, user, "attention:flatten", n.outputs[0])
            gate = _output_gate(graph, user, p)
            if gate is not None:
                p.propose(n, gate[0], "attention:gate", user.outputs[0], brings=gate[1:])

    def select(self, g: Graph, grp: FusedGroup) -> SelectedKernel:
        att = grp.anchor
        q, k, v, pos, kc, vc = att.inputs
        q_src, q_norm, q_rope, q_clip = _chain(q, grp.prologue)
        k_src, k_norm, k_rope, k_clip = _chain(k, grp.prologue)
        v_src, v_norm, v_rope, v_clip = _chain(v, grp.prologue)
        if q_rope is None or k_rope is None or v_norm or v_rope:
            raise FusionError(f"attention kernel needs RoPE on q and k only ({grp.name})")
        if bool(q_norm) != bool(k_norm):
            raise FusionError(f"attention kernel needs q and k norms together ({grp.name})")
        clips = {_clip_bound(g, c) if c else None for c in (q_clip, k_clip, v_clip)}
        if len(clips) != 1:
            raise FusionError(f"attention kernel clips q, k and v alike or not at all ({grp.name})")
        clip = clips.pop() or 0.0
        _, NH, D = g.values[q].shape
        NKV = g.values[k].shape[1]
        out = grp.epilogue[0].outputs[0] if grp.epilogue else att.outputs[0]
        gate = grp.node_with_role("attention:gate")
        split = next((n for n in grp.prologue if n.op == "Split"), None)
        if (gate is None) != (split is None) or (split and g.values[q_src].shape[-1] != 2 * NH * D):
            raise FusionError(
                f"attention kernel reads a split q only as Qwen3-Next's [query | gate] per "
                f"head with its output gate ({grp.name})"
            )
        if gate is not None:
            out = gate.outputs[0]
        refs: dict[str, Any] = {
            "q": ("act", q_src),
            "k": ("act", k_src),
            "v": ("act", v_src),
            "q_norm_w": ("weight", q_norm.inputs[1]) if q_norm else ("none", None),
            "k_norm_w": ("weight", k_norm.inputs[1]) if k_norm else ("none", None),
            "cos": ("weight", q_rope.inputs[1]),
            "sin": ("weight", q_rope.inputs[2]),
            "pos": ("input", pos),
            "k_cache": ("state", kc),
            "v_cache": ("state", vc),
            "out": ("act", out),
        }
        params = AttentionParams(
            NH=int(NH),
            NKV=int(NKV),
            D=int(D),
            scale=float(att.attrs["scale"]),
            window=int(att.attrs.get("sliding_window") or 0),
            interleaved=bool(q_rope.attrs.get("interleaved")),
            norm_eps=float(q_norm.attrs["epsilon"]) if q_norm else 0.0,
            softcap=float(att.attrs.get("softcap") or 0.0),
            clip=clip,
            rot=_partial(q_rope, int(D)),
            out_gate=gate is not None,
        )
        return SelectedKernel(grp.name, grp.node_names, self, params, refs)

    # -- CPU --

    def cpu_kernel(self, k: SelectedKernel, activations: str) -> tuple[str, dict[str, Any]]:
        return "cpu/attention.cpp.j2", dict(params=CPU.render(CPU_INDENT))

    def cpu_call(self, k: SelectedKernel, b: Binder) -> dict[str, Any]:
        r = k.refs
        return {
            "T": b.int("T"),
            "pos": b.input("pos"),
            "seq": b.input("seq"),
            "blocks": b.input("blocks"),
            **{n: b.act(r[n][1]) for n in ("q", "k", "v", "out")},
            **{f"ld{n}": b.int(b.ld(r[n][1])) for n in ("q", "k", "v")},
            **{n: b.ref(r[n]) for n in ("q_norm_w", "k_norm_w", "k_cache", "v_cache")},
            "cos_t": b.ref(r["cos"]),
            "sin_t": b.ref(r["sin"]),
        }

    # -- GPU --

    def gpu_scratch(self, k: SelectedKernel, g: GpuProgramBuilder) -> dict[str, int]:
        # the decode kernel's per-block partials (max, sum, acc[D]), then a counter per head
        p: AttentionParams = k.params
        dk = decode_attention(k.fn, p, g.target, k.nodes, g.max_ctx, g.kv_storage)
        sizes = {"attention": 4 * p.NH * dk.grid[1] * (p.D + 2) + 4 * p.NH}
        # the split batch attention's partials, then a counter per row and KV head
        forms = batch_attention_forms(k.fn, p, g, k.nodes)
        if any(s > 1 for _, s, _ in forms):
            sizes["attention_batch"] = batch_scratch(p, forms) + 4 * g.max_tokens * p.NKV
        return sizes

    def bf16_reader(self, k: SelectedKernel, b: Binder, g: GpuProgramBuilder):
        """The o projection, where it reads this attention's output in bf16 on the sm_90a GEMM
        (linear.wgmma_bf16_reader): the prefill and batch steps' attention kernels then write it
        in bf16, as its _xb pass would have rounded it (linear.py's _handoffs asks this too)."""
        p: AttentionParams = k.params
        return wgmma_bf16_reader(k, k.refs["out"], p.NH * p.D, b, g)

    def gpu(self, k: SelectedKernel, b: Binder, g: GpuProgramBuilder) -> None:
        p: AttentionParams = k.params
        r = k.refs
        D, wave = p.D, g.target.wave
        kv_ctx = kv_context(g.kv_storage, g.max_ctx)
        kv = kv_ctx["kv_type"]
        rope_sig, attn_sig = rope_kv_signature(kv), prefill_signature(kv)
        block = max(D // 2, wave)
        rope = g.kernel(
            GpuKernel(f"{k.fn}_rope_kv", "rope_kv", dict(nodes=k.nodes, block=block,
                      params=rope_sig.render(GPU_INDENT), **kv_ctx, **p.context()), [], block)
        )  # fmt: skip
        # prefill and batch steps write the output in bf16 where the o projection's sm_90a GEMM
        # loads it by TMA (its _xb pass then goes); decode steps keep float32 for the GEMV
        ob = self.bf16_reader(k, b, g) is not None
        fn = k.fn + ("_ob" if ob else "")
        # the flash kernel: bf16 operands like the GEMMs' (--prefill-precision split: the float32
        # SIMT kernel), a form per step size where the target's differ (FLASH_BY_STEP)
        short, long = FLASH_BY_STEP.get(g.target.family, ({}, {}))
        forms = [(short, None)]
        if long != short and g.max_tokens > SHORT_STEP:
            forms = [(short, (1, SHORT_STEP)), (long, (SHORT_STEP + 1, g.max_tokens))]
        flash = [
            (flash_attention(k.fn + "".join(f"_{x}{v}" for x, v in sorted(f.items()))
                             + ("_ob" if ob else ""), p, g.target, k.nodes, g.kv_storage,
                             g.max_ctx, out_bf16=ob, **f), tokens)
            for f, tokens in forms
        ]  # fmt: skip
        fk = flash[0][0] if g.prefill_precision == "bf16" else None
        # the SIMT kernel (one block per row and head) is also the batch step's: there every
        # row is another sequence's, which the flash kernel's query blocks would split into
        # one pass over the keys per row
        attn = g.kernel(
            GpuKernel(f"{fn}_attn", "attention", dict(nodes=k.nodes, waves=ATTN_WAVES,
                      params=attn_sig.render(GPU_INDENT), out_bf16=ob, **kv_ctx, **p.context()),
                      [], 0)
        )  # fmt: skip
        dk = decode_attention(k.fn, p, g.target, k.nodes, g.max_ctx, g.kv_storage)
        if dk.template == "attention_decode" and DECODE_WAVES * wave < D // 2:
            raise FusionError(f"{k.group}: head dim {D} is too wide for the decode block")
        attn_decode = g.kernel(dk)
        splits = dk.grid[1]
        partial_at = g.scratch("attention")
        counters_at = partial_at + 4 * p.NH * splits * (D + 2)
        shared = {
            "pos": b.input("pos"),
            "seq": b.input("seq"),
            "blocks": b.input("blocks"),
            "cos_t": b.ref(r["cos"]),
            "sin_t": b.ref(r["sin"]),
            "k_cache": b.ref(r["k_cache"]),
            "v_cache": b.ref(r["v_cache"]),
        }
        q, kk, v = b.act(r["q"][1]), b.act(r["k"][1]), b.act(r["v"][1])
        rope_args = {**shared, "k": kk, "ldk": b.int(b.ld(r["k"][1])), "v": v,
                     "ldv": b.int(b.ld(r["v"][1])), "k_norm_w": b.ref(r["k_norm_w"])}  # fmt: skip
        g.launch("prefill", k.group, rope, ["T", p.NKV], [block], rope_sig, rope_args,
                 batch=False)  # fmt: skip
        # batch steps: both kernels wait in-kernel for the one before (programmatic launch)
        g.launch("batch", k.group, rope, ["T", p.NKV], [block], rope_sig, rope_args, overlap=True)
        q_args = {**shared, "q": q, "ldq": b.int(b.ld(r["q"][1])),
                  "q_norm_w": b.ref(r["q_norm_w"]), "out": b.act(r["out"][1])}  # fmt: skip
        if fk is None:
            g.launch("prefill", k.group, attn, ["T", p.NH], [ATTN_WAVES * wave], attn_sig, q_args,
                     batch=False)  # fmt: skip
        else:
            for fk, tokens in flash:
                g.launch("prefill", k.group, g.kernel(fk), [f"cdiv(T,{fk.ctx['bq']})", p.NH],
                         [fk.threads], flash_signature(kv), {**q_args, "T": b.int("T")},
                         shared=fk.shared, tokens=tokens, batch=False)  # fmt: skip
        # batch steps: the split attention from BATCH_SPLIT_ROWS rows; below that a block per row
        # and head, or from BATCH_GROUP_ROWS per row and KV head (its query heads together)
        split = batch_attention_forms(fn, p, g, k.nodes, ob)
        if split:
            if any(s > 1 for _, s, _ in split):
                at = g.scratch("attention_batch")
                counters = b.scratch(at + batch_scratch(p, split))
            else:
                at, counters = 0, b.scratch(0)  # (a kernel of one split never touches them)
            for bk, s, tokens in split:
                g.launch("batch", k.group, g.kernel(bk), ["T", p.NKV * s], [bk.threads],
                         batch_signature(kv), {**q_args, "partial": b.scratch(at),
                         "counters": counters}, overlap=True, tokens=tokens)  # fmt: skip
        first = split[0][2][0] if split else g.max_tokens + 1
        G = batch_group(p) if g.batch_attn_group else 1
        grouped_from = min(BATCH_GROUP_ROWS, first) if G > 1 else first
        if grouped_from > 1:
            full = grouped_from > g.max_tokens  # every step: no token range
            g.launch("batch", k.group, attn, ["T", p.NH], [ATTN_WAVES * wave], attn_sig, q_args,
                     overlap=True, tokens=None if full else (1, grouped_from - 1))  # fmt: skip
        if grouped_from < first:
            grouped = g.kernel(
                GpuKernel(f"{fn}_attn_g{G}", "attention", dict(nodes=k.nodes, waves=ATTN_WAVES,
                          group=G, params=attn_sig.render(GPU_INDENT), out_bf16=ob, **kv_ctx,
                          **p.context()), [], 0)
            )  # fmt: skip
            g.launch("batch", k.group, grouped, ["T", p.NH // G], [ATTN_WAVES * wave], attn_sig,
                     q_args, overlap=True, tokens=(grouped_from, first - 1))  # fmt: skip
        g.launch(
            "decode",
            k.group,
            attn_decode,
            dk.grid,
            [dk.threads],
            decode_signature(kv),
            {
                **shared,
                "q": q,
                "k": kk,
                "v": v,
                "q_norm_w": b.ref(r["q_norm_w"]),
                "k_norm_w": b.ref(r["k_norm_w"]),
                "partial": b.scratch(partial_at),
                "counters": b.scratch(counters_at),
                "out": b.act(r["out"][1]),
            },
            overlap=True,
            shared=dk.shared,
        )


def _feeder_chain(graph: Graph, value: str, p: Proposals) -> list[tuple[Node, str | None]]:
    """Nodes between a Split view (or any producer) and an attention input."""
    chain: list[tuple[Node, str | None]] = []
    node = graph.producer(value)
    while node is not None and node.op in FEEDERS and not _is_projection(graph, value):
        why = (
            None
            if p.only_user(node.outputs[0]) is not None
            else f"{node.outputs[0]} has several readers"
        )
        # OLMoE's q/k norm spans the whole projection ([T, heads * head_dim], scale 1-D too)
        if node.op == "RMSNormalization" and (
            len(graph.values[node.inputs[1]].shape) != 1
            or len(graph.values[node.inputs[0]].shape) != 3
        ):
            why = "only per-head norms (scale [head_dim]) fuse into attention"
        if node.op == "Split":
            # only a split of q into [query | gate] per head: the gate goes to the epilogue
            why = None if node.outputs[0] == value else "not the query half of a [query | gate]"
        chain.append((node, why))
        value = node.inputs[0]
        node = graph.producer(value)
    return chain


def _partial(rope: Node, D: int) -> int:
    rot = int(rope.attrs.get("rotary_embedding_dim") or D)
    return 0 if rot == D else rot


def _output_gate(graph: Graph, flat: Node, p: Proposals) -> list[Node] | None:
    """Mul(flat, Sigmoid(Reshape(gate))) with the gate the second output of a Split that
    feeds q (graphs/blocks.py's attn_output_gate): [the Mul, the Sigmoid, the Reshape]."""
    mul = p.only_user(flat.outputs[0])
    if mul is None or mul.op != "Mul":
        return None
    other = next((i for i in mul.inputs if i != flat.outputs[0]), None)
    sig = graph.producer(other) if other else None
    reshape = graph.producer(sig.inputs[0]) if sig is not None and sig.op == "Sigmoid" else None
    split = graph.producer(reshape.inputs[0]) if reshape and reshape.op == "Reshape" else None
    if split is None or split.op != "Split" or reshape.inputs[0] != split.outputs[-1]:
        return None
    return [mul, sig, reshape]


def _is_projection(graph: Graph, value: str) -> bool:
    """A Linear's output or a column view of one (a Split after merged projections)."""
    p = graph.producer(value)
    if p is not None and p.op == "Split":
        p = graph.producer(p.inputs[0])
    return p is not None and p.op == "hipc::Linear"


def _chain(value: str, prologue: list[Node]) -> tuple[str, Node | None, Node | None, Node | None]:
    """Walk an attention input back through Reshape/Clip/RMSNorm/RoPE to its source view:
    (source, norm, rope, clip), the kernel applying clip, norm, RoPE in that order."""
    mine = {n.outputs[0]: n for n in prologue}
    rope = norm = clip = None
    while value in mine:
        n = mine[value]
        if n.op in ("RotaryEmbedding", "RMSNormalization") and clip is not None:
            raise FusionError(
                f"attention kernel clips before the q/k norm and RoPE, not after ({clip.name})"
            )
        if n.op == "RotaryEmbedding":
            rope = n
        elif n.op == "RMSNormalization":
            if rope is None:
                raise FusionError(
                    f"attention kernel applies the q/k norm before RoPE, not after ({n.name})"
                )
            norm = n
        elif n.op == "Clip":
            if clip is not None:
                raise FusionError(f"attention kernel clips once ({n.name})")
            clip = n
        value = n.inputs[0]
    return value, norm, rope, clip


def _clip_bound(g: Graph, clip: Node) -> float:
    """c of a Clip to [-c, c] with constant bounds (OLMoE's clip_qkv)."""
    bounds = [g.initializers.get(i) for i in clip.inputs[1:3]]
    if len(bounds) != 2 or not all(isinstance(b, Constant) for b in bounds):
        raise FusionError(f"attention kernel clips to constant bounds only ({clip.name})")
    lo, hi = (float(np.asarray(b.array).reshape(())) for b in bounds)
    if lo != -hi or hi <= 0:
        raise FusionError(f"attention kernel clips to [-c, c] only ({clip.name}: [{lo}, {hi}])")
    return hi


KIND = Attention()


# -- GPU geometry --------------------------------------------------------------------------

ATTN_WAVES = 8
# The batch step's SIMT attention takes a KV head's query heads together (each key and value row
# read once for them) up to this many, within 40 KiB of its per-wave partials in shared memory
BATCH_GROUP_MAX = 8
# ... in steps of this many rows and more. On the H200 (2-layer 8B, mid call) the one-head kernel
# took 20 us a layer at 8 rows (256 blocks) and 37 at 32 (1,024 blocks); grouping makes a
# quarter of the blocks, each reading its rows once for the group: kept for steps whose block
# count still covers the GPU. Timed alone in session 10 (battn: 8B heads, 64 rows of 256
# positions 43.9 us, 79.8 one head a block); the split kernel below now takes every batch step
# from BATCH_SPLIT_ROWS rows, these where it has no kernel or HIPC_BATCH_ATTN_SPLIT=0
BATCH_GROUP_ROWS = 16


def batch_group(p: AttentionParams) -> int:
    """Query heads per block of the batch step's attention: the KV head's group (NH / NKV) when
    it fits, else 1 (one block per head, as in prefill)."""
    G = p.NH // p.NKV
    fits = ATTN_WAVES * G * p.D * 4 + G * p.D * 4 <= 40 << 10
    if G < 2 or G > BATCH_GROUP_MAX or not fits or p.D % 8:
        return 1
    return G


# The batch step's split-context attention (attention_batch.hip.j2): a block per row, KV head and
# split of the context, each wave's keys read a row per D / 8 lanes (16-byte loads) with every
# load of a pass in flight at once, the group's query heads sharing each row. It serves batch
# steps from BATCH_SPLIT_ROWS rows (the kernels above below that), in BATCH_WAVES waves a block
# and about BATCH_BLOCKS blocks a layer (splits of a power of two up to BATCH_SPLITS_MAX; a row
# whose context has fewer tiles uses fewer). Measured on the H200 (docs/benchmarks/gpu-h200.md,
# "Session 10, battn": bench_decode_attention.py --batch, 8B heads, us per launch at contexts
# 256 / 1024 / 4096): 256 blocks was the best splits count or near it at every row count
# (4 rows: 10.5 / 17.9 / 43.6 against the one-head kernel's 17.5 / 62.8 / 240; 16 rows, 2
# splits: 17.0 / 43.0 / 141 against the grouped kernel's 16.0 / 53.4 / 196; 32 and 64 rows, 1
# split: 22.7 / 72.3 / 266 and 42.6 / 139 / 525 against 23.4 / 76.9 / 269 and 43.9 / 145 / 521),
# while 1,024 (2 splits at 64 rows: 56.5 us at 256) paid each block's fixed cost twice. Taken at
# every row count: slower only at 16 rows of 256 positions (6%).
BATCH_SPLIT_ROWS = 1
BATCH_WAVES = 4
BATCH_BLOCKS = 256
BATCH_SPLITS_MAX = 16
# How its waves load keys and values (batch_attention's unroll, pipe, ring), by target family
# and shape (query heads per KV head, head dim): from a step's rows on, the form measured best
# there; families and shapes not listed, and fewer rows than the first listed, take session
# 10's form (a pass's 8 loads a lane, then its math). Measured on the H200 (gpu-h200.md,
# "Session 11, battn2": bench_decode_attention.py --batch, us per launch at contexts 256 / 1024
# / 4096, the form against session 10's, each at batch_splits' splits): 8B heads (4 x 128) at 64
# rows a ring of 2 passes of 4 loads 28.1 / 90.4 / 342 against 42.0 / 140 / 525 (3.13 TB/s of
# K+V at 4,096, the copy rate 4.23), at 32 rows 18.1 / 55.1 / 202 against 22.2 / 72.0 / 267 (two
# splits were faster at 4,096 only: 183); at 16 rows a ring of 4 passes of 2 loads 16.2 / 38.3
# / 124 against 17.0 / 43.0 / 141; at 4 rows none better by over 1%; at 1 row the pipelined 4
# loads 8.6 / 13.0 / 23.5 against 9.4 / 13.6 / 25.8 (the ring slower at 256). Qwen3.5's full
# attention (8 x 256; no room for a ring beside its shared arrays): the pipelined 2 loads at 1,
# 16 and 64 rows, 1.00-1.23x (64 rows: 36.8 / 90.7 / 302 against 40.5 / 109 / 372).
BATCH_LOADS: dict[str, dict[tuple[int, int], tuple[tuple[int, dict[str, Any]], ...]]] = {
    "nvidia": {
        (4, 128): (
            (1, dict(unroll=4, pipe=True)),
            (4, {}),
            (16, dict(unroll=2, ring=4)),
            (32, dict(unroll=4, ring=2)),
        ),
        (8, 256): ((1, dict(unroll=2, pipe=True)),),
    }
}


def batch_loads(p: AttentionParams, family: str, rows: int) -> dict[str, Any]:
    """BATCH_LOADS' form for a step of `rows` rows of shape p on a target of `family`."""
    form: dict[str, Any] = {}
    for first, loads in BATCH_LOADS.get(family, {}).get((p.NH // p.NKV, p.D), ()):
        if rows >= first:
            form = loads
    return form


def batch_attention(
    fn: str,
    p: AttentionParams,
    target: GpuTarget,
    nodes: list[str],
    max_ctx: int,
    kv_storage: str,
    splits: int,
    out_bf16: bool = False,
    waves: int = BATCH_WAVES,
    unroll: int | None = None,
    pipe: bool = False,
    min_blocks: int = 0,
    q_shared: bool = False,
    ring: int = 0,
) -> GpuKernel | None:
    """The split-context batch attention with `splits` blocks per row and KV head (its grid:
    (T, NKV x splits)), `waves` waves a block and `unroll` loads of keys and values in flight
    per lane, or None where its lanes or shared arrays do not fit the shape (head dims not a
    multiple of 8, rows wider than a wave of 8-dim lanes, over 48 KiB of shared arrays)."""
    G = p.NH // p.NKV
    lanes = p.D // 8
    if p.NH % p.NKV or p.D % 8 or lanes > target.wave or waves * target.wave < p.D // 2:
        return None
    # loads in flight per lane and pass, keys and values each: fewer for big groups, whose q,
    # scores and sums take more registers
    unroll = unroll or max(2, min(8, 32 // G))
    ring = ring if kv_storage == "bfloat16" else 0  # (the ring's slots: 16 bytes a load)
    shared = 4 * (G * p.D + 32 + waves * G * (p.D + 2) + 2 * G * splits)
    shared += ring * 2 * unroll * waves * target.wave * 16
    if shared > STATIC_SHARED:
        return None
    kv_ctx = kv_context(kv_storage, max_ctx)
    ctx = dict(nodes=nodes, wave=target.wave, waves=waves, splits=splits, unroll=unroll,
               keys=unroll * target.wave // lanes, out_bf16=out_bf16, pipe=pipe,
               min_blocks=min_blocks, q_shared=(pipe or ring > 0) and q_shared,
               ring=ring, params=batch_signature(kv_ctx["kv_type"]).render(GPU_INDENT), **kv_ctx,
               **p.context())  # fmt: skip
    return GpuKernel(f"{fn}_battn_s{splits}", "attention_batch", ctx, [], waves * target.wave)


def batch_splits(rows: int, NKV: int, blocks: int = BATCH_BLOCKS) -> int:
    """Blocks per row and KV head of the split batch attention at `rows` rows: the least power of
    two giving `blocks` in all, at most BATCH_SPLITS_MAX."""
    s = 1
    while s < BATCH_SPLITS_MAX and rows * NKV * s < blocks:
        s *= 2
    return s


def batch_attention_forms(
    fn: str, p: AttentionParams, g: GpuProgramBuilder, nodes: list[str], out_bf16: bool = False
) -> list[tuple[GpuKernel, int, tuple[int, int]]]:
    """The split batch attention's kernels, (kernel, splits, (first, last) rows) for steps of
    BATCH_SPLIT_ROWS rows and more; none where the shape has no such kernel or
    HIPC_BATCH_ATTN_SPLIT=0 asked for the one-block-per-row kernels (benchmarks)."""
    if not g.batch_attn_split:
        return []
    forms: list[tuple[GpuKernel, int, tuple[int, int]]] = []
    last: tuple[int, dict[str, Any]] | None = None
    for T in range(BATCH_SPLIT_ROWS, g.max_tokens + 1):
        s = batch_splits(T, p.NKV)
        loads = batch_loads(p, g.target.family, T) if g.batch_attn_loads else {}
        if loads.get("ring") and g.kv_storage != "bfloat16":
            loads = {}  # (the ring holds 16-byte loads of bf16: a float32 cache's form as before)
        if forms and last == (s, loads):
            forms[-1] = (forms[-1][0], s, (forms[-1][2][0], T))
            continue
        last = (s, loads)
        name = fn + "".join(f"_{k[0]}{int(v)}" for k, v in sorted(loads.items()))
        k = batch_attention(name, p, g.target, nodes, g.max_ctx, g.kv_storage, s, out_bf16,
                            **loads)  # fmt: skip
        if k is None and loads:  # (a ring too big for the shape's shared arrays)
            k = batch_attention(fn, p, g.target, nodes, g.max_ctx, g.kv_storage, s, out_bf16)
        if k is None:
            return []
        forms.append((k, s, (T, T)))
    return forms


def batch_scratch(p: AttentionParams, forms: list[tuple[GpuKernel, int, tuple[int, int]]]) -> int:
    """Bytes of the split batch attention's partials (a row's (m, l, acc[D]) per head and split,
    for the largest step that splits); its counters (one per row and KV head) follow."""
    return max((4 * hi * p.NH * s * (p.D + 2) for _, s, (_, hi) in forms if s > 1), default=0)


DECODE_WAVES = 4  # decode attention: a chunk of 4 waves x one 32/64-key tile each per block
DECODE_BLOCKS = 256  # decode attention blocks per layer (heads x splits): ~2 per SM of an H200
KV_TYPES = {"float32": ("float", "f32"), "bfloat16": ("uint16_t", "bf16")}


def kv_context(kv_storage: str, max_ctx: int) -> dict[str, Any]:
    """The attention templates' KV element type, the suffix of its prelude helpers, and the
    paging: positions per block and block-table entries per sequence (the table's stride)."""
    kv_type, kv_suffix = KV_TYPES[kv_storage]
    return dict(
        kv_type=kv_type, kv_suffix=kv_suffix, kv_block=KV_BLOCK, kv_table=-(-max_ctx // KV_BLOCK)
    )


FLASH_WAVES = 4  # the NVIDIA flash kernel's warps per block (measured: see flash_attention)
# flash_attention's form arguments per target family for steps of up to SHORT_STEP tokens and for
# longer ones (docs/benchmarks/gpu-prefill.md, bench_gpu_flash.py on the H200)
FLASH_BY_STEP: dict[str, tuple[dict[str, int], dict[str, int]]] = {"nvidia": ({}, {})}
FLASH_FORMS = ("mma", "generic")


WIDE_FLASH_ARCHS = frozenset({"sm_80", "sm_90"})  # up to 163 / 227 KiB of shared memory a block


def flash_attention(
    fn: str,
    p: AttentionParams,
    target: GpuTarget,
    nodes: list[str],
    kv_storage: str,
    max_ctx: int,
    form: str | None = None,
    waves: int = FLASH_WAVES,
    min_blocks: int | None = None,
    out_bf16: bool = False,
    tiles: int = 1,
) -> GpuKernel | None:
    """The matrix-instruction prefill attention, or None for the SIMT one: on the target's
    prefill GEMM instruction (MMA_TILES: mma.sync, WMMA, MFMA), head dims of whole k steps up
    to 128 (the accumulators of 16 rows x D stay in registers), and up to 256 on
    WIDE_FLASH_ARCHS in the generic form (254 registers a thread at 256 on sm_90, no spills).
    Its query rows per block are `ctx["bq"]` (the grid's x is cdiv(T, bq)). `out_bf16` (sm_90a
    only): the output in bf16, for the o projection's GEMM (Attention.bf16_reader).

    `form`: "mma" (NVIDIA's default, templates/hip/attention_flash_mma.hip.j2): FA2-style, `waves`
    warps of `tiles` x 16 rows (1: q's fragments in registers; 2: q read from shared memory per
    key block, each K/V fragment used twice), K/V double-buffered (cp.async from a bfloat16
    cache), P kept in registers, masks only on diagonal blocks; "generic" (every other target's,
    templates/hip/attention_flash.hip.j2, which NVIDIA runs too when asked: the AMD forms'
    structure on real hardware, and the "before" of bench_gpu_flash.py): 4 waves, K/V
    loaded then used, P through shared memory."""
    tile = MMA_TILES.get(target.arch)
    if tile is None or p.D % 16 or p.D > 256:
        return None
    if p.D > 128:
        # wide heads (Qwen3.5's 256): the generic form with q read from shared memory; its
        # K/V and q tiles take ~110 KiB, which only the big-shared-memory archs hold
        if target.arch not in WIDE_FLASH_ARCHS:
            return None
        form, waves, tiles, min_blocks = "generic", FLASH_WAVES, 1, None
    form = form or ("mma" if target.family == "nvidia" else "generic")
    if form not in FLASH_FORMS or (form == "mma" and target.family != "nvidia"):
        raise ValueError(f"flash form {form!r} on {target.arch}")
    if out_bf16 and target.arch not in WGMMA_ARCHS:  # only the sm_90a GEMM reads bf16 activations
        raise ValueError(f"flash on {target.arch} writes float32 only")
    kv_ctx = kv_context(kv_storage, max_ctx)
    base = dict(nodes=nodes, params=flash_signature(kv_ctx["kv_type"]).render(GPU_INDENT),
                **kv_ctx, **p.context())  # fmt: skip
    if form == "mma":
        # two K/V buffers of 64 rows (padded by 8: ldmatrix rows on distinct banks), q staged
        # in the second (one m tile a warp) or after them; registers for `min_blocks` blocks
        # per SM (default 2 of 4 warps)
        min_blocks = min_blocks or max(1, 8 // waves)
        bq = 16 * tiles * waves
        if tiles not in (1, 2) or bq > 128:
            raise ValueError(f"flash: {waves} warps of {tiles} m tiles")
        ctx = dict(base, bq=bq, waves=waves, rw=tiles, q_regs=tiles == 1, min_blocks=min_blocks,
                   out_bf16=out_bf16, cp_async=kv_storage == "bfloat16")  # fmt: skip
        shared = (4 * 64 + (0 if tiles == 1 else bq)) * (p.D + 8) * 2
        return GpuKernel(f"{fn}_flash", "attention_flash_mma", ctx, [], 32 * waves, shared)
    # q's fragments stay in registers up to 32 a lane; RDNA3's take 8 each, and at D = 128 its
    # kernel then spilled past 256 VGPRs (clang-19), so q is read from shared memory there
    q_regs = p.D // 16 * tile.a_regs <= 32
    ctx = dict(base, bq=64, instruction=tile.instruction, wave=target.wave, q_regs=q_regs,
               out_bf16=out_bf16)  # fmt: skip
    # q (then the 4 waves' 16 x 64 P tiles, the larger below D = 64; both where q stays in shared
    # memory), and K and V in bf16, rows padded: at most 52 KiB (D = 128), within AMD's 64 KiB
    qp = 64 * (p.D + 8), 4 * 16 * (64 + 8)
    qp = max(qp) if q_regs else sum(qp)
    shared = (qp + 2 * 64 * (p.D + 8)) * 2
    return GpuKernel(f"{fn}_flash", "attention_flash", ctx, [], 4 * target.wave, shared)


def decode_attention(
    fn: str,
    p: AttentionParams,
    target: GpuTarget,
    nodes: list[str],
    max_ctx: int,
    kv_storage: str,
    waves: int = DECODE_WAVES,
    blocks: int | None = None,
    form: str | None = None,
) -> GpuKernel:
    """The decode attention of one layer: the grouped kernels (attention_decode_gqa.hip.j2,
    attention_decode_tile.hip.j2) where their tiles fit in shared memory, else the per-head
    one (attention_decode.hip.j2). `form` ("gqa" / "head" / "tile[:option...]", see
    decode_attention_tile) overrides decode_form's; `waves` and `blocks` override
    DECODE_WAVES and DECODE_BLOCKS (bench_gpu_gemv.py times several)."""
    form = form or decode_form(target)
    if form == "gqa":
        k = decode_attention_gqa(
            fn, p, target, nodes, max_ctx, kv_storage, waves, blocks or DECODE_BLOCKS
        )
        if k is not None:
            return k
    if form.split(":")[0] == "tile":
        k = decode_attention_tile(
            fn, p, target, nodes, max_ctx, kv_storage, form, blocks or TILE_BLOCKS
        )
        if k is not None:
            return k
    wave = target.wave
    splits = decode_splits(p.NH, max_ctx, wave, waves, blocks or DECODE_BLOCKS)
    kv_ctx = kv_context(kv_storage, max_ctx)
    ctx = dict(
        nodes=nodes,
        wave=wave,
        waves=waves,
        splits=splits,
        params=decode_signature(kv_ctx["kv_type"]).render(GPU_INDENT),
        **kv_ctx,
        **p.context(),
    )
    return GpuKernel(f"{fn}_decode", "attention_decode", ctx, [p.NH, splits], waves * wave)


def decode_splits(
    heads: int, max_ctx: int, wave: int, waves: int = DECODE_WAVES, blocks: int = DECODE_BLOCKS
) -> int:
    """Blocks per head of the decode attention: ~`blocks` in all, never more than the
    context has chunks. Fixed at compile time (the decode graph is captured once); each
    block loops over every SPLITS-th chunk, so any context length runs."""
    chunks = -(-max_ctx // (waves * wave))
    return max(1, min(chunks, -(-blocks // heads)))


# decode attention: "head" (a block per query head and split), "tile" (a block per KV head and
# 64-key tile, the tile loaded before the PDL wait) or "gqa" (a block per KV head and split).
# "tile" where kernels overlap their predecessor (NVIDIA sm_90+: programmatic dependent launch),
# so its first tile is read while the q/k/v projection finishes. On the H200 (session 13,
# docs/benchmarks/gpu-h200.md; each form compiled, the engine's forward() loop) the 8B Q4_0
# decoded 606.1 tok/s from position 0 (tg128) and 580.1 at 512 positions with it (256 blocks)
# where "head" did 585.2 and 518.5; the real SmolLM2 Q4_1's tensors 2,280 / 2,187 against
# 2,321 / 2,077 (generation / engine loop at 512). Elsewhere (AMD, sm_80/89: no overlap, the
# tile is read after the wait like any other load; not measured) "head". DECODE_FORM, when set,
# overrides both (benchmarks compile each form: bench_decode_latency.py --forms), and so does
# HIPC_DECODE_FORM at compile time (bench_gpu_variants.py times forms inside the 8B's graph).
DECODE_FORM: str | None = None
FORM_ENV = "HIPC_DECODE_FORM"


def decode_form(target: GpuTarget) -> str:
    """The decode attention form a target gets by default (DECODE_FORM or HIPC_DECODE_FORM
    overrides it)."""
    return DECODE_FORM or os.environ.get(FORM_ENV) or ("tile" if target.sm >= 90 else "head")


DECODE_TILE = 32  # keys per tile of the grouped decode kernel (16 where a row is over 256 bytes)
# blocks per KV head at most: the last one merges every block's partial sums
DECODE_GQA_SPLITS = 32
STATIC_SHARED = 48 * 1024  # shared memory a kernel may declare statically (NVIDIA's limit)


def decode_attention_gqa(
    fn: str,
    p: AttentionParams,
    target: GpuTarget,
    nodes: list[str],
    max_ctx: int,
    kv_storage: str,
    waves: int = DECODE_WAVES,
    blocks: int = DECODE_BLOCKS,
) -> GpuKernel | None:
    """One block per (KV head, split) serving the group's NH / NKV query heads, so a cached
    row is read once per step, not once per query head; its first tile is read before the
    kernel waits on the projection. None where its shared arrays would not fit."""
    kv_ctx = kv_context(kv_storage, max_ctx)
    esize = 2 if kv_storage == "bfloat16" else 4
    if p.D % 2 or p.NH % p.NKV:
        return None
    G, threads = p.NH // p.NKV, waves * target.wave
    tk = DECODE_TILE if p.D * esize <= 256 else DECODE_TILE // 2
    splits = max(1, min(-(-max_ctx // tk), -(-blocks // p.NKV), DECODE_GQA_SPLITS))
    rw = p.D * esize // 4
    shared = 4 * (
        tk * (rw | 1) + tk * rw  # the key tile (rows padded to an odd stride), the value tile
        + G * p.D + 2 * p.D + G * tk + G + p.D  # q, new k and v, scores, rescales, cos/sin
        + 2 * G * splits + 2 * G  # the merge's (m, l) per block and head, (m, l) per head
    )  # fmt: skip
    if shared > STATIC_SHARED or tk > target.wave:
        return None
    ctx = dict(
        nodes=nodes,
        wave=target.wave,
        threads=threads,
        tk=tk,
        splits=splits,
        params=decode_signature(kv_ctx["kv_type"]).render(GPU_INDENT),
        **kv_ctx,
        **p.context(),
    )
    return GpuKernel(f"{fn}_decode", "attention_decode_gqa", ctx, [p.NKV, splits], threads)


# the tile form's geometry (decode_attention_tile; "tile:k32:w4:l1:m8:b128:t2:s2:h1:v4:r1" overrides each)
TILE_KEYS = 64  # keys per tile (a block's whole share up to TILE_KEYS x splits positions)
TILE_WAVES = 8
# lanes per (head, key) score (0: as many as fill the block with the tile's heads x keys, up to a
# wave). With the whole group on a block that is one, measured faster than 4 on the H200 at
# every position, 8B and SmolLM2 heads (no shuffles; a wave's q reads one address).
TILE_LANES = 0
# blocks per layer (KV heads x splits; fewer run where the context is short): 256 gives the 8B's
# 8 KV heads a block per tile up to 2,048 positions. In the engine's loop (session 13) 256 decoded
# the 8B Q4_0 at 606.1 / 580.1 tok/s (tg128 / 512 positions), 128 at 606.5 / 574.7 and 512 at
# 589.2 / 563.2 (605.6 / 575.4 in another call): the blocks past the context's end cost at short
# context. Alone, at 2,048 positions, 512 took 11.2 us a layer and 256 12.7 (one block, two tiles).
TILE_BLOCKS = 256
TILE_MIN_BLOCKS = 2  # blocks per SM the registers are capped for
TILE_PER_BLOCK = 1  # tiles a block takes before the context is split over more blocks
# tiles one block takes alone before the context is split at all: below 128 positions no merge
# (its partials out, a counter, the last block reading them back: 3.1 us of the 8B's attention
# at 100 positions on an H100, trace_gpu_decode.py) but a second tile multiplied after the
# first. In the 8B Q4_0 decode graph (bench_gpu_variants.py, H100, session 22 call 3,
# alternating rounds) 518.3 / 521.3 tok/s at tg128 against 514.4 / 517.8 with a block a tile,
# 487.1 / 491.5 at 512 positions against 489.9 / 492.0 (the same kernels there: 9 tiles split).
TILE_SINGLE = 2
# query heads a block (0: the KV head's whole group, its tiles read once a step). One (hN: N of
# the group): the group's blocks each load the same tiles before the wait (from L2 after the
# first), a quarter of the 8B's shared-memory reads, the value sums' keys split over
# TILE_VALUE_GROUPS groups of threads and the scores over 4 lanes a key; but with 256 blocks a
# head's context has a quarter of the splits, so past 8 tiles its blocks take tiles one after
# another. The 8B Q4_0 decode graph (bench_gpu_variants.py, alternating rounds, tok/s at tg128 /
# after the context): on an H200 (session 25 calls 3-4) one head a block 646.9 / 630.6 and
# 645.7 / 635.8 at tg128 where the whole group did 623.7 / 633.6 and 636.4 / 636.3 (+1.1%), but
# 504.7 / 492.1 after 2,048 positions against 527.7 / 537.7 (-6.4%); on H100s 545.2 / 507.4
# against 538.3 / 505.2 at tg128 / 512 (call 2, means of 3 rounds), 534.2 / 435.3 against
# 539.6 / 466.1 at tg128 / 2,048 (call 1), 533.3 / 495.8 against 514.5 / 480.3 at tg128 / 512
# (session 24, the attention at 32 positions 5.14 us against 6.85). The whole group by
# default: a percent at short context against 6.4% at 2,048. (One kernel taking either form at
# run time on one grid, the whole group past 8 tiles, ran its whole-group path slower than this
# kernel: the attention at 600 positions 14.9 us against 9.7 on an H100, the decode after 512
# positions 543 against 589 tok/s on the H200; cause not found, branch tile-wide-switch.)
TILE_HEADS = 0
# at most this many key groups the value sums are split over (the largest power of two whose
# (group, pair) items a block's threads hold)
TILE_VALUE_GROUPS = 4
# shared memory a block may take in all, per target family (sm_80/90: 163/227 KiB; AMD: 64 KiB LDS)
TILE_MAX_SHARED = {"nvidia": 160 * 1024, "amd": 64 * 1024}


def _fill(room: int, cap: int) -> int:
    """The largest power of two up to `cap` and `room` (at least one)."""
    n = 1
    while 2 * n <= min(room, cap):
        n *= 2
    return n


def decode_attention_tile(
    fn: str,
    p: AttentionParams,
    target: GpuTarget,
    nodes: list[str],
    max_ctx: int,
    kv_storage: str,
    form: str = "tile",
    blocks: int = TILE_BLOCKS,
) -> GpuKernel | None:
    """The decode attention with its work after the PDL wait shortened
    (attention_decode_tile.hip.j2): a block per (`h` query heads of a KV head, tile of `k`
    keys), the block's first tile in shared memory before the wait, scores `l` lanes per
    (head, key), the value sums' keys over `v` groups of threads, and the merge's (m, l, acc)
    loads of up to `m` blocks issued together. `form` options after "tile", colon-separated:
    kN keys per tile, wN waves, lN lanes per score (0: as many as fill the block), mN blocks
    per merge step, bN blocks per layer (default `blocks`), tN tiles a block takes before
    another block gets one (its later tiles read after the wait, multiplied one after
    another), sN tiles one block takes alone before the context splits at all, hN query heads
    a block (default TILE_HEADS; 0: the KV head's whole group, whose tiles are then read once),
    vN key groups of the value sums (1, 2 or 4; 0: as many as fill the block, up to
    TILE_VALUE_GROUPS), r1 the first tile's arithmetic rehearsed before the wait (q = 0, the
    results dropped: its instructions fetched while the block waits). None where the tiles do
    not fit in shared memory; HipcError for a form the model cannot take."""
    opts = {
        "k": TILE_KEYS,
        "w": TILE_WAVES,
        "l": TILE_LANES,
        "m": 0,
        "b": blocks,
        "t": TILE_PER_BLOCK,
        "s": TILE_SINGLE,
        "h": TILE_HEADS,
        "v": 0,
        "r": 0,
    }
    for o in form.split(":")[1:]:
        if o[:1] not in opts or not o[1:].isdigit():
            raise HipcError(f"{FORM_ENV}={form!r}: unknown option {o!r}")
        opts[o[0]] = int(o[1:])
    if opts["r"] > 1:
        raise HipcError(f"{FORM_ENV}={form!r}: the rehearsal is r0 or r1")
    kv_ctx = kv_context(kv_storage, max_ctx)
    esize = 2 if kv_storage == "bfloat16" else 4
    tk, threads = opts["k"], opts["w"] * target.wave
    if p.D % 2 or p.NH % p.NKV:
        return None
    G = p.NH // p.NKV
    hb = min(opts["h"] or G, G)
    if G % hb:
        raise HipcError(f"{FORM_ENV}={form!r}: {hb} heads a block do not divide {G}")
    heads_split = G // hb
    lpk = opts["l"] or _fill(threads // (hb * tk), target.wave)
    if lpk & (lpk - 1) or lpk > target.wave:
        return None
    vs = opts["v"] or _fill(threads // (hb * p.D // 2), TILE_VALUE_GROUPS)
    if 4 % vs:  # (a group's share of a tile's keys, summed a pair at a time, is even)
        raise HipcError(f"{FORM_ENV}={form!r}: key groups are 1, 2 or 4")
    if vs > 1 and hb * p.D // 2 * vs > threads:
        raise HipcError(f"{FORM_ENV}={form!r}: {vs} key groups need more threads")
    splits = max(1, min(-(-max_ctx // tk), -(-opts["b"] // (p.NKV * heads_split))))
    rw = p.D * esize // 4
    ks = rw + (1 - rw % 2 if lpk == 1 else (lpk - rw % 32) % 32)
    tiles = 4 * tk * (ks + rw)
    statics = 4 * (
        hb * p.D + 2 * p.D + hb * tk + hb + p.D + 2 * hb + (hb * p.D * vs if vs > 1 else 2)
    )
    dyn = tiles + statics > STATIC_SHARED
    if statics > STATIC_SHARED or tiles + statics > TILE_MAX_SHARED.get(target.family, 0):
        return None
    # the merge: a thread's consecutive outputs, one (m, l) per block where they are one head's;
    # a step's loads held in <= 64 registers (32 where a thread has more outputs to keep: the
    # 256-dim heads spilled at 64)
    outputs = -(-hb * p.D // threads)
    loads = outputs + (2 if p.D % outputs == 0 else 2 * outputs)
    mu = opts["m"] or max(2, min(16, (64 if outputs <= 2 else 32) // loads))
    ctx = dict(
        nodes=nodes,
        wave=target.wave,
        threads=threads,
        tk=tk,
        lpk=lpk,
        mu=mu,
        dyn=dyn,
        # registers for two blocks per SM: a layer's 256 blocks resident at once on an H200
        min_blocks=TILE_MIN_BLOCKS,
        splits=splits,
        hb=hb,
        vs=vs,
        per_block=max(1, opts["t"]),
        single=max(1, opts["s"]),
        rehearse=opts["r"] == 1,
        params=decode_signature(kv_ctx["kv_type"]).render(GPU_INDENT),
        **kv_ctx,
        **p.context(),
    )
    return GpuKernel(
        f"{fn}_decode", "attention_decode_tile", ctx, [p.NKV * heads_split, splits], threads,
        tiles if dyn else 0,
    )  # fmt: skip
