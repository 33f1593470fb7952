"""Targets as objects: what differs between the CPU and a GPU arch is said here once.

A target renders the selected kernels into one source, names the toolchain that builds
it, and says what the artifact records about the build. The pipeline asks every target
the same questions; nothing else in the compiler branches on a target's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hipc.compiler.options import GPU_TARGETS

if TYPE_CHECKING:
    from hipc.compiler.pipeline import Compilation


@dataclass
class Program:
    """One target's rendered source and its part of the launch plan."""

    source: str
    plan: dict[str, Any]  # the target's section of plan.json
    info: dict[str, Any]  # what the manifest records besides the toolchain


class Target:
    name: str
    family: str  # "cpu" | "nvidia" | "amd": what kernel modules specialize geometry on
    source_ext: str
    binary_ext: str

    def toolchain(self):
        raise NotImplementedError

    def render(self, c: Compilation) -> Program:
        raise NotImplementedError


class CpuTarget(Target):
    name = family = "cpu"
    source_ext, binary_ext = "cpp", "so"

    def toolchain(self):
        from hipc.compiler.toolchains.cpu import CpuToolchain

        return CpuToolchain()

    def render(self, c: Compilation) -> Program:
        from hipc.compiler.codegen.cpu import ABI_VERSION, render_cpu_program
        from hipc.compiler.toolchains.cpu import cpu_flags

        program = render_cpu_program(c, self)
        info = {"cpu_features": list(cpu_flags()), "abi_version": ABI_VERSION}
        return Program(program.source, program.plan, info)


@dataclass(frozen=True)
class GpuTarget(Target):
    arch: str  # sm_90, gfx1100 ...

    source_ext = "hip"

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.arch

    @property
    def family(self) -> str:  # type: ignore[override]
        return "nvidia" if self.arch.startswith("sm_") else "amd"

    @property
    def sm(self) -> int:
        """NVIDIA's compute capability as sm_XY's number (90 for sm_90); 0 on AMD."""
        return int(self.arch[3:].rstrip("af")) if self.family == "nvidia" else 0

    @property
    def binary_ext(self) -> str:  # type: ignore[override]
        return "fatbin" if self.family == "nvidia" else "co"

    @property
    def wave(self) -> int:
        """Wavefront width: CDNA (gfx9*) runs wave64; NVIDIA warps and RDNA (gfx1x) wave32."""
        return 64 if self.arch.startswith("gfx9") else 32

    def toolchain(self):
        from hipc.compiler.toolchains.gpu import gpu_toolchain

        return gpu_toolchain(self.arch)

    def render(self, c: Compilation) -> Program:
        from hipc.compiler.codegen.hip import render_hip_program

        program = render_hip_program(c, self)
        return Program(program.source, program.plan, {"wave": self.wave})


def target(name: str) -> Target:
    """The target object for a --target name (validated by CompileOptions)."""
    if name == "cpu":
        return CpuTarget()
    if name in GPU_TARGETS:
        return GpuTarget(name)
    raise ValueError(f"unknown target {name!r}")
