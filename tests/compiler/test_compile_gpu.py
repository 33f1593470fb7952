"""GPU targets compiled without a GPU: nvcc for sm_90, clang for gfx1100 and gfx942.

The code objects must exist, be the right kind of file, and hold every kernel the
plan launches; bf16 linears must prefill on the target's matrix instructions (read from
the PTX / the disassembly), other weight types on the SIMT GEMM. They run only on the GPU
machine (tests/gpu).
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from hipc.base.errors import HipcError
from hipc.compiler.kernels.linear import MMA_TILES
from hipc.compiler.options import CompileOptions
from hipc.compiler.pipeline import compile_model
from hipc.compiler.toolchains.gpu import NvccToolchain

from gguf_writer import write_numpy_gguf, write_q6k_head_gguf
from support import IN_CI, TINY_FAMILIES, TINY_GEMMA, write_tiny_hf

CLANG = shutil.which("clang++-19") or shutil.which("clang++")
OBJDUMP = shutil.which("llvm-objdump-19") or shutil.which("llvm-objdump")


def need(tool: str | None, name: str) -> None:
    if tool is None:
        if IN_CI:
            pytest.fail(f"{name} is required under CI=true (.ci/run installs it)")
        pytest.skip(f"{name} not installed")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    need(shutil.which("nvcc"), "nvcc")
    need(CLANG, "clang++-19")
    root = tmp_path_factory.mktemp("gpu")
    folder = write_tiny_hf(root / "m", **TINY_FAMILIES["qwen3-qknorm"])
    out = root / "m.hipc"
    compile_model(
        folder,
        out,
        CompileOptions(targets=("sm_90", "gfx1100", "gfx942"), max_context=64),
        verbose=False,
    )
    return out


def compiled(root, model, targets):
    need(shutil.which("nvcc"), "nvcc")
    need(CLANG, "clang++-19")
    out = root / "m.hipc"
    compile_model(model, out, CompileOptions(targets=targets, max_context=64), verbose=False)
    return out


# the instruction each target's prefill GEMM must show for bf16 weights
MMA_INSTRUCTION = {
    "sm_90": "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
    "gfx1100": "v_wmma_f32_16x16x16_bf16",
    "gfx942": "v_mfma_f32_16x16x16_bf16",
    "gfx90a": "v_mfma_f32_16x16x16bf16_1k",  # CDNA2's spelling of the same operation
}


@pytest.fixture(scope="module")
def bf16_artifact(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16")
    model = write_tiny_hf(root / "m", dtype="bfloat16", hidden_size=64, intermediate_size=96)
    return compiled(root, model, tuple(MMA_INSTRUCTION))


@pytest.fixture(scope="module")
def q8_artifact(tmp_path_factory):
    root = tmp_path_factory.mktemp("q8")
    return compiled(root, write_numpy_gguf(root / "m.gguf", "Q8_0"), ("sm_90", "gfx942", "gfx1100"))


def kernel_code(artifact, target) -> dict[str, str]:
    """Each kernel's code: PTX on NVIDIA (from the artifact's source), disassembly on AMD."""
    if target.startswith("sm_"):
        ptx = NvccToolchain(target).ptx((artifact / "kernels" / f"{target}.hip").read_text())
        parts = ptx.split(".entry ")[1:]
        return {part.split("(", 1)[0].strip(): part for part in parts}
    need(OBJDUMP, "llvm-objdump-19")
    co = artifact / "kernels" / f"{target}.co"
    dis = subprocess.run([OBJDUMP, "-d", str(co)], capture_output=True, text=True, check=True)
    code: dict[str, str] = {}
    name = None
    for line in dis.stdout.splitlines():
        if line.endswith(">:"):
            name = line.split("<")[1].rstrip(">:")
            code[name] = ""
        elif name:
            code[name] += line + "\n"
    return code


def prefill_linears(artifact, target) -> list[dict]:
    plan = json.loads((artifact / "plan.json").read_text())["targets"][target]["steps"]
    return [x for x in plan["prefill"] if x["kernel"].endswith(("_gemm", "_mma"))]


@pytest.mark.parametrize("target", sorted(MMA_INSTRUCTION))
def test_bf16_prefill_on_matrix_instructions(bf16_artifact, target):
    linears = prefill_linears(bf16_artifact, target)
    assert len(linears) == 2 * 4 + 1  # per layer qkv, o, gate/up, down; then the lm head
    tile = MMA_TILES[target]
    code = kernel_code(bf16_artifact, target)
    for launch in linears:
        name = launch["kernel"]
        assert name.endswith("_mma"), name
        assert launch["block"] == [256] and launch["shared"] == tile.shared_bytes()
        assert launch["grid"][1] in (f"cdiv(T,{tile.bm})", f"cdiv(rows,{tile.bm})")
        assert MMA_INSTRUCTION[target] in code[name], name
        if target.startswith("sm_"):
            assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in code[name]
    # decode stays on the GEMV; its code has no matrix instruction
    gemv = [k for k in code if k.endswith("_gemv")]
    assert gemv and not any(MMA_INSTRUCTION[target] in code[k] for k in gemv)


@pytest.mark.parametrize("target", ["sm_90", "gfx942"])
def test_other_weight_types_prefill_on_the_simt_gemm(artifact, target):
    linears = prefill_linears(artifact, target)  # float32 weights
    assert linears and all(x["kernel"].endswith("_gemm") for x in linears)
    assert all(x["block"] == [256] and x["shared"] == 0 for x in linears)


def test_quantized_prefill_on_matrix_instructions_where_they_fit(q8_artifact):
    """Q8_0 prefill: NVIDIA's mma.sync GEMM (integer quants in the tiles, scales in float32);
    CDNA's 64 KiB of LDS cannot hold its 32-deep stages with the scales: SIMT there."""
    linears = prefill_linears(q8_artifact, "sm_90")
    tile = MMA_TILES["sm_90"]
    assert linears and all(x["kernel"].endswith("_mma") for x in linears)
    assert all(x["shared"] == tile.shared_bytes(quant=True) for x in linears)
    code = kernel_code(q8_artifact, "sm_90")
    assert all("mma.sync" in code[x["kernel"]] for x in linears)
    linears = prefill_linears(q8_artifact, "gfx942")
    assert linears and all(x["kernel"].endswith("_gemm") for x in linears)
    assert not any("mfma" in c for c in kernel_code(q8_artifact, "gfx942").values())


