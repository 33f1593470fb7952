"""The CPU toolchain: the system C++ compiler with OpenMP, building a shared library.

`-march=native` specializes for the build machine's vector units (AVX2, AVX-512 ...);
the CPU features it relies on are recorded in the artifact and checked at load, so an
artifact moved to a machine without them fails with a message instead of SIGILL.
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess
from pathlib import Path

from hipc.base.cpu_features import cpu_features
from hipc.base.errors import HipcError
from hipc.compiler.scratch import tool_dir

# features -march=native may use that hipc's kernels care about
RELEVANT_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512vnni",
    "avx512vbmi",
    "avx512_vnni",
    "avx512_vbmi",
    "avx512_bitalg",  # the transposed Q5_0/Q5_1 GEMV's vpshufbitqmb (with VBMI)
    "avx_vnni",
)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-fno-math-errno")


def cpu_flags() -> tuple[str, ...]:
    """The features -march=native may rely on, as the runtime will check them at load."""
    have = cpu_features()
    return tuple(f for f in RELEVANT_FLAGS if f in have)


class CpuToolchain:
    target = "cpu"
    flags = FLAGS

    def __init__(self, cxx: str | None = None) -> None:
        self.cxx = (
            cxx
            or os.environ.get("CXX")
            or shutil.which("g++")
            or shutil.which("c++")
            or shutil.which("clang++")
        )
        if not self.cxx:
            raise HipcError(
                "target cpu needs a C++ compiler: install g++ (Debian: apt-get install g++)"
            )

    @functools.cached_property
    def identity(self) -> str:
        try:
            out = subprocess.run(
                [self.cxx, "--version"], capture_output=True, text=True, timeout=30
            )
        except OSError as e:
            raise HipcError(f"cannot run the C++ compiler {self.cxx} ({e.strerror})") from None
        return f"{self.cxx}: {out.stdout.splitlines()[0] if out.stdout else 'unknown version'}"

    @property
    def target_id(self) -> str:
        """What the binary is specialized for: machine + the CPU features -march=native sees."""
        return f"cpu-{platform.machine()}-{'+'.join(cpu_flags()) or 'generic'}"

    def compile(self, source: str) -> bytes:
        with tool_dir("hipc-cc-") as tmp:
            src, out = Path(tmp) / "program.cpp", Path(tmp) / "program.so"
            src.write_text(source)
            cmd = [self.cxx, *FLAGS, str(src), "-o", str(out)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                first = next(
                    (ln for ln in proc.stderr.splitlines() if "error" in ln),
                    proc.stderr.strip()[:300],
                )
                raise HipcError(
                    f"C++ compiler failed ({Path(self.cxx).name} exit {proc.returncode}): {first}"
                )
            return out.read_bytes()
