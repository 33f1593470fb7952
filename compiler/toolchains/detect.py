"""--target auto: the local GPU's arch, else cpu (with a notice on stderr)."""

from __future__ import annotations

import shutil
import subprocess
import sys


def _nvidia() -> str | None:
    try:
        from cuda.bindings import driver as cu

        if cu.cuInit(0)[0] == cu.CUresult.CUDA_SUCCESS and cu.cuDeviceGetCount()[1] > 0:
            dev = cu.cuDeviceGet(0)[1]
            attr = cu.CUdevice_attribute
            major = cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)[
                1
            ]
            minor = cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)[
                1
            ]
            return f"sm_{major}{minor}"
    except Exception:  # no bindings, no driver: try the command line tool
        pass
    if shutil.which("nvidia-smi"):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        caps = out.stdout.split()
        if out.returncode == 0 and caps:
            return "sm_" + caps[0].replace(".", "")
    return None


def _amd() -> str | None:
    for tool in ("amdgpu-arch", "rocm_agent_enumerator"):
        if shutil.which(tool):
            out = subprocess.run([tool], capture_output=True, text=True)
            archs = [a for a in out.stdout.split() if a.startswith("gfx") and a != "gfx000"]
            if archs:
                return archs[0]
    return None


def detect_target() -> str:
    target = _nvidia() or _amd()
    if target is None:
        print("hipc: note: no GPU found (--target auto); compiling for cpu", file=sys.stderr)
        return "cpu"
    return target


def resolve_targets(targets: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(detect_target() if t == "auto" else t for t in targets))
