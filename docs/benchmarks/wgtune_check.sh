#!/usr/bin/env bash
# One short device call for the sm_90a wgmma GEMM (issue 14), <= 90 s on an H200; everything it
# reports goes to stdout (the device returns one log):
#   1. tests/gpu/test_prefill_gemm.py: every tile and cluster variant against NumPy on odd shapes
#      (partial tiles, K not a multiple of 64, T = 1 and 389), the K split's determinism;
#   2. whole tiny bf16 models against the reference (the default policy: wgmma GEMMs with the
#      GLU -> down bf16 hand-off and the batched residual epilogue, inside real plans), and the
#      hand-off against the same model with down's own _xb pass (logits equal bit for bit);
#   3. bench_gpu_gemm.py at the Llama-3-8B layer shapes, 512 and 2048 tokens (the default chunk),
#      for the variants select_wgmma now takes, the plain tiles and 128 x 176 (gate/up at 512
#      tokens: 4.94 waves where 128 x 192 makes 4.55), gate/up also with its bf16 output (_yb),
#      beside cuBLAS.
# The code objects for 1 and 3 are built ahead on the build box (.kcache, keyed by source hash;
# a miss is built here).
#   bash docs/benchmarks/wgtune_check.sh WHEEL_DIR
set -uo pipefail
source docs/benchmarks/install_wheels.sh "$1"
export HIPC_KERNEL_CACHE=$PWD/.kcache
nvidia-smi -L
echo "== tests/gpu/test_prefill_gemm.py"
timeout 28 python3 -m pytest -q -p no:cacheprovider -m gpu -rf tests/gpu/test_prefill_gemm.py 2>&1 \
  | grep -v "^tests/gpu.*PASSED" | tail -15
echo "== whole tiny bf16 models: the hand-off bit for bit, then the default policy"
timeout 15 python3 -m pytest -q -p no:cacheprovider -m gpu -rf tests/gpu/test_compiled_gpu.py \
  -k "test_glu_bf16_handoff_is_exact_on_gpu" 2>&1 | tail -4
timeout 22 python3 -m pytest -q -p no:cacheprovider -m gpu -rf tests/gpu/test_compiled_gpu.py \
  -k "test_bf16_prefill_policy_on_gpu and (llama or qwen2)" 2>&1 | tail -4
echo "== bench_gpu_gemm.py"
timeout 20 python3 docs/benchmarks/bench_gpu_gemm.py --tokens 512,2048 --cache .kcache \
  --tiles wg128x256,wg128x192,wg128x176,wg128x128,wg128x256t2,wg128x256c2p 2>&1 | awk '!seen[$0]++' 
