"""The compiled SmolLM2-135M-Instruct Q4_1 artifact against transformers' dequantized model."""

from __future__ import annotations

import numpy as np
import pytest

from hipc.compiler.options import CompileOptions
from hipc.compiler.pipeline import compile_model
from hipc.runtime.engine import load_engine

from support import hf_greedy, require

pytestmark = [pytest.mark.oracle, pytest.mark.slow]

CORPUS = [
    "The capital of France is Paris, and the capital of Germany is Berlin.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Unicode: naïve café, Здравствуйте, こんにちは世界, emoji 🎉🚀 and math ∑∫√.",
    "Whitespace    runs\t\tand\n\n\nnewlines   keep   going.      End.",
    "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n17 * 23 = 391.<|im_end|>\n",
    "SELECT name, COUNT(*) FROM users WHERE age > 30 GROUP BY name ORDER BY 2 DESC;",
    "In 1969, Apollo 11 landed on the Moon. Neil Armstrong said: 'That's one small step for man.'",
]
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Who wrote Hamlet?",
]


@pytest.fixture(scope="module")
def oracle(smollm2_gguf):
    transformers = require("transformers")
    require("torch")
    folder, name = smollm2_gguf.parent, smollm2_gguf.name
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, torch_dtype="float32"
    )
    return tok, model.eval()


@pytest.fixture(scope="module")
def engine(smollm2_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("smol") / "smollm2.hipc"
    compile_model(smollm2_gguf, out, CompileOptions(max_context=512), verbose=False)
    return load_engine(out)


def test_teacher_forced_top1(oracle, engine):
    import torch

    tok, model = oracle
    agree = total = 0
    for text in CORPUS:
        ids = tok(text)["input_ids"]
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0].numpy()
        got = engine.logits(ids)
        agree += int(np.sum(got.argmax(-1) == want.argmax(-1)))
        total += len(ids)
    assert agree / total >= 0.98, f"{agree}/{total}"


@pytest.mark.parametrize("prompt", CHAT_PROMPTS)
def test_greedy_chat_matches_transformers(oracle, engine, prompt):
    tok, model = oracle
    text = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    want = hf_greedy(model, ids, 32)
    logits, got = engine.forward(ids, 0), []
    for i in range(32):
        got.append(int(logits.argmax()))
        logits = engine.forward([got[-1]], len(ids) + i)
    assert got == want
