"""What a kernel kind is made of, and the pieces every kind shares.

A kind (linear, attention, embedding ...) is one module in this package holding:
  - the IR ops it anchors on, and the fusion candidates it proposes around an anchor
    (each with the role it would play: prologue or epilogue);
  - a typed parameter record (what its templates specialize on);
  - `select`: a fused group -> the parameters and the logical argument bindings;
  - per target: the kernel signatures (declared once: they render the C parameter list and
    order the launch plan's arguments), the CPU call, and the GPU kernels with their geometry
    per target family.
compiler/kernels/__init__.py registers the kinds; fuse, select and the renderers iterate it.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

from hipc.base.errors import HipcError
from hipc.compiler.ir import Graph, Node

if TYPE_CHECKING:
    from hipc.compiler.codegen.bindings import Binder
    from hipc.compiler.codegen.hip import GpuProgramBuilder
    from hipc.compiler.passes.fuse import FusedGroup, Proposals


class FusionError(HipcError):
    """A graph the kernel templates cannot cover (reported to the user, one line)."""


# -- parameters --------------------------------------------------------------------------


@dataclass(frozen=True)
class Params:
    """A kind's specialization. Equal parameters share one rendered function."""

    def tag(self) -> str:
        """The readable middle of the function name."""
        raise NotImplementedError

    def items(self) -> tuple[tuple[str, Any], ...]:
        """The fields that name the kernel. A field declared with a default is a switch some
        families turn on (Gemma's soft-caps ...): at its default it is left out, so the kernels
        of models without it keep their names, sources and plans."""
        return tuple(
            sorted(
                (f.name, getattr(self, f.name))
                for f in fields(self)
                if f.default is MISSING or getattr(self, f.name) != f.default
            )
        )

    def to_json(self) -> dict[str, Any]:
        return dict(self.items())

    def context(self) -> dict[str, Any]:
        """Every field, switches at their default included: what templates read."""
        return asdict(self)

    def switched_on(self) -> list[str]:
        """The switches (fields declared with a default) not at their default."""
        return [
            f.name
            for f in fields(self)
            if f.default is not MISSING and getattr(self, f.name) != f.default
        ]


def kernel_name(kind: str, params: Params) -> str:
    """<kind>_<tag>_<6 hex digits of the parameters>: stable across runs and machines."""
    digest = hashlib.sha1(json.dumps(params.items()).encode()).hexdigest()[:6]
    return f"{kind}_{params.tag()}_{digest}"


# -- signatures --------------------------------------------------------------------------

_PARAM = re.compile(r"^(.*?)\b(\w+)$")


@dataclass(frozen=True)
class Arg:
    ctype: str  # "const float* __restrict__", "int", "const void*"
    name: str

    @property
    def pointer_type(self) -> str:
        """The type without qualifiers that do not matter to a caller (for casts)."""
        return self.ctype.replace("__restrict__", "").replace("  ", " ").strip()


@dataclass(frozen=True)
class Signature:
    """A kernel's parameters, written once as C ("const float* x, int T,\\n float* y").

    Rendered into the template as its parameter list (line breaks kept, continuation lines
    indented), and the order in which a launch passes its argument bindings."""

    lines: tuple[tuple[Arg, ...], ...]

    @classmethod
    def parse(cls, text: str) -> Signature:
        lines = []
        for line in text.strip().split("\n"):
            args = []
            for part in (p.strip() for p in line.split(",")):
                if not part:
                    continue
                m = _PARAM.match(part)
                if not m:
                    raise ValueError(f"bad parameter {part!r}")
                args.append(Arg(m.group(1).strip(), m.group(2)))
            lines.append(tuple(args))
        return cls(tuple(lines))

    @property
    def args(self) -> tuple[Arg, ...]:
        return tuple(a for line in self.lines for a in line)

    def render(self, indent: int) -> str:
        """The parameter list; `indent`: the column continuation lines start at."""
        return f",\n{' ' * indent}".join(
            ", ".join(f"{a.ctype} {a.name}" for a in line) for line in self.lines
        )

    def order(self, bindings: dict[str, Any], kernel: str) -> list[Any]:
        """Bindings by parameter name -> in parameter order; a name left over or missing
        is a bug in the kind's module, caught here rather than as a wrong pointer."""
        names = [a.name for a in self.args]
        if set(bindings) != set(names):
            raise ValueError(
                f"{kernel}: bindings {sorted(bindings)} do not match the parameters {names}"
            )
        return [bindings[n] for n in names]


