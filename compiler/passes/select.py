"""select_kernels: each fused group -> a kernel template, its parameters and its arguments.

Parameters are what the template specializes on (weight type, shapes, which prologue
and epilogue); groups with equal parameters share one rendered function. Arguments
bind the kernel's pointers to activations (resolved by the memory plan), weights,
KV-cache states and the step's inputs.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from hipc.compiler.ir import Graph, Node
from hipc.compiler.passes.fuse import FusedGroup, Fusion, FusionError

# Parameters a family switches on (Gemma: GeGLU, post-norms, soft-caps, scaled embeddings).
# At their default they are left out of `params`, so the kernels of models that do not use
# them keep their names and sources; param_dict fills them in for templates and renderers.
PARAM_DEFAULTS: dict[str, dict[str, Any]] = {
    "linear": {"act": "silu", "post_norm_eps": 0.0, "softcap": 0.0},
    "attention": {"softcap": 0.0},
    "embedding": {"scale": 1.0},
}


@dataclass(frozen=True)
class KernelSpec:
    template: str
    params: tuple[tuple[str, Any], ...]

    @property
    def param_dict(self) -> dict[str, Any]:
        return {**PARAM_DEFAULTS.get(self.template, {}), **dict(self.params)}

    @property
    def fn(self) -> str:
        p = self.param_dict
        tag = {
            "linear": lambda: (
                f"{p['wtype']}_{p['N']}x{p['K']}_{p['epilogue']}"
                + ("_rms" if p["norm_eps"] else "")
                + ("_gelu" if p["act"] == "gelu_tanh" else "")
                + ("_postrms" if p["post_norm_eps"] else "")
                + ("_cap" if p["softcap"] else "")
            ),
            "attention": lambda: f"h{p['NH']}kv{p['NKV']}d{p['D']}",
            "embedding": lambda: f"{p['wtype']}_{p['K']}",
        }[self.template]()
        digest = hashlib.sha1(json.dumps(self.params).encode()).hexdigest()[:6]
        return f"{self.template}_{tag}_{digest}"


@dataclass
class Launch:
    group: str
    nodes: list[str]
    kernel: KernelSpec
    args: dict[str, tuple[str, str | None]]  # name -> (kind, what): act/weight/state/input/none

    def to_json(self) -> dict:
        return {
            "group": self.group,
            "kernel": self.kernel.fn,
            "nodes": self.nodes,
            "args": {k: {"kind": v[0], "ref": v[1]} for k, v in self.args.items()},
        }


def _spec(template: str, **params: Any) -> KernelSpec:
    defaults = PARAM_DEFAULTS.get(template, {})
    kept = {k: v for k, v in params.items() if k not in defaults or v != defaults[k]}
    return KernelSpec(template, tuple(sorted(kept.items())))


def select_kernels(fusion: Fusion) -> list[Launch]:
    g = fusion.graph
    pick = {"linear": _linear, "attention": _attention, "embedding": _embedding}
    launches = []
    for grp in fusion.groups:
        if grp.kind not in pick:
            raise FusionError(f"no kernel for a lone {grp.anchor.op} ({grp.name})")
        launches.append(pick[grp.kind](g, grp))
    return launches


def _linear(g: Graph, grp: FusedGroup) -> Launch:
    lin = grp.anchor
    x, w = lin.inputs[0], lin.inputs[1]
    N, K = g.values[w].shape
    args: dict[str, tuple[str, str | None]] = {
        "w": ("weight", w),
        "norm_w": ("none", None),
        "bias": ("none", None),
        "res": ("none", None),
    }
    eps = 0.0
    norm = next((n for n in grp.prologue if n.op == "RMSNormalization"), None)
    if norm is not None:
        x, eps = norm.inputs[0], float(norm.attrs["epsilon"])
        args["norm_w"] = ("weight", norm.inputs[1])
    args["x"] = ("act", x)
    if len(lin.inputs) > 2:
        args["bias"] = ("weight", lin.inputs[2])
    ops = [n.op for n in grp.epilogue]
    y = lin.outputs[0]
    act, post_eps, softcap = "silu", 0.0, 0.0
    if not ops:
        epilogue = "none"
    elif ops in (["Add"], ["RMSNormalization", "Add"]):
        # residual, with Gemma's post-norm on the linear's row before the add
        epilogue, y = "residual", grp.epilogue[-1].outputs[0]
        args["res"] = ("act", _residual_input(grp))
        if ops[0] == "RMSNormalization":
            post_eps = float(grp.epilogue[0].attrs["epsilon"])
            args["post_norm_w"] = ("weight", grp.epilogue[0].inputs[1])
    elif len(ops) == 3 and ops[0] == "Split" and ops[2] == "Mul":
        epilogue, y = "glu", grp.epilogue[-1].outputs[0]
        act = _glu_activation(grp.epilogue[1], grp.name)
    elif ops == ["Split"]:
        epilogue = "none"  # the parts are column views of y
    elif ops == ["hipc::SoftCap"]:
        epilogue, y = "none", grp.epilogue[0].outputs[0]
        softcap = float(grp.epilogue[0].attrs["cap"])
    else:
        raise FusionError(f"no linear kernel with epilogue {ops} ({grp.name})")
    args["y"] = ("act", y)
    spec = _spec(
        "linear",
        wtype=g.values[w].dtype,
        N=int(N),
        K=int(K),
        norm_eps=eps,
        epilogue=epilogue,
        bias=len(lin.inputs) > 2,
        act=act,
        post_norm_eps=post_eps,
        softcap=softcap,
    )
    return Launch(grp.name, grp.node_names, spec, args)


def _residual_input(grp: FusedGroup) -> str:
    """The residual stream an epilogue Add reads: its input not computed inside the group."""
    inside = {o for n in grp.nodes for o in n.outputs}
    return next(i for i in grp.epilogue[-1].inputs if i not in inside)


def _glu_activation(node: Node, group: str) -> str:
    if node.op == "hipc::SiLU":
        return "silu"
    if node.op == "Gelu" and node.attrs.get("approximate") == "tanh":
        return "gelu_tanh"
    raise FusionError(f"no GLU epilogue with {node.op} {dict(node.attrs)} ({group})")


def _chain(g: Graph, value: str, prologue: list[Node]) -> tuple[str, Node | None, Node | None]:
    """Walk an attention input back through Reshape/RMSNorm/RoPE to its source view."""
    mine = {n.outputs[0]: n for n in prologue}
    rope = norm = None
    while value in mine:
        n = mine[value]
        if n.op == "RotaryEmbedding":
            rope = n
        elif n.op == "RMSNormalization":
            if rope is None:
                raise FusionError(
                    f"attention kernel applies the q/k norm before RoPE, not after ({n.name})"
                )
            norm = n
        value = n.inputs[0]
    return value, norm, rope


def _attention(g: Graph, grp: FusedGroup) -> Launch:
    att = grp.anchor
    q, k, v, pos, kc, vc = att.inputs
    q_src, q_norm, q_rope = _chain(g, q, grp.prologue)
    k_src, k_norm, k_rope = _chain(g, k, grp.prologue)
    v_src, v_norm, v_rope = _chain(g, v, grp.prologue)
    if q_rope is None or k_rope is None or v_norm or v_rope:
        raise FusionError(f"attention kernel needs RoPE on q and k only ({grp.name})")
    if bool(q_norm) != bool(k_norm):
        raise FusionError(f"attention kernel needs q and k norms together ({grp.name})")
    _, NH, D = g.values[q].shape
    NKV = g.values[k].shape[1]
    out = grp.epilogue[0].outputs[0] if grp.epilogue else att.outputs[0]
    args: dict[str, tuple[str, str | None]] = {
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
    spec = _spec(
        "attention",
        NH=int(NH),
        NKV=int(NKV),
        D=int(D),
        scale=float(att.attrs["scale"]),
        window=int(att.attrs.get("sliding_window") or 0),
        interleaved=bool(q_rope.attrs.get("interleaved")),
        norm_eps=float(q_norm.attrs["epsilon"]) if q_norm else 0.0,
        softcap=float(att.attrs.get("softcap") or 0.0),
    )
    return Launch(grp.name, grp.node_names, spec, args)


def _embedding(g: Graph, grp: FusedGroup) -> Launch:
    emb = grp.anchor
    w, ids = emb.inputs
    V, K = (int(d) for d in g.values[w].shape)
    scale, out = 1.0, emb.outputs[0]
    if grp.epilogue:  # Mul by a constant scalar (Gemma's sqrt(hidden))
        mul = grp.epilogue[0]
        factor = next(i for i in mul.inputs if i != out)
        scale = float(g.initializers[factor].array.reshape(()))
        out = mul.outputs[0]
    spec = _spec("embedding", wtype=g.values[w].dtype, K=K, V=V, scale=scale)
    args = {"w": ("weight", w), "ids": ("input", ids), "out": ("act", out)}
    return Launch(grp.name, grp.node_names, spec, args)


def weight_order(launches: list[Launch]) -> list[str]:
    """Every weight the launches read, in order of first use: the W[] order of all targets."""
    order: dict[str, None] = {}
    for launch in launches:
        for kind, ref in launch.args.values():
            if kind == "weight":
                order.setdefault(ref)
    return list(order)
