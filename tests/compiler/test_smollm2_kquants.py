"""The real SmolLM2-135M-Instruct requantized to K-quant mixes, compiled for the CPU,
against transformers' dequantized model of the same file.

The package's Q4_1 GGUF is dequantized by gguf-py and re-stored by hipc's quantizer:
"q4_k_m" with llama.cpp's Q4_K_M recipe (166 Q5_0, 16 Q4_K, 15 Q8_0, 14 Q6_K: SmolLM2's
576-wide rows fall back from the K-quants), "q6_k" with Q6_K where a row allows it and
Q8_0 elsewhere. transformers reads either file through gguf-py's dequantize and runs
its own Llama in float32, so this checks hipc's kernels, loader and fusion on every
type of the mix, not the quantizer's quality.
"""

from __future__ import annotations

import numpy as np
import pytest

from hipc.compiler.options import CompileOptions
from hipc.compiler.pipeline import compile_model
from hipc.compiler.quantize import q4_k_m_type
from hipc.runtime.engine import load_engine

from gguf_writer import requantize_gguf
from support import SMOLLM2_CHAT_PROMPTS, SMOLLM2_CORPUS, greedy, hf_greedy, require

pytestmark = [pytest.mark.oracle, pytest.mark.slow]

RECIPES = {
    "q4_k_m": lambda name, shape: q4_k_m_type(name, shape, n_layers=30),
    "q6_k": lambda name, shape: (
        None if len(shape) != 2 else ("q6_k" if shape[-1] % 256 == 0 else "q8_0")
    ),
}


@pytest.fixture(scope="module", params=sorted(RECIPES))
def requantized(request, smollm2_gguf, tmp_path_factory):
    """(transformers tokenizer, transformers model, compiled engine) for one recipe."""
    transformers = require("transformers")
    require("torch")
    root = tmp_path_factory.mktemp(request.param)
    path = requantize_gguf(
        smollm2_gguf, root / f"smollm2-{request.param}.gguf", RECIPES[request.param]
    )
    tok = transformers.AutoTokenizer.from_pretrained(root, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        root, gguf_file=path.name, dtype="float32"
    ).eval()
    compile_model(path, root / "m.hipc", CompileOptions(max_context=512), verbose=False)
    engine = load_engine(root / "m.hipc")
    stored = {w["dtype"] for w in engine.artifact.plan["weights"]}
    assert stored >= ({"q4_k", "q5_0", "q6_k", "q8_0"} if request.param == "q4_k_m" else {"q6_k"})
    return tok, model, engine


def test_teacher_forced_top1(requantized):
    import torch

    tok, model, engine = requantized
    agree = total = 0
    for text in SMOLLM2_CORPUS:
        ids = tok(text)["input_ids"]
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0].numpy()
        got = engine.logits(ids)
        agree += int(np.sum(got.argmax(-1) == want.argmax(-1)))
        total += len(ids)
    assert agree / total >= 0.98, f"{agree}/{total}"


@pytest.mark.parametrize("prompt", SMOLLM2_CHAT_PROMPTS)
def test_greedy_chat_matches_transformers(requantized, prompt):
    tok, model, engine = requantized
    text = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert greedy(engine, ids, 32) == hf_greedy(model, ids, 32)
