"""The reference executor on the real SmolLM2-135M-Instruct Q4_1 GGUF vs transformers.

transformers dequantizes the same file to float32 and runs its own Llama; the
tokens come from transformers' tokenizer, so this checks the model, not ours.
"""

from __future__ import annotations

import numpy as np
import pytest

from hipc.compiler.reference.executor import ReferenceExecutor
from hipc.graphs import build_graph, load_model

from support import SMOLLM2_CHAT_PROMPTS, SMOLLM2_CORPUS, hf_greedy

pytestmark = [pytest.mark.oracle, pytest.mark.slow]


@pytest.fixture(scope="module")
def executor(smollm2_gguf):
    return ReferenceExecutor(build_graph(load_model(smollm2_gguf), max_ctx=512))


def hf_logits(model, tokens):
    import torch

    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


def test_teacher_forced_top1_agreement(smollm2_oracle, executor):
    tok, model = smollm2_oracle
    agree = total = 0
    worst = 0.0
    for text in SMOLLM2_CORPUS:
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


@pytest.mark.parametrize("prompt", SMOLLM2_CHAT_PROMPTS)
def test_greedy_chat_continuation(smollm2_oracle, executor, prompt):
    tok, model = smollm2_oracle
    text = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    tokens = tok(text, add_special_tokens=False)["input_ids"]
    assert greedy_ours(executor, tokens, 32) == hf_greedy(model, tokens, 32)
