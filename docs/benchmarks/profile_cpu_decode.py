"""Where a CPU decode step goes, launch by launch: a compiled artifact's hipc_forward with a
cycle counter around each launch, its weights' bytes beside each kernel's time.

    python docs/benchmarks/profile_cpu_decode.py ARTIFACT [--threads 2] [--rounds 20]
        [--tokens 64] [--depth 0]

The artifact's kernels/cpu.cpp is copied into a temporary artifact (the other files linked,
nothing of ARTIFACT changed) with `__rdtsc()` read before and after every launch of
hipc_forward, and built with the flags its manifest records. Then ROUNDS runs of TOKENS
single-token steps from position DEPTH (after an untimed DEPTH-token prompt; the argmax fed
back, as bench_cpu_moe.py's decode). Printed: the step's wall time, the time inside the
launches, and per kernel (launches with the same name but their hash) its launches a step,
microseconds a step and a launch, the bytes of quantized weights it reads and the rate that
makes, and (after the steps) the rate the same threads read a 256 MB buffer at: the memory
ceiling of the moment (on a shared VM it drifts by a quarter within minutes). The counters
cost ~20 ns a launch; x86-64 only (the TSC).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAUNCH = re.compile(r"^(  )(\w+)\((.*)\);\n", re.M)


def instrument(source: str) -> tuple[str, list[tuple[str, str]]]:
    """cpu.cpp with each launch of hipc_forward timed into hipc_prof[i]; the launches."""
    head, body = source.split('extern "C" int hipc_forward', 1)
    launches: list[tuple[str, str]] = []

    def timed(m: re.Match) -> str:
        launches.append((m[2], m[3]))
        i = len(launches) - 1
        return f"{m[1]}{{ const uint64_t t0_ = __rdtsc(); {m[2]}({m[3]}); hipc_prof[{i}] += __rdtsc() - t0_; }}\n"

    body = LAUNCH.sub(timed, body)
    counters = (
        "#include <x86intrin.h>\n"
        f'extern "C" {{ __attribute__((visibility("default"))) uint64_t hipc_prof[{len(launches)}]; '
        '__attribute__((visibility("default"))) uint64_t hipc_tsc() { return __rdtsc(); } }\n'
    )
    return head + counters + 'extern "C" int hipc_forward' + body, launches


def build(artifact: Path, work: Path) -> tuple[Path, list[tuple[str, str]]]:
    """A copy of `artifact` in `work` whose code object counts cycles a launch."""
    out = work / artifact.name
    (out / "kernels").mkdir(parents=True)
    for f in artifact.iterdir():
        if f.name not in ("kernels", "manifest.json"):
            (out / f.name).symlink_to(f.resolve())
    manifest = json.loads((artifact / "manifest.json").read_text())
    cpu = manifest["targets"].get("cpu")
    if cpu is None:
        sys.exit(f"{artifact}: no cpu code object (compile with --target cpu)")
    source, launches = instrument((artifact / cpu["source"]).read_text())
    (out / cpu["source"]).write_text(source)
    cmd = ["g++", *cpu["flags"], str(out / cpu["source"]), "-o", str(out / cpu["code_object"])]
    subprocess.run(cmd, check=True)
    for rel in (cpu["source"], cpu["code_object"]):
        data = (out / rel).read_bytes()
        manifest["files"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return out, launches


READ_RATE = r"""
#include <omp.h>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>
int main() {  // the best of 10 reads of 256 MB by the team, statically split
  std::vector<uint64_t> buf((256u << 20) / 8);
  std::memset(buf.data(), 1, buf.size() * 8);
  double best = 0;
  uint64_t sink = 0;
  for (int r = 0; r < 10; ++r) {
    const double t = omp_get_wtime();
    uint64_t s = 0;
#pragma omp parallel for schedule(static) reduction(+ : s)
    for (size_t i = 0; i < buf.size(); ++i) s += buf[i];
    const double gbs = buf.size() * 8 / (omp_get_wtime() - t) / 1e9;
    best = gbs > best ? gbs : best;
    sink += s;
  }
  std::printf("%.1f %d\n", best, (int)(sink & 1));
}
"""


def read_rate(work: Path, threads: int) -> float:
    """GB/s the threads read from memory together (a 256 MB sum, best of 10)."""
    src, exe = work / "read_rate.cpp", work / "read_rate"
    src.write_text(READ_RATE)
    subprocess.run(
        ["g++", "-O2", "-march=native", "-fopenmp", str(src), "-o", str(exe)], check=True
    )
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    return float(
        subprocess.run(
            [str(exe)], env=env, capture_output=True, text=True, check=True
        ).stdout.split()[0]
    )


def weight_bytes(plan: dict, args: str) -> int:
    """Bytes of the quantized (and dense non-float32) weights a launch's arguments name."""
    total = 0
    for i in re.findall(r"W\[(\d+)\]", args):
        w = plan["weights"][int(i)]
        if w["dtype"] == "float32":
            continue  # norms, biases, RoPE tables: small, and read from cache
        n = 1
        for d in w["stored_shape"]:
            n *= d
        total += n * (2 if w["dtype"] in ("float16", "bfloat16") else 1)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, default=0)
    args = ap.parse_args()
    if not (args.artifact / "manifest.json").is_file():
        sys.exit(f"{args.artifact}: not a compiled artifact (no manifest.json)")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before libgomp loads
    from hipc.runtime.engine import load_engine

    with tempfile.TemporaryDirectory() as tmp:
        timed, launches = build(args.artifact, Path(tmp))
        engine = load_engine(timed, target="cpu", threads=args.threads)
        lib = ctypes.CDLL(str(timed / "kernels" / "cpu.so"))
        prof = (ctypes.c_uint64 * len(launches)).in_dll(lib, "hipc_prof")
        lib.hipc_tsc.restype = ctypes.c_uint64
        t0, c0 = time.perf_counter(), lib.hipc_tsc()
        time.sleep(0.2)
        hz = (lib.hipc_tsc() - c0) / (time.perf_counter() - t0)
        prompt = [1 + i % 100 for i in range(max(args.depth, 1))]
        engine.forward(prompt, 0)  # pages the weights in
        counted = [0] * len(launches)  # the decode steps' cycles (the prompts' left out)
        wall = 0.0
        for _ in range(args.rounds):
            engine.forward(prompt, 0)
            before = list(prof)
            tok, start = 1, time.perf_counter()
            for i in range(args.tokens):
                tok = int(engine.forward([tok], len(prompt) + i).argmax())
            wall += time.perf_counter() - start
            counted = [c + p - b for c, p, b in zip(counted, prof, before, strict=True)]
        engine.close()
        ceiling = read_rate(Path(tmp), args.threads)
    steps = args.rounds * args.tokens
    plan = json.loads((args.artifact / "plan.json").read_text())
    kinds: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0])
    for i, (name, call_args) in enumerate(launches):
        k = kinds[re.sub(r"_[0-9a-f]{6}$", "", name)]
        k[0] += 1
        k[1] += counted[i] / hz / steps * 1e6
        if not name.startswith("embedding"):  # (a row of its table a token)
            k[2] += weight_bytes(plan, call_args)
    inside = sum(k[1] for k in kinds.values())
    print(
        f"{args.artifact.name}: {args.threads} thread(s), {steps} steps from position "
        f"{len(prompt)}: {wall / steps * 1e6:,.1f} us a step, {inside:,.1f} in the launches; "
        f"the threads read {ceiling:.1f} GB/s together (a 256 MB sum, same run)\n"
    )
    print("| kernel | launches | us a step | us a launch | weights MB | GB/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (n, us, nbytes) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
        rate = f"{nbytes / us / 1e3:.1f}" if nbytes else ""
        print(f"| {name} | {n} | {us:,.1f} | {us / n:.2f} | {nbytes / 1e6:.2f} | {rate} |")


if __name__ == "__main__":
    main()
