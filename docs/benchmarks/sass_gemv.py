"""Instruction counts of the quantized decode GEMVs' SASS, on a machine with no GPU.

    # the GEMV units alone: instructions per 256 weights of one lane (hipc_load_unit +
    # hipc_dot_unit<false>, int8 activations), by unit
    python docs/benchmarks/sass_gemv.py units [--units q4_0,q4_k,q4_k64,q6_k,q6_k64]
    # whole kernels as bench_gpu_gemv.py renders them: registers, and the instruction mix of
    # each loop (the one with the dot products, IDP, is the main loop)
    python docs/benchmarks/sass_gemv.py kernels [--shapes l8_down,l8_down_q4k] [--variants default]

Compiles for --arch (default sm_90) with this checkout's prelude and nvcc, then disassembles
with cuobjdump (its nvdisasm on PATH too; both are in pip's nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm wheels). --keep DIR leaves the source, code object and SASS there.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "docs" / "benchmarks"))

from hipc.compiler.codegen.hip import program_source  # noqa: E402

from gpu_kernels import compiled, kernels_source  # noqa: E402

# unit -> (its qmat type, weights per unit)
UNITS = {
    "q4_0": ("q4_0", 32),
    "q4_1": ("q4_1", 32),
    "q8_0": ("q8_0", 32),
    "q4_k": ("q4_k", 128),
    "q4_k64": ("q4_k", 64),
    "q5_k": ("q5_k", 128),
    "q6_k": ("q6_k", 128),
    "q6_k64": ("q6_k", 64),
    "iq4_xs": ("iq4_xs", 128),
    "q3_k": ("q3_k", 128),
}
WEIGHTS = 256  # per lane in the units' micro-kernels
INSTR = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)([^;]*);")


def sass(blob: bytes, keep: Path | None) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        d = keep or Path(tmp)
        d.mkdir(parents=True, exist_ok=True)
        (d / "k.bin").write_bytes(blob)
        out = subprocess.run(
            ["cuobjdump", "-sass", str(d / "k.bin")], capture_output=True, text=True
        )
        if out.returncode:
            sys.exit(f"cuobjdump: {out.stderr.strip()}")
        if keep:
            (d / "k.sass").write_text(out.stdout)
        return out.stdout


def functions(text: str) -> dict[str, list[tuple[int, str, str]]]:
    """function -> its instructions as (address, opcode, operands)."""
    out = {}
    for part in text.split("Function : ")[1:]:
        name = part.split()[0]
        out[name] = [(int(a, 16), op, rest) for a, op, rest in INSTR.findall(part)]
    return out


def mix(ins) -> str:
    c = collections.Counter(op for _, op, _ in ins if op != "NOP")
    return ", ".join(f"{k} {v}" for k, v in c.most_common(12))


def units(args) -> None:
    names = args.units.split(",")
    kernels = []
    for name in names:
        mat, values = UNITS[name]
        n = WEIGHTS // values
        kernels.append(f"""
extern "C" __global__ void __launch_bounds__(256) k_{name}(const void* W, float* y) {{
  HIPC_DYNAMIC_SHARED(int, xq);
  const hipc_qmat_{mat} m{{(const char*)W, (size_t)1 << 20}};
  const hipc_xqs xs{{xq}};
  hipc_unit_{name} v[{n}];
#pragma unroll
  for (int j = 0; j < {n}; ++j) hipc_load_unit(v[j], m, (size_t)blockIdx.x * 4096 + j * 32 + threadIdx.x);
  float acc = 0.f;
#pragma unroll
  for (int j = 0; j < {n}; ++j) acc += hipc_dot_unit<false>(v[j], xs, j * 32 + threadIdx.x);
  y[blockIdx.x * 256 + threadIdx.x] = acc;
}}""")
    src = program_source("sass_units", "0", args.arch, kernels)
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        (args.keep / "src.cu").write_text(src)
    fns = functions(sass(compiled(src, args.arch), args.keep))
    print(f"| unit | instructions per {WEIGHTS} weights | mix |\n|---|---:|---|")
    for name in names:
        ins = [i for i in fns[f"k_{name}"] if i[1] != "NOP"]
        print(f"| {name} | {len(ins)} | {mix(ins)} |")


def kernels(args) -> None:
    import bench_gpu_gemv as bench

    shapes = args.shapes.split(",")
    specs = bench.gemv_specs(args.arch, shapes, args.variants.split(","), (args.activations,))
    src = kernels_source(bench.as_built(specs), args.arch)
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        (args.keep / "src.cu").write_text(src)
    blob = compiled(src, args.arch)
    fns = functions(sass(blob, args.keep))
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.bin").write_bytes(blob)
        res = subprocess.run(
            ["cuobjdump", "-res-usage", str(Path(tmp) / "k.bin")], capture_output=True, text=True
        ).stdout
    regs = dict(re.findall(r"Function (\w+):\s*\n?\s*REG:(\d+)", res))
    print(
        "| shape | variant | registers | instructions | main loop | its mix |\n|---|---|---:|---:|---:|---|"
    )
    for (s, g, _), k in specs.items():
        ins = fns[k.fn]
        at = {a: i for i, (a, _, _) in enumerate(ins)}
        loops = []
        for i, (a, op, rest) in enumerate(ins):
            m = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
            if m and int(m.group(1), 16) <= a and int(m.group(1), 16) in at:
                loops.append(ins[at[int(m.group(1), 16)] : i + 1])
        dots = [lp for lp in loops if any(op == "IDP" for _, op, _ in lp)]
        main = max(dots, key=len) if dots else []
        print(f"| {s} | {g} | {regs.get(k.fn, '?')} | {len(ins)} | {len(main)} | {mix(main)} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("units", "kernels"))
    ap.add_argument("--units", default="q4_0,q4_k,q4_k64,q6_k,q6_k64")
    ap.add_argument(
        "--shapes",
        default="l8_down,l8_down_q4k,l8_down_q6k,l8_gate_up,l8_gate_up_q4k,l8_o_q4k,l8_qkv_q4k",
    )
    ap.add_argument("--variants", default="default")
    ap.add_argument("--activations", default="int8")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--keep", type=Path, help="leave the source, code object and SASS here")
    args = ap.parse_args()
    units(args) if args.what == "units" else kernels(args)


if __name__ == "__main__":
    main()
