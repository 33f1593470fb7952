"""GPU targets compiled without a GPU: nvcc for sm_80/sm_90, clang-19 for every AMD target.

The code objects must exist, be the right kind of file, and hold every kernel the
plan launches; bf16 linears must prefill on the target's matrix instructions (read from
the PTX / the disassembly), other weight types on the SIMT GEMM, and the prefill attention
on the same instructions (the flash kernel) without spilling. NVIDIA's run on the GPU
machine (tests/gpu); AMD's are compiled, disassembled and run in host emulation
(tests/compiler/test_gpu_flash_host.py) only: no AMD GPU is available to this project.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from hipc.base.errors import HipcError
from hipc.compiler.kernels.linear import MMA_TILES
from hipc.compiler.options import CompileOptions
from hipc.compiler.passes.lanes import lane_types
from hipc.compiler.pipeline import compile_model
from hipc.compiler.toolchains.cpu import cpu_flags
from hipc.compiler.toolchains.gpu import NvccToolchain

from gguf_writer import (
    q2_k_dense_type,
    q3_k_m_dense_type,
    write_mixed_glu_gguf,
    write_numpy_gguf,
    write_q6k_head_gguf,
)
from support import IN_CI, TINY_FAMILIES, TINY_GEMMA, amd_kernel_metadata, write_tiny_hf

CLANG = shutil.which("clang++-19") or shutil.which("clang++")
OBJDUMP = shutil.which("llvm-objdump-19") or shutil.which("llvm-objdump")
READELF = shutil.which("llvm-readelf-19") or shutil.which("llvm-readelf")


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


def compiled(root, model, targets, **options):
    need(shutil.which("nvcc"), "nvcc")
    need(CLANG, "clang++-19")
    out = root / "m.hipc"
    opts = CompileOptions(targets=targets, max_context=64, **options)
    compile_model(model, out, opts, verbose=False)
    return out


# the instruction each target's prefill GEMM must show for bf16 weights (sm_90: see the wgmma test)
MMA_INSTRUCTION = {
    "sm_80": "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
    "gfx1100": "v_wmma_f32_16x16x16_bf16",
    "gfx942": "v_mfma_f32_16x16x16_bf16",
    "gfx90a": "v_mfma_f32_16x16x16bf16_1k",  # CDNA2's spelling of the same operation
    "gfx1151": "v_wmma_f32_16x16x16_bf16",
    "gfx1201": "v_wmma_f32_16x16x16_bf16",  # RDNA4: the same name, another operand layout
}
AMD_TARGETS = ("gfx90a", "gfx942", "gfx1100", "gfx1151", "gfx1201")


@pytest.fixture(scope="module")
def bf16_artifact(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16")
    model = write_tiny_hf(root / "m", dtype="bfloat16", hidden_size=64, intermediate_size=96)
    return compiled(root, model, tuple(MMA_INSTRUCTION))


@pytest.fixture(scope="module")
def q8_artifact(tmp_path_factory):
    root = tmp_path_factory.mktemp("q8")
    targets = ("sm_90", "gfx942", "gfx1100", "gfx1201")
    return compiled(root, write_numpy_gguf(root / "m.gguf", "Q8_0"), targets)


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
    return [x for x in plan["prefill"] if x["kernel"].endswith(("_gemm", "_mma", "_mma_split"))]


def test_bf16_prefill_on_wgmma_sm90(tmp_path):
    """sm_90: each bf16 linear's prefill is an _xb kernel (x -> bf16 in scratch) and the wgmma
    GEMM reading it and W through tensor maps, except where the kernel before it writes x in bf16
    (down after gate/up, o after the flash attention); --prefill-precision split keeps
    mma.sync."""
    model = write_tiny_hf(tmp_path / "m", dtype="bfloat16", hidden_size=64, intermediate_size=96)
    art = compiled(tmp_path, model, ("sm_90",))
    plan = json.loads((art / "plan.json").read_text())
    steps = plan["targets"]["sm_90"]["steps"]["prefill"]
    code = kernel_code(art, "sm_90")
    gemms = [i for i, x in enumerate(steps) if "_wg" in x["kernel"] and "_xb" not in x["kernel"]]
    assert len(gemms) == 2 * 4 + 1  # per layer qkv, o, gate/up, down; then the lm head
    shapes = {w["name"]: w["shape"] for w in plan["weights"]}
    handoffs = 0
    for i in gemms:
        launch, before = steps[i], steps[i - 1]
        xmap, wmap = launch["args"][0], launch["args"][1]
        assert xmap["kind"] == wmap["kind"] == "tmap"
        if xmap["of"]["kind"] == "arena":  # x written in bf16 by the kernel before it:
            # down's by the GLU GEMM, o's by the flash attention
            assert before["kernel"].endswith(("_yb", "_ob_flash")), before["kernel"]
            assert before["args"][-1] == xmap["of"]
            handoffs += 1
            continue
        assert before["kernel"] == launch["kernel"] + "_xb"
        assert before["args"][2] == launch["args"][0]["of"]  # xb written, then mapped
        assert xmap["of"]["kind"] == "scratch"
        assert wmap["of"]["kind"] == "weight"
        n, k = shapes[plan["weights"][wmap["of"]["index"]]["name"]]
        assert wmap["dims"] == [k, n] and xmap["dims"] == [k, plan["max_tokens"]]
        ptx = code[launch["kernel"]]
        assert "wgmma.mma_async.sync.aligned.m64n" in ptx
        assert "cp.async.bulk.tensor.2d.shared::cluster.global.tile" in ptx
        assert "mma.sync" not in ptx
    assert handoffs == 4  # two per layer
    (tmp_path / "s").mkdir()
    (tmp_path / "o").mkdir()
    split = compiled(tmp_path / "s", model, ("sm_90",), prefill_precision="split")
    linears = prefill_linears(split, "sm_90")
    assert len(linears) == 9 and all(x["kernel"].endswith("_mma_split") for x in linears)
    attn = [x["kernel"] for x in json.loads((split / "plan.json").read_text())["targets"]["sm_90"]
            ["steps"]["prefill"] if "_attn" in x["kernel"] or "_flash" in x["kernel"]]  # fmt: skip
    assert attn and all(a.endswith("_attn") for a in attn)  # split: the float32 SIMT attention
    assert any(x["kernel"].endswith("_flash") for x in steps)
    split_code = kernel_code(split, "sm_90")
    mma = MMA_INSTRUCTION["sm_80"]
    one = kernel_code(compiled(tmp_path / "o", model, ("sm_80",)), "sm_80")
    name = linears[0]["kernel"]
    # hi and lo: twice the matrix instructions of the bf16 kernel
    assert split_code[name].count(mma) == 2 * one[name.removesuffix("_split")].count(mma)


@pytest.mark.parametrize("target", sorted(MMA_INSTRUCTION))
def test_bf16_prefill_on_matrix_instructions(bf16_artifact, target):
    linears = prefill_linears(bf16_artifact, target)
    assert len(linears) == 2 * 4 + 1  # per layer qkv, o, gate/up, down; then the lm head
    tile = MMA_TILES[target]
    code = kernel_code(bf16_artifact, target)
    for launch in linears:
        name = launch["kernel"]
        assert name.endswith("_mma"), name
        assert launch["block"] == [256] and launch["shared"] == tile.shared_bytes(split=False)
        assert launch["grid"][1] in (f"cdiv(T,{tile.bm})", f"cdiv(rows,{tile.bm})")
        assert MMA_INSTRUCTION[target] in code[name], name
        if target.startswith("sm_"):
            assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in code[name]
    # decode stays on the GEMV; its code has no matrix instruction
    gemv = [k for k in code if k.endswith("_gemv")]
    assert gemv and not any(MMA_INSTRUCTION[target] in code[k] for k in gemv)


@pytest.mark.parametrize("target", ["sm_90", "gfx942"])
def test_float32_weights_prefill_on_the_float32_gemm(artifact, target):
    """float32 linears prefill on linear_sgemm in float32 (not the SIMT linear_gemm, nor
    the matrix instructions in bf16), with select_sgemm's tile: 64 x 64, 64 threads; K split
    (grid z) where the tiny model's few tiles would leave the GPU idle, then a _sum pass."""
    steps = json.loads((artifact / "plan.json").read_text())["targets"][target]["steps"]
    gemms = [x for x in steps["prefill"] if re.search(r"_s64x64(k\d+)?$", x["kernel"])]
    assert gemms and not prefill_linears(artifact, target)
    assert all(x["block"] == [64] and x["grid"][1] in ("cdiv(T,64)", "cdiv(rows,64)")
               for x in gemms)  # fmt: skip
    # K of 64: too short to split (SGEMM_MIN_KS per split)
    assert all(len(x["grid"]) == 2 for x in gemms)


