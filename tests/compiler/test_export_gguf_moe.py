"""hipc compile --export-gguf on MoE models (tiny random-init HF folders of tests/graphs/test_moe.py).

- the exported file read by gguf-py: llama.cpp's names and metadata keys (gguf-py's own
  constants), the experts stacked 3-D in Q8_0 [E, rows, cols], dequantized by gguf-py within a
  Q8_0 step of each source expert in its slot (the order llama.cpp routes by), the router and
  Qwen2-MoE's shared-expert gate ([H]) as float32;
- the file compiled by hipc: the --quant artifact's logits;
- the file read by transformers' GGUF loader (qwen2moe, qwen3moe: the architectures it maps)
  against the reference executor on the same quantized weights;
- the file loaded by llama.cpp (llama-cpp-python with the lead's CPU build: LLAMA_CPP_LIB_PATH,
  skipped where not importable): float32 exports give hipc's logits within llama.cpp's own
  rounding (measured <= 6.3e-4); Q8_0 ones within what llama.cpp's 8-bit activations add
  (measured 1.2e-2 mixtral, 1.3e-2 olmoe, 9.8e-2 qwen3moe, 0.19 qwen2moe; llama.cpp given the
  same file's blocks dequantized by gguf-py as float32 lands 5e-4 from hipc, so the blocks are
  read alike and the rest is its integer dot products), hence the loose 0.25; a misplaced
  expert or row is O(1) (models of other seeds differ by ~1);
- what llama.cpp would read as another model refused in one line (exit 2, no file).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from hipc.cli.main import main
from hipc.compiler.options import CompileOptions
from hipc.compiler.pipeline import compile_model
from hipc.compiler.reference.engine import ReferenceEngine
from hipc.graphs import load_model
from hipc.runtime.engine import load_engine

from support import rel_err, require

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "graphs"))  # the MoE families
from test_moe import make_moe_model

pytestmark = pytest.mark.oracle
CTX = 64
SHAPES = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
# name -> (test_moe family, GGUF arch, overrides); hidden 64 and widths of 32: whole Q8_0 blocks
CASES = {
    "qwen3moe": (
        "qwen3_moe-e7-k2-norm-mlp_only",
        "qwen3moe",
        dict(mlp_only_layers=[], moe_intermediate_size=32, head_dim=16),
    ),
    "qwen2moe-shared": (
        "qwen2_moe-e5-k1-shared",
        "qwen2moe",
        dict(moe_intermediate_size=32, shared_expert_intermediate_size=64),
    ),
    "mixtral": ("mixtral-e8-k1", "llama", dict(intermediate_size=32)),
    "olmoe": ("olmoe-e13-k8", "olmoe", dict(intermediate_size=32, num_key_value_heads=4)),
}


def tiny_moe(case: str, folder: Path, fused: bool = False):
    """The case's model saved as an HF folder, norms set to 1, routers scaled by 0.1 and the
    other matrices by 0.5 (random norm scales, sharp routers and gains above 1 make these
    tiny models amplify any rounding); `fused`: experts stored as transformers >= 5 holds
    them (gate_up_proj [E, 2F, H], down_proj [E, H, F])."""
    torch = require("torch")
    family, _, overrides = CASES[case]
    src = make_moe_model(family, **{**SHAPES, **overrides})
    with torch.no_grad():
        for name, p in src.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("mlp.gate.weight"):
                p.mul_(0.1)  # routers near uniform: rounding rarely flips the top-k
            elif "embed" not in name:
                p.mul_(0.5)
    src.save_pretrained(folder)
    if fused:
        _fuse_experts(folder)
    return src


def _fuse_experts(folder: Path) -> None:
    from safetensors.numpy import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    out, experts = {}, {}
    for name, arr in state.items():
        parts = name.split(".")
        if "experts" in parts:
            i, e, proj = parts[2], int(parts[5]), parts[6]
            experts.setdefault((i, proj), {})[e] = arr
        else:
            out[name] = arr
    for i in sorted({i for i, _ in experts}):
        stack = {p: np.stack([v for _, v in sorted(experts[i, p].items())]) for p in ("gate_proj", "up_proj", "down_proj")}  # fmt: skip
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.concatenate(
            [stack["gate_proj"], stack["up_proj"]], axis=1
        )
        out[f"model.layers.{i}.mlp.experts.down_proj"] = stack["down_proj"]
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module", params=sorted(CASES))
def exported(request, tmp_path_factory):
    """(case, source model, HF folder, --quant q8_0 artifact, the exported GGUF)."""
    case = request.param
    root = tmp_path_factory.mktemp(case)
    src = tiny_moe(case, root / "m")
    path = root / "m.gguf"
    opts = CompileOptions(quant="q8_0", max_context=CTX)
    art = compile_model(root / "m", root / "q.hipc", opts, verbose=False, export_gguf=path)
    return case, src, root / "m", art.artifact, path


def test_exported_moe_gguf_layout(exported):
    gguf = require("gguf")
    case, src, _, _, path = exported
    _, arch, _ = CASES[case]
    cfg = src.config
    reader = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items()}
    tensors = {t.name: t for t in reader.tensors}
    keys = gguf.Keys.LLM
    E = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    F = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    H = cfg.hidden_size
    assert meta["general.architecture"] == arch
    assert meta[keys.EXPERT_COUNT.format(arch=arch)] == E
    assert meta[keys.EXPERT_USED_COUNT.format(arch=arch)] == cfg.num_experts_per_tok
    assert meta[keys.EXPERT_FEED_FORWARD_LENGTH.format(arch=arch)] == F
    shared = getattr(cfg, "shared_expert_intermediate_size", 0)
    if shared:
        assert meta[keys.EXPERT_SHARED_FEED_FORWARD_LENGTH.format(arch=arch)] == shared
    state = {k: v.detach().float().numpy() for k, v in src.state_dict().items()}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.mlp"
        router = tensors[f"blk.{i}.ffn_gate_inp.weight"]
        assert router.tensor_type.name == "F32"
        np.testing.assert_array_equal(
            np.asarray(router.data).reshape(E, H), state[f"{p}.gate.weight"]
        )
        want = _experts(state, p, E, F)
        for g in ("gate", "up", "down"):
            t = tensors[f"blk.{i}.ffn_{g}_exps.weight"]
            assert t.tensor_type.name == "Q8_0"
            got = gguf.quants.dequantize(t.data, t.tensor_type)
            assert got.shape == want[g].shape == ((E, H, F) if g == "down" else (E, F, H))
            # within half a Q8_0 step of each block (expert e in slot e)
            assert np.all(np.abs(got - want[g]) <= np.abs(want[g]).max() / 127 / 2 + 1e-7), g
        if shared:
            gate = tensors[f"blk.{i}.ffn_gate_inp_shexp.weight"]
            assert gate.tensor_type.name == "F32" and list(gate.shape) == [H]
            np.testing.assert_array_equal(
                gate.data, state[f"model.layers.{i}.mlp.shared_expert_gate.weight"].reshape(H)
            )
            assert tensors[f"blk.{i}.ffn_down_shexp.weight"].tensor_type.name == "Q8_0"


def _experts(state: dict, p: str, E: int, F: int) -> dict[str, np.ndarray]:
    """gate/up [E, F, H] and down [E, H, F] from transformers' modules: fused as
    transformers >= 5 holds them, or one module per expert."""
    if f"{p}.experts.gate_up_proj" in state:
        gate_up = state[f"{p}.experts.gate_up_proj"]
        down = state[f"{p}.experts.down_proj"]
        return {"gate": gate_up[:, :F], "up": gate_up[:, F:], "down": down}
    return {
        g: np.stack([state[f"{p}.experts.{e}.{g}_proj.weight"] for e in range(E)])
        for g in ("gate", "up", "down")
    }


def test_exported_moe_gguf_compiles_to_the_same_model(exported, tmp_path):
    _, _, _, art, path = exported
    again = compile_model(path, tmp_path / "g.hipc", CompileOptions(max_context=CTX), verbose=False)
    ids = np.random.default_rng(4).integers(0, 211, 23).tolist()
    a, b = load_engine(art, "cpu"), load_engine(again.artifact, "cpu")
    # measured 0 for the NeoX-RoPE archs; Mixtral's Q/K rows permuted for llama.cpp's
    # interleaved RoPE sum in another order (1.1e-4 with random norm scales)
    assert rel_err(b.logits(ids), a.logits(ids)) <= 1e-3


def test_fused_expert_checkpoint_exports(tmp_path):
    """gate_up_proj [E, 2F, H] split into ffn_gate_exps / ffn_up_exps by rows (Q8_0 blocks
    as stored): the same file, byte for byte in its tensors, as from per-expert tensors."""
    gguf = require("gguf")
    files = {}
    for fused in (False, True):
        folder = tmp_path / f"m{int(fused)}"
        tiny_moe("qwen3moe", folder, fused=fused)
        files[fused] = folder.with_suffix(".gguf")
        opts = CompileOptions(quant="q8_0", max_context=CTX)
        compile_model(
            folder, tmp_path / f"{fused}.hipc", opts, verbose=False, export_gguf=files[fused]
        )
    a, b = ({t.name: t for t in gguf.GGUFReader(files[f]).tensors} for f in (False, True))
    assert a.keys() == b.keys() and "blk.0.ffn_up_exps.weight" in a
    for name in a:
        np.testing.assert_array_equal(np.asarray(a[name].data), np.asarray(b[name].data), name)


def test_exported_moe_gguf_read_by_transformers(exported):
    transformers = require("transformers")
    torch = require("torch")
    case, src, folder, _, path = exported
    if CASES[case][1] not in ("qwen2moe", "qwen3moe"):
        pytest.skip("transformers' GGUF loader maps no MoE under llama and no olmoe")
    # transformers maps no expert_feed_forward_length: the config comes from the source
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, config=src.config, dtype=torch.float32
    ).eval()
    ids = np.random.default_rng(6).integers(0, 211, 19).tolist()
    with torch.no_grad():
        got = hf(torch.tensor([ids])).logits[0].numpy()
    want = ReferenceEngine(load_model(folder), CTX, quant="q8_0").logits(ids, 0)
    assert rel_err(got, want) <= 1e-4


@pytest.fixture
def llama_cpp(monkeypatch):
    llama_cpp = pytest.importorskip("llama_cpp")
    capi = llama_cpp.llama_cpp
    default_params = capi.llama_model_default_params

    def no_repack():
        # llama.cpp's AMX weight repacking segfaults on AMX CPUs (ggml-org/llama.cpp#20824)
        params = default_params()
        params.use_extra_bufts = False
        return params

    monkeypatch.setattr(capi, "llama_model_default_params", no_repack)
    return llama_cpp


def _llama_cpp_logits(llama_cpp, path: Path, ids: list[int]) -> np.ndarray:
    llm = llama_cpp.Llama(str(path), n_ctx=CTX, logits_all=True, verbose=False)
    llm.eval(ids)
    return np.asarray(llm.scores[: len(ids)])


def test_exported_moe_gguf_loads_in_llama_cpp(exported, llama_cpp, tmp_path):
    case, _, folder, art, path = exported
    ids = np.random.default_rng(8).integers(0, 211, 21).tolist()
    got = _llama_cpp_logits(llama_cpp, path, ids)
    err_q8 = rel_err(got, load_engine(art, "cpu").logits(ids))
    # float32 weights: llama.cpp's own rounding only
    f32 = tmp_path / "f32.gguf"
    opts = CompileOptions(max_context=CTX)
    float_art = compile_model(folder, tmp_path / "f.hipc", opts, verbose=False, export_gguf=f32)
    got = _llama_cpp_logits(llama_cpp, f32, ids)
    err_f32 = rel_err(got, load_engine(float_art.artifact, "cpu").logits(ids))
    assert err_q8 <= 0.25 and err_f32 <= 1e-2, (case, err_q8, err_f32)


REFUSED = {
    "dense layers": ("qwen2_moe-e11-k3-shared-norm-step2", {}, "dense"),
    "renormalisation": (
        "qwen3_moe-e7-k2-norm-mlp_only",
        dict(mlp_only_layers=[], norm_topk_prob=False),
        "always renormalises",
    ),
    "olmoe clip": (
        "olmoe-e5-k2-norm-clip",
        dict(norm_topk_prob=False, num_key_value_heads=4),
        "clip_qkv",
    ),
    "olmoe gqa": ("olmoe-e13-k8", {}, "key/value heads"),
}


@pytest.mark.parametrize("what", sorted(REFUSED))
def test_export_refuses_what_llama_cpp_reads_otherwise(tmp_path, capsys, what):
    family, overrides, words = REFUSED[what]
    make_moe_model(family, **overrides).save_pretrained(tmp_path / "m")
    out = ["-o", str(tmp_path / "m.hipc"), "--export-gguf", str(tmp_path / "m.gguf"), "-q"]
    rc = main(["compile", str(tmp_path / "m"), *out])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("hipc: error: --export-gguf") and words in err[-1], err
    assert not (tmp_path / "m.gguf").exists()


def test_per_expert_gguf_source_exports_stacked(tmp_path):
    """An early Mixtral GGUF (one Q8_0 tensor per expert, blk.N.ffn_gate.E.weight) goes out
    stacked as ffn_gate_exps, its blocks as they were, and compiles to the same logits."""
    gguf = require("gguf")
    from gguf_writer import write_gguf

    src = make_moe_model("mixtral-e8-k1", **SHAPES, intermediate_size=32)
    path = write_gguf(src, tmp_path / "m.gguf", "llama", "Q8_0", per_expert=True, tokenizer=False)
    out = tmp_path / "x.gguf"
    opts = CompileOptions(max_context=CTX)
    art = compile_model(path, tmp_path / "m.hipc", opts, verbose=False, export_gguf=out).artifact
    before = {t.name: t for t in gguf.GGUFReader(path).tensors}
    after = {t.name: t for t in gguf.GGUFReader(out).tensors}
    stacked = after["blk.1.ffn_down_exps.weight"]
    assert stacked.tensor_type.name == "Q8_0" and "blk.1.ffn_down.0.weight" not in after
    for e in range(8):
        np.testing.assert_array_equal(
            np.asarray(stacked.data)[e], np.asarray(before[f"blk.1.ffn_down.{e}.weight"].data)
        )
    again = compile_model(out, tmp_path / "g.hipc", opts, verbose=False).artifact
    ids = np.random.default_rng(9).integers(0, 211, 17).tolist()
    assert (
        rel_err(load_engine(again, "cpu").logits(ids), load_engine(art, "cpu").logits(ids)) <= 1e-5
    )
