#!/usr/bin/env bash
# One device call (<= 120 s on an H200) for hybrids batched on GPU targets (issues 11, 13):
#   1. tests/gpu/test_deltanet_gpu.py: the deltanet kernels against NumPy (NaN-poisoned outputs),
#      rows of several sequences each in its slot of the states, and the one-sequence steps;
#   2. tests/gpu/test_batch_hybrid_gpu.py: tiny Qwen3.5 / Qwen3.5-MoE / Qwen3-Next through the
#      BatchEngine (each sequence of a batch = alone; cancel frees blocks and slots; prefix hit);
#   3. tests/gpu/test_batch_gpu.py (dense batching unchanged) and the one-sequence hybrid path
#      (tests/gpu/test_compiled_hybrid_gpu.py, its float32 Qwen3.5 and Qwen3-Next cases).
# Here (the build box), in the repo root:
#   bash docs/benchmarks/hybatch_check.sh prebuild   (.whl: hipc + its wheels; .work/kcache and
#   .work/fatbins: the code objects; .work/hybrid-models: the tiny models)
# On the GPU machine, from the repo root: bash docs/benchmarks/hybatch_check.sh
set -uo pipefail
MODELS=${HIPC_HYBRID_MODELS:-$PWD/.work/hybrid-models}  # copied from /work/main/.work/hybrid-models
TESTS=(tests/gpu/test_batch_hybrid_gpu.py tests/gpu/test_deltanet_gpu.py)
ONE=(tests/gpu/test_compiled_hybrid_gpu.py
     -k "qwen3_5_on_gpu and float32 or qwen3_next_on_gpu and hf or prefix_reuse")

if [ "${1:-}" = prebuild ]; then
  set -e
  mkdir -p .whl .work/kcache
  rm -f .whl/hipc_compiler-*.whl
  cp /work/main/.whl/*.whl .whl/
  rm -f .whl/hipc_compiler-*.whl
  pip wheel -q --no-deps -w .whl .
  export HIPC_CACHE_DIR=$PWD/.work/kcache HIPC_HYBRID_MODELS=/work/main/.work/hybrid-models
  PYTHONPATH=tests:tests/gpu python3 - <<'PY'
import tempfile
from pathlib import Path

import test_batch_hybrid_gpu as t
from hipc.compiler.options import CompileOptions
from hipc.compiler.pipeline import compile_model

# this file's models, and test_compiled_hybrid_gpu.py's prefix-reuse one (16 tokens a step)
for name, step in (("qwen3_5-float32", t.STEP), ("qwen3_5_moe", t.STEP),
                   ("qwen3_next-hf", t.STEP), ("qwen3_5-float32", 16)):
    with tempfile.TemporaryDirectory() as tmp:
        src = t.model(name, Path(tmp))
        opts = CompileOptions(targets=(t.TARGET,), max_context=t.CONTEXT, max_tokens=step,
                              prefill_precision="split")
        compile_model(src, Path(tmp) / "m.hipc", opts, verbose=False)
        print("prebuilt", name)

import test_batch_gpu as dense  # noqa: E402

for policy in ("split", "bf16"):
    with tempfile.TemporaryDirectory() as tmp:
        dense.compiled_model(Path(tmp), policy)
        print("prebuilt dense", policy)
PY
  # test_deltanet_gpu.py's kernels, by source hash (tests/gpu_kernels.compiled)
  mkdir -p .work/fatbins
  PYTHONPATH=tests:tests/gpu python3 - <<'PY'
from pathlib import Path

from deltanet_cases import device_specs
from gpu_kernels import compiled, kernels_source

specs, _, _ = device_specs("sm_90")
compiled(kernels_source(specs, "sm_90", "split"), "sm_90", Path(".work/fatbins"))
PY
  rm -rf .work/hybrid-models && cp -r /work/main/.work/hybrid-models .work/
  # test_server_gpu.py's hybrid with a tokenizer, and its code object
  PYTHONPATH=tests:tests/server python3 - <<'PY'
import tempfile
from pathlib import Path

import test_server_gpu as t
from hipc.cli.main import main

folder = t.write_served_hybrid(Path(".work/hybrid-models") / t.SERVED)
with tempfile.TemporaryDirectory() as tmp:
    out = str(Path(tmp) / "h.hipc")
    assert main(["compile", str(folder), "-o", out, *t.HYBRID_FLAGS]) == 0
PY
  ls .whl .work/kcache .work/fatbins | head -30
  exit 0
fi

source docs/benchmarks/install_wheels.sh .whl
export HIPC_HYBRID_MODELS=$MODELS HIPC_CACHE_DIR=$PWD/.work/kcache HIPC_KERNEL_CACHE=$PWD/.work/fatbins
nvidia-smi -L
LOG=${OUT:-/tmp}/hybatch.log
section() {  # section NAME SECONDS PYTEST-ARGS...: the tests, bounded, everything printed
  local name=$1 limit=$2
  shift 2
  echo "== $name (<= ${limit} s)"
  local t0=$SECONDS
  timeout "$limit" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE --tb=short "$@" \
    > "$LOG.$name" 2>&1
  local rc=$?
  tail -60 "$LOG.$name"
  local last
  last=$(grep -E '(passed|failed|error|skipped|deselected).* in [0-9.]+s' "$LOG.$name" | tail -1)
  echo "$name | rc $rc | ${last:-no summary (timed out?)} | $((SECONDS - t0)) s" >> /tmp/hybatch_table
}
rm -f /tmp/hybatch_table
section batch-hybrid 45 tests/gpu/test_batch_hybrid_gpu.py
section deltanet 20 tests/gpu/test_deltanet_gpu.py
section one-sequence-hybrid 20 "${ONE[@]}"
section server-hybrid 15 tests/server/test_server_gpu.py -k hybrid
section dense-batch 15 tests/gpu/test_batch_gpu.py
echo "== summary: section | pytest's last line | seconds"
cat /tmp/hybatch_table
