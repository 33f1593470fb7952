"""Per-token cost of grammar-constrained decoding on a real vocabulary.

    python docs/benchmarks/grammar_mask.py ARTIFACT.hipc

Walks a valid JSON document token by token through runtime/constraint.py's Constraint (the
llguidance mask, unpacked to one bool per logit) and the sampler with and without that mask,
and prints median and 99th-percentile microseconds per token. The model is not run: this is
the host-side overhead a constrained step adds to the engine's own step.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from hipc.runtime.artifact import load_artifact
from hipc.runtime.constraint import Constraint, json_schema_grammar
from hipc.runtime.sampler import Sampler, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
DOC = {
    "name": "Ada Lovelace, Countess of Lovelace",
    "age": 36,
    "tags": ["red", "blue", "green", "red"],
    "address": {"city": "London, Marylebone", "zip": "W1U 3BU"},
}


def main(path: str, rounds: int = 20) -> None:
    tok = load_artifact(path).tokenizer()
    grammar = json_schema_grammar(SCHEMA)
    ids = tok.encode(json.dumps(DOC, separators=(",", ":")), False)
    t0 = time.perf_counter()
    Constraint(tok, grammar)
    print(
        f"vocabulary {tok.vocab_size}; first constraint (builds the token trie) {time.perf_counter() - t0:.2f} s"
    )
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(tok.vocab_size).astype(np.float32)
    mask_us, greedy_us, sampled_us, plain_us = [], [], [], []
    for _ in range(rounds):
        c = Constraint(tok, grammar)
        greedy, sampled = (
            Sampler(SamplingParams()),
            Sampler(SamplingParams(temperature=0.8, top_p=0.9, seed=0)),
        )
        for t in ids:
            t0 = time.perf_counter()
            allowed = c.allowed(logits.size)
            t1 = time.perf_counter()
            greedy(logits, allowed=allowed)
            t2 = time.perf_counter()
            sampled(logits, allowed=allowed)
            t3 = time.perf_counter()
            sampled(logits)
            t4 = time.perf_counter()
            assert allowed[t]
            c.advance(t)
            mask_us.append(t1 - t0)
            greedy_us.append(t2 - t1)
            sampled_us.append(t3 - t2)
            plain_us.append(t4 - t3)
    for name, xs in [
        ("mask (llguidance + unpack)", mask_us),
        ("greedy pick with mask", greedy_us),
        ("top-p draw with mask", sampled_us),
        ("top-p draw, no mask", plain_us),
    ]:
        us = np.array(xs) * 1e6
        print(f"{name:28s} median {np.median(us):7.1f} us   p99 {np.percentile(us, 99):7.1f} us")


if __name__ == "__main__":
    main(sys.argv[1])