def test_float32_gemm_splits_k(tmp_path):
    """Float32 linears over K of 512 and 1024 at 8-token steps (few output tiles) split K 4
    and 8 ways: each GEMM launch has the splits as grid z and writes the parts to the
    sgemm_part scratch, and its _sum launch right after reads them and writes the linear's
    output (the residual, in place; the LM head's logits)."""
    model = write_tiny_hf(tmp_path / "m", **TINY_FAMILIES["llama"], hidden_size=512,
                          intermediate_size=1024)  # fmt: skip
    art = compiled(tmp_path, model, ("sm_90",), max_tokens=8)
    steps = json.loads((art / "plan.json").read_text())["targets"]["sm_90"]["steps"]["prefill"]
    gemms = [(i, x) for i, x in enumerate(steps) if re.search(r"_s64x64k\d+$", x["kernel"])]
    assert {x["grid"][2] for _, x in gemms} == {4, 8}
    assert len(gemms) == 2 * 4 + 1  # qkv, o, gate/up, down per layer; the LM head
    for i, x in gemms:
        assert x["grid"][2] == int(x["kernel"].rsplit("k", 1)[1])
        after = steps[i + 1]
        assert after["kernel"] == x["kernel"] + "_sum"
        assert x["args"][-1] == after["args"][1] and x["args"][-1]["kind"] == "scratch"
        assert after["args"][-1] == x["args"][-2]  # y


@pytest.mark.parametrize("target", ["sm_90", "gfx942", "gfx1201"])
def test_quantized_prefill_on_matrix_instructions(q8_artifact, target):
    """Q8_0 prefill on the mma.sync / MFMA GEMM (integer quants in the tiles, scales in
    float32), never the wgmma one (bf16 weights only)."""
    linears = prefill_linears(q8_artifact, target)
    tile = MMA_TILES[target]
    assert linears and all(x["kernel"].endswith("_mma") for x in linears)
    assert all(x["shared"] == tile.shared_bytes(False, quant=True) for x in linears)
    code = kernel_code(q8_artifact, target)
    instruction = MMA_INSTRUCTION["sm_80" if target == "sm_90" else target]
    assert all(instruction in code[x["kernel"]] for x in linears)


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


def test_quantized_gemv_weights_stream_evict_first(q8_artifact):
    """On sm_80+ every quantized GEMV's weight loads carry an L2 evict_first policy (the weight
    stream leaves L2 to what is read again)."""
    code = kernel_code(q8_artifact, "sm_90")
    gemv = [k for k in code if k.endswith("_gemv")]
    assert gemv
    for k in gemv:
        assert "createpolicy.fractional.L2::evict_first" in code[k]
        hinted = re.findall(r"ld\.global\.nc\.L2::cache_hint\.v4\.u32 [^;]*;", code[k])
        assert hinted and all(line.count(",") == 5 for line in hinted)  # 4 words, address, policy


@pytest.mark.parametrize(
    "env, loads, policy",
    [
        (None, ".L2::cache_hint", "L2::evict_first"),
        ("none", "", ""),
        ("L2::256B.L1::no_allocate", ".L1::no_allocate.L2::256B", ""),
        ("L2::256B.L2::evict_last", ".L2::cache_hint.L2::256B", "L2::evict_last"),
    ],
)
def test_weight_cache_qualifiers(monkeypatch, env, loads, policy):
    from hipc.compiler.codegen.hip import WEIGHT_CACHE_ENV, program_source, weight_cache

    if env is None:
        monkeypatch.delenv(WEIGHT_CACHE_ENV, raising=False)
    else:
        monkeypatch.setenv(WEIGHT_CACHE_ENV, env)
    assert weight_cache("sm_90") == (loads, policy)
    assert weight_cache("sm_75") == weight_cache("gfx942") == ("", "")
    source = program_source("m", "0", "sm_90", [])
    assert (f'#define HIPC_WEIGHT_POLICY "{policy}"' in source) == bool(policy)
    assert "#define HIPC_WEIGHT_POLICY" not in program_source("m", "0", "gfx942", [])


@pytest.mark.parametrize("env", ["L2::evict_first.L2::evict_last", "L2::256B.L2::256B", "fast"])
def test_weight_cache_refuses_a_bad_value(monkeypatch, env):
    from hipc.compiler.codegen.hip import WEIGHT_CACHE_ENV, weight_cache

    monkeypatch.setenv(WEIGHT_CACHE_ENV, env)
    with pytest.raises(HipcError, match=f"^{WEIGHT_CACHE_ENV}: '{re.escape(env)}' is not"):
        weight_cache("sm_90")


