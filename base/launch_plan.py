"""The launch plan (an artifact's plan.json): what to allocate and what to launch, for
every target. The runtime owns this format; the compiler writes it. docs/LAUNCH_PLAN.md
describes it field by field.

  format, version          "hipc-launch-plan", LAUNCH_PLAN_VERSION (refused otherwise)
  max_context, max_tokens  compiled KV positions; tokens per step (the prefill chunk)
  vocab_size
  weights  [{name, dtype, shape, stored_shape}]   W[i] order (weights.safetensors)
  states   [{name, kind, dtype, shape, reset, reuse}]  state j (StateSpec: sizing, reset,
                                                      prefix-reuse rule per kind)
  memory   the compiler's arena layout (for inspection; targets carry arena_bytes)
  kernels  {function: {kind, params}}
  groups   [{group, kernel, nodes, args: {name: {kind, ref}}}]  the kernel selection, by
           graph value (runtime/integrity.py checks states and weights against it)
  targets  {name: {entry, abi_version, wave, arena_bytes, scratch_bytes, kv_block,
                   steps: {step: [launch]}, topk}}

A GPU target's optional "topk": {"kernel": NAME, "block": THREADS, "max_k": K} names the
program's row top-k kernel (templates/hip/topk.hip.j2: logits, vocab, k, vals, ids, stats;
one block per row), which GpuBackend.step_top runs after a step so that only k values and ids
per row are copied back; without it the runtime picks them from the logits on the host. Its
optional "pick" and "split": {"kernel": NAME, "block": THREADS, "blocks": G} are the same on
G blocks a row, which the runtime runs instead for up to 64 rows: "pick" for k = 1 (logits,
vocab, vals, ids, stats, partials [rows, G, 5] words, a counter per row that is zero between
launches, and a draw per row: 1 / temperature and a uniform number, 1 / temperature 0 for the
greedy pick, else a token drawn at that temperature), "split" for k > 1 (logits, vocab, k, vals,
ids, stats, partials [rows, G, 2k + 2] words, the counters). Plans before "pick" have "greedy":
"pick" without the draw (partials of 4 words).

A target's steps are launch lists over the same buffers: the cpu target has one,
"forward" (any T; its C entry point hipc_forward is rendered from it), GPU targets have
"decode" (one row; captured once as a graph and replayed), "prefill" (up to max_tokens
rows of any sequences) and "batch" (rows of as many sequences, one row each: prefill's list
with the attention kernel made for such rows; captured per batch size). A launch names a kernel, its grid/block and dynamic shared memory (GPU
only), and its arguments:

  {"kind": "arena",  "offset": BYTES, "row_skip": LD}   arena base + offset
                                                        (+ (T - rows) * LD * 4 when row_skip)
  {"kind": "scratch", "offset": BYTES}                  scratch base + offset
  {"kind": "weight", "index": I}                        weight I
  {"kind": "state",  "index": J}                        state J
  {"kind": "input",  "name": "ids"}                     int64 ids[T]
  {"kind": "input",  "name": "pos" | "seq" | "blocks"}  int32 per row position / per row
                                                        block-table row / the block tables
  {"kind": "output", "name": "logits"}                  logits [rows, vocab] float32
  {"kind": "int",    "value": N | "T" | "rows"}         a 32-bit int argument
  {"kind": "null"}                                      a null pointer
  {"kind": "tmap", "of": ARG, "dims": [C, R], "box": [BC, BR]}
                                                        a TMA tensor map (CUDA sm_90, 128 bytes
                                                        by value): R rows of C bf16 at ARG (an
                                                        arena/scratch/weight argument), rows C*2
                                                        bytes apart, copied in BC x BR boxes with
                                                        the 128-byte swizzle

A launch with "tokens": [LO, HI] runs only in steps of LO..HI tokens (a prefill kernel
specialised for short or long steps; the others always run).

A launch marked "overlap": true waits in-kernel for the kernels before it (hipc_wait_prior)
before it reads or writes anything they touch, so a backend may launch it to start early
(CUDA programmatic dependent launch, sm_90+).

Grid dims are ints or the expressions "T", "rows", "cdiv(T,N)", "cdiv(rows,N)", "N*T".
`rows` is T when every token's logits are wanted, else 1 (only the last token's); on the cpu
target it is the number of rows whose logits are wanted (one per sequence that needs them).

KV states are paged on every target (kv_block positions per block): a runtime allocates a
pool of blocks per kv state, and each row of a step finds its position's block through its
sequence's block table (`blocks[seq[t] * ceil(max_context / kv_block) + pos[t] / kv_block]`).
On a GPU, pointers are passed as 64-bit device addresses and ints as 32-bit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from hipc.base.errors import HipcError

LAUNCH_PLAN_FORMAT = "hipc-launch-plan"
# 1: plan.json before it was versioned (launch lists under "gpu", no state kinds)
# 2: versioned, state kinds
# 3: "tmap" arguments and launches limited to step sizes ("tokens"): a version-2 runtime would
#    refuse the first and run every step-size variant of a GEMM (adding residuals twice)
# 4: the cpu target steps rows of many sequences over a paged KV pool (kv_block, the
#    pos/seq/blocks inputs, ABI 2)
# 5: GPU targets too: paged KV states, the pos/seq/blocks inputs instead of "start", and
#    the "batch" step
LAUNCH_PLAN_VERSION = 5
# positions per KV block (every target): small enough that a shared prefix is found at
# a fine grain and a sequence wastes under one block, large enough that a block is a few
# contiguous KiB per head (vLLM's default is 16 too)
KV_BLOCK = 16
# the most values per row a "topk" kernel returns (a greedy step wants 1, top-k sampling <= 64)
TOPK_MAX = 64
# the most rows a forward step holds (--prefill-chunk; a batched step's rows of all its sequences)
MAX_STEP_TOKENS = 8192

ARG_KINDS = ("arena", "scratch", "weight", "state", "input", "output", "int", "null", "tmap")
STEP_INPUTS = ("ids", "pos", "seq", "blocks")

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


# -- states ------------------------------------------------------------------------------

# kind -> (how it is sized, what reset does, what prefix reuse requires)
STATE_KINDS = {
    # [positions, ...]: written at a token's position, read at positions <= the current one
    # by this sequence only. Positions past the current sequence are never read, so reset
    # has nothing to clear, and a prefix of equal tokens may be kept as it is.
    "kv": ("positions", "none", "prefix"),
    # a fixed-size per-sequence state every token updates (a convolution window, a
    # linear-attention matrix): reset zeroes it, and it holds the state after the last token
    # only, so a prefix can be reused only from a snapshot taken at the end of that prefix.
    "recurrent": ("fixed", "zero", "snapshot"),
}
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class StateSpec:
    """A persistent per-sequence buffer the kernels read and update in place."""

    name: str
    kind: str  # a STATE_KINDS key
    dtype: str
    shape: tuple[int, ...]  # kv: at the compiled context (shape[0] = max_context)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StateSpec:
        kind = d.get("kind", "kv")
        if kind not in STATE_KINDS:
            raise ValueError(f"state {d.get('name')!r}: unknown kind {kind!r}")
        if d.get("dtype", "float32") not in _ITEMSIZE:
            raise ValueError(f"state {d.get('name')!r}: unsupported dtype {d.get('dtype')!r}")
        return cls(d["name"], kind, d.get("dtype", "float32"), tuple(int(x) for x in d["shape"]))

    def to_json(self) -> dict[str, Any]:
        sizing, reset, reuse = STATE_KINDS[self.kind]
        return {
            "name": self.name,
            "kind": self.kind,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "sizing": sizing,
            "reset": reset,
            "reuse": reuse,
        }

    @property
    def positional(self) -> bool:
        return STATE_KINDS[self.kind][0] == "positions"

    def shape_for(self, positions: int | None = None) -> tuple[int, ...]:
        """The shape one sequence needs when it may hold `positions` tokens (None: as
        compiled)."""
        return (positions, *self.shape[1:]) if self.positional and positions else self.shape

    def nbytes(self, positions: int | None = None) -> int:
        n = _ITEMSIZE[self.dtype]
        for d in self.shape_for(positions):
            n *= d
        return n

    @property
    def needs_reset(self) -> bool:
        """Whether a new sequence must clear it (reset "zero")."""
        return STATE_KINDS[self.kind][1] == "zero"

    @property
    def reuse(self) -> str:
        """ "prefix": a cached prefix of equal tokens stays valid; "snapshot": only a copy taken
        at the end of that prefix is."""
        return STATE_KINDS[self.kind][2]


def prefix_reuse(states: list[StateSpec] | tuple[StateSpec, ...]) -> bool:
    """Whether a sequence's states after a prompt stay valid for a later sequence that starts
    with the same prompt: only when every state is position-indexed (a recurrent state
    would need a snapshot at the end of the prompt, which the runtime does not take)."""
    return all(s.reuse == "prefix" for s in states)


# -- launches ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Bases:
    """Device addresses a backend allocated for one engine."""

    arena: int
    scratch: int
    weights: tuple[int, ...]
    states: tuple[int, ...]
    ids: int
    pos: int
    seq: int
    blocks: int
    logits: int


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a target's step."""

    kernel: str
    grid: tuple[int | str, ...]
    block: tuple[int, ...]
    shared: int
    args: tuple[dict[str, Any], ...]
    group: str = ""
    overlap: bool = False  # may start before the previous kernel ends (it waits in-kernel)
    tokens: tuple[int, int] | None = None  # runs only in steps of lo..hi tokens

    def runs_at(self, T: int) -> bool:
        return self.tokens is None or self.tokens[0] <= T <= self.tokens[1]

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Launch:
        grid = tuple(d.get("grid", [])) + (1,) * (3 - len(d.get("grid", [])))
        block = tuple(d.get("block", [])) + (1,) * (3 - len(d.get("block", [])))
        for a in d["args"]:
            if a.get("kind") not in ARG_KINDS:
                raise ValueError(f"{d['kernel']}: unknown argument kind {a.get('kind')!r}")
        return cls(
            d["kernel"],
            grid,
            block,
            int(d.get("shared", 0)),
            tuple(d["args"]),
            d.get("group", ""),
            bool(d.get("overlap", False)),
            (int(d["tokens"][0]), int(d["tokens"][1])) if d.get("tokens") else None,
        )

    def grid_dims(self, T: int, rows: int) -> tuple[int, int, int]:
        return tuple(eval_dim(g, T, rows) for g in self.grid)  # type: ignore[return-value]

    def resolve(self, bases: Bases, T: int, rows: int) -> list[tuple[str, Any]]:
        """[(ctype, value)]: ctype "u64" for pointers, "i32" for ints, "tmap" for a tensor
        map's (address, cols, rows, box cols, box rows), which the backend encodes."""
        return [resolve_arg(a, bases, T, rows) for a in self.args]


