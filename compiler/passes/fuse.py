"""fuse: group the canonical graph's nodes into the kernels that will run.

Every node starts as its own group. Candidate fusions are edges between a group and a
neighbouring node; each is checked for legality (`can_fuse`) and scored by the bytes
per token it saves (the intermediate is neither written nor read back). Legal
candidates are taken best score first; every refusal is kept with its reason, which
`hipc compile --explain` prints.

Fusions an LLM decoder step needs:
  prologue  RMSNorm -> Linear                 (the norm is applied while loading rows)
  epilogue  Linear -> Add(residual)           (written in place into the residual stream)
            Linear -> RMSNorm -> Add(residual) (Gemma's post-norms: the row is normalized first)
            Linear -> Split -> act*Mul        (gate/up, act SiLU or tanh-GELU: only the product is written)
            Linear -> Split                   (q/k/v stay column views of one buffer)
            Linear -> SoftCap                 (Gemma-2's final logits)
            Embedding -> Mul(scalar)          (Gemma's sqrt(hidden) multiplier)
  attention Reshape/RMSNorm/RoPE -> CachedAttention -> Reshape (RoPE + KV write + attention)
  residual  Add -> RMSNorm                    (refused when the Add already went to a Linear)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hipc.base.errors import HipcError
from hipc.compiler.ir import Graph, Node

ATTENTION_FEEDERS = {"Reshape", "RMSNormalization", "RotaryEmbedding"}
GLU_ACTIVATIONS = {"hipc::SiLU", "Gelu"}  # act(gate) * up epilogues the linear kernels have


@dataclass
class FusedGroup:
    name: str
    kind: str  # "linear" | "attention" | "embedding" | "rmsnorm"
    anchor: Node
    prologue: list[Node] = field(default_factory=list)
    epilogue: list[Node] = field(default_factory=list)

    @property
    def nodes(self) -> list[Node]:
        return [*self.prologue, self.anchor, *self.epilogue]

    @property
    def node_names(self) -> list[str]:
        return [n.name for n in self.nodes]


@dataclass(frozen=True)
class Decision:
    group: str
    node: str
    role: str
    score: int  # bytes per token saved
    accepted: bool
    reason: str


@dataclass
class Fusion:
    graph: Graph
    groups: list[FusedGroup]
    decisions: list[Decision]


KIND_OF = {
    "hipc::Linear": "linear",
    "hipc::CachedAttention": "attention",
    "hipc::Embedding": "embedding",
    "RMSNormalization": "rmsnorm",
}


def fuse(graph: Graph) -> Fusion:
    consumers: dict[str, list[Node]] = {}
    for n in graph.nodes:
        for i in n.inputs:
            consumers.setdefault(i, []).append(n)
    for o in graph.outputs:
        consumers.setdefault(o, [])

    def only_user(value: str) -> Node | None:
        users = consumers.get(value, [])
        return users[0] if len(users) == 1 and value not in graph.outputs else None

    def row_bytes(value: str) -> int:
        t = graph.values[value]
        n = 1
        for d in t.shape[1:]:
            n *= int(d)
        return 2 * 4 * n  # one write + one read of a float32 row

    candidates: list[tuple[int, int, str, Node, str, str | None]] = []
    # (score, order, anchor, node, role, reason-if-illegal)
    order = {n.name: i for i, n in enumerate(graph.nodes)}

    def propose(anchor: Node, node: Node, role: str, value: str, legal: str | None) -> None:
        candidates.append(
            (
                row_bytes(value),
                -abs(order[anchor.name] - order[node.name]),
                anchor.name,
                node,
                role,
                legal,
            )
        )

    for n in graph.nodes:
        if n.op == "hipc::Linear":
            x = graph.producer(n.inputs[0])
            if x is not None and x.op == "RMSNormalization":
                users = consumers[x.outputs[0]]
                why = (
                    None
                    if len(users) == 1
                    else f"its output is also read by {', '.join(u.name for u in users if u is not n)}"
                )
                propose(n, x, "prologue:rmsnorm", x.outputs[0], why)
            user = only_user(n.outputs[0])
            if user is None:
                users = consumers.get(n.outputs[0], [])
                if users:
                    propose(
                        n,
                        users[0],
                        "epilogue",
                        n.outputs[0],
                        f"{n.outputs[0]} has {len(users)} readers",
                    )
            elif user.op == "Add":
                propose(n, user, "epilogue:residual", n.outputs[0], None)
            elif user.op == "Split":
                propose(n, user, _split_role(graph, user, only_user), n.outputs[0], None)
            elif user.op == "hipc::SoftCap":
                propose(n, user, "epilogue:softcap", n.outputs[0], None)
            elif user.op == "RMSNormalization":
                add = only_user(user.outputs[0])
                why = None if add is not None and add.op == "Add" else "no residual Add after it"
                propose(n, user, "epilogue:norm-residual", n.outputs[0], why)
            else:
                propose(
                    n,
                    user,
                    "epilogue",
                    n.outputs[0],
                    f"no {user.op} epilogue in the linear kernels",
                )
        elif n.op == "hipc::CachedAttention":
            for v in n.inputs[:3]:
                chain = _feeder_chain(graph, v, only_user)
                for node, why in chain:
                    propose(n, node, "attention:feeder", node.outputs[0], why)
            user = only_user(n.outputs[0])
            if user is not None and user.op == "Reshape":
                propose(n, user, "attention:flatten", n.outputs[0], None)
        elif n.op == "hipc::Embedding":
            user = only_user(n.outputs[0])
            if user is not None and user.op == "Mul":
                other = [i for i in user.inputs if i != n.outputs[0]]
                scalar = len(other) == 1 and graph.values[other[0]].shape == ()
                why = None if scalar and other[0] in graph.initializers else "not a constant scalar"
                propose(n, user, "epilogue:scale", n.outputs[0], why)
        elif n.op == "Add":
            user = only_user(n.outputs[0])
            norm_users = [u for u in consumers.get(n.outputs[0], []) if u.op == "RMSNormalization"]
            for u in norm_users:
                propose(
                    u,
                    n,
                    "prologue:residual-add",
                    n.outputs[0],
                    None if user is not None else "the residual stream is read again later",
                )

    groups: dict[str, FusedGroup] = {}
    owner: dict[str, str] = {}  # node -> anchor name
    decisions: list[Decision] = []
    for n in graph.nodes:
        if n.op in KIND_OF:
            groups[n.name] = FusedGroup(n.name, KIND_OF[n.op], n)
            owner[n.name] = n.name

    for score, _, anchor, node, role, why in sorted(candidates, key=lambda c: (-c[0], -c[1])):
        if why is None and node.name in owner and owner[node.name] != anchor:
            why = f"already fused into {owner[node.name]}"
            if (
                node.op in KIND_OF
                and node.name in groups
                and not groups[node.name].prologue
                and not groups[node.name].epilogue
            ):
                why = None  # an anchor with nothing attached may still be absorbed
        if why is None and anchor not in groups:
            why = f"{anchor} was itself fused into {owner.get(anchor)}"
        if why is None and role == "prologue:residual-add":
            why = "the norm's kernel has no residual-add prologue; the Add goes to the Linear before it"
        accepted = why is None
        decisions.append(Decision(anchor, node.name, role, score, accepted, why or "legal"))
        if not accepted:
            continue
        g = groups[anchor]
        if node.name in groups and node.name != anchor:
            del groups[node.name]
        owner[node.name] = anchor
        if role.startswith("prologue") or role == "attention:feeder":
            g.prologue.append(node)
        else:
            g.epilogue.append(node)
        # the glu epilogue brings the activation and Mul after the Split
        if role == "epilogue:glu":
            act = only_user(node.outputs[0])
            g.epilogue += [act, only_user(act.outputs[0])]
            owner[act.name] = owner[only_user(act.outputs[0]).name] = anchor
        # the post-norm brings the residual Add after it
        if role == "epilogue:norm-residual":
            add = only_user(node.outputs[0])
            g.epilogue.append(add)
            owner[add.name] = anchor

    ordered = sorted(groups.values(), key=lambda g: order[g.anchor.name])
    for g in ordered:
        g.prologue.sort(key=lambda n: order[n.name])
    covered = {n for g in ordered for n in g.node_names}
    for n in graph.nodes:
        if n.name not in covered:
            # NOTE: no kernel template exists for a lone op of this kind; say which.
            raise FusionError(f"node {n.name!r} ({n.op}) could not be placed in any kernel")
    return Fusion(graph, ordered, decisions)


class FusionError(HipcError):
    """A graph the kernel templates cannot cover (reported to the user, one line)."""


def _split_role(graph: Graph, split: Node, only_user) -> str:
    """'epilogue:glu' for Split -> act(a) * b with equal halves, else 'epilogue:split'."""
    sizes = list(split.attrs["split"])
    if len(sizes) == 2 and sizes[0] == sizes[1]:
        a, b = split.outputs
        act = only_user(a)
        if act is not None and act.op in GLU_ACTIVATIONS:
            mul = only_user(act.outputs[0])
            if (
                mul is not None
                and mul.op == "Mul"
                and set(mul.inputs) == {act.outputs[0], b}
                and only_user(b) is mul
            ):
                return "epilogue:glu"
    return "epilogue:split"


def _feeder_chain(graph: Graph, value: str, only_user) -> list[tuple[Node, str | None]]:
    """Nodes between a Split view (or any producer) and an attention input."""
    chain: list[tuple[Node, str | None]] = []
    node = graph.producer(value)
    while node is not None and node.op in ATTENTION_FEEDERS:
        why = (
            None
            if only_user(node.outputs[0]) is not None
            else f"{node.outputs[0]} has several readers"
        )
        if node.op == "RMSNormalization" and len(graph.values[node.inputs[1]].shape) != 1:
            why = "only per-head norms (scale [head_dim]) fuse into attention"
        chain.append((node, why))
        node = graph.producer(node.inputs[0])
    return chain
