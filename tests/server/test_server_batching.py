"""`hipc serve --max-batch 8` on the tiny artifact: requests overlap in the batch, each gets
what the engine gives it alone, cancellation returns every KV block, the prefix cache hits
and changes nothing, and the pool is reported in /metrics and at startup."""

from __future__ import annotations

import threading
import time

import pytest

from hipc.runtime.engine import load_engine
from hipc.runtime.generate import Generation, GenerationRequest
from hipc.runtime.sampler import SamplingParams

from serving import running

BATCH = 8
POOL = 8 * 256
NEW = 200  # tokens per request: long enough that requests arriving one by one overlap


@pytest.fixture(scope="module")
def batch_server(tiny_artifact, server_logs):
    with running(
        tiny_artifact, "--served-model-name", "tiny", "--threads", "1",
        "--max-batch", str(BATCH), "--kv-pool-tokens", str(POOL), log_dir=server_logs,
    ) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="module")
def engine(tiny_artifact):
    eng = load_engine(tiny_artifact, threads=1)
    yield eng
    eng.close()


def direct(engine, prompt_ids, max_tokens, **sampling) -> str:
    gen = Generation(
        engine,
        engine.tokenizer,
        GenerationRequest(tuple(prompt_ids), max_tokens, SamplingParams(**sampling)),
    )
    for _ in gen.steps():
        pass
    return gen.result.text


def wait_for(cond, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def pool_is_full(server) -> bool:
    m = server.metrics()
    return m["hipc_kv_blocks_used"] == 0 and m["hipc_kv_blocks_free"] == POOL // 16


def complete(server, prompt: str, max_tokens: int, **kw):
    return server.client().completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, extra_body={"ignore_eos": True}, **kw
    )


def test_startup_logs_the_pool(batch_server):
    log = batch_server.log()
    assert f"KV pool: {POOL // 16} blocks of 16 positions = {POOL} positions" in log
    assert f"up to {BATCH} sequences per step" in log
    assert pool_is_full(batch_server)


def test_concurrent_requests_overlap_and_each_gets_its_own_output(batch_server, engine):
    prompts = [f"Request {i}: the quick brown fox" for i in range(BATCH)]
    want = []
    for i, p in enumerate(prompts):
        gen = Generation(
            engine,
            engine.tokenizer,
            GenerationRequest(
                tuple(engine.tokenizer.encode(p)),
                NEW,
                SamplingParams(temperature=0.8, seed=i),
                ignore_eos=True,
            ),
        )
        for _ in gen.steps():
            pass
        want.append(gen.result.text)
    t0 = time.perf_counter()
    one = complete(batch_server, prompts[0], NEW, temperature=0.8, seed=0).choices[0].text
    single = time.perf_counter() - t0
    assert one == want[0]
    before = batch_server.metrics()
    got: dict[int, str] = {}
    barrier = threading.Barrier(BATCH)

    def run(i):
        barrier.wait()
        got[i] = complete(batch_server, prompts[i], NEW, temperature=0.8, seed=i).choices[0].text

    threads = [threading.Thread(target=run, args=(i,)) for i in range(BATCH)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    together = time.perf_counter() - t0
    assert [got.get(i) for i in range(BATCH)] == want
    m = batch_server.metrics()
    steps = m["hipc_batch_size_count"] - before["hipc_batch_size_count"]
    rows = m["hipc_batch_size_sum"] - before["hipc_batch_size_sum"]
    # the 8 requests shared their steps: about NEW steps of 8, not 8 x NEW steps of 1
    # (one at a time it would be exactly 1; measured 5.5 on a busy 2-core machine)
    assert rows / steps > 2, (rows, steps)
    assert together < 0.5 * BATCH * single, (together, single)
    assert pool_is_full(batch_server)


def test_cancelled_streams_return_their_blocks(batch_server):
    """Streams closed after their first chunk: each is cancelled (or, the tiny model being
    fast, has finished); either way every block is back. tests/runtime/test_batch.py cancels
    at chosen steps."""
    before = batch_server.metrics()
    streams = [
        complete(batch_server, f"cancel me {i}", 240, stream=True, temperature=0) for i in range(4)
    ]
    for s in streams:
        next(iter(s))
        s.close()
    cancelled = 'hipc_requests_cancelled_total{reason="client_disconnected"}'
    finished = 'hipc_choices_finished_total{reason="length"}'

    def settled():
        m = batch_server.metrics()
        return sum(m.get(k, 0) - before.get(k, 0) for k in (cancelled, finished)) == 4

    assert wait_for(settled)
    assert wait_for(lambda: pool_is_full(batch_server))
    m = batch_server.metrics()
    assert m["hipc_sequences_running"] == 0 and m["hipc_sequences_waiting"] == 0
    assert m["hipc_requests_running"] == 0


def test_a_shared_prompt_hits_the_prefix_cache_and_changes_nothing(batch_server, engine):
    system = "You are a careful assistant. " * 8  # several 16-token blocks
    prompt = system + "Name a colour."
    want = direct(engine, engine.tokenizer.encode(prompt), 16)
    before = batch_server.metrics()
    first = complete(batch_server, prompt, 16, temperature=0).choices[0].text
    again = complete(batch_server, prompt, 16, temperature=0).choices[0].text
    # n choices of one request share the prompt too
    many = complete(batch_server, prompt, 16, temperature=0, n=3).choices
    assert first == again == want and [c.text for c in many] == [want] * 3
    m = batch_server.metrics()
    hits = m["hipc_prefix_cache_hit_tokens"] - before["hipc_prefix_cache_hit_tokens"]
    assert hits >= 4 * 16 * (len(engine.tokenizer.encode(prompt)) // 16 - 1)
    assert 0 < m["hipc_prefix_cache_hit_rate"] <= 1
    assert m["hipc_prompt_reuse_total"] >= before.get("hipc_prompt_reuse_total", 0) + 4


def test_streamed_choices_arrive_in_order(batch_server):
    client = batch_server.client()
    chunks = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=12, n=3, stream=True, temperature=0.9, seed=3
    )
    order = [c.choices[0].index for c in chunks if c.choices]
    assert order == sorted(order) and set(order) == {0, 1, 2}
    whole = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=12, n=3, temperature=0.9, seed=3
    )
    assert len({c.text for c in whole.choices}) == 3