def resolve_arg(a: dict[str, Any], bases: Bases, T: int, rows: int) -> tuple[str, Any]:
    kind = a["kind"]
    if kind == "arena":
        skip = (T - rows) * int(a["row_skip"]) * 4 if a.get("row_skip") else 0
        return ("u64", bases.arena + int(a["offset"]) + skip)
    if kind == "scratch":
        return ("u64", bases.scratch + int(a["offset"]))
    if kind == "weight":
        return ("u64", bases.weights[a["index"]])
    if kind == "state":
        return ("u64", bases.states[a["index"]])
    if kind == "input":
        if a["name"] not in STEP_INPUTS:
            raise ValueError(f"unknown step input {a['name']!r}")
        return ("u64", getattr(bases, a["name"]))
    if kind == "output":
        return ("u64", bases.logits)
    if kind == "int":
        return ("i32", eval_dim(a["value"], T, rows))
    if kind == "null":
        return ("u64", 0)
    if kind == "tmap":
        ctype, addr = resolve_arg(a["of"], bases, T, rows)
        if ctype != "u64":
            raise ValueError(f"a tensor map over a {a['of']['kind']!r} argument")
        return ("tmap", (addr, *(int(v) for v in a["dims"]), *(int(v) for v in a["box"])))
    raise ValueError(f"unknown argument kind {kind!r}")