@pytest.fixture(scope="module")
def amd_artifact(tmp_path_factory):
    """Head dim 128 (the flash kernel's widest) for every AMD target: clang-19 only."""
    need(CLANG, "clang++-19")
    root = tmp_path_factory.mktemp("amd")
    model = write_tiny_hf(root / "m", dtype="bfloat16", hidden_size=256, intermediate_size=96,
                          num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    out = root / "m.hipc"
    compile_model(model, out, CompileOptions(targets=AMD_TARGETS, max_context=64), verbose=False)
    return out


@pytest.mark.parametrize("target", AMD_TARGETS)
def test_amd_prefill_attention_and_gemm_on_matrix_instructions(amd_artifact, target):
    """Every AMD target prefills on its matrix instruction, MFMA or WMMA (gfx1201's own operand
    layout): the GEMMs and the flash attention (4 waves, a block per 64 query rows and head), as
    the disassembly shows, and neither spills (scratch) at head dim 128."""
    need(READELF, "llvm-readelf-19")
    steps = json.loads((amd_artifact / "plan.json").read_text())["targets"][target]["steps"]
    code = kernel_code(amd_artifact, target)
    meta = amd_kernel_metadata(amd_artifact / "kernels" / f"{target}.co", READELF)
    flash = [x for x in steps["prefill"] if x["kernel"].endswith("_flash")]
    assert len(flash) == 2 and not any(x["kernel"].endswith("_attn") for x in steps["prefill"])
    wave = 64 if target.startswith("gfx9") else 32
    linears = prefill_linears(amd_artifact, target)
    assert len(linears) == 2 * 4 + 1 and all(x["kernel"].endswith("_mma") for x in linears)
    for launch in flash + linears:
        name = launch["kernel"]
        assert MMA_INSTRUCTION[target] in code[name], name
        assert meta[name][".private_segment_fixed_size"] == "0", (name, "spills to scratch")
        assert meta[name][".wavefront_size"] == str(wave)
    assert all(x["block"] == [4 * wave] and x["grid"] == ["cdiv(T,64)", 2] for x in flash)


def launched_kernels(artifact, target):
    """The kernels the plan launches: its steps', the row top-k and its several-block forms."""
    plan = json.loads((artifact / "plan.json").read_text())
    sec = plan["targets"][target]
    topk = sec["topk"]
    steps = sec["steps"]
    return {launch["kernel"] for launch in steps["decode"] + steps["prefill"]} | {
        topk["kernel"],
        topk["pick"]["kernel"],
        topk["split"]["kernel"],
    }


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
        pos=8,
        seq=9,
        blocks=10,
        logits=11,
    )
    assert gp.kv_block == 16
    for launch in (*gp.prefill, *gp.batch(5)):
        args = launch.resolve(bases, T=5, rows=1)
        assert all(t in ("u64", "i32") for t, _ in args)
        assert all(d >= 1 for d in launch.grid_dims(5, 1))
    # batch = prefill with the SIMT attention (one block per row and head) for a flash one
    assert [x.kernel for x in gp.batch(5)] == [
        x.kernel.replace("_flash", "_attn") for x in gp.prefill
    ]
    # decode = prefill without the GEMM norm stats, one attention kernel per layer where
    # prefill runs RoPE+KV then attention; every decode kernel may overlap the one before
    stats = sum(1 for x in gp.prefill if x.kernel.endswith("_stats"))
    attn = [x for x in gp.decode if x.kernel.endswith("_decode")]
    assert len(attn) == 2  # one per layer of the tiny model
    assert len(gp.decode) == len(gp.prefill) - stats - len(attn)
    assert all(x.overlap for x in gp.decode) and not any(x.overlap for x in gp.prefill)
    # max_context 64 is a single 64-key tile of sm_90's default (tile) form: one block per KV
    # head (TILE_HEADS: the whole group)
    config = json.loads((artifact / "manifest.json").read_text())["config"]
    assert attn[0].grid_dims(1, 1) == (config["num_kv_heads"], 1, 1)
    # the counters the merging blocks reset live inside the scratch buffer
    counters = attn[0].args[13]
    assert counters["kind"] == "scratch"
    assert counters["offset"] + 4 * attn[0].grid[0] <= gp.scratch_bytes


