"""fuse: group the canonical graph's nodes into the kernels that will run.

Every node the registered kernel kinds anchor on (compiler/kernels) starts a group. Each
kind proposes fusions around its anchors: a neighbouring node, the role it would play
(prologue or epilogue), and whether that is legal. Each proposal is scored by the bytes per
token it saves (the intermediate is neither written nor read back); legal ones are taken
best score first, and every refusal is kept with its reason (`hipc compile --explain`).

Fusions an LLM decoder step needs:
  prologue  RMSNorm -> Linear                 (the norm is applied while loading rows)
  epilogue  Linear -> Add(residual)           (written in place into the residual stream)
            Linear -> Split -> SiLU*Mul       (gate/up: only the product is written)
            Linear -> Split                   (q/k/v stay column views of one buffer)
  attention Reshape/RMSNorm/RoPE -> CachedAttention -> Reshape (RoPE + KV write + attention)
  residual  Add -> RMSNorm                    (refused when the Add already went to a Linear)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hipc.compiler.ir import Graph, Node
from hipc.compiler.kernels import BY_ANCHOR, BY_NAME
from hipc.compiler.kernels.base import FusionError

__all__ = ["Decision", "FusedGroup", "Fusion", "FusionError", "Proposals", "fuse"]


@dataclass
class FusedGroup:
    name: str
    kind: str  # a registered kernel kind's name (compiler/kernels)
    anchor: Node
    prologue: list[Node] = field(default_factory=list)
    epilogue: list[Node] = field(default_factory=list)
    roles: dict[str, str] = field(default_factory=dict)  # fused node -> the role it took

    @property
    def nodes(self) -> list[Node]:
        return [*self.prologue, self.anchor, *self.epilogue]

    @property
    def node_names(self) -> list[str]:
        return [n.name for n in self.nodes]

    def node_with_role(self, role: str) -> Node | None:
        return next((n for n in self.nodes if self.roles.get(n.name) == role), None)


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


@dataclass(frozen=True)
class Candidate:
    score: int
    nearness: int  # minus the distance between anchor and node in graph order
    anchor: str
    node: Node
    role: str
    why: str | None  # None: legal
    side: str  # "prologue" | "epilogue"
    brings: tuple[Node, ...]  # nodes that come along (the SiLU and Mul after a GLU's Split)


class Proposals:
    """What kinds see of the graph while proposing, and where their proposals go."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.consumers: dict[str, list[Node]] = {}
        for n in graph.nodes:
            for i in n.inputs:
                self.consumers.setdefault(i, []).append(n)
        for o in graph.outputs:
            self.consumers.setdefault(o, [])
        self.order = {n.name: i for i, n in enumerate(graph.nodes)}
        self.candidates: list[Candidate] = []

    def users(self, value: str) -> list[Node]:
        return self.consumers.get(value, [])

    def only_user(self, value: str) -> Node | None:
        users = self.users(value)
        return users[0] if len(users) == 1 and value not in self.graph.outputs else None

    def propose(
        self,
        anchor: Node,
        node: Node,
        role: str,
        value: str,
        why: str | None = None,
        *,
        side: str = "epilogue",
        brings: list[Node] | tuple[Node, ...] = (),
    ) -> None:
        """Fuse `node` into `anchor`'s group as `role`, saving `value`'s round trip;
        `why`: the reason it is illegal (None: legal)."""
        near = -abs(self.order[anchor.name] - self.order[node.name])
        self.candidates.append(
            Candidate(
                self._row_bytes(value), near, anchor.name, node, role, why, side, tuple(brings)
            )
        )

    def _row_bytes(self, value: str) -> int:
        n = 1
        for d in self.graph.values[value].shape[1:]:
            n *= int(d)
        return 2 * 4 * n  # one write + one read of a float32 row


def fuse(graph: Graph) -> Fusion:
    p = Proposals(graph)
    groups: dict[str, FusedGroup] = {}
    owner: dict[str, str] = {}  # node -> anchor name
    for n in graph.nodes:
        kind = BY_ANCHOR.get(n.op)
        if kind is not None:
            kind.propose(graph, n, p)
            groups[n.name] = FusedGroup(n.name, kind.name, n)
            owner[n.name] = n.name

    decisions: list[Decision] = []
    for c in sorted(p.candidates, key=lambda c: (-c.score, -c.nearness)):
        node, anchor, why = c.node, c.anchor, c.why
        for m in (node, *c.brings):
            if why is None and m.name in owner and owner[m.name] != anchor:
                why = f"already fused into {owner[m.name]}"
                if m.name in groups and not groups[m.name].prologue and not groups[m.name].epilogue:
                    why = None  # an anchor with nothing attached may still be absorbed
        if why is None and anchor not in groups:
            why = f"{anchor} was itself fused into {owner.get(anchor)}"
        if why is None and c.role not in BY_NAME[groups[anchor].kind].roles:
            kind = BY_NAME[groups[anchor].kind]
            why = kind.refusals.get(c.role, f"{kind.name} kernels take no {c.role}")
        accepted = why is None
        decisions.append(Decision(anchor, node.name, c.role, c.score, accepted, why or "legal"))
        if not accepted:
            continue
        g = groups[anchor]
        for m in (node, *c.brings):
            if m.name in groups and m.name != anchor:
                del groups[m.name]
            owner[m.name] = anchor
            g.roles[m.name] = c.role
        (g.prologue if c.side == "prologue" else g.epilogue).extend((node, *c.brings))

    ordered = sorted(groups.values(), key=lambda g: p.order[g.anchor.name])
    for g in ordered:
        g.prologue.sort(key=lambda n: p.order[n.name])
    covered = {n for g in ordered for n in g.node_names}
    for n in graph.nodes:
        if n.name not in covered:
            # NOTE: no kernel template exists for a lone op of this kind; say which.
            raise FusionError(f"node {n.name!r} ({n.op}) could not be placed in any kernel")
    return Fusion(graph, ordered, decisions)
