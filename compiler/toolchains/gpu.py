"""GPU toolchains: nvcc for NVIDIA sm_*, and for AMD gfx* ROCm's hipcc/amdclang++ when
installed, else a plain clang++ (-x hip -nogpulib -nogpuinc) with the prelude's builtins.

Each produces one code object per arch holding every kernel: a fatbin (cubin + PTX)
for NVIDIA, an ELF code object for AMD.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path

from hipc.base.errors import HipcError
from hipc.compiler.scratch import tool_dir

NVIDIA_TARGETS = ("sm_80", "sm_89", "sm_90")
ARCH_SPECIFIC = {"sm_90": "sm_90a"}
AMD_TARGETS = ("gfx90a", "gfx942", "gfx1100", "gfx1101", "gfx1151", "gfx1201")


def _run(cmd: list[str], what: str) -> None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise HipcError(f"cannot run {cmd[0]} ({e.strerror})") from None
    if proc.returncode != 0:
        lines = (
            [ln for ln in proc.stderr.splitlines() if "error" in ln]
            or proc.stderr.strip().splitlines()
            or ["?"]
        )
        raise HipcError(
            f"{what} failed ({Path(cmd[0]).name} exit {proc.returncode}): {lines[0].strip()}"
        )


def _version(exe: str) -> str:
    out = (
        subprocess.run([exe, "--version"], capture_output=True, text=True)
        .stdout.strip()
        .splitlines()
    )
    return f"{exe}: {out[-1] if 'nvcc' in exe else out[0]}" if out else exe


class NvccToolchain:
    def __init__(self, target: str) -> None:
        self.target = target
        self.nvcc = shutil.which("nvcc") or next(
            (p for p in ("/usr/local/cuda/bin/nvcc",) if Path(p).exists()), None
        )
        if not self.nvcc:
            raise HipcError(
                f"target {target} needs nvcc: install the CUDA toolkit (Debian: nvidia-cuda-toolkit)"
            )
        # sm_90a: wgmma (the prefill GEMM) exists only in the arch-specific target; its code
        # runs on sm_90 parts (H100/H200) alone, which is what the sm_90 target means here
        cc = ARCH_SPECIFIC.get(target, target).removeprefix("sm_")
        self.flags = (
            "-fatbin",
            "-O3",
            "-std=c++17",
            "-x",
            "cu",
            f"-gencode=arch=compute_{cc},code=[sm_{cc},compute_{cc}]",
        )

    @functools.cached_property
    def identity(self) -> str:
        return _version(self.nvcc)

    @property
    def target_id(self) -> str:
        return self.target

    def compile(self, source: str) -> bytes:
        with tool_dir("hipc-nvcc-") as tmp:
            src, out = Path(tmp) / "program.cu", Path(tmp) / "program.fatbin"
            src.write_text(source)
            _run([self.nvcc, *self.flags, str(src), "-o", str(out)], f"nvcc for {self.target}")
            return out.read_bytes()

    def ptx(self, source: str) -> str:
        """The PTX of `source` as compile() builds it (the fatbin's copy may be compressed, and
        reading its machine code needs cuobjdump): what tests inspect for instructions."""
        cc = ARCH_SPECIFIC.get(self.target, self.target).removeprefix("sm_")
        flags = [f for f in self.flags if f != "-fatbin" and not f.startswith("-gencode")]
        with tool_dir("hipc-nvcc-") as tmp:
            src, out = Path(tmp) / "program.cu", Path(tmp) / "program.ptx"
            src.write_text(source)
            cmd = [self.nvcc, "-ptx", *flags, f"-arch=compute_{cc}", str(src), "-o", str(out)]
            _run(cmd, f"nvcc -ptx for {self.target}")
            return out.read_text()


class AmdToolchain:
    def __init__(self, target: str) -> None:
        self.target = target
        rocm = shutil.which("hipcc") or shutil.which("amdclang++")
        clang = rocm or next(
            (
                shutil.which(c)
                for c in ("clang++-19", "clang++-18", "clang++-20", "clang++")
                if shutil.which(c)
            ),
            None,
        )
        if not clang:
            raise HipcError(
                f"target {target} needs ROCm (hipcc) or clang++ >= 18 (Debian: apt-get install clang-19)"
            )
        self.clang = clang
        base = (
            "-x",
            "hip",
            f"--offload-arch={target}",
            "--cuda-device-only",
            "--no-gpu-bundle-output",
            "-O3",
            "-std=c++17",
        )
        self.flags = (*base, "-DHIPC_ROCM") if rocm else (*base, "-nogpulib", "-nogpuinc")

    @functools.cached_property
    def identity(self) -> str:
        return _version(self.clang)

    @property
    def target_id(self) -> str:
        return self.target

    def compile(self, source: str) -> bytes:
        with tool_dir("hipc-clang-") as tmp:
            src, out = Path(tmp) / "program.hip", Path(tmp) / "program.co"
            src.write_text(source)
            _run([self.clang, *self.flags, str(src), "-o", str(out)], f"clang for {self.target}")
            return out.read_bytes()


def gpu_toolchain(target: str):
    if target in NVIDIA_TARGETS:
        return NvccToolchain(target)
    if target in AMD_TARGETS:
        return AmdToolchain(target)
    raise HipcError(f"--target: unknown GPU target {target!r}")
