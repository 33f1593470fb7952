"""Which weight type, in which matrix, moves a compiled model off the reference executor.

A tiny random llama-architecture GGUF (tests/gguf_writer.write_numpy_gguf, 256 wide, ffn 512)
with every matrix in one type, then with TYPE in one kind of matrix at a time and BASE in the
rest; each compiled for --target and for the cpu target and compared with the reference:
prefill logits (19 tokens) and stepwise decode (a 6-token prefill, then one token a step).

    python docs/benchmarks/decode_error_by_type.py --type iq4_xs --types iq4_nl,q4_0,q4_k,q8_0
    python docs/benchmarks/decode_error_by_type.py --type iq4_xs --kv-storage float32

Session 16 (H200) found the GPU's stepwise decode ~2.4e-3 off with bf16 KV whatever the type
(docs/benchmarks/gpu-h200.md). The cpu column is against a reference with the GPU's KV
storage, so it reads the bf16 rounding the CPU (float32 KV) does not do, unless
--kv-storage float32.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from hipc.compiler.options import CompileOptions  # noqa: E402
from hipc.compiler.pipeline import compile_model  # noqa: E402
from hipc.compiler.reference.engine import ReferenceEngine  # noqa: E402
from hipc.graphs import load_model  # noqa: E402
from hipc.runtime.engine import load_engine  # noqa: E402

from gguf_writer import write_numpy_gguf  # noqa: E402
from support import rel_err  # noqa: E402

MATRICES = ("token_embd", "output.weight", "attn_q", "attn_k", "attn_v", "attn_output",
            "ffn_gate", "ffn_up", "ffn_down")  # fmt: skip


def run(types, target: str, activations: str, kv_storage: str) -> list[float]:
    tmp = Path(tempfile.mkdtemp())
    path = write_numpy_gguf(tmp / "m.gguf", hidden=256, ffn=512, types=types)
    out = {}
    for t in (target, "cpu"):
        art = tmp / f"{t}.hipc"
        opts = CompileOptions(targets=(t,), max_context=64, max_tokens=8, activations=activations,
                              prefill_precision="split", kv_storage="auto" if t == "cpu" else kv_storage)  # fmt: skip
        compile_model(path, art, opts, verbose=False)
        e = load_engine(art, target="cpu" if t == "cpu" else "auto")
        tokens = np.random.default_rng(5).integers(0, e.vocab_size, 19).tolist()
        pre = e.logits(tokens)
        e.reset()
        steps = [e.forward(tokens[:6], 0)] + [
            e.forward([x], 6 + i) for i, x in enumerate(tokens[6:])
        ]
        out[t] = (pre, np.stack(steps), e.artifact.kv_storage)
        e.close()
    ref = ReferenceEngine(load_model(path), 64, kv_storage=out[target][2])
    want_pre = ref.logits(tokens, 0)
    ref.reset()
    want = np.stack([ref.logits(tokens[:6], 0)[-1]]
                    + [ref.logits([x], 6 + i)[-1] for i, x in enumerate(tokens[6:])])  # fmt: skip
    g, c = out[target], out["cpu"]
    return [rel_err(g[0], want_pre), rel_err(g[1], want), rel_err(c[1], want), rel_err(g[1], c[1])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--type", default="iq4_xs", help="the type placed one kind of matrix at a time")
    ap.add_argument("--base", default="q8_0", help="the other matrices' type")
    ap.add_argument(
        "--types", default="", help="also every matrix in each of these (comma-separated)"
    )
    ap.add_argument("--target", default="sm_90")
    ap.add_argument("--activations", default="int16")
    ap.add_argument("--kv-storage", default="auto")
    a = ap.parse_args()
    print(f"| matrices in {a.type} (the rest {a.base}) | {a.target} prefill | {a.target} decode "
          f"| cpu decode | {a.target} vs cpu decode |\n|---|---:|---:|---:|---:|")  # fmt: skip
    rows = [(f"all {t}", lambda n, t=t: t) for t in [a.type, *filter(None, a.types.split(","))]]
    rows += [(m, lambda n, m=m: a.type if m in n else a.base) for m in MATRICES]
    for name, types in rows:
        errs = run(types, a.target, a.activations, a.kv_storage)
        print(f"| {name} | " + " | ".join(f"{e:.2e}" for e in errs) + " |", flush=True)


if __name__ == "__main__":
    main()