# the integer dot product each target's quantized GEMV must show (PTX / AMD disassembly)
DOT4_INSTRUCTION = {
    "sm_90": "dp4a.s32.s32",
    "gfx942": "v_dot4c_i32_i8",
    "gfx1100": "v_dot4_i32_iu8",
}


@pytest.mark.parametrize("target", sorted(DOT4_INSTRUCTION))
def test_quantized_gemv_multiplies_int8(q8_artifact, target):
    """Q8_0 decode GEMVs dot int8 weights with x staged as int8 planes in one instruction."""
    code = kernel_code(q8_artifact, target)
    gemv = [k for k in code if k.endswith("_gemv")]
    assert gemv and all(DOT4_INSTRUCTION[target] in code[k] for k in gemv)


def launched_kernels(artifact, target):
    plan = json.loads((artifact / "plan.json").read_text())
    steps = plan["targets"][target]["steps"]
    return {launch["kernel"] for launch in steps["decode"] + steps["prefill"]}


def test_nvidia_fatbin_holds_every_kernel(artifact):
    fatbin = (artifact / "kernels" / "sm_90.fatbin").read_bytes()
    assert fatbin[:4] == bytes.fromhex("50ed55ba")  # fatbin magic
    for name in launched_kernels(artifact, "sm_90"):
        assert name.encode() in fatbin, name


@pytest.mark.parametrize("target", ["gfx1100", "gfx942"])
def test_amd_code_object_holds_every_kernel(artifact, target):
    need(OBJDUMP, "llvm-objdump-19")
    co = artifact / "kernels" / f"{target}.co"
    assert co.read_bytes()[:4] == b"\x7fELF"
    dis = subprocess.run(
        [OBJDUMP, "-d", str(co)], capture_output=True, text=True, check=True
    ).stdout
    defined = {line.split("<")[1].rstrip(">:") for line in dis.splitlines() if line.endswith(">:")}
    assert launched_kernels(artifact, target) <= defined
    # wave64 on CDNA, wave32 on RDNA: the attention block is 8 waves of either
    steps = json.loads((artifact / "plan.json").read_text())["targets"][target]["steps"]
    attn = next(x for x in steps["prefill"] if x["kernel"].endswith("_attn"))
    assert attn["block"] == [8 * (64 if target == "gfx942" else 32)]
    assert "v_exp_f32" in dis  # the softmax uses the hardware exp, not a library call


def test_gpu_plan_matches_the_runtime_reader(artifact):
    from hipc.base.launch_plan import Bases, TargetPlan

    plan = json.loads((artifact / "plan.json").read_text())
    gp = TargetPlan.from_json(plan, "sm_90")
    bases = Bases(
        arena=1 << 32,
        scratch=2 << 32,
        weights=tuple(range(100, 100 + len(plan["weights"]))),
        states=tuple(range(500, 500 + len(plan["states"]))),
        ids=7,
        start=8,
        logits=9,
    )
    for launch in gp.prefill:
        args = launch.resolve(bases, T=5, rows=1)
        assert all(t in ("u64", "i32") for t, _ in args)
        assert all(d >= 1 for d in launch.grid_dims(5, 1))
    # decode = prefill without the GEMM norm stats, one attention kernel per layer where
    # prefill runs RoPE+KV then attention; every decode kernel may overlap the one before
    stats = sum(1 for x in gp.prefill if x.kernel.endswith("_stats"))
    attn = [x for x in gp.decode if x.kernel.endswith("_decode")]
    assert len(attn) == 2  # one per layer of the tiny model
    assert len(gp.decode) == len(gp.prefill) - stats - len(attn)
    assert all(x.overlap for x in gp.decode) and not any(x.overlap for x in gp.prefill)
    # max_context 64 is a single chunk of 4 waves x 32 keys: one block per head
    heads = json.loads((artifact / "manifest.json").read_text())["config"]["num_heads"]
    assert attn[0].grid_dims(1, 1) == (heads, 1, 1)
    # the counters the merging blocks reset live inside the scratch buffer
    counters = attn[0].args[11]
    assert counters["kind"] == "scratch"
    assert counters["offset"] + 4 * attn[0].grid[0] <= gp.scratch_bytes


