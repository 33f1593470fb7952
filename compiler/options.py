"""Compile options: a frozen record that validates itself."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from hipc.base.errors import HipcError
from hipc.base.launch_plan import MAX_STEP_TOKENS
from hipc.compiler.quant_recipes import RECIPES

GPU_TARGETS = (
    "sm_80",
    "sm_89",
    "sm_90",
    "gfx90a",
    "gfx942",
    "gfx1100",
    "gfx1101",
    "gfx1151",
    "gfx1201",
)
KNOWN_TARGETS = ("cpu", *GPU_TARGETS)
# NOTE: the CPU's KV cache is float32 [max_ctx, kv_heads, head_dim] per layer; 4096
# positions keep SmolLM2's at 377 MB and a Llama-3-8B's at 1 GiB. A hybrid whose linear-
# attention layers hold a fixed-size state instead (Qwen3.5: 3 in 4) gets the positions
# the same KV memory holds: 4096 x layers / KV layers (16384 for Qwen3.5). GPU targets
# compile the model's whole context: the runtime sizes the KV cache to the device at load.
DEFAULT_MAX_CONTEXT = {"cpu": 4096}
KV_STORAGE = ("auto", "float32", "bfloat16")
# How GPU prefill GEMMs feed activations to the matrix units (bf16 weights): "bf16" rounds
# them to bf16 once, as every peer does; "split" multiplies hi = bf16(x) and lo = bf16(x - hi)
# (twice the matrix work, float32-class logits). docs/ARCHITECTURE.md "Precision" has numbers.
PREFILL_PRECISIONS = ("bf16", "split")
# GPUs: 2048-token prefill steps, so a long prompt runs in a few large steps, at the matrix
# units' long-step rate (the tiles for short steps are separate launches; the arena and the
# logits buffer grow with it: ~1 GiB of logits for a 128k vocabulary)
DEFAULT_MAX_TOKENS = {"cpu": 256, **dict.fromkeys(GPU_TARGETS, 2048)}


@dataclass(frozen=True)
class CompileOptions:
    targets: tuple[str, ...] = ("cpu",)
    max_context: int | None = None  # None: the model's limit, capped per target
    max_tokens: int | None = None  # tokens per step (prefill chunk); None: per target
    activations: str = "int16"  # quantized matmuls round activations to int16 (near-exact) or int8
    kv_storage: str = "auto"  # KV-cache element type; auto: bfloat16 on GPUs, float32 on the CPU
    quant: str | None = None  # quantize float weights at compile time (a recipe name)
    prefill_precision: str = "bf16"  # GPU prefill GEMM activations: bf16, or the hi + lo split

    def __post_init__(self) -> None:
        if not self.targets:
            raise HipcError("--target: at least one target is needed")
        for t in self.targets:
            if t not in KNOWN_TARGETS:
                raise HipcError(
                    f"--target: unknown target {t!r} (known: {', '.join(KNOWN_TARGETS)})"
                )
        if self.activations not in ("int16", "int8"):
            raise HipcError(f"--activations: expected int16 or int8, got {self.activations!r}")
        if self.kv_storage not in KV_STORAGE:
            raise HipcError(
                f"--kv-storage: expected one of {', '.join(KV_STORAGE)}, got {self.kv_storage!r}"
            )
        if self.kv_storage == "bfloat16" and "cpu" in self.targets:
            raise HipcError(
                "--kv-storage bfloat16: the cpu target stores its KV cache as float32 only "
                "(compile the cpu target separately, or with --kv-storage float32)"
            )
        if self.prefill_precision not in PREFILL_PRECISIONS:
            raise HipcError(
                f"--prefill-precision: expected one of {', '.join(PREFILL_PRECISIONS)}, "
                f"got {self.prefill_precision!r}"
            )
        if self.quant is not None and self.quant not in RECIPES:
            raise HipcError(f"--quant: expected one of {', '.join(RECIPES)}, got {self.quant!r}")
        if self.max_context is not None and self.max_context < 2:
            raise HipcError(f"--max-context must be at least 2, got {self.max_context}")
        if self.max_tokens is not None and not 1 <= self.max_tokens <= MAX_STEP_TOKENS:
            raise HipcError(
                f"--prefill-chunk must be in 1..{MAX_STEP_TOKENS}, got {self.max_tokens}"
            )

    def resolved_max_context(self, model_limit: int, kv_layer_share: float = 1.0) -> int:
        """`kv_layer_share`: the fraction of layers with a KV cache (the rest recurrent)."""
        caps = [
            int(DEFAULT_MAX_CONTEXT[t] / max(kv_layer_share, 1e-3))
            if t in DEFAULT_MAX_CONTEXT
            else model_limit
            for t in self.targets
        ]
        cap = min(caps)
        return min(self.max_context or cap, model_limit)

    def resolved_kv_storage(self) -> str:
        """auto: bfloat16 when every target is a GPU (half the bytes, as peers store it),
        else float32 (the cpu target's only type; one artifact has one KV layout)."""
        if self.kv_storage != "auto":
            return self.kv_storage
        return "float32" if "cpu" in self.targets else "bfloat16"

    @property
    def quant_layout(self) -> str:
        """How the artifact stores quantized weight blocks: "split" (every block's quants, then
        every block's scales: aligned wide loads on GPUs) when every target is a GPU, else
        "gguf" (the file's interleaved blocks, which the CPU kernels read; GPU kernels read it
        too, more slowly). One artifact holds one copy of the weights."""
        return "gguf" if "cpu" in self.targets else "split"

    def resolved_max_tokens(self, max_context: int) -> int:
        """Rows a forward step holds. The default is the targets' step, at most the context
        (one sequence's prompt never needs more); an explicit --prefill-chunk is kept above
        the context too, since a batched step holds rows of many sequences (the prompts of
        clients joining at once prefill together)."""
        if self.max_tokens is not None:
            return self.max_tokens
        return min(min(DEFAULT_MAX_TOKENS[t] for t in self.targets), max_context)

    def to_json(self) -> dict:
        return asdict(self)
