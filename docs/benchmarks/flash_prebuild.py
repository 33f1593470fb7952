"""Builds ahead, on a box with nvcc and no GPU, the kernels of the artifacts flash_check.sh
compiles on the GPU machine (hipc's kernel cache, for HIPC_CACHE_DIR; a toolchain that differs
on the device is a miss there, not an error): the tiny models of the three
tests/gpu/test_compiled_gpu.py tests it runs, and the 2-layer Llama-3-8B shape of
bench_gpu_prefill.py (its weights are written to --work and deleted after).

    PYTHONPATH=tests:tests/gpu python docs/benchmarks/flash_prebuild.py HIPC_CACHE [--l8]
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "gpu"), str(ROOT / "docs" / "benchmarks")]


class Compiled(Exception):
    """Raised in place of loading the engine: the test's compile is all that is wanted here."""


def main() -> None:
    os.environ["HIPC_CACHE_DIR"] = str(Path(sys.argv[1]).resolve())
    import pytest
    import test_compiled_gpu as t

    def stop(*_a, **_k):
        raise Compiled

    with pytest.MonkeyPatch.context() as mp, tempfile.TemporaryDirectory() as tmp:
        mp.setattr(t, "load_engine", stop)
        runs = [
            lambda d: t.test_bf16_prefill_policy_on_gpu("llama", d),
            lambda d: t.test_bf16_prefill_policy_on_gpu("mistral-window", d),
        ]
        for i, run in enumerate(runs):
            try:
                run(Path(tmp) / str(i))
            except Compiled:
                print("built", i, flush=True)
        # the hand-off test compiles twice (with and without); each compile stops it once
        from hipc.compiler.kernels.attention import Attention

        for i, off in enumerate((False, True)):
            with pytest.MonkeyPatch.context() as mp2:
                if off:
                    mp2.setattr(Attention, "bf16_reader", lambda *a: None)
                    mp2.setattr(mp2, "setattr", lambda *a: None)  # the test's own switch: done
                try:
                    t.test_attention_bf16_handoff_is_exact_on_gpu(Path(tmp) / f"h{i}", mp2)
                except Compiled:
                    print("built hand-off", off, flush=True)
    if "--l8" in sys.argv:
        from bench_gpu import SHAPES, write_model

        v, d, ff, _, h, kv, theta, tied = SHAPES["l8"]
        SHAPES["l8"] = (v, d, ff, 2, h, kv, theta, tied)
        work = Path(tempfile.mkdtemp(prefix="flash-l8-"))
        try:
            write_model("l8", work / "l8")
            cmd = [sys.executable, "-m", "hipc.cli.main", "compile", str(work / "l8"), "--target"]
            subprocess.run([*cmd, "sm_90", "-o", str(work / "l8.hipc"), "-q"], check=True)
            print("built l8 (2 layers)", flush=True)
        finally:
            shutil.rmtree(work)


if __name__ == "__main__":
    main()