def test_gpu_kv_cache_is_bfloat16_by_default(artifact):
    plan = json.loads((artifact / "plan.json").read_text())
    assert {s["dtype"] for s in plan["states"]} == {"bfloat16"}
    source = (artifact / "kernels" / "sm_90.hip").read_text()
    assert "uint16_t* k_cache" in source and "hipc_kv_store_bf16" in source


def test_gpu_target_without_its_toolchain(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvcc, no clang
    folder = write_tiny_hf(tmp_path / "m")
    with pytest.raises(HipcError, match="nvcc"):
        compile_model(
            folder, tmp_path / "x.hipc", CompileOptions(targets=("sm_90",)), verbose=False
        )
    assert not (tmp_path / "x.hipc").exists()


@pytest.mark.parametrize("targets", [("sm_90",), ("cpu", "sm_90")], ids=["gpu", "cpu+gpu"])
def test_quantized_blocks_split_for_gpu_targets(tmp_path, targets):
    """A GPU-only artifact stores quantized blocks split (quants, then scales); one that also
    holds the cpu target keeps GGUF's order. Either way the bytes dequantize (gguf-py) to
    the file's tensor."""
    import gguf
    import numpy as np

    from hipc.base.safetensors_file import SafetensorsFile

    model = write_numpy_gguf(tmp_path / "m.gguf", "Q4_0")
    art = compiled(tmp_path, model, targets)
    plan = json.loads((art / "plan.json").read_text())
    spec = next(w for w in plan["weights"] if w["name"] == "token_embd.weight")
    want_layout = "gguf" if "cpu" in targets else "split"
    assert spec["dtype"] == "q4_0" and spec["layout"] == want_layout
    stored = np.asarray(SafetensorsFile(art / "weights.safetensors").raw(spec["name"]))
    if want_layout == "split":
        n = stored.size // 18  # blocks: 16 bytes of quants each, then 2 bytes of scale each
        quants, scales = stored.reshape(-1)[: 16 * n], stored.reshape(-1)[16 * n :]
        stored = np.concatenate([scales.reshape(n, 2), quants.reshape(n, 16)], axis=1)
    tensor = next(t for t in gguf.GGUFReader(model).tensors if t.name == "token_embd.weight")
    got = gguf.quants.dequantize(stored.reshape(-1), gguf.GGMLQuantizationType.Q4_0)
    want = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    np.testing.assert_array_equal(got.reshape(want.shape), want)


def test_q6_k_output_compiles_for_gpus_and_cpu(tmp_path):
    """llama-quantize's Q4_0 files keep the output matrix in Q6_K: GPU targets have a kernel
    for it (stored split like the others), and so has the cpu target (in GGUF order)."""
    model = write_q6k_head_gguf(tmp_path / "m.gguf")
    art = compiled(tmp_path, model, ("sm_90", "gfx942"))
    plan = json.loads((art / "plan.json").read_text())
    spec = next(w for w in plan["weights"] if w["name"] == "output.weight")
    assert spec["dtype"] == "q6_k" and spec["layout"] == "split"
    kernels = {x["kernel"] for x in plan["targets"]["sm_90"]["steps"]["decode"]}
    assert any(k.startswith("linear_q6_k_") and k.endswith("_gemv") for k in kernels)
    compile_model(model, tmp_path / "c.hipc", CompileOptions(targets=("cpu",)), verbose=False)
    cpu_plan = json.loads((tmp_path / "c.hipc" / "plan.json").read_text())
    cpu_spec = next(w for w in cpu_plan["weights"] if w["name"] == "output.weight")
    assert cpu_spec["dtype"] == "q6_k" and cpu_spec.get("layout") == "gguf"


@pytest.mark.parametrize("family", sorted(TINY_GEMMA))
def test_gemma_params_refused_on_gpu(tmp_path, family):
    # the GPU templates lack GeGLU, post-norms, soft-caps and the embedding scale: one line
    # naming them, before any toolchain runs, never a kernel that silently ignores them
    model = write_tiny_hf(tmp_path / "g", **TINY_GEMMA[family])
    with pytest.raises(HipcError, match=r"the GPU (embedding|linear|attention) kernels have no"):
        compile_model(model, tmp_path / "g.hipc", CompileOptions(targets=("sm_90",)), verbose=False)
