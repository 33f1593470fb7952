"""The reference executor on the real SmolLM2-135M-Instruct Q4_1 GGUF vs transformers.

transformers dequantizes the same file to float32 and runs its own Llama; the
tokens come from transformers' tokenizer, so this checks the model, not ours.
"""

from __future__ import annotations

import numpy as np
import pytest

from hipc.compiler.reference.executor import ReferenceExecutor
from hipc.graphs import build_graph, load_model

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
    "Explain what a hash table is in one paragraph.",
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
    model.eval()
    return tok, model


@pytest.fixture(scope="module")
def executor(smollm2_gguf):
    return ReferenceExecutor(build_graph(load_model(smollm2_gguf), max_ctx=512))


def hf_logits(model, tokens):
    import torch

    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


def test_teacher_forced_top1_agreement(oracle, executor):
    tok, model = oracle
    agree = total = 0
    worst = 0.0
    for text in CORPUS:
        tokens = tok(text)["input_ids"]
        executor.reset()
        ours = executor.logits(tokens)
        theirs = hf_logits(model, tokens)
        agree += int(np.sum(ours.argmax(-1) == theirs.argmax(-1)))
        total += len(tokens)
        worst = max(worst, float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs))))
    assert total > 150
    assert agree / total >= 0.99, f"top-1 agreement {agree}/{total}"
    assert worst < 1e-3, f"max relative logit error {worst}"


def greedy_ours(executor, tokens, n):
    executor.reset()
    logits = executor.logits(tokens)[-1]
    out = []
    for _ in range(n):
        nxt = int(logits.argmax())
        out.append(nxt)
        logits = executor.logits([nxt], len(tokens) + len(out) - 1)[-1]
    return out


@pytest.mark.parametrize("prompt", CHAT_PROMPTS)
def test_greedy_chat_continuation(oracle, executor, prompt):
    tok, model = oracle
    text = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    tokens = tok(text, add_special_tokens=False)["input_ids"]
    assert greedy_ours(executor, tokens, 32) == hf_greedy(model, tokens, 32)
