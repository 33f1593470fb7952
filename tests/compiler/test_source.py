"""Model references: HF folders (sharded too), the local HF cache, GGUF, bf16/f16 weights."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hipc.base.errors import HipcError
from hipc.base.safetensors_file import SafetensorsFile
from hipc.compiler.source.model import open_model
from hipc.graphs import load_model

from support import require, write_tiny_hf


def test_hf_cache_id_resolves_locally(tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    snap = hub / "models--acme--tiny" / "snapshots" / "abc123"
    write_tiny_hf(snap)
    (hub / "models--acme--tiny" / "refs").mkdir()
    (hub / "models--acme--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    model = load_model("acme/tiny")
    assert model.source.path == snap
    assert model.config.vocab_size == 97


def test_sharded_folder_with_index(tmp_path):
    from safetensors.numpy import save_file

    folder = write_tiny_hf(tmp_path / "m")
    single = SafetensorsFile(folder / "model.safetensors")
    names = sorted(single.entries)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    for shard, part in shards.items():
        save_file({n: np.array(single.load(n)) for n in part}, str(folder / shard))
    weight_map = {n: shard for shard, part in shards.items() for n in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (folder / "model.safetensors").unlink()
    src = open_model(folder)
    assert sorted(src.tensor_names) == names
    np.testing.assert_array_equal(src.load(names[0]), single.load(names[0]))


def test_index_naming_a_missing_shard(tmp_path):
    folder = write_tiny_hf(tmp_path / "m")
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "gone.safetensors"}})
    )
    with pytest.raises(HipcError, match=r"gone\.safetensors"):
        open_model(folder)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_weights_read_exactly(tmp_path, dtype):
    torch = require("torch")
    from safetensors.torch import save_file

    t = torch.randn(7, 33).to(getattr(torch, dtype))
    save_file({"w": t}, str(tmp_path / "w.safetensors"))
    got = SafetensorsFile(tmp_path / "w.safetensors").load("w")
    np.testing.assert_array_equal(got.astype(np.float32), t.float().numpy())


def test_gguf_alias_and_metadata(smollm2_gguf):
    src = open_model("smollm2-135m")
    assert src.format == "gguf" and src.path == smollm2_gguf
    assert src.entry("token_embd.weight") == ("q8_0", (49152, 576))
    assert src.entry("blk.0.ffn_down.weight") == ("q4_1", (576, 1536))
    model = load_model(smollm2_gguf)
    assert model.config.tie_word_embeddings and model.config.rope_interleaved
