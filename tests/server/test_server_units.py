"""Pieces of the server on their own: the <think> splitter, config precedence, metrics text,
the scheduler's queue and cancellation."""

from __future__ import annotations

import random
import threading
import time

import pytest

from hipc.base.errors import HipcError
from hipc.runtime.server.config import OPTIONS, Config
from hipc.runtime.server.metrics import ServerMetrics
from hipc.runtime.server.reasoning import ReasoningSplitter, prompt_opens_think, split_reasoning
from hipc.runtime.server.scheduler import Job, QueueFull, Scheduler, ShuttingDown

from serving import parse_metrics

REPLIES = [
    "<think>plan</think>answer",
    "  \n<think>\nsteps 1 < 2 </thin k></think>\n\nfinal </think> stays",
    "no reasoning at all",
    "<thi",
    "<think>never closed",
    " <thinking>is not the tag",
    "",
    "   ",
    "plan only</think>answer",
]


@pytest.mark.parametrize("text", REPLIES)
@pytest.mark.parametrize("opened", [False, True])
def test_splitter_streaming_equals_whole(text, opened):
    whole = split_reasoning(text, opened)
    rng = random.Random(hash(text) & 0xFFFF)
    for _ in range(100):
        s, reasoning, content, i = ReasoningSplitter(opened), "", "", 0
        while i < len(text):
            j = i + rng.randint(1, 5)
            r, c = s.feed(text[i:j])
            reasoning, content, i = reasoning + r, content + c, j
        r, c = s.finish()
        assert (reasoning + r if s.opened else None, content + c) == whole


def test_splitter_cases():
    assert split_reasoning("<think>a</think>b") == ("a", "b")
    assert split_reasoning("\n<think>a</think>b") == ("a", "b")
    assert split_reasoning("x<think>a</think>b") == (None, "x<think>a</think>b")
    assert split_reasoning("a</think>b", True) == ("a", "b")
    assert split_reasoning("<think>a") == ("a", "")
    assert split_reasoning("<thi") == (None, "<thi")
    s = ReasoningSplitter()
    assert s.feed("<thi") == ("", "")  # held: could still be the tag
    assert s.feed("nk>ok </th") == ("ok ", "")  # '</th' held
    assert s.feed("ink>done") == ("", "done")