def test_program_compiles_with_the_decode_trace(artifact):
    """docs/benchmarks/trace_gpu_decode.py compiles the artifact's program again with HIPC_TRACE
    (the timeline records and the end marks of prelude.h): that program must still build."""
    from hipc.compiler.toolchains.gpu import gpu_toolchain

    source = (artifact / "kernels" / "sm_90.hip").read_text()
    assert "hipc_trace_scope trace;" in source  # the GEMVs' and the decode attention's end marks
    assert gpu_toolchain("sm_90").compile("#define HIPC_TRACE 1024\n" + source)


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
    for it (stored split like the others), and so has the cpu target (in GGUF order, or in
    row lanes where the build machine has AVX512-VNNI)."""
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
    cpu_layout = "lanes" if "q6_k" in lane_types(("cpu",), cpu_flags()) else "gguf"
    assert cpu_spec["dtype"] == "q6_k" and cpu_spec.get("layout") == cpu_layout


def test_gate_and_up_in_different_types_compile_for_gpus(tmp_path):
    """ffn_gate Q4_K beside ffn_up Q5_0: two GEMVs (and prefill GEMMs) and the glu kernel
    between them and the down projection, in every step (tests/gpu runs it)."""
    art = compiled(tmp_path, write_mixed_glu_gguf(tmp_path / "m.gguf"), ("sm_90", "gfx942"))
    plan = json.loads((art / "plan.json").read_text())
    for target in ("sm_90", "gfx942"):
        for step, launches in plan["targets"][target]["steps"].items():
            names = [x["kernel"] for x in launches]
            glu = [i for i, k in enumerate(names) if k.startswith("glu_silu_512_")]
            assert len(glu) == 2, (target, step, names)  # one per layer
            for i in glu:  # gate and up before it, the down projection after
                assert "_q5_0_512x256_" in " ".join(names[i - 3 : i]), (target, step, names)
                assert "_q8_0_256x512_residual" in names[i + 1], (target, step, names)


def test_mixed_qkv_types_compile_for_gpus(tmp_path):
    """Q4_K q and k beside a Q6_K v (llama.cpp's Q4_K_M): q+k merge into one linear, v keeps
    its own, each with the norm as its prologue (repack.split_shared_norms), in every step;
    tests/gpu runs it."""
    types = lambda n: "q6_k" if n.endswith(("attn_v.weight", "ffn_down.weight")) else "q4_k"  # noqa: E731
    model = write_numpy_gguf(tmp_path / "m.gguf", hidden=256, ffn=512, types=types)
    art = compiled(tmp_path, model, ("sm_90", "gfx942"), activations="int8")
    plan = json.loads((art / "plan.json").read_text())
    for target in ("sm_90", "gfx942"):
        for step, launches in plan["targets"][target]["steps"].items():
            kernels = {x["group"]: x["kernel"] for x in launches}
            for layer in ("l0", "l1"):
                qk, v = kernels[f"{layer}.q+k"], kernels[f"{layer}.v"]
                assert "_q4_k_384x256_none_rms" in qk and "_q6_k_128x256_none_rms" in v, (
                    target, step, qk, v,
                )  # fmt: skip
        assert launched_kernels(art, target) <= set(kernel_code(art, target))


@pytest.mark.parametrize(
    "low, types, step_up",
    [("q3_k", q3_k_m_dense_type, "q4_k"), ("q2_k", q2_k_dense_type, "q3_k")],
    ids=["q3_k_m", "q2_k"],
)
def test_low_bit_k_quant_layers_compile_for_gpus(low, types, step_up, tmp_path):
    """llama-quantize's Q3_K_M of a Llama (Q3_K q+k (merged), gate/up and embedding beside Q4_K
    v, o and down) and a Q2_K file (Q2_K beside Q3_K v and down), a Q6_K output, stored split,
    each low-bit matrix on its own quantized GEMV in decode and matrix-instruction GEMM in
    prefill, for NVIDIA and AMD; tests/gpu runs them."""
    model = write_numpy_gguf(tmp_path / "m.gguf", hidden=256, ffn=512, types=types)
    art = compiled(tmp_path, model, ("sm_90", "gfx942"))
    plan = json.loads((art / "plan.json").read_text())
    stored = {w["name"]: (w["dtype"], w.get("layout")) for w in plan["weights"]}
    assert stored["token_embd.weight"] == (low, "split")
    assert stored["l0.gate+up.weight"] == stored["l1.q+k.weight"] == (low, "split")
    assert stored["blk.0.attn_v.weight"] == (step_up, "split")
    for target in ("sm_90", "gfx942"):
        target_steps = plan["targets"][target]["steps"]
        for step in ("decode", "prefill"):
            kernels = {x["group"]: x["kernel"] for x in target_steps[step]}
            want = "_gemv" if step == "decode" else "_mma"
            for group in ("l0.q+k", "l0.gate+up", "l1.q+k", "l1.gate+up"):
                assert f"_{low}_" in kernels[group] and want in kernels[group], (
                    target,
                    step,
                    group,
                )
        assert launched_kernels(art, target) <= set(kernel_code(art, target))


@pytest.mark.parametrize("family", sorted(TINY_GEMMA))
def test_gemma_params_refused_on_gpu(tmp_path, family):
    # the GPU templates lack GeGLU, post-norms, soft-caps and the embedding scale: one line
    # naming them, before any toolchain runs, never a kernel that silently ignores them
    model = write_tiny_hf(tmp_path / "g", **TINY_GEMMA[family])
    with pytest.raises(HipcError, match=r"the GPU (embedding|linear|attention) kernels have no"):
        compile_model(model, tmp_path / "g.hipc", CompileOptions(targets=("sm_90",)), verbose=False)


def test_wgmma_tiles_follow_the_measured_choice():
    """select_wgmma against what bench_gpu_gemm.py measured fastest on the H200 (Llama-3-8B
    layer, docs/benchmarks/gpu-prefill.md): the table for those shapes at the step sizes
    measured and the nearest one otherwise; the wave model for other shapes (short steps take
    narrower tiles where 128 x 256 leaves SMs idle, long steps the widest)."""
    from hipc.compiler.kernels.linear import LinearParams, select_wgmma

    shapes = {  # N, K, epilogue: {tokens: variant measured fastest}
        "qkv": (6144, 4096, "none", {512: "wg128x192", 2048: "wg128x256", 4096: "wg128x256"}),
        "o": (4096, 4096, "residual", {512: "wg128x128", 2048: "wg128x256t2"}),
        "gate_up": (28672, 4096, "glu", {512: "wg128x192", 2048: "wg128x256"}),
        "down": (4096, 14336, "residual", {512: "wg128x128", 2048: "wg128x256"}),
    }
    for name, (N, K, ep, best) in shapes.items():
        p = LinearParams("bfloat16", N, K, 0.0, ep, False)
        for tokens, want in best.items():
            assert select_wgmma(p, tokens).name == want, (name, tokens)
        assert select_wgmma(p, 300).name == best[512], name  # nearest measured: 512
        assert select_wgmma(p, 1024).name == best[512], name  # a tie: the smaller
        assert select_wgmma(p, 1400).name == best[2048], name
    # an unlisted shape: the wave model (SmolLM2's gate/up: 2 x 1536 x 576)
    p = LinearParams("bfloat16", 3072, 576, 0.0, "glu", False)
    assert select_wgmma(p, 512).name == "wg128x128"  # 4 x 12 blocks: the narrowest fills most
    assert select_wgmma(p, 4096).name == "wg128x256"


def test_float32_gemm_selection():
    """select_sgemm: float32 weights whose rows load as float4s (K % 4 == 0) only; K split
    in powers of two while the output tiles at the step size are fewer than SGEMM_BLOCKS and
    each split keeps SGEMM_MIN_KS of K, at most SGEMM_MAX_SPLITS."""
    from hipc.compiler.kernels.linear import LinearParams, select_sgemm

    def tile(N, K, tokens, epilogue="none", wtype="float32"):
        t = select_sgemm(LinearParams(wtype, N, K, 0.0, epilogue, False), tokens)
        return t and t.name

    # the fastest split measured on the H200 (bench_gpu_gemm.py --f32) at each router shape
    assert tile(257, 2048, 512) == "s64x64k8"  # Qwen3.5-35B-A3B's router: 5 x 8 tiles
    assert tile(129, 2048, 512) == "s64x64k16"  # Qwen3-30B-A3B's (+ 1): 3 x 8
    assert tile(257, 4096, 512) == "s64x64k8"
    assert tile(257, 2048, 128) == "s64x64k16"  # at most 16 splits
    assert tile(2 * 257, 2048, 512, "glu") == "s64x64k4"  # GLU tiles: 32 outputs each
    assert tile(257, 256, 512) == "s64x64k2"  # 128 of K a split at least
    assert tile(257, 128, 512) == "s64x64"
    assert tile(4096, 4096, 4096) == "s64x64"  # 64 x 64 tiles fill the GPU
    assert tile(257, 2046, 512) is None  # rows not float4-aligned: the SIMT GEMM
    assert tile(257, 2048, 512, wtype="bfloat16") is None


def test_launches_by_step_size():
    from hipc.base.launch_plan import Launch, TargetPlan

    def launch(name, tokens=None):
        d = {"kernel": name, "grid": [1], "block": [32], "args": []}
        if tokens:
            d["tokens"] = tokens
        return Launch.from_json(d)

    steps = (launch("a"), launch("short", [1, 1024]), launch("long", [1025, 2048]))
    plan = TargetPlan("sm_90", 2048, 10, 0, 0, {"prefill": steps, "decode": (launch("d"),)})
    assert [x.kernel for x in plan.launches(512)] == ["a", "short"]
    assert [x.kernel for x in plan.launches(1025)] == ["a", "long"]
    assert [x.kernel for x in plan.launches(1)] == ["d"]


def _sm90_program(folder, tmp_path):
    """The sm_90 program (source and launch plan) as rendered, without running nvcc."""
    from hipc.cache.store import KernelCache
    from hipc.compiler.pipeline import Compilation, stages
    from hipc.compiler.targets import target

    targets = [target("sm_90")]
    c = Compilation(folder, tmp_path / "m.hipc", CompileOptions(targets=("sm_90",)), targets,
                    KernelCache(tmp_path / "cache"))  # fmt: skip
    for stage in stages(targets):
        stage.run(c)
        if stage.name == "render sm_90":
            return c.programs["sm_90"]
    raise AssertionError("no render stage")


def test_glu_hands_bf16_to_the_down_linear(tmp_path):
    """sm_90, bf16 weights: the gate/up GEMM writes its output in bf16 and the down GEMM's
    tensor map reads that buffer directly (no _xb launch); o likewise reads the attention's
    output, qkv and gate/up keep theirs, and the decode GEMVs still read the buffer the GLU
    GEMV writes (float32)."""
    folder = write_tiny_hf(tmp_path / "m", dtype="bfloat16", intermediate_size=128)
    program = _sm90_program(folder, tmp_path)
    prefill = program.plan["steps"]["prefill"]
    names = [x["kernel"] for x in prefill]
    gemms = [x for x in prefill if "_glu_" in x["kernel"] and x["kernel"].endswith("_yb")]
    down = [x for x in prefill if "_32x128_residual_" in x["kernel"]]  # hidden 32, ffn 128
    assert len(gemms) == len(down) == 2, names  # one per layer
    assert not any(x["kernel"].endswith("_xb") for x in down), names
    for glu, d in zip(gemms, down, strict=True):
        y, xmap = glu["args"][-1], d["args"][0]  # WGMMA's arguments: xmap first, y last
        assert xmap["kind"] == "tmap" and xmap["of"] == y and y["kind"] == "arena", (y, xmap)
        assert xmap["dims"][0] == 128  # K of down = the GLU's outputs, bf16 rows
    # o reads the attention's bf16 output likewise (head dim 8: the SIMT kernel's, Attention's
    # bf16_reader); every other wgmma GEMM still has its _xb pass just before it
    for i, x in enumerate(prefill):
        if "_wg" in x["kernel"] and not x["kernel"].endswith("_xb") and x not in down:
            before = prefill[i - 1]
            if before["kernel"].endswith("_ob_attn"):
                assert x["args"][0]["of"] == before["args"][-1], names
                continue
            assert before["kernel"] == x["kernel"] + "_xb", names
    assert "hipc_f32_to_bf16(v0) | hipc_f32_to_bf16(v1) << 16" in program.source
    # decode: the GLU GEMV writes float32 where the down GEMV reads it
    decode = program.plan["steps"]["decode"]
    glu_gemv = [x for x in decode if "_glu_" in x["kernel"]]
    down_gemv = [x for x in decode if "_32x128_residual_" in x["kernel"]]
    assert [x["args"][-1] for x in glu_gemv] == [x["args"][0] for x in down_gemv]


def test_cluster_variants_in_the_plan(tmp_path, monkeypatch):
    """A measured cluster variant reaches the plan with its grid (W-sharing token pairs: half
    the token blocks, z = 2; x-sharing pairs: output blocks rounded up to whole pairs), its
    tensor-map box (a pair copies half an x tile each) and, for the overlapped launch, the
    plan's "overlap" flag; the GEMM kernel's source declares the cluster."""
    from hipc.compiler.kernels import linear

    monkeypatch.setitem(linear.WGMMA_MEASURED, (32, 32, "residual"), {512: "wg128x256t2"})
    monkeypatch.setitem(linear.WGMMA_MEASURED, (64, 32, "none"), {512: "wg128x256c2p"})
    folder = write_tiny_hf(tmp_path / "m", dtype="bfloat16", intermediate_size=128)
    program = _sm90_program(folder, tmp_path)
    prefill = program.plan["steps"]["prefill"]
    o = [x for x in prefill if x["kernel"].endswith("_wg128x256t2")]
    qkv = [x for x in prefill if x["kernel"].endswith("_wg128x256c2p")]
    assert len(o) == len(qkv) == 2, [x["kernel"] for x in prefill]  # one per layer
    for x in o:
        assert x["grid"] == ["cdiv(T,256)", 1, 2] and "overlap" not in x
        assert x["args"][0]["box"] == [64, 128]
    for x in qkv:
        assert x["grid"] == ["cdiv(T,128)", 2, 1] and x["overlap"] is True  # 1 block -> a pair
        assert x["args"][0]["box"] == [64, 64]
    assert "__cluster_dims__(1, 1, 2)" in program.source
    assert "__cluster_dims__(1, 2, 1)" in program.source


def test_batch_steps_take_the_weights_once_gemv(tmp_path, monkeypatch):
    """sm_90, bf16 weights: batch steps of up to BATCH_GEMV_ROWS rows run each linear as the
    weights-once GEMV of their size class (8, 16, 32 rows), after an _xb pass where the linear
    has a norm; larger batch steps and every prefill step keep the wgmma GEMMs; with
    HIPC_BATCH_GEMV_ROWS=0 the batch list is the prefill GEMMs' again."""
    from hipc.base.launch_plan import Launch
    from hipc.compiler.kernels.attention import BATCH_GROUP_ROWS, BATCH_SPLIT_ROWS, batch_splits
    from hipc.compiler.kernels.linear import BATCH_GEMV_ROWS

    folder = write_tiny_hf(tmp_path / "m", dtype="bfloat16", intermediate_size=128)
    plan = _sm90_program(folder, tmp_path).plan["steps"]
    assert not any("_gemvm" in x["kernel"] for x in plan["prefill"] + plan["decode"])
    batch = [Launch.from_json(x) for x in plan["batch"]]

    def at(B: int) -> list[Launch]:
        return [x for x in batch if x.runs_at(B)]

    prefill_gemms = sum(
        1 for x in plan["prefill"] if "_wg" in x["kernel"] and "_xb" not in x["kernel"]
    )
    for B in (2, 5, 8, 9, 16, 17, 32, 33, 64):
        names = [x.kernel for x in at(B)]
        gemv = [x for x in at(B) if "_gemvm" in x.kernel and not x.kernel.endswith("_xb")]
        if B > BATCH_GEMV_ROWS:
            assert not gemv and sum("_wg" in n and "_xb" not in n for n in names) == prefill_gemms
            continue
        nt = 1 if B <= 8 else 2 if B <= 16 else 4
        assert len(gemv) == prefill_gemms, names  # every linear, the LM head included
        assert all(x.kernel.endswith(f"_gemvm{nt}") and x.overlap for x in gemv), names
        assert not any("_wg" in n for n in names), names
        for x in gemv:
            i = names.index(x.kernel)
            if "_rms" in x.kernel:  # the norm: its _xb pass writes the bf16 rows it reads
                assert names[i - 1] == x.kernel + "_xb"
                assert at(B)[i - 1].args[2] == x.args[0] and x.args[0]["kind"] == "scratch"
            else:
                assert x.args[0]["kind"] == "arena"
    # the batch attention: from BATCH_SPLIT_ROWS rows the split-context kernel (a block per
    # row, KV head and split: batch_splits of them); below that a block per row and head, or from
    # BATCH_GROUP_ROWS per row and KV head, its 2 query heads together
    for B in (1, 8, BATCH_GROUP_ROWS, 33, 64):
        attn = [x for x in at(B) if "attn" in x.kernel]
        if B >= BATCH_SPLIT_ROWS:
            name, grid = f"_battn_s{batch_splits(B, 2)}", ("T", 2 * batch_splits(B, 2))
        else:
            name, grid = ("_attn_g2", ("T", 2)) if B >= BATCH_GROUP_ROWS else ("_attn", ("T", 4))
        assert len(attn) == 2 and all(x.kernel.endswith(name) for x in attn), (B, attn)
        assert all(x.grid[:2] == grid and x.overlap for x in attn)
    assert not any("attn_g" in x["kernel"] or "battn" in x["kernel"] for x in plan["prefill"])
    # down reads the float32 rows the GLU GEMV wrote (no bf16 hand-off in these steps)
    glu = [x for x in at(8) if "_glu_" in x.kernel and x.kernel.endswith("_gemvm1")]
    down = [x for x in at(8) if "_32x128_residual_" in x.kernel]
    assert [x.args[-1] for x in glu] == [x.args[0] for x in down] and len(glu) == 2
    monkeypatch.setenv("HIPC_BATCH_GEMV_ROWS", "0")
    (tmp_path / "off").mkdir()
    off = _sm90_program(folder, tmp_path / "off").plan["steps"]
    assert not any("_gemvm" in x["kernel"] for x in off["batch"])
    # (head dim 8: the prefill attention is the SIMT one too, one head per block)
    off_batch = [Launch.from_json(x) for x in off["batch"]]
    for B in (8, BATCH_GROUP_ROWS):

        def batch_form(name: str, B: int = B) -> str:
            if not name.endswith("_attn"):
                return name
            if B >= BATCH_SPLIT_ROWS:
                return f"{name.removesuffix('_attn')}_battn_s{batch_splits(B, 2)}"
            return name + ("_g2" if B >= BATCH_GROUP_ROWS else "")

        assert [x.kernel for x in off_batch if x.runs_at(B)] == [
            batch_form(x["kernel"]) for x in off["prefill"]
        ]


