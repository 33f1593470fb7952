"""The GPU launch plan in plan.json, and how a backend turns it into kernel launches.

plan["gpu"][target] holds two launch lists over the same buffers: `decode` (one token; the
runtime captures it once as a graph and replays it) and `prefill` (up to max_tokens
tokens, launched directly with T as a kernel argument). Each launch names a kernel in
the code object, its grid/block, dynamic shared memory, and its arguments:

  {"kind": "arena",  "offset": BYTES, "row_skip": LD}   arena base + offset
                                                        (+ (T - rows) * LD * 4 when row_skip)
  {"kind": "scratch", "offset": BYTES}                  scratch base + offset
  {"kind": "weight", "index": I}                        weight I (plan["weights"] order)
  {"kind": "state",  "index": J}                        KV-cache state J (plan["states"] order)
  {"kind": "input",  "name": "ids" | "start"}           int64 ids[T] / int32 start, on the device
  {"kind": "output", "name": "logits"}                  logits [rows, vocab] float32
  {"kind": "int",    "value": N | "T" | "rows"}         a 32-bit int argument
  {"kind": "null"}                                      a null pointer

A launch marked "overlap": true waits in-kernel for the kernels before it
(hipc_wait_prior) before it reads or writes anything they touch, so a backend may
launch it to start early (CUDA programmatic dependent launch, sm_90+).

Grid dims are ints or the expressions "T", "rows", "cdiv(T,N)", "cdiv(rows,N)", "N*T".
`rows` is T when every token's logits are wanted, else 1 (only the last token's).
Pointers are passed as 64-bit device addresses, ints as 32-bit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_CDIV = re.compile(r"^cdiv\((T|rows),(\d+)\)$")
_MUL = re.compile(r"^(\d+)\*(T|rows)$")


def eval_dim(expr: int | str, T: int, rows: int) -> int:
    if isinstance(expr, int):
        return expr
    e = expr.replace(" ", "")
    env = {"T": T, "rows": rows}
    if e in env:
        return env[e]
    m = _CDIV.match(e)
    if m:
        n = int(m.group(2))
        return (env[m.group(1)] + n - 1) // n
    m = _MUL.match(e)
    if m:
        return int(m.group(1)) * env[m.group(2)]
    raise ValueError(f"bad grid expression {expr!r}")


@dataclass(frozen=True)
class Bases:
    """Device addresses a backend allocated for one engine."""

    arena: int
    scratch: int
    weights: tuple[int, ...]
    states: tuple[int, ...]
    ids: int
    start: int
    logits: int


@dataclass(frozen=True)
class Launch:
    kernel: str
    grid: tuple[int | str, ...]
    block: tuple[int, ...]
    shared: int
    args: tuple[dict[str, Any], ...]
    group: str = ""
    overlap: bool = False  # may start before the previous kernel ends (it waits in-kernel)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Launch:
        grid = tuple(d["grid"]) + (1,) * (3 - len(d["grid"]))
        block = tuple(d["block"]) + (1,) * (3 - len(d["block"]))
        return cls(
            d["kernel"],
            grid,
            block,
            int(d.get("shared", 0)),
            tuple(d["args"]),
            d.get("group", ""),
            bool(d.get("overlap", False)),
        )

    def grid_dims(self, T: int, rows: int) -> tuple[int, int, int]:
        return tuple(eval_dim(g, T, rows) for g in self.grid)  # type: ignore[return-value]

    def resolve(self, bases: Bases, T: int, rows: int) -> list[tuple[str, int]]:
        """[(ctype, value)]: ctype "u64" for pointers, "i32" for ints."""
        out: list[tuple[str, int]] = []
        for a in self.args:
            kind = a["kind"]
            if kind == "arena":
                skip = (T - rows) * int(a["row_skip"]) * 4 if a.get("row_skip") else 0
                out.append(("u64", bases.arena + int(a["offset"]) + skip))
            elif kind == "scratch":
                out.append(("u64", bases.scratch + int(a["offset"])))
            elif kind == "weight":
                out.append(("u64", bases.weights[a["index"]]))
            elif kind == "state":
                out.append(("u64", bases.states[a["index"]]))
            elif kind == "input":
                out.append(("u64", {"ids": bases.ids, "start": bases.start}[a["name"]]))
            elif kind == "output":
                out.append(("u64", bases.logits))
            elif kind == "int":
                out.append(("i32", eval_dim(a["value"], T, rows)))
            elif kind == "null":
                out.append(("u64", 0))
            else:
                raise ValueError(f"unknown argument kind {kind!r}")
        return out


@dataclass(frozen=True)
class GpuPlan:
    max_tokens: int
    arena_bytes: int
    scratch_bytes: int
    vocab: int
    decode: tuple[Launch, ...]
    prefill: tuple[Launch, ...]

    @classmethod
    def from_json(cls, plan: dict[str, Any], target: str | None = None) -> GpuPlan:
        """plan["gpu"] holds one section per GPU target (launch geometry depends on the wave size)."""
        sections = plan["gpu"]
        if target is None:
            if "decode" in sections:
                g = sections
            elif len(sections) == 1:
                g = next(iter(sections.values()))
            else:
                raise ValueError(f"plan has GPU sections for {sorted(sections)}; name one")
        else:
            g = sections[target]
        return cls(
            max_tokens=int(plan["max_tokens"]),
            arena_bytes=int(g["arena_bytes"]),
            scratch_bytes=int(g["scratch_bytes"]),
            vocab=int(plan["vocab_size"]),
            decode=tuple(Launch.from_json(x) for x in g["decode"]),
            prefill=tuple(Launch.from_json(x) for x in g["prefill"]),
        )

    def launches(self, T: int) -> tuple[Launch, ...]:
        return self.decode if T == 1 else self.prefill
