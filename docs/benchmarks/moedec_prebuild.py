"""Fill $HIPC_CACHE_DIR with the code objects of moedec_check.sh's variants (the build box's
half of that device call): `python moedec_prebuild.py --variant LABEL:ACT:SETS ...`.
A one-layer Qwen3-30B-A3B-shape GGUF renders the same source as eight layers (one kernel per
shape; the header names the file, hence bench_gpu_moe's name), the LM head at the full
vocabulary."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gpu_moe as b

work = Path("/tmp/moedec-prebuild")
work.mkdir(exist_ok=True)
src = b.write_gguf(work / "qwen3.gguf", dict(b.PRESETS["qwen3-30b-a3b"], layers=1), "q4_0")
for i, spec in enumerate(sys.argv[2::2]):
    label, act, sets = [*spec.split(":", 2), "", ""][:3]
    print(label, f"{b.compile_hipc(src, work / f'{i}.hipc', 'sm_90', act or 'int16', sets):.0f} s")
