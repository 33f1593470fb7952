"""plan_memory: liveness over the fused groups -> one activation arena with offsets.

Activations are [tokens, cols] float32 rows, so a buffer is sized per token: a slot of
`cols` floats per token at `offset` (also per token) in an arena of
max_tokens x arena_cols floats. A step may process up to max_tokens tokens (prefill
longer prompts in chunks); rows of a [T, cols] buffer are contiguous.

Values that never leave a group are not materialized. Split outputs are column views
of their Linear's buffer. A residual epilogue writes in place over the residual
input when that input dies in the same group, so the residual stream is one buffer
for the whole model. The KV cache is a graph state, allocated by the runtime for
max_ctx, outside the arena.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hipc.compiler.passes.fuse import Fusion

# epilogues whose Add writes the residual stream (in place when it is not read again);
# norm-residual: the linear's row is normalized first (Gemma's post-norms); gated-residual:
# scaled by a per-token sigmoid first (Qwen2-MoE's shared expert)
RESIDUAL_ROLES = ("epilogue:residual", "epilogue:norm-residual", "epilogue:gated-residual")


@dataclass(frozen=True)
class View:
    buffer: str
    col: int  # first column inside the buffer's row
    ld: int  # row stride in floats (the buffer's cols)


@dataclass
class MemoryPlan:
    max_tokens: int
    arena_cols: int = 0
    offsets: dict[str, int] = field(default_factory=dict)  # buffer -> offset (floats per token)
    cols: dict[str, int] = field(default_factory=dict)  # buffer -> floats per token
    views: dict[str, View] = field(default_factory=dict)  # value -> where it lives
    outputs: dict[str, int] = field(
        default_factory=dict
    )  # graph output -> cols (outside the arena)

    @property
    def arena_bytes(self) -> int:
        return 4 * self.max_tokens * self.arena_cols

    def to_json(self) -> dict:
        return {
            "max_tokens": self.max_tokens,
            "arena_floats_per_token": self.arena_cols,
            "arena_bytes": self.arena_bytes,
            "buffers": {
                b: {"offset_per_token": self.offsets[b], "cols": self.cols[b]} for b in self.offsets
            },
            "outputs": self.outputs,
            "views": {
                v: {"buffer": x.buffer, "col": x.col, "ld": x.ld} for v, x in self.views.items()
            },
        }


def _row_cols(shape) -> int:
    n = 1
    for d in shape[1:]:
        n *= int(d)
    return n


def plan_memory(fusion: Fusion, max_tokens: int) -> MemoryPlan:
    g = fusion.graph
    plan = MemoryPlan(max_tokens)
    owner = {n: i for i, grp in enumerate(fusion.groups) for n in grp.node_names}
    producer_group = {o: owner[n.name] for n in g.nodes for o in n.outputs}
    last_use: dict[str, int] = {}
    for n in g.nodes:
        for i in n.inputs:
            if i in producer_group and producer_group[i] != owner[n.name]:
                last_use[i] = max(last_use.get(i, -1), owner[n.name])

    # which values are materialized, and as what
    for o in g.outputs:
        plan.outputs[o] = _row_cols(g.values[o].shape)
        plan.views[o] = View(o, 0, plan.outputs[o])
    backing: dict[str, str] = {}  # buffer -> value that defines it
    for grp in fusion.groups:
        for n in grp.epilogue:
            if n.op == "Split" and any(o in last_use for o in n.outputs):
                wide = n.inputs[0]
                cols = _row_cols(g.values[wide].shape)
                col = 0
                for out, size in zip(n.outputs, n.attrs["split"], strict=True):
                    plan.views[out] = View(wide, col, cols)
                    col += size
                plan.cols[wide] = cols
                backing[wide] = wide
                readers = [last_use[o] for o in n.outputs if o in last_use]
                if readers:
                    last_use[wide] = max(readers)
        for n in grp.nodes:
            for out in n.outputs:
                if out in last_use and out not in plan.views:
                    plan.views[out] = View(out, 0, _row_cols(g.values[out].shape))
                    plan.cols[out] = plan.views[out].ld
                    backing[out] = out
    # Reshape inside a group keeps its input's storage
    for grp in fusion.groups:
        for n in grp.nodes:
            if n.op == "Reshape" and n.inputs[0] in plan.views and n.outputs[0] not in plan.views:
                plan.views[n.outputs[0]] = plan.views[n.inputs[0]]

    # in-place residual epilogues
    alias: dict[str, str] = {}
    for i, grp in enumerate(fusion.groups):
        for n in grp.epilogue:
            if n.op == "Add" and grp.roles.get(n.name) in RESIDUAL_ROLES:
                inside = {o for m in grp.nodes for o in m.outputs}
                res = next(x for x in n.inputs if x not in inside)
                out = n.outputs[0]
                if out in backing and res in plan.views and last_use.get(res) == i:
                    alias[out] = plan.views[res].buffer

    def root(buf: str) -> str:
        while buf in alias:
            buf = alias[buf]
        return buf

    # liveness of each root buffer
    live: dict[str, list[int]] = {}
    for buf in backing:
        r = root(buf)
        start = producer_group[buf]
        end = max(last_use.get(buf, start), start)
        span = live.setdefault(r, [start, end])
        span[0], span[1] = min(span[0], start), max(span[1], end)
    for value, view in list(plan.views.items()):
        if view.buffer in alias:
            plan.views[value] = View(root(view.buffer), view.col, view.ld)
    for buf in list(plan.cols):
        if buf in alias:
            del plan.cols[buf]

    # first-fit over per-token offsets
    free: list[tuple[int, int]] = []  # (offset, cols)
    active: list[tuple[int, str]] = []  # (end, buffer)
    top = 0
    for buf, (start, end) in sorted(live.items(), key=lambda kv: (kv[1][0], kv[0])):
        for e, b in [a for a in active if a[0] < start]:
            free.append((plan.offsets[b], plan.cols[b]))
            active.remove((e, b))
        free.sort()
        need = plan.cols[buf]
        slot = next((f for f in free if f[1] >= need), None)
        if slot is not None:
            free.remove(slot)
            plan.offsets[buf] = slot[0]
            if slot[1] > need:
                free.append((slot[0] + need, slot[1] - need))
        else:
            plan.offsets[buf] = top
            top += need
        active.append((end, buf))
    plan.arena_cols = top
    return plan