def test_batch_steps_take_the_shared_x_gemv_where_its_geometry_says(tmp_path, monkeypatch):
    """A `split` geometry (GEMVM_MEASURED, or GEMVM_DEFAULT for unlisted shapes) makes a size
    class's batch GEMV the shared-x kernel (linear_gemvs): its launch has grid.y = the K splits
    (given, or gemvs_splits') and the same arguments as linear_gemvm's, its partials live in the
    module (HIPC_MODULE_ARRAY); HIPC_BATCH_GEMV_TUNED=0 keeps linear_gemvm."""
    from hipc.base.launch_plan import Launch
    from hipc.compiler.kernels import linear

    geo = dict(warps=2, mt=1, unroll=2, xasync=True)  # 16-row steps: 3 splits; else the rule's
    default = {2: {"split": dict(geo, splits=3)}, 4: {"split": geo}, 8: {"split": geo}}
    monkeypatch.setattr(linear, "GEMVM_DEFAULT", default)
    monkeypatch.setenv("HIPC_BATCH_GEMV_ROWS", "64")
    folder = write_tiny_hf(tmp_path / "m", dtype="bfloat16", intermediate_size=128)
    program = _sm90_program(folder, tmp_path)
    batch = [Launch.from_json(x) for x in program.plan["steps"]["batch"]]
    gemvm = [x for x in batch if x.runs_at(8) and "_gemvm" in x.kernel and "_xb" not in x.kernel]
    split = [x for x in batch if x.runs_at(9) and "_gemvs" in x.kernel and "_xb" not in x.kernel]
    assert gemvm and len(split) == len(gemvm), [x.kernel for x in batch if x.runs_at(9)]
    for a, b in zip(gemvm, split, strict=True):
        assert b.kernel == a.kernel.replace("_gemvm1", "_gemvs2")
        assert b.grid[1] == 3 and b.args == a.args and b.overlap
    assert all(any(x.runs_at(B) and x.kernel.endswith(f"_gemvs{nt}") for x in batch)
               for B, nt in ((16, 2), (32, 4), (64, 8)))  # fmt: skip
    assert "HIPC_MODULE_ARRAY(unsigned" in program.source
    monkeypatch.setenv("HIPC_BATCH_GEMV_TUNED", "0")
    (tmp_path / "off").mkdir()
    off = _sm90_program(folder, tmp_path / "off").plan["steps"]["batch"]
    assert not any("_gemvs" in x["kernel"] for x in off)


