"""The compiled SmolLM2-135M-Instruct Q4_1 artifact against transformers' dequantized model."""

from __future__ import annotations

import numpy as np
import pytest

from hipc.compiler.options import CompileOptions
from hipc.compiler.pipeline import compile_model
from hipc.runtime.engine import load_engine

from support import SMOLLM2_CHAT_PROMPTS, SMOLLM2_CORPUS, greedy, hf_greedy

pytestmark = [pytest.mark.oracle, pytest.mark.slow]


@pytest.fixture(scope="module")
def engine(smollm2_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("smol") / "smollm2.hipc"
    compile_model(smollm2_gguf, out, CompileOptions(max_context=512), verbose=False)
    return load_engine(out)


def test_teacher_forced_top1(smollm2_oracle, engine):
    import torch

    tok, model = smollm2_oracle
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
def test_greedy_chat_matches_transformers(smollm2_oracle, engine, prompt):
    tok, model = smollm2_oracle
    text = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    want = hf_greedy(model, ids, 32)
    assert greedy(engine, ids, 32) == want
