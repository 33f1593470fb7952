"""The reference executor's bfloat16 KV cache: the storage GPU artifacts use by default.

Compiled artifacts are checked against a reference that stores its cache the same way,
so the rounding itself is checked here against torch's own float32 -> bfloat16 cast.
"""

from __future__ import annotations

import numpy as np
import pytest

from hipc.base.errors import HipcError
from hipc.compiler.reference.engine import ReferenceEngine
from hipc.graphs import load_model

from support import rel_err, require, write_tiny_hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(write_tiny_hf(tmp_path_factory.mktemp("kv") / "tiny"))


def test_bfloat16_rounding_matches_torch(tiny):
    torch = require("torch")
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            rng.standard_normal(10000).astype(np.float32) * 10.0 ** rng.integers(-6, 6, 10000),
            # ties to even, both ways; the largest finite values; signed zeros
            np.array([0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x80000000, 0], np.uint32).view(
                np.float32
            ),
        ]
    ).astype(np.float32)
    ref = ReferenceEngine(tiny, 16, kv_storage="bfloat16").executor.store_kv(x)
    want = torch.from_numpy(x).to(torch.bfloat16).to(torch.float32).numpy()
    np.testing.assert_array_equal(ref.view(np.uint32), want.view(np.uint32))


def test_bfloat16_cache_changes_logits_slightly(tiny):
    tokens = np.random.default_rng(1).integers(0, tiny.config.vocab_size, 24).tolist()
    f32 = ReferenceEngine(tiny, 64).logits(tokens, 0)
    bf16 = ReferenceEngine(tiny, 64, kv_storage="bfloat16").logits(tokens, 0)
    err = rel_err(bf16, f32)
    assert 0 < err < 2e-2  # rounded (not identical), and close
    assert np.mean(bf16.argmax(-1) == f32.argmax(-1)) >= 0.9


def test_unknown_kv_storage(tiny):
    with pytest.raises(HipcError, match="KV storage"):
        ReferenceEngine(tiny, 16, kv_storage="int4")