def test_wide_linears_keep_the_batch_gemv_to_8_rows(tmp_path, monkeypatch):
    """With the batch GEMV up to 32 rows, an LM head of GEMVM_WIDE_ROWS outputs or more takes it
    for steps of up to 8 rows only and the wgmma GEMM above (it streams a wide head faster
    there); the other linears take it up to 32. HIPC_BATCH_GEMV_ROWS forces it on every linear."""
    from hipc.base.launch_plan import Launch
    from hipc.compiler.codegen import hip
    from hipc.compiler.kernels.linear import GEMVM_WIDE_ROWS

    monkeypatch.setattr(hip, "BATCH_GEMV_ROWS", 32)
    folder = write_tiny_hf(tmp_path / "m", dtype="bfloat16", vocab_size=GEMVM_WIDE_ROWS)

    def gemv_heads(sub: str) -> dict[int, list[str]]:
        (tmp_path / sub).mkdir()
        batch = [
            Launch.from_json(x)
            for x in _sm90_program(folder, tmp_path / sub).plan["steps"]["batch"]
        ]
        at = {
            B: [x.kernel for x in batch if x.runs_at(B) and "_xb" not in x.kernel]
            for B in (8, 9, 32)
        }
        head = f"_{GEMVM_WIDE_ROWS}x"
        return {B: [n for n in names if head in n] for B, names in at.items()}, at

    heads, at = gemv_heads("cap")
    assert heads[8] and all("_gemvm1" in n for n in heads[8])
    assert heads[9] and all("_wg" in n for n in heads[9]) and heads[32] == heads[9]
    assert sum("_gemvm4" in n for n in at[32]) == sum("_gemvm1" in n for n in at[8]) - 1
    monkeypatch.setenv("HIPC_BATCH_GEMV_ROWS", "32")
    heads, _ = gemv_heads("forced")
    assert all("_gemvm4" in n for n in heads[32]) and heads[32]


