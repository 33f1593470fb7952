"""Builds ahead, on a box with nvcc and no GPU, what hybridgpu_check.sh would compile on the
GPU machine, so that its device time runs kernels instead of nvcc: the code objects of
tests/gpu/test_deltanet_gpu.py and bench_gpu_deltanet.py (by source hash, for
HIPC_KERNEL_CACHE) and the kernels of the end-to-end hybrid artifacts the check compiles
(hipc's kernel cache, for HIPC_CACHE_DIR; a toolchain that differs on the device is a miss
there, not an error).

    PYTHONPATH=tests python docs/benchmarks/hybridgpu_prebuild.py KERNEL_CACHE HIPC_CACHE MODELS
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "docs" / "benchmarks"))

ARCH = "sm_90"
# (model under MODELS, max_tokens) as tests/gpu/test_compiled_hybrid_gpu.py compiles them
E2E = [("qwen3_5-float32", 16), ("qwen3_5-float32", 64), ("qwen3_next-hf", 64)]


def main() -> None:
    kernel_cache, hipc_cache, models = (Path(a).resolve() for a in sys.argv[1:4])
    os.environ["HIPC_CACHE_DIR"] = str(hipc_cache)
    import bench_gpu_deltanet
    from deltanet_cases import device_specs

    from hipc.compiler.options import CompileOptions
    from hipc.compiler.pipeline import compile_model

    from gpu_kernels import compiled, kernels_source

    for what, specs in (
        ("tests/gpu/test_deltanet_gpu.py", device_specs(ARCH)[0]),
        ("bench_gpu_deltanet.py", bench_gpu_deltanet.kernels(ARCH)[2]),
    ):
        compiled(kernels_source(specs, ARCH), ARCH, kernel_cache)
        print("built", what, flush=True)
    for name, max_tokens in E2E:
        opts = CompileOptions(
            targets=(ARCH,), max_context=192, max_tokens=max_tokens, prefill_precision="split"
        )
        with tempfile.TemporaryDirectory() as tmp:
            compile_model(models / name, Path(tmp) / "m.hipc", opts, verbose=False)
        print("built", name, max_tokens, flush=True)


if __name__ == "__main__":
    main()