def test_prompt_opens_think():
    assert prompt_opens_think("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_think("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_think("user said <think> once\n<|im_start|>assistant\n")


def test_config_precedence_flags_over_env_over_defaults():
    env = {"HIPC_PORT": "9001", "HIPC_API_KEY": "k", "HIPC_EAGER_LOAD": "off", "HIPC_HOST": ""}
    c = Config.from_sources({"port": 9002, "host": None}, env)
    assert (c.port, c.api_key, c.eager_load, c.host) == (9002, "k", False, "127.0.0.1")
    assert Config.from_sources({}, {}).port == 8000
    with pytest.raises(HipcError, match="HIPC_PORT='x'"):
        Config.from_sources({}, {"HIPC_PORT": "x"})
    with pytest.raises(HipcError, match="HIPC_EAGER_LOAD"):
        Config.from_sources({}, {"HIPC_EAGER_LOAD": "maybe"})
    with pytest.raises(HipcError, match="--port / HIPC_PORT"):
        Config(port=70000)
    with pytest.raises(HipcError, match="HIPC_REASONING"):
        Config.from_sources({}, {"HIPC_REASONING": "sometimes"})


def test_every_option_is_a_config_field_with_an_env_var():
    fields = set(Config.__dataclass_fields__)
    assert {o.field for o in OPTIONS} == fields
    assert all(o.env == "HIPC_" + o.field.upper() for o in OPTIONS)


def test_metrics_text_format():
    m = ServerMetrics(kv_bytes=1024, max_context=64)
    m.set_load(3, 1)
    m.requests.labels("/v1/completions", "200").inc()
    m.requests.labels("/v1/completions", "200").inc()
    m.ttft.observe(0.003)
    m.ttft.observe(100)
    body, content_type = m.render()
    text = body.decode()
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    parsed = parse_metrics(text)
    assert parsed['hipc_requests_total{endpoint="/v1/completions",status="200"}'] == 2
    assert parsed['hipc_time_to_first_token_seconds_bucket{le="0.0025"}'] == 0
    assert parsed['hipc_time_to_first_token_seconds_bucket{le="0.005"}'] == 1
    assert parsed['hipc_time_to_first_token_seconds_bucket{le="+Inf"}'] == 2
    assert parsed["hipc_time_to_first_token_seconds_count"] == 2
    assert parsed["hipc_time_to_first_token_seconds_sum"] == pytest.approx(100.003)
    assert parsed["hipc_queue_depth"] == 3 and parsed["hipc_kv_cache_bytes"] == 1024
    assert "# TYPE hipc_time_to_first_token_seconds histogram" in text
    assert parsed["hipc_requests_running"] == 1 and parsed["hipc_max_context_tokens"] == 64
    other = ServerMetrics()  # a second app in the same process keeps its own registry
    assert 'hipc_requests_total{endpoint="/v1/completions"' not in other.render()[0].decode()


MULTIPROCESS_WORKER = """
import sys
from hipc.runtime.server.metrics import ServerMetrics
m = ServerMetrics(kv_bytes=100, max_context=64)
m.requests.labels("/v1/completions", "200").inc(int(sys.argv[1]))
m.generation_tokens.inc(int(sys.argv[1]))
m.ttft.observe(0.003)
m.set_load(int(sys.argv[1]), 1)
if sys.argv[2] == "exit":
    m.close()
sys.stdout.write(m.render()[0].decode())
"""


def test_metrics_add_up_across_processes_with_prometheus_multiproc_dir(tmp_path):
    """Three worker processes, as gunicorn-style workers would be: counters and histograms
    add up whatever became of the process; a closed worker's live gauges no longer count."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}

    def worker(n: int, how: str) -> dict[str, float]:
        cmd = [sys.executable, "-c", MULTIPROCESS_WORKER, str(n), how]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return parse_metrics(done.stdout)

    worker(2, "stay")
    worker(5, "exit")
    m = worker(3, "stay")
    assert m['hipc_requests_total{endpoint="/v1/completions",status="200"}'] == 10
    assert m["hipc_generation_tokens_total"] == 10
    assert m["hipc_time_to_first_token_seconds_count"] == 3
    assert m['hipc_time_to_first_token_seconds_bucket{le="0.005"}'] == 3
    assert m["hipc_queue_depth"] == 2 + 3 and m["hipc_requests_running"] == 2
    assert m["hipc_kv_cache_bytes"] == 200 and m["hipc_max_context_tokens"] == 64
    assert not any(k.startswith("process_") for k in m)  # only the answering process's


def test_hipc_chat_needs_no_server_extra():
    """`hipc chat` shares the prompt helpers of service.py: without prometheus-client (or
    falcon) installed it still imports."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules.update(prometheus_client=None, falcon=None, waitress=None)\n"
        "import hipc.runtime.server.terminal_chat"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_scheduler_runs_one_at_a_time_in_order_and_cancels():
    running, order, gate = [], [], threading.Event()
    cancelled = []

    def work(name):
        def run(job):
            running.append(name)
            assert len(running) - len(order) == 1  # never two at once
            gate.wait(5)
            order.append(name)

        return run

    loads = []
    s = Scheduler(
        max_queued=2,
        on_cancel=lambda job: cancelled.append(job.cancel_reason),
        on_change=lambda depth, running: loads.append((depth, running)),
    )
    jobs = [Job(work(i)) for i in range(3)]
    for job in jobs:
        s.submit(job)
    time.sleep(0.1)
    with pytest.raises(QueueFull):
        s.submit(Job(work(9)))
    assert (s.running, s.depth) == (1, 2)
    jobs[2].cancel("client_disconnected")  # leaves the queue at once
    assert s.depth == 1 and jobs[2].done.is_set() and not jobs[2].started.is_set()
    gate.set()
    for job in jobs[:2]:
        assert job.done.wait(5)
    assert order == [0, 1]
    assert cancelled == ["client_disconnected"]
    # every move of the queue, in order: what the metrics' gauges were set to
    full = loads.index((2, 1))  # two waiting behind the running one
    assert loads[full + 1] == (1, 1)  # the cancelled one left the queue
    assert loads[-1] == (0, 0) and max(d + r for d, r in loads) == 3
    s.close(grace=1)
    with pytest.raises(ShuttingDown):
        s.submit(Job(work(5)))


def test_scheduler_close_cancels_after_grace():
    stop = threading.Event()

    def run(job):
        while not job.cancelled:
            time.sleep(0.01)
        stop.set()

    s = Scheduler(max_queued=4)
    job = Job(run)
    s.submit(job)
    t0 = time.monotonic()
    s.close(grace=0.3)
    assert stop.is_set() and job.cancel_reason == "shutdown"
    assert 0.25 < time.monotonic() - t0 < 3


def test_logit_bias_and_logprobs_in_the_sampler():
    import numpy as np

    from hipc.runtime.sampler import Sampler, SamplingParams, log_softmax, token_logprobs

    logits = np.array([1.0, 3.0, 2.5, -1.0])
    assert Sampler(SamplingParams(logit_bias=((3, 5.0),)))(logits) == 3
    assert Sampler(SamplingParams(logit_bias=((1, -100.0),)))(logits) == 2
    with pytest.raises(HipcError, match="out of vocabulary"):
        Sampler(SamplingParams(logit_bias=((9, 1.0),)))(logits)
    with pytest.raises(HipcError, match="seed"):
        SamplingParams(seed=-1)
    lp, top = token_logprobs(logits, 2, 2)
    ref = log_softmax(logits)
    assert np.exp(ref).sum() == pytest.approx(1.0)
    assert lp == pytest.approx(ref[2])
    assert [t for t, _ in top] == [1, 2] and top[0][1] == pytest.approx(ref[1])


def test_generation_steps_add_up_to_the_result():
    from hipc.runtime.generate import Generation, GenerationRequest

    from serving import ScriptedEngine, script, tiny_tokenizer

    tok = tiny_tokenizer()
    engine = ScriptedEngine(tok, script(tok, "ab日本 STOP cd"))
    request = GenerationRequest((5, 6), stop=("STOP",), logprobs=1)
    gen = Generation(engine, tok, request)
    steps = list(gen.steps())
    assert "".join(s.text for s in steps) == gen.result.text == "ab日本 "
    assert [t for s in steps for t in s.token_ids] == gen.result.token_ids
    assert [lp for s in steps for lp in s.logprobs] == gen.result.logprobs
    assert all(len(s.token_ids) <= 1 for s in steps)
    assert gen.result.finish_reason == "stop"
    assert "".join(Generation(engine, tok, request)) == gen.result.text  # the CLI's view


def test_pipelined_generation_matches_the_plain_loop():
    """An engine with submit/collect (the next step runs while a token is detokenized)
    gives the same steps, text, tokens and finish reasons as one with forward alone, and
    a step started for a sequence that then stops is collected, never left in flight."""
    from hipc.runtime.generate import Generation, GenerationRequest

    from serving import ScriptedEngine, script, tiny_tokenizer

    class Pipelined(ScriptedEngine):
        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            self.queued, self.submits, self.log = None, 0, []

        def submit(self, tokens, start) -> None:
            assert self.queued is None, "a step is already in flight"
            self.queued, self.submits = (list(tokens), start), self.submits + 1
            self.log.append(("submit", start))

        def collect(self):
            tokens, start = self.queued
            self.queued = None
            self.log.append(("collect", start))
            return ScriptedEngine.forward(self, tokens, start)

    tok = tiny_tokenizer()
    text = "ab日本 STOP cd"
    for request in (
        GenerationRequest((5, 6), stop=("STOP",), logprobs=1),  # a stop string
        GenerationRequest((5, 6), max_tokens=3),  # the length limit
        GenerationRequest((5, 6)),  # EOS after the script
    ):
        plain = Generation(ScriptedEngine(tok, script(tok, text)), tok, request)
        want = list(plain.steps())
        engine = Pipelined(tok, script(tok, text))
        gen = Generation(engine, tok, request)
        assert list(gen.steps()) == want
        for field in ("text", "token_ids", "finish_reason", "logprobs"):
            assert getattr(gen.result, field) == getattr(plain.result, field), field
        assert engine.queued is None and engine.submits > 0
        # strictly alternating, each submit at the position after the last
        assert [k for k, _ in engine.log] == ["submit", "collect"] * engine.submits


def test_serve_refuses_a_partial_server_extra_at_start(monkeypatch, capsys):
    """A missing pydantic used to surface as a 500 on the first request (seen on a GPU image)."""
    import importlib.util

    from hipc.cli.main import main

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "pydantic" else real(name, *a)
    )
    assert main(["serve", "no-such.hipc", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert (
        "missing: pydantic" in err and "hipc-compiler[server]" in err and len(err.splitlines()) == 1
    )


@pytest.mark.parametrize("max_batch,max_queued", [(64, 0), (64, 128), (1, 64), (8, 2)])
def test_waitress_has_a_thread_for_every_request_the_engine_may_hold(max_batch, max_queued):
    """A streamed request keeps its waitress thread to the end: --max-batch running plus
    --max-queued-requests waiting each need one, and spares answer /health and 429s;
    with fewer, batch slots stay empty while requests wait inside waitress."""
    from hipc.runtime.server.serve import MAX_HTTP_THREADS, SPARE_HTTP_THREADS, http_threads

    threads = http_threads(Config(max_batch=max_batch, max_queued_requests=max_queued))
    held = max_batch + max_queued  # requests past these get a 429 at once
    assert threads == MAX_HTTP_THREADS or threads >= held + SPARE_HTTP_THREADS
    assert threads <= MAX_HTTP_THREADS