def test_batch_attention_splits_and_forms():
    """The split batch attention's geometry: splits a power of two giving ~BATCH_BLOCKS blocks
    (at most BATCH_SPLITS_MAX, at least one); its launches' row ranges cover every batch step
    from BATCH_SPLIT_ROWS on without gaps; partials only for steps that split; no kernel for
    shapes its lanes or shared arrays do not fit; HIPC_BATCH_ATTN_SPLIT=0 leaves none."""
    from itertools import pairwise
    from types import SimpleNamespace

    from hipc.compiler.kernels.attention import (
        BATCH_BLOCKS,
        BATCH_SPLIT_ROWS,
        BATCH_SPLITS_MAX,
        AttentionParams,
        batch_attention,
        batch_attention_forms,
        batch_scratch,
        batch_splits,
    )
    from hipc.compiler.targets import GpuTarget

    for rows in (1, 3, 16, 17, 64, 65, 512):
        s = batch_splits(rows, 8)
        assert s & (s - 1) == 0 and 1 <= s <= BATCH_SPLITS_MAX
        assert rows * 8 * s >= BATCH_BLOCKS or s == BATCH_SPLITS_MAX
        assert s == 1 or rows * 8 * s // 2 < BATCH_BLOCKS  # the least that reaches it
    assert batch_splits(1, 8) == BATCH_SPLITS_MAX and batch_splits(512, 8) == 1

    def params(NH, NKV, D):
        return AttentionParams(NH=NH, NKV=NKV, D=D, scale=D**-0.5, window=0, interleaved=False,
                               norm_eps=0.0)  # fmt: skip

    p = params(32, 8, 128)
    g = SimpleNamespace(batch_attn_split=True, batch_attn_loads=True, max_tokens=200, target=GpuTarget("sm_90"),
                        max_ctx=8192, kv_storage="bfloat16")  # fmt: skip
    forms = batch_attention_forms("a", p, g, ["att"])
    ranges = [r for _, _, r in forms]
    assert ranges[0][0] == BATCH_SPLIT_ROWS and ranges[-1][1] == 200
    assert all(a[1] + 1 == b[0] for a, b in pairwise(ranges))
    for k, s, (lo, hi) in forms:
        assert k.fn.startswith("a_") and k.fn.endswith(f"_battn_s{s}") and k.ctx["splits"] == s
        assert all(batch_splits(T, 8) == s for T in range(lo, hi + 1))
    # the largest splitting step's partials: rows x heads x splits x (m, l, D sums)
    split = [(s, hi) for _, s, (_, hi) in forms if s > 1]
    assert batch_scratch(p, forms) == max(4 * hi * 32 * s * 130 for s, hi in split)
    g.batch_attn_split = False
    assert batch_attention_forms("a", p, g, ["att"]) == []
    target = GpuTarget("sm_90")
    assert batch_attention("a", params(8, 2, 12), target, ["x"], 64, "bfloat16", 1) is None
    assert batch_attention("a", params(8, 2, 512), target, ["x"], 64, "bfloat16", 1) is None
    assert batch_attention("a", params(9, 3, 64), target, ["x"], 64, "bfloat16", 4) is not None


