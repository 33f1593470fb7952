"""The op set: type rules for every op the IR may hold.

Each op is registered under its qualified name ("MatMul", "hipc::CachedAttention")
with a rule that computes output types from input types. The verifier recomputes
every node's outputs with these rules between passes; the NumPy reference
implementations live in compiler/reference/ops.py, keyed the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from hipc.compiler.ir.graph import Constant, Dim, Graph, Node, TensorType

TypeRule = Callable[[Node, Sequence[TensorType], Graph], list[TensorType]]
TYPE_RULES: dict[str, TypeRule] = {}


class TypeError_(ValueError):
    """A node whose inputs do not fit its op (raised by the verifier)."""


def rule(*ops: str) -> Callable[[TypeRule], TypeRule]:
    def register(fn: TypeRule) -> TypeRule:
        for op in ops:
            TYPE_RULES[op] = fn
        return fn

    return register


def _check(cond: bool, node: Node, msg: str) -> None:
    if not cond:
        raise TypeError_(f"{node.op} node {node.name!r}: {msg}")


def broadcast(a: Sequence[Dim], b: Sequence[Dim]) -> tuple[Dim, ...] | None:
    out: list[Dim] = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else 1
        y = b[-i] if i <= len(b) else 1
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            return None
    return tuple(reversed(out))


@rule("Add", "Mul", "Div")
def _binary(node: Node, ins: Sequence[TensorType], g: Graph) -> list[TensorType]:
    a, b = ins
    _check(a.dtype == b.dtype, node, f"dtype mismatch {a.dtype} vs {b.dtype}")
    shape = broadcast(a.shape, b.shape)
    _check(shape is not None, node, f"shapes {a.shape} and {b.shape} do not broadcast")
    return [TensorType(a.dtype, shape)]


@rule("Sigmoid", "Tanh", "Exp", "Neg", "Softplus")
def _unary(node: Node, ins: Sequence[TensorType], g: Graph) -> list[TensorType]:
    return [ins[0]]


@rule("Gelu")
def _gelu(node: Node, ins: Sequence[TensorType], g: Graph) -> list[TensorType]:
    approx = node.attrs.get("approximate", "none")
    _check(
        approx in ("none", "tanh"), node, f"approximate must be 'none' or 'tanh', got {approx!r}"
    )
    return [ins[0]]


@rule("Clip")
def _clip(node: Node, ins: Sequence[TensorType], g: Graph) -> list[TensorType]:
    """ONNX Clip: min and max are scalar inputs."""
    for bound in ins[1:]:
        _check(bound.shape == (), node, f"min/max must be scalars, got {bound.shape}")
    return [ins[0]]


@rule("Cast")
def _cast(node: Node, ins: Sequence[TensorType], g: Graph) -> list[TensorType]:
    return [TensorType(node.attrs["to"], ins[0].shape)]


@rule("hipc::Dequantize")
def _dequantize(node: Node, ins: Sequence[TensorType], g: Graph) -> list[TensorType]:
    return [TensorType("float32", ins[0].shape)]


@rule("Transpose")
def _transpose(node: Node, ins: Sequence[TensorType], g: Graph) -> list[TensorType]:
    perm = node.attrs.get("perm") or list(reversed(range(len(ins[0].shape))))
    _check(sorted(perm) == list(range(len(ins[0].shape))), node, f"bad perm {perm}")
    return [TensorType(ins[0].dtype, tuple(ins[0].shape[p] for p in perm))]


@rule("Gather")
def _gather(node: Node, ins: Sequence[TensorType], g: Graph) -> list[TensorType]:
    data, idx = ins
    _check(node.attrs.get("axis", 0) == 0, node, "only axis 0 is supported")
    _check(idx.dtype in ("int64", "int32"), node, f"indices must be integers, got {idx.dtype}")
    return [TensorType(data.dtype, (*idx.shape, *data.shape[1:]))]


@rule("RMSNormalization")
def _rms_norm(node: Node, ins: Sequence[TensorType], g: Graph) -> list[TensorType]:
    x, scale = ins
    _check(node.attrs.get("axis", -1) == -1, node, "only axis -1 is supported")
    _check(scale.shape == x.shape[-1:], node, f"scale {scale.shape} vs input {x.shape}")
    return [x]


@rule("MatMul")
def _matmul(node: Node, ins: Sequence[TensorType], g: Graph) -> list[TensorType]:
    a, b = ins
    _check(len(b.shape) == 2, node, "right operand must be a 2-D weight")
    _check(a.shape[-1] == b.shape[0], node, f"inner dims differ: {a.shape} @ {b.shape}")
    _check(a.dtype == b.dtype, node, f"dtype mismatch {a.dtype} vs {b.dtype}")
    return [TensorType(a.dtype, (*a.shape[:-1], b.shape[1]))]


@rule("Reshape")
def _reshape(node: Node, ins: Sequence[TensorType], g: Graph) -> list[TensorType]:
    x = ins[0]
    const = g.initializers.get(node.inputs[1])
    _check(isinstance(const, Constant), node, "shape must be a constant")
    target = [int(d) for d in const.array]
    out: list[Dim] = []
    for i, d in enumerate(target):
        out.append(x.shape[i] if d == 0 else d)
    known = [d for d in out if isinstance(d, int) and d != -1]
    if -1 in out:
        # NOTE: the inferred dim must be symbolic-safe: we only allow it in front
        # (the token axis), where it equals the input's leading dim.
        _check(out.index(-1) == 0 and x.is_static is False, node, "-1 only on the token axis")
        out[0] = x.shape[0]
        inner_in = int(np.prod([d for d in x.shape[1:]]))
        _check(inner_in == int(np.prod(known)), node, f"cannot reshape {x.shape} to {target}")
    return [TensorType(x.dtype, tuple(out))]


@rule("RotaryEmbedding")
def _rope(node: Node, ins: Sequence[TensorType], g: Graph) -> list[TensorType]:
    x, cos, sin, pos = ins
    _check(len(x.shape) == 3, node, "input must be [tokens, heads, head_dim]")
    rot = node.attrs.get("rotary_embedding_dim", 0) or x.shape[-1]
    _check(cos.shape[-1] * 2 == rot and sin.shape == cos.shape, node, "cos/sin cache width")
    _check(pos.shape == x.shape[:1], node, "position_ids must be [tokens]")
    return [x]


@rule("hipc::CachedAttention")
def _cached_attention(node: Node, ins: Sequence[TensorType], g: Graph) -> list[TensorType]:
    q, k, v, pos, k_cache, v_cache = ins
    _check(q.shape[0] == k.shape[0] == v.shape[0] == pos.shape[0], node, "token counts differ")
    _check(k.shape[1:] == k_cache.shape[1:], node, f"k {k.shape} vs cache {k_cache.shape}")
    _check(v.shape[1:] == v_cache.shape[1:], node, f"v {v.shape} vs cache {v_cache.shape}")
    _check(q.shape[1] % k.shape[1] == 0, node, "query heads must be a multiple of KV heads")
    return [TensorType(q.dtype, (q.shape[0], q.shape[1], v.shape[2]))]


@rule("hipc::MoERouter")
def _moe_router(node: Node, ins: Sequence[TensorType], g: Graph) -> list[TensorType]:
    """Router logits [tokens, experts] -> (expert ids int64, weights) [tokens, top_k].

    softmax over all experts, the top_k largest probabilities (ties as torch.topk on the
    CPU breaks them), renormalised to sum 1 when `normalize`.
    """
    (logits,) = ins
    k = node.attrs["top_k"]
    _check(len(logits.shape) == 2, node, f"logits must be [tokens, experts], got {logits.shape}")
    experts = logits.shape[1]
    _check(isinstance(experts, int) and 1 <= k <= experts, node, f"top_k {k} of {experts}")
    return [
        TensorType("int64", (logits.shape[0], k)),
        TensorType(logits.dtype, (logits.shape[0], k)),
    ]


@rule("hipc::Experts")
def _experts(node: Node, ins: Sequence[TensorType], g: Graph) -> list[TensorType]:
    """sum_j w[t,j] * down[e](silu(gate[e] x) * up[e] x), e = ids[t,j], over stacked weights.

    Inputs: x [tokens, H], ids and weights [tokens, k], then either gate [E, F, H],
    up [E, F, H], down [E, H, F], or gate_up [E, 2F, H] (gate rows first) and down.
    """
    x, ids, weights, *w = ins
    _check(len(w) in (2, 3), node, f"expects 5 or 6 inputs, got {len(ins)}")
    _check(ids.dtype in ("int64", "int32"), node, f"ids must be integers, got {ids.dtype}")
    _check(ids.shape == weights.shape, node, f"ids {ids.shape} vs weights {weights.shape}")
    _check(ids.shape[0] == x.shape[0], node, f"ids {ids.shape} vs input {x.shape}")
    _check(all(len(t.shape) == 3 for t in w), node, "expert weights must be 3-D [E, out, in]")
    down = w[-1]
    E, H, F = down.shape
    _check(x.shape[-1] == H, node, f"input width {x.shape[-1]} vs down {down.shape}")
    if len(w) == 3:
        gate, up = w[0], w[1]
        _check(gate.shape == up.shape == (E, F, H), node, f"gate {gate.shape} up {up.shape}")
    else:
        _check(w[0].shape == (E, 2 * F, H), node, f"gate_up {w[0].shape} vs down {down.shape}")
    return [TensorType(x.dtype, x.shape)]


@rule("Concat")
def _concat(node: Node, ins: Sequence[TensorType], g: Graph) -> list[TensorType]:
    """ONNX Concat, here only on the last axis (columns of [tokens, ...] activations)."""
    rank = len(ins[0].shape)
    _check(node.attrs.get("axis", -1) in (-1, rank - 1), node, "only the last axis")
    _check(
        all(len(t.shape) == rank and t.shape[:-1] == ins[0].shape[:-1] for t in ins),
        node,
        f"shapes {[t.shape for t in ins]} differ before the last axis",
    )
    _check(all(t.dtype == ins[0].dtype for t in ins), node, "dtypes differ")
    widths = [t.shape[-1] for t in ins]
    _check(all(isinstance(w, int) for w in widths), node, "last axis must be static")
    return [TensorType(ins[0].dtype, (*ins[0].shape[:-1], sum(widths)))]


@rule("hipc::CausalConv1d")
def _causal_conv1d(node: Node, ins: Sequence[TensorType], g: Graph) -> list[TensorType]:
    """Depthwise causal convolution along the tokens of x [tokens, C] with weight [C, K]:
    y[t, c] = sum_j w[c, j] * x'[t + j - (K - 1), c] over x' = the state's K - 1 previous
    inputs [K - 1, C] followed by x. The state is updated to the last K - 1 inputs."""
    x, w, state = ins
    # the weight [C, K], or [C, 1, K] as HF stores it (the same bytes)
    squeezed = (w.shape[0], w.shape[-1]) if len(w.shape) == 3 and w.shape[1] == 1 else w.shape
    _check(len(x.shape) == 2 and len(squeezed) == 2, node, "x [tokens, C] and weight [C, K]")
    C, K = squeezed
    _check(x.shape[1] == C, node, f"x {x.shape} vs weight {w.shape}")
    _check(state.shape == (K - 1, C), node, f"state {state.shape}, expected {(K - 1, C)}")
    return [x]


@rule("hipc::L2Normalization")
def _l2_norm(node: Node, ins: Sequence[TensorType], g: Graph) -> list[TensorType]:
    """x / sqrt(sum(x^2) + epsilon) over the last axis."""
    return [ins[0]]


@rule("hipc::GatedDeltaRule")
def _gated_delta_rule(node: Node, ins: Sequence[TensorType], g: Graph) -> list[TensorType]:
    """The gated delta rule over tokens, per value head h with state S [dk, dv]:
    S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T (scale q_t).

    q, k [tokens, Hk, dk], v [tokens, Hv, dv], g and beta [tokens, Hv], state [Hv, dk, dv]
    (updated in place). Value head h reads key head h // (Hv / Hk), or h % Hk when
    `v_tiled`. `chunk_size` > 0: several tokens run in chunks (the same numbers)."""
    q, k, v, gate, beta, state = ins
    T, Hk, dk = q.shape
    _check(k.shape == q.shape, node, f"q {q.shape} vs k {k.shape}")
    _check(v.shape[0] == T and len(v.shape) == 3, node, f"v {v.shape} vs q {q.shape}")
    Hv, dv = v.shape[1], v.shape[2]
    _check(isinstance(Hv, int) and Hv % Hk == 0, node, f"value heads {Hv} vs key heads {Hk}")
    _check(gate.shape == beta.shape == (T, Hv), node, f"g {gate.shape} beta {beta.shape}")
    _check(state.shape == (Hv, dk, dv), node, f"state {state.shape}, expected {(Hv, dk, dv)}")
    return [v]


# -- ops introduced by the compiler's passes ------------------------------------------


@rule("hipc::Linear")
def _linear(node: Node, ins: Sequence[TensorType], g: Graph) -> list[TensorType]:
    """y = x @ W^T (+ b), W in its storage type and file layout [out, in]."""
    x, w = ins[0], ins[1]
    _check(len(w.shape) == 2, node, "weight must be 2-D [out, in]")
    _check(x.shape[-1] == w.shape[1], node, f"input width {x.shape[-1]} vs weight {w.shape}")
    if len(ins) > 2:
        _check(ins[2].shape == (w.shape[0],), node, f"bias {ins[2].shape} vs weight {w.shape}")
    return [TensorType("float32", (*x.shape[:-1], w.shape[0]))]


@rule("hipc::SoftCap")
def _softcap(node: Node, ins: Sequence[TensorType], g: Graph) -> list[TensorType]:
    """cap * tanh(x / cap): Gemma's attention and logit soft-capping, as canonicalize spells it."""
    _check(float(node.attrs.get("cap", 0)) > 0, node, "cap must be positive")
    return [ins[0]]


@rule("hipc::SiLU")
def _silu(node: Node, ins: Sequence[TensorType], g: Graph) -> list[TensorType]:
    return [ins[0]]


@rule("Split")
def _split(node: Node, ins: Sequence[TensorType], g: Graph) -> list[TensorType]:
    x = ins[0]
    sizes = list(node.attrs["split"])
    _check(node.attrs.get("axis", -1) in (-1, len(x.shape) - 1), node, "only the last axis")
    _check(sum(sizes) == x.shape[-1], node, f"split {sizes} does not cover {x.shape[-1]}")
    return [TensorType(x.dtype, (*x.shape[:-1], s)) for s in sizes]


@rule("hipc::Embedding")
def _embedding(node: Node, ins: Sequence[TensorType], g: Graph) -> list[TensorType]:
    """Rows of a (possibly quantized) table, as float32."""
    table, ids = ins
    _check(len(table.shape) == 2, node, "table must be 2-D")
    _check(ids.dtype in ("int64", "int32"), node, f"ids must be integers, got {ids.dtype}")
    return [TensorType("float32", (*ids.shape, table.shape[1]))]
