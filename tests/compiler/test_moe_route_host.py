"""The GPU kernels' routing (templates/hip/moe_route.hip.j2: hipc_moe_route) compiled for
the host (HIPC_HOST, one thread as a block of one wave of one lane) on a machine with no GPU:
routes against the reference executor's router (compiler/reference/ops.py), and exact ties
ordered as torch.topk orders them on the CPU, through every path of the replay
(std::partial_sort for k * 64 <= E; nth_element, then introsort past 16 when k > 17).
tests/gpu runs the same code inside the kernels, one block of many threads per token.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from hipc.compiler.codegen.environment import render, template_text
from hipc.compiler.ir import Node
from hipc.compiler.reference.ops import IMPLS

CXX = shutil.which("g++") or shutil.which("clang++")

WRAPPER = r"""
#include <vector>
extern "C" void route(const float* logits, int T, int E, int K, int normalize, int* ids, float* w) {
  std::vector<float> p(E);
  std::vector<hipc_moe_pair> q(E);
  float red[32];
  int tie;
  for (int t = 0; t < T; ++t)
    hipc_moe_route(logits + (size_t)t * E, E, K, normalize != 0, p.data(), ids + (size_t)t * K,
                   w + (size_t)t * K, q.data(), red, &tie);
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    if CXX is None:
        pytest.skip("no C++ compiler")
    root = tmp_path_factory.mktemp("route")
    prelude = template_text("hip/prelude.h").replace("#pragma once", "")
    src = root / "route.cpp"
    # a wave of one lane: the block reductions and ranks run on the one host thread
    src.write_text(f"#define HIPC_WAVE 1\n{prelude}\n{render('hip/moe_route.hip.j2')}\n{WRAPPER}")
    so = root / "route.so"
    cmd = [CXX, "-std=c++20", "-O1", "-DHIPC_HOST", "-shared", "-fPIC", str(src), "-o", str(so)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return ctypes.CDLL(str(so))


def run(lib, logits: np.ndarray, k: int, normalize: bool):
    T, E = logits.shape
    logits = np.ascontiguousarray(logits, np.float32)
    ids = np.zeros((T, k), np.int32)
    w = np.zeros((T, k), np.float32)
    vp = ctypes.c_void_p
    lib.route(logits.ctypes.data_as(vp), T, E, k, int(normalize), ids.ctypes.data_as(vp),
              w.ctypes.data_as(vp))  # fmt: skip
    return ids, w


def reference(logits: np.ndarray, k: int, normalize: bool):
    node = Node("r", "MoERouter", ("l",), ("i", "w"), {"top_k": k, "normalize": int(normalize)})
    return IMPLS["hipc::MoERouter"](node, [logits], None)


@pytest.mark.parametrize(
    "E,k,normalize", [(7, 2, True), (64, 8, False), (128, 8, True), (5, 1, False)]
)
def test_route_matches_reference(lib, E, k, normalize):
    rng = np.random.default_rng(E * k)
    logits = (2 * rng.standard_normal((13, E))).astype(np.float32)
    ids, w = run(lib, logits, k, normalize)
    want_ids, want_w = reference(logits, k, normalize)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(w, want_w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "E,k", [(9, 2), (9, 8), (64, 1), (130, 2), (128, 8), (5, 5), (40, 20), (300, 40)]
)
def test_route_ties_in_torchs_order(lib, E, k):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(E + k)
    logits = rng.integers(0, 3, size=(40, E)).astype(np.float32)
    ids, _ = run(lib, logits, k, False)
    want = torch.topk(torch.softmax(torch.from_numpy(logits), dim=-1), k, dim=-1).indices.numpy()
    np.testing.assert_array_equal(ids, want)
