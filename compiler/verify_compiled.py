"""hipc verify: the compiled program against the reference executor on the same tokens.

Tolerances follow the weights: float weights are computed in float32 on both sides
(relative error <= 1e-3, top-1 equal). Quantized matmuls round activations per
32-block (int16 by default: logits within ~1e-3; int8 with --activations int8: a few
percent, as llama.cpp's kernels), so for them the bar is 1e-2 and 98% top-1. GPU
prefill rounds matrix operands to bf16 by default (`--prefill-precision bf16`, as peers do:
the activations of bf16-weight GEMMs, q and the softmax weights in NVIDIA's attention): the bar is then BF16_PREFILL_RTOL and
BF16_PREFILL_TOP1; `--prefill-precision split` keeps float32-class logits and the 1e-3 bar.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hipc.base.errors import HipcError
from hipc.compiler.ir import QUANT_DTYPES
from hipc.compiler.options import CompileOptions

# Operands rounded to bf16 (8 significant bits) in prefill's GEMMs and attention. Measured
# (docs/ARCHITECTURE.md "Precision"): 6e-3 (SmolLM2 shape, H200) to 1.8e-2 (SmolLM2's weights,
# NumPy emulation of the GEMM rounding); the bar leaves ~3x over the larger.
BF16_PREFILL_RTOL = 5e-2
BF16_PREFILL_TOP1 = 0.95

DEFAULT_TEXT = (
    "The quick brown fox jumps over the lazy dog. def add(a, b):\n    return a + b\n"
    "Numbers 12345 and unicode café, naïve, 東京. The capital of France is"
)


@dataclass
class VerifyReport:
    target: str
    tokens: int
    max_abs: float
    max_rel: float
    top1: float
    rtol: float
    min_top1: float

    @property
    def ok(self) -> bool:
        return self.max_rel <= self.rtol and self.top1 >= self.min_top1

    def table(self) -> str:
        verdict = "PASS" if self.ok else "FAIL"
        return "\n".join(
            [
                f"target      {self.target}",
                f"tokens      {self.tokens}",
                f"max |diff|  {self.max_abs:.3e}",
                f"max rel     {self.max_rel:.3e}   (tolerance {self.rtol:g})",
                f"top-1       {self.top1:.4f}   (minimum {self.min_top1:g})",
                verdict,
            ]
        )


def compare(got: np.ndarray, want: np.ndarray) -> tuple[float, float, float]:
    diff = float(np.max(np.abs(got - want)))
    return (
        diff,
        diff / float(np.max(np.abs(want))),
        float(np.mean(got.argmax(-1) == want.argmax(-1))),
    )


def _tokens(engine, text: str | None) -> list[int]:
    """The text's tokens; a model without a tokenizer gets fixed pseudo-random ids."""
    if (engine.artifact.path / "tokenizer.json").is_file():
        return engine.tokenizer.encode(text or DEFAULT_TEXT)[: engine.max_context]
    if text:
        raise HipcError("--text: this model has no tokenizer")
    n = min(48, engine.max_context)
    return np.random.default_rng(0).integers(0, engine.vocab_size, n).tolist()


def verify_model(
    model_ref: str,
    target: str = "cpu",
    text: str | None = None,
    max_context: int | None = None,
    rtol: float | None = None,
    min_top1: float | None = None,
    quant: str | None = None,
    prefill_precision: str = "bf16",
) -> VerifyReport:
    from hipc.compiler.cached import cached_artifact
    from hipc.compiler.reference.engine import ReferenceEngine
    from hipc.graphs import load_model
    from hipc.runtime.engine import load_engine

    options = CompileOptions(
        targets=(target,),
        max_context=max_context or 512,
        quant=quant,
        prefill_precision=prefill_precision,
    )
    engine = load_engine(cached_artifact(model_ref, options), target)
    model = load_model(model_ref)
    ids = _tokens(engine, text)
    # the reference stores its KV cache as the artifact does (bfloat16 on GPUs by default)
    reference = ReferenceEngine(
        model, engine.max_context, kv_storage=engine.artifact.kv_storage, quant=quant
    )
    want = reference.logits(ids, 0)
    got = engine.logits(ids)
    quantized = any(w["dtype"] in QUANT_DTYPES for w in engine.artifact.plan["weights"])
    max_abs, max_rel, top1 = compare(got, want)
    bar, bar_top1 = (1e-2, 0.98) if quantized else (1e-3, 1.0)
    if bf16_prefill(target, prefill_precision):
        bar, bar_top1 = max(bar, BF16_PREFILL_RTOL), min(bar_top1, BF16_PREFILL_TOP1)
    return VerifyReport(
        target,
        len(ids),
        max_abs,
        max_rel,
        top1,
        rtol if rtol is not None else bar,
        min_top1 if min_top1 is not None else bar_top1,
    )


def bf16_prefill(target: str, precision: str) -> bool:
    """Whether the compiled prefill rounds operands to bf16: a GPU target with the bf16 policy
    (its bf16-weight GEMMs round x, its NVIDIA prefill attention q and the softmax weights)."""
    return target != "cpu" and precision == "bf16"