@dataclass(frozen=True)
class TargetPlan:
    """One target's part of the plan, with the shared sizes the runtime needs."""

    target: str
    max_tokens: int
    vocab: int
    arena_bytes: int
    scratch_bytes: int
    steps: dict[str, tuple[Launch, ...]]
    entry: str | None = None  # the cpu program's C entry point
    abi_version: int | None = None
    wave: int | None = None
    kv_block: int = 0  # positions per KV block of the paged pools
    topk: dict[str, Any] | None = None  # the row top-k kernel ("topk" above), if the plan has one

    @property
    def decode(self) -> tuple[Launch, ...]:
        return self.steps.get("decode", ())

    @property
    def prefill(self) -> tuple[Launch, ...]:
        return self.steps.get("prefill", ())

    def batch(self, T: int) -> tuple[Launch, ...]:
        """A step of T rows of T sequences (GPU)."""
        return tuple(x for x in self.steps.get("batch", ()) if x.runs_at(T))

    def launches(self, T: int) -> tuple[Launch, ...]:
        if "forward" in self.steps:
            return self.steps["forward"]
        return self.decode if T == 1 else tuple(x for x in self.prefill if x.runs_at(T))

    @classmethod
    def from_json(cls, plan: dict[str, Any], target: str | None = None) -> TargetPlan:
        """`target` None: the plan's only GPU target."""
        sections = plan["targets"]
        if target is None:
            gpus = [t for t, s in sections.items() if "decode" in s.get("steps", {})]
            if len(gpus) != 1:
                raise ValueError(f"plan has GPU sections for {sorted(gpus)}; name one")
            target = gpus[0]
        s = sections[target]
        return cls(
            target=target,
            max_tokens=int(plan["max_tokens"]),
            vocab=int(plan["vocab_size"]),
            arena_bytes=int(s["arena_bytes"]),
            scratch_bytes=int(s.get("scratch_bytes", 0)),
            steps={k: tuple(Launch.from_json(x) for x in v) for k, v in s["steps"].items()},
            entry=s.get("entry"),
            abi_version=s.get("abi_version"),
            wave=s.get("wave"),
            kv_block=int(s.get("kv_block", 0)),
            topk=s.get("topk"),
        )


def check_launch_plan(plan: Any, where: str) -> None:
    """Refuse a plan.json of another format or version (one line naming `where`)."""
    if not isinstance(plan, dict) or plan.get("format") != LAUNCH_PLAN_FORMAT:
        raise HipcError(
            f'{where}: not a launch plan this hipc reads (no "format": "{LAUNCH_PLAN_FORMAT}"; '
            "an older hipc wrote it?); recompile the artifact with this hipc (hipc compile)"
        )
    version = plan.get("version")
    if version != LAUNCH_PLAN_VERSION:
        raise HipcError(
            f"{where}: launch plan version {version}, this hipc reads version "
            f"{LAUNCH_PLAN_VERSION}; recompile the artifact with this hipc (hipc compile)"
        )
    try:
        states(plan)
        for name in plan["targets"]:
            TargetPlan.from_json(plan, name)
    except (KeyError, ValueError, TypeError) as e:
        raise HipcError(f"{where}: malformed launch plan ({e!r})") from None


def states(plan: dict[str, Any]) -> tuple[StateSpec, ...]:
    return tuple(StateSpec.from_json(s) for s in plan.get("states", []))