def test_batch_attention_loads_by_family(monkeypatch):
    """The split batch attention's loads: BATCH_LOADS' forms for the target's family and the
    shape, by the step's rows (a launch per splits count and form); session 10's form for
    families and shapes it does not list and with HIPC_BATCH_ATTN_LOADS=0 (batch_attn_loads
    False); a ring over a float32 cache, or without room beside the shape's shared arrays,
    falls back to session 10's form; the ring's slots count in its shared bytes."""
    from types import SimpleNamespace

    from hipc.compiler.kernels import attention
    from hipc.compiler.kernels.attention import AttentionParams, batch_attention_forms
    from hipc.compiler.targets import GpuTarget

    def params(NH, NKV, D):
        return AttentionParams(NH=NH, NKV=NKV, D=D, scale=D**-0.5, window=0, interleaved=False,
                               norm_eps=0.0)  # fmt: skip

    def forms(target, p, loads=True, kv="bfloat16"):
        g = SimpleNamespace(batch_attn_split=True, batch_attn_loads=loads, max_tokens=64,
                            target=GpuTarget(target), max_ctx=8192, kv_storage=kv)  # fmt: skip
        out = batch_attention_forms("a", p, g, ["att"])
        assert out and out[0][2][0] == 1 and out[-1][2][1] == 64
        return [(r, s, k.ctx["unroll"], k.ctx["pipe"], k.ctx["ring"]) for k, s, r in out]

    l8, q35, smol = params(32, 8, 128), params(16, 2, 256), params(9, 3, 64)
    old = (8, False, 0)
    assert forms("sm_90", l8) == [
        ((1, 3), 16, 4, True, 0), ((4, 7), 8, *old), ((8, 15), 4, *old),
        ((16, 31), 2, 2, False, 4), ((32, 64), 1, 4, False, 2),
    ]  # fmt: skip
    for other in (forms("sm_90", l8, loads=False), forms("gfx942", l8)):
        assert [f[2:] for f in other] == [old] * 5
    assert [f[2:] for f in forms("sm_90", l8, kv="float32")] == [(4, True, 0)] + [old] * 4
    assert {f[2:] for f in forms("sm_90", q35)} == {(2, True, 0)}
    assert {f[2:] for f in forms("sm_90", smol)} == {(max(2, min(8, 32 // 3)), False, 0)}
    monkeypatch.setitem(attention.BATCH_LOADS["nvidia"], (8, 256), ((1, dict(unroll=2, ring=4)),))
    assert {f[2:] for f in forms("sm_90", q35)} == {(4, False, 0)}  # no room for the ring
    target = GpuTarget("sm_90")
    fits = attention.batch_attention("a", l8, target, ["x"], 64, "bfloat16", 1, unroll=2, ring=4)
    assert fits is not None
    assert attention.batch_attention("a", l8, target, ["x"], 64, "bfloat16", 1, unroll=2,
                                     ring=6) is None  # fmt: skip


def test_short_steps_take_their_measured_wgmma_tiles(monkeypatch, tmp_path):
    """The 8B shapes' batch steps (32 and 64 tokens) on the 64-token tiles bench_gpu_gemm.py
    measured fastest (WGMMA_SHORT), their 512+-token steps on the tiles they had; a shape's
    steps up to each listed size on that size's tile (17-32 tokens on the 32-token one, 33-64 on
    the 64-token one), tiles equal to their neighbour's one launch, quantized steps (from
    DEQUANT_MIN_TOKENS) never on them; unlisted shapes as before; HIPC_WGMMA_SHORT's file in
    place of the table."""
    import json

    from hipc.compiler.kernels import linear
    from hipc.compiler.kernels.linear import LinearParams, select_wgmma, wgmma_buckets

    shapes = {  # N, K, epilogue: the short tile; {tokens: the tile before, unchanged}
        "qkv": (6144, 4096, "none", "wg64x96k2", {512: "wg128x192", 4096: "wg128x256"}),
        "o": (4096, 4096, "residual", "wg64x192k4p", {512: "wg128x128", 4096: "wg128x256c2p"}),
        "gate_up": (28672, 4096, "glu", "wg64x224p", {512: "wg128x192", 4096: "wg128x256"}),
        "down": (4096, 14336, "residual", "wg64x192k4p", {512: "wg128x128", 4096: "wg128x256"}),
    }
    names = lambda buckets: [(t.name, r) for t, r in buckets]  # noqa: E731
    for name, (N, K, ep, short, long) in shapes.items():
        p = LinearParams("bfloat16", N, K, 0.0, ep, False)
        for tokens in (1, 17, 32, 37, 64):
            assert select_wgmma(p, tokens).name == short, (name, tokens)
        for tokens, want in long.items():
            assert select_wgmma(p, tokens).name == want, (name, tokens)
        assert select_wgmma(p, 65).name == long[512], name
        assert names(wgmma_buckets(p, 1, 4096)) == [
            (short, (1, 64)),
            (long[512], (65, 1024)),
            (long[4096], (1025, 4096)),
        ], name
        assert names(wgmma_buckets(p, 128, 4096)) == [
            (long[512], (128, 1024)),
            (long[4096], (1025, 4096)),
        ], name
    head = LinearParams("bfloat16", 128256, 4096, 1e-5, "none", False)
    assert select_wgmma(head, 64).name == "wg64x256p"
    assert select_wgmma(head, 512).name == "wg128x256"  # the wave model's, as before

    # different tiles at 32 and 64 tokens: a launch each
    down = LinearParams("bfloat16", 4096, 14336, 0.0, "residual", False)
    monkeypatch.setitem(linear.WGMMA_SHORT, (4096, 14336, "residual"),
                        {32: "wg64x128k4", 64: "wg64x256k8"})  # fmt: skip
    assert [select_wgmma(down, t).name for t in (1, 32, 33, 64)] == [
        "wg64x128k4", "wg64x128k4", "wg64x256k8", "wg64x256k8"]  # fmt: skip
    assert names(wgmma_buckets(down, 1, 4096))[:2] == [
        ("wg64x128k4", (1, 32)),
        ("wg64x256k8", (33, 64)),
    ]
    assert names(wgmma_buckets(down, 1, 48)) == [("wg64x128k4", (1, 32)), ("wg64x256k8", (33, 48))]
    # an unlisted shape (SmolLM2's gate/up): one tile for every step up to SHORT_STEP
    smol = LinearParams("bfloat16", 3072, 576, 0.0, "glu", False)
    assert names(wgmma_buckets(smol, 1, 512)) == [("wg128x128", None)]
    assert select_wgmma(smol, 64).name == "wg128x128"
    # the benchmarks' override: a JSON file of entries in place of the table
    path = tmp_path / "short.json"
    path.write_text(json.dumps({"3072,576,glu": {"64": "wg64x224p"}}))
    monkeypatch.setenv("HIPC_WGMMA_SHORT", str(path))
    assert select_wgmma(smol, 64).name == "wg64x224p"
    assert select_wgmma(down, 32).name == "wg128x128"  # not in the file: the 512 tile


def test_short_wgmma_tiles_in_the_batch_plan(tmp_path, monkeypatch):
    """The plan for a listed shape: the batch step's GEMM above the batch GEMV and prefill steps
    of up to 64 tokens run the short tile with its K split over a cluster (grid z,
    __cluster_dims__); steps of 65 tokens and more keep the 512-token tile. Listed at 32 tokens
    too, the linear takes 17-32-row batch steps off the GEMV, and so does the GLU linear whose
    bf16 output it reads (that GEMM writes bf16 where the GEMV would read float32)."""
    from hipc.base.launch_plan import Launch
    from hipc.compiler.kernels import linear

    def down(launches: list[Launch], T: int, kind: str = "_wg") -> list[str]:
        # the tiny model's down projection (32 outputs, K = 128) at T tokens: its kernels' tiles
        return [
            x.kernel.rsplit("_", 1)[1]
            for x in launches
            if x.runs_at(T) and "_32x128_residual_" in x.kernel and kind in x.kernel
        ]

    for sizes in ({64: "wg64x64k2"}, {32: "wg64x64k2", 64: "wg64x64k2"}):
        monkeypatch.setitem(linear.WGMMA_SHORT, (32, 128, "residual"), sizes)
        work = tmp_path / str(len(sizes))
        folder = write_tiny_hf(  # 256-token steps: a longer context
            work / "m", dtype="bfloat16", intermediate_size=128, max_position_embeddings=256
        )
        program = _sm90_program(folder, work)
        steps = program.plan["steps"]
        batch = [Launch.from_json(x) for x in steps["batch"]]
        prefill = [Launch.from_json(x) for x in steps["prefill"]]
        assert down(batch, 33) == down(batch, 64) == ["wg64x64k2"] * 2  # one per layer
        assert down(prefill, 37) == down(prefill, 64) == ["wg64x64k2"] * 2
        assert down(prefill, 65) == down(prefill, 256) == ["wg128x128"] * 2  # the wave model's
        k2 = [x for x in batch if x.runs_at(64) and x.kernel.endswith("_wg64x64k2")]
        assert [x.grid for x in k2] == [("cdiv(T,64)", 1, 2)] * 2  # one output block, K in two
        assert "__cluster_dims__(1, 1, 2)" in program.source
        assert down(batch, 16, "_gemvm") == ["gemvm2"] * 2
        if 32 in sizes:  # 17-32 rows: the GEMM, gate/up's too (unlisted: its one tile)
            assert down(batch, 17) == down(batch, 32) == ["wg64x64k2"] * 2
            assert not down(batch, 32, "_gemvm")
            glu = [x.kernel for x in batch if x.runs_at(17) and "_glu_" in x.kernel]
            assert glu == [x.kernel for x in batch if x.runs_at(64) and "_glu_" in x.kernel]
            assert len(glu) == 4 and all("_wg128x128_yb" in n for n in glu), glu  # +_xb
        else:
            assert not down(batch, 32) and down(batch, 32, "_gemvm") == ["gemvm4"] * 2


def test_quantized_gemvs_keep_their_units_out_of_local_memory(tmp_path):
    """Every quantized type's decode GEMV at the 8B's shapes (qkv, gate/up, down, o; default
    geometries), compiled for sm_90: ptxas may spill a few registers, but no stack frame
    beyond its spills but a word or two. A GEMV unit whose fields are indexed by a run-time value (Q3_K's
    scale words read as w[j % 2] with j the unit's half) puts the whole register ring in
    local memory: 288-384 bytes a thread there, 48 local stores a loop, the 8B Q3_K gate/up
    at 35.3 us against 20.1 without (docs/benchmarks/gpu-h200.md, session 21)."""
    need(shutil.which("nvcc"), "nvcc")
    need(shutil.which("ptxas"), "ptxas")
    from hipc.compiler.kernels.linear import QUANT_TYPES, LinearParams, decode_gemv
    from hipc.compiler.targets import GpuTarget

    from gpu_kernels import kernels_source

    shapes = {
        "qkv": (6144, 4096, 1e-5, "none"),
        "gate_up": (2 * 14336, 4096, 1e-5, "glu"),
        "down": (4096, 14336, 0.0, "residual"),
        "o": (4096, 4096, 0.0, "residual"),
    }
    target = GpuTarget("sm_90")
    specs = [
        decode_gemv(
            f"{t}_{s}", LinearParams(t, *shape, bias=False), target, [s], activations="int8"
        )
        for t in QUANT_TYPES
        for s, shape in shapes.items()
    ]
    source = kernels_source([(k.fn, k.template, k.ctx, k.shared) for k in specs], "sm_90")
    ptx_path = tmp_path / "gemv.ptx"
    ptx_path.write_text(NvccToolchain("sm_90").ptx(source))
    out = subprocess.run(
        ["ptxas", "-arch=sm_90a", "-v", str(ptx_path), "-o", str(tmp_path / "gemv.cubin")],
        capture_output=True, text=True, check=True,
    ).stderr  # fmt: skip
    frames = {}
    for fn, frame, spills in re.findall(
        r"Compiling entry function '(\w+)'.*?(\d+) bytes stack frame, (\d+) bytes spill stores",
        out,
        re.S,
    ):
        frames[fn] = (int(frame), int(spills))
    assert set(frames) == {k.fn for k in specs}, sorted(frames)
    local = {fn: f for fn, f in frames.items() if f[0] > f[1] + 8}
    assert not local, local