# Continuation lines align with the character after "(" as the templates are laid out:
# "static void {{ fn }}(" on the CPU, "{{ fn }}(" on its own line in the HIP templates.
CPU_INDENT = len("static void {{ fn }}(")
GPU_INDENT = len("{{ fn }}(")


# -- selection ---------------------------------------------------------------------------

Ref = tuple[str, str | None]  # (what: act/weight/state/input/none, the graph value)


@dataclass
class SelectedKernel:
    """A fused group after selection: its kind, parameters and logical argument bindings
    (graph values; the renderers turn them into arena offsets and weight indices)."""

    group: str
    nodes: list[str]
    kind: KernelKind
    params: Params
    refs: dict[str, Ref] = field(default_factory=dict)

    @property
    def fn(self) -> str:
        return kernel_name(self.kind.name, self.params)

    def to_json(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "kernel": self.fn,
            "nodes": self.nodes,
            "args": {k: {"kind": v[0], "ref": v[1]} for k, v in self.refs.items()},
        }


def weight_suffix(k: SelectedKernel, where: str) -> str:
    """The suffix of the weight type's helpers in the templates' headers, or a FusionError
    naming the group when `where` ("CPU", "HIP") has no kernel for that type."""
    from hipc.compiler.codegen.environment import CPU_WTYPES, HIP_WTYPES, WEIGHT_SUFFIX

    wtype = k.params.wtype
    supported = CPU_WTYPES if where == "CPU" else HIP_WTYPES
    if wtype not in supported:
        listed = f" (supported: {', '.join(supported)})" if where == "CPU" else ""
        raise FusionError(f"{k.group}: weight type {wtype} has no {where} kernel{listed}")
    return WEIGHT_SUFFIX[wtype]


@dataclass(frozen=True)
class GpuKernel:
    """One GPU kernel to render: its name, template, context and launch geometry."""

    fn: str
    template: str
    ctx: dict[str, Any]
    grid: list[int]
    threads: int
    shared: int = 0
    block_outputs: int = 0  # GEMM: grid.x = ceil(n_out / block_outputs)
    block_tokens: int = 0  # GEMM: grid.y = ceil(rows / block_tokens)


# -- the kind ----------------------------------------------------------------------------


class KernelKind:
    """One kind of kernel. Subclasses are singletons registered in compiler/kernels."""

    name: ClassVar[str]
    anchors: ClassVar[frozenset[str]]  # IR ops a group of this kind starts from
    roles: ClassVar[frozenset[str]]  # fusion roles it accepts ("prologue:rmsnorm" ...)
    refusals: ClassVar[dict[str, str]] = {}  # role -> why it is refused, where that needs saying

    def propose(self, graph: Graph, anchor: Node, p: Proposals) -> None:
        """Offer fusions around `anchor` (p.propose); the fuse pass decides."""

    def select(self, graph: Graph, group: FusedGroup) -> SelectedKernel:
        raise FusionError(f"no kernel for a lone {group.anchor.op} ({group.name})")

    # -- the CPU target --

    def cpu_kernel(self, k: SelectedKernel, activations: str) -> tuple[str, dict[str, Any]]:
        """(template under templates/, its context) for the kernel's one CPU function."""
        raise FusionError(f"{k.group}: no CPU kernel for {self.name}")

    def cpu_call(self, k: SelectedKernel, b: Binder) -> dict[str, Any]:
        """The CPU function's argument bindings, by parameter name."""
        raise NotImplementedError

    cpu_signature: ClassVar[Signature]

    def cpu_signature_of(self, k: SelectedKernel) -> Signature:
        """The CPU function's parameters for this kernel (a switch may add one)."""
        return self.cpu_signature

    # -- GPU targets --

    # parameter switches (Params fields with a default) the GPU templates do not implement:
    # a kernel with one on is refused in one line instead of rendered without it
    gpu_lacks: ClassVar[frozenset[str]] = frozenset()

    def gpu_scratch(self, k: SelectedKernel, g: GpuProgramBuilder) -> dict[str, int]:
        """Scratch regions this kernel needs on a GPU: {name: bytes}; g.scratch(name) is the
        offset once every kernel has asked (regions of one name are shared)."""
        return {}

    def gpu(self, k: SelectedKernel, b: Binder, g: GpuProgramBuilder) -> None:
        """Render this group's GPU kernels into `g` and add its decode/prefill launches."""
        raise FusionError(f"{k.group}: no GPU kernel for {self.name}")

    def __repr__(self) -> str:
        return f"<kernel kind {self.name}>"
