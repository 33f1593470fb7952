"""Argument bindings of the launch plan, from the graph values a selected kernel names.

A binding is what the launch plan records for one kernel argument (the schema is
hipc.base.launch_plan's): an arena offset, a weight or state index, a step input, the
logits, an int, a scratch offset, or null. Both targets bind through this one class; the
CPU renderer then prints each binding as a C expression, a GPU runtime resolves it to a
device address.
"""

from __future__ import annotations

from typing import Any

from hipc.compiler.passes.memory import MemoryPlan

Binding = dict[str, Any]

# graph inputs -> the step inputs the runtimes provide (token ids, per-row positions)
STEP_INPUTS = {"input_ids": "ids", "positions": "pos"}


class Binder:
    def __init__(self, memory: MemoryPlan, weights: list[str], states: list[str]) -> None:
        self.memory, self.weights, self.states = memory, weights, states

    def is_output(self, value: str) -> bool:
        return self.memory.views[value].buffer in self.memory.outputs

    def ld(self, value: str) -> int:
        """Row stride (floats) of the buffer a value lives in."""
        return self.memory.views[value].ld

    def act(self, value: str, row_skip: bool = False) -> Binding:
        """An activation: its arena offset in bytes; `row_skip` when only the last `rows`
        of T rows are read (the LM head's input when only the last token's logits are wanted)."""
        view = self.memory.views[value]
        if view.buffer in self.memory.outputs:
            return {"kind": "output", "name": value}
        offset = 4 * (self.memory.offsets[view.buffer] * self.memory.max_tokens + view.col)
        arg: Binding = {"kind": "arena", "offset": offset}
        if row_skip:
            arg["row_skip"] = view.ld
        return arg

    def ref(self, ref: tuple[str, str | None]) -> Binding:
        kind, what = ref
        if kind == "act":
            return self.act(what)
        if kind == "weight":
            return {"kind": "weight", "index": self.weights.index(what)}
        if kind == "state":
            return {"kind": "state", "index": self.states.index(what)}
        if kind == "input":
            return self.input(STEP_INPUTS[what])
        if kind == "none":
            return self.null()
        raise ValueError(kind)

    @staticmethod
    def input(name: str) -> Binding:
        return {"kind": "input", "name": name}

    @staticmethod
    def int(value: int | str) -> Binding:
        """A 32-bit int: a number, or "T" / "rows" (this step's tokens / logits rows)."""
        return {"kind": "int", "value": value}

    @staticmethod
    def scratch(offset: int) -> Binding:
        return {"kind": "scratch", "offset": offset}

    @staticmethod
    def null() -> Binding:
        return {"kind": "null"}
