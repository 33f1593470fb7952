"""The work behind the routes: requests to plans, plans to jobs on the engine's queue.

The service owns the engine's slot, the scheduler and the metrics. A request is checked
against the admitted context before it queues, so a prompt that cannot fit is a 400 at
once; everything that touches the engine happens on the scheduler's thread.
"""

from __future__ import annotations

import functools
import json
import logging
import queue
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from hipc.base.errors import HipcError
from hipc.runtime.artifact import plan_kv_storage
from hipc.runtime.batch import BatchEngine, batchable
from hipc.runtime.generate import Generation, GenerationRequest, GenerationResult
from hipc.runtime.server import openai_format as fmt
from hipc.runtime.server.batching import BatchScheduler
from hipc.runtime.server.config import Config
from hipc.runtime.server.errors import APIError, bad_request, server_busy, unavailable
from hipc.runtime.server.reasoning import prompt_opens_think
from hipc.runtime.server.responses import Plan, Responder
from hipc.runtime.server.runner import ChoiceSpec, EngineSlot, Runner
from hipc.runtime.server.scheduler import Job, QueueFull, Scheduler, ShuttingDown
from hipc.runtime.server.tools import forced_call_grammar, prepare_messages, syntax_of
from hipc.runtime.server.validation import ChatParams, Common, CompletionParams, Limits

log = logging.getLogger("hipc.server")

Disconnected = Callable[[], bool]
_POLL_S = 0.1


def admitted_context(engine, requested: int | None) -> int:
    """The context a request may use: all the engine holds unless fewer are asked for."""
    holds = int(engine.max_context)
    if requested is None:
        return holds
    if requested > holds:
        raise HipcError(
            f"--max-context-tokens {requested}: the artifact's KV cache holds {holds} positions "
            f"(it was compiled with --max-context {holds}); admit at most {holds}, or recompile "
            "with a larger --max-context"
        )
    return requested


COMPILED_KV_STORAGE = ("float32", "bfloat16")
_KV_ALIASES = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def check_kv_storage(engine, requested: str | None) -> str:
    """The KV storage type in use: the artifact's, fixed when it was compiled; asking for
    another is a clear error naming the compile flag that would store it."""
    target = getattr(getattr(engine, "backend", None), "name", "this")
    plan = getattr(getattr(engine, "artifact", None), "plan", None) or {}
    native = plan_kv_storage(plan)
    if requested is None:
        return native
    want = _KV_ALIASES.get(requested.lower(), requested.lower())
    if want == native:
        return want
    have = f"--kv-storage {requested}: this artifact's KV cache is {native}"
    if want not in COMPILED_KV_STORAGE:
        raise HipcError(
            f"{have}; hipc stores KV caches as {' or '.join(COMPILED_KV_STORAGE)} "
            f"(bfloat16 on GPU targets only)"
        )
    raise HipcError(
        f"{have} on the {target} target; the type is chosen when compiling: "
        f"hipc compile MODEL --kv-storage {want}"
        + (" (GPU targets only)" if want == "bfloat16" else "")
    )


def default_model_name(engine) -> str:
    artifact = getattr(engine, "artifact", None)
    path = getattr(artifact, "path", None)
    return Path(path).name.removesuffix(".hipc") if path else "hipc-model"


def reasoning_enabled(mode: str, tokenizer, template: str | None) -> bool:
    """--reasoning auto: split <think> spans if the vocabulary or the template knows them."""
    if mode != "auto":
        return mode == "on"
    return tokenizer.token_to_id("<think>") is not None or "<think>" in (template or "")


def render_prompt(
    tokenizer, template: str | None, messages: list[dict], kwargs: dict[str, Any]
) -> tuple[list[int], str]:
    """Token ids and text of a chat prompt, through `template` (ChatML if None)."""
    text = chat_text(tokenizer, template, messages, kwargs)
    return encode(tokenizer, text, False), text


def chat_text(tokenizer, template: str | None, messages: list[dict], kwargs: dict[str, Any]) -> str:
    from hipc.base.chat_template import CHATML_TEMPLATE, render_chat

    return render_chat(
        template or CHATML_TEMPLATE,
        messages,
        add_generation_prompt=True,
        bos_token=tokenizer.bos_token or "",
        eos_token=tokenizer.eos_token or "",
        **kwargs,
    )


def longest_token_bytes(tokenizer) -> int | None:
    """An upper bound on the bytes of text one token can stand for, or None if there is none.

    Without a normalizer every token covers at most its own spelling (a byte-level symbol
    spells one byte in two, '<0x41>' one in six), so a text of B bytes has at least
    B / this many tokens. A normalizer may shrink text before it is split (NFKC composes
    up to three code points into one), hence the factor 4 then. An unknown-token id that
    swallows any run of unknown characters (BPE or Unigram fusing them without byte
    fallback, WordPiece's [UNK] for an over-long word) covers unboundedly many: None.
    """
    backend = getattr(tokenizer, "backend", None)
    if backend is None:
        return None
    try:
        model = json.loads(backend.to_str()).get("model") or {}
    except (ValueError, AttributeError):
        return None
    kind = model.get("type")
    has_unk = model.get("unk_token") is not None or model.get("unk_id") is not None
    fuses = kind == "Unigram" or model.get("fuse_unk")
    if kind not in ("BPE", "Unigram") or (has_unk and fuses and not model.get("byte_fallback")):
        return None
    longest = max(
        (len(t.encode("utf-8")) for t in backend.get_vocab(with_added_tokens=True)), default=1
    )
    return max(longest, 1) * (4 if backend.normalizer is not None else 1)


_ENCODER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hipc-tokenize")


def encode(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """Encode on one thread: the tokenizers library keeps caches per calling thread
    (megabytes each once prompts vary), so encoding from every HTTP thread would grow one
    set per thread; measured in docs/benchmarks/server-load.md."""
    return _ENCODER.submit(tokenizer.encode, text, add_special_tokens).result()


class Service:
    def __init__(self, engine, config: Config, tokenizer=None) -> None:
        self.engine = engine
        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
        self.model_name = config.served_model_name or default_model_name(engine)
        self.max_context = admitted_context(engine, config.max_context_tokens)
        self.kv_storage = check_kv_storage(engine, config.kv_storage)
        self.created = fmt.now()
        # NOTE: imported here: `hipc chat` uses this module's prompt helpers, and it needs
        # no server extra (prometheus-client)
        from hipc.runtime.server.metrics import ServerMetrics

        backend = getattr(engine, "backend", None)
        self.metrics = ServerMetrics(getattr(backend, "kv_bytes", 0), self.max_context)
        self.slot = EngineSlot(engine, self.max_context, self.metrics)
        self.runner = Runner(self.slot, self.tokenizer, self.metrics)
        # a backend that steps many sequences (cpu, GPU) gets the batch loop; others (engines
        # without a paged pool) run one request at a time behind the same queue
        self.batch = BatchEngine(engine, config.max_batch) if batchable(engine) else None
        if self.batch is not None:
            self.scheduler: Scheduler | BatchScheduler = BatchScheduler(
                self.batch,
                self.tokenizer,
                self.metrics,
                self.max_context,
                config.max_queued_requests,
                on_cancel=self._count_cancel,
                on_change=self.metrics.set_load,
            )
        else:
            self.scheduler = Scheduler(
                config.max_queued_requests,
                on_cancel=self._count_cancel,
                on_change=self.metrics.set_load,
            )
        defaults = {}
        artifact = getattr(engine, "artifact", None)
        if artifact is not None and hasattr(artifact, "generation_defaults"):
            defaults = artifact.generation_defaults() or {}
        self.limits = Limits(
            max_body_bytes=config.max_body_bytes,
            max_json_depth=config.max_json_depth,
            max_n=config.max_n,
            vocab_size=min(int(engine.vocab_size), self.tokenizer.vocab_size),
            defaults=defaults,
        )
        self.chat_template = self.tokenizer.chat_template
        if config.chat_template:
            try:
                self.chat_template = Path(config.chat_template).read_text(encoding="utf-8")
            except OSError as e:
                raise HipcError(f"--chat-template {config.chat_template}: {e.strerror}") from None
            except UnicodeDecodeError as e:
                raise HipcError(
                    f"--chat-template {config.chat_template}: not UTF-8 text (byte {e.start})"
                ) from None
        self.reasoning = reasoning_enabled(config.reasoning, self.tokenizer, self.chat_template)
        # A prompt longer than this cannot fit the context whatever its tokens: refused
        # before tokenizing it (a multi-MiB prompt costs seconds of the one encoder thread)
        longest = longest_token_bytes(self.tokenizer)
        self.max_prompt_bytes = None if longest is None else self.max_context * longest
        self.responder = Responder(self.model_name, self.tokenizer, self.reasoning)
        # /ready: with --eager-load the server is ready once warmup() has run
        self.warm = not config.eager_load

    # ------------------------------------------------------------ lifecycle

    def warmup(self, prompt: str, max_tokens: int) -> float:
        """One short greedy chat generation on the engine, before serving (no queue yet)."""
        t0 = time.perf_counter()
        ids = self._chat_prompt([{"role": "user", "content": prompt}], {})[0]
        ids = ids[: max(self.max_context - 1, 1)]
        request = GenerationRequest(prompt_ids=tuple(ids), max_tokens=max_tokens)
        if isinstance(self.scheduler, BatchScheduler):
            job = self.scheduler.job([ChoiceSpec(0, request)], False, len(ids), counted=False)
            self.scheduler.submit(job)
            job.done.wait()
            if job.error is not None:
                raise HipcError(f"warmup failed: {job.error}")
        else:
            for _ in Generation(self.slot, self.tokenizer, request).steps():
                pass
        self.warm = True
        return time.perf_counter() - t0

    def close(self, grace: float) -> None:
        self.scheduler.close(grace)

    @property
    def accepting(self) -> bool:
        return self.scheduler.accepting

    def _count_cancel(self, job: Job) -> None:
        self.metrics.cancelled.labels(job.cancel_reason or "unknown").inc()

    # ------------------------------------------------------------ /v1/models, /health

    def models(self) -> dict[str, Any]:
        return fmt.model_list([self.model_card()])

    def model_card(self, name: str | None = None) -> dict[str, Any]:
        if name is not None and name != self.model_name:
            raise self._no_model(name)
        return fmt.model_card(self.model_name, self.created, self.max_context)

    def _no_model(self, name: str) -> APIError:
        return APIError(
            404,
            f"The model `{name}` does not exist (this server serves `{self.model_name}`).",
            param="model",
            code="model_not_found",
        )

    # ------------------------------------------------------------ planning

    def _check_context(self, n_prompt: int, max_tokens: int | None, what: str) -> None:
        c = self.max_context
        note = ""
        if c < self.engine.max_context:
            note = f" (this server admits {c} of the {self.engine.max_context} positions the artifact holds: --max-context-tokens)"
        param = "messages" if what == "messages" else "prompt"
        if n_prompt >= c:
            raise bad_request(
                f"This model's maximum context length is {c} tokens{note}. However, your {what} "
                f"resulted in {n_prompt} tokens, leaving no room for a completion. Please reduce "
                f"the length of the {what}.",
                param=param,
                code="context_length_exceeded",
            )
        if max_tokens is not None and n_prompt + max_tokens > c:
            raise bad_request(
                f"This model's maximum context length is {c} tokens{note}. However, you requested "
                f"{n_prompt + max_tokens} tokens ({n_prompt} in the {what}, {max_tokens} in the "
                f"completion). Please reduce the length of the {what} or completion.",
                param="max_tokens",
                code="context_length_exceeded",
            )

    def _check_text_size(self, text: str, what: str) -> None:
        # NOTE: len(text) <= bytes <= 4 * len(text): encode only a text that might be too long
        if self.max_prompt_bytes is None or 4 * len(text) <= self.max_prompt_bytes:
            return
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.max_prompt_bytes:
            c = self.max_context
            raise bad_request(
                f"This model's maximum context length is {c} tokens. However, your {what} "
                f"is {size} bytes long, more than {c} tokens can hold (at most "
                f"{self.max_prompt_bytes} bytes). Please reduce the length of the {what}.",
                param="messages" if what == "messages" else "prompt",
                code="context_length_exceeded",
            )

    def _choices(self, common: Common, prompts: list[list[int]]) -> list[ChoiceSpec]:
        if common.grammar is not None:
            # the grammar library's token trie (~1 s once per tokenizer) is built here,
            # on the HTTP thread, not on the engine thread where it would stall the queue
            from hipc.runtime.constraint import ll_tokenizer

            ll_tokenizer(self.tokenizer)
        out = []
        for pi, ids in enumerate(prompts):
            for j in range(common.n):
                index = pi * common.n + j
                sampling = common.sampling
                if common.seed is not None:
                    # choice i draws from seed + i: n choices differ, and each repeats
                    sampling = replace(sampling, seed=(common.seed + index) % 2**64)
                out.append(
                    ChoiceSpec(
                        index,
                        GenerationRequest(
                            prompt_ids=tuple(ids),
                            max_tokens=common.max_tokens,
                            sampling=sampling,
                            stop=common.stop,
                            stop_token_ids=common.stop_token_ids,
                            ignore_eos=common.ignore_eos,
                            logprobs=common.logprobs,
                            grammar=common.grammar,
                        ),
                    )
                )
        return out

    def _chat_prompt(self, messages: list[dict], kwargs: dict[str, Any]) -> tuple[list[int], str]:
        return render_prompt(self.tokenizer, self.chat_template, messages, kwargs)

    def _chat_text(self, messages: list[dict], kwargs: dict[str, Any]) -> str:
        return chat_text(self.tokenizer, self.chat_template, messages, kwargs)

    def plan_chat(self, p: ChatParams) -> Plan:
        if p.common.model != self.model_name:
            raise self._no_model(p.common.model)
        messages, tools = prepare_messages(
            [dict(m) for m in p.messages], p.tools, self.chat_template
        )
        kwargs = {**p.template_kwargs, "tools": tools} if tools else p.template_kwargs
        try:  # the template is the model's own code: anything it raises is the request's 400
            text = self._chat_text(messages, kwargs)
        except HipcError as e:
            raise bad_request(str(e), param="messages", code="chat_template_error") from None
        common, syntax = p.common, syntax_of(self.chat_template)
        if p.tools is not None and p.tools.forced:
            try:
                grammar = forced_call_grammar(p.tools, syntax, self.tokenizer)
            except HipcError as e:
                raise bad_request(f"tools: {e}", param="tools", code="invalid_schema") from None
            common = replace(common, grammar=grammar)
        self._check_text_size(text, "messages")
        ids = encode(self.tokenizer, text, False)
        if not ids:
            raise bad_request("The chat template made an empty prompt.", param="messages")
        self._check_context(len(ids), p.common.max_tokens, "messages")
        return Plan(
            id=fmt.new_id("chatcmpl"),
            created=fmt.now(),
            common=common,
            prompts=[ids],
            choices=self._choices(common, [ids]),
            prefixes={},
            opens_think=self.reasoning and prompt_opens_think(text),
            tools=p.tools,
            tool_syntax=syntax,
        )

    def plan_completion(self, p: CompletionParams) -> Plan:
        if p.common.model != self.model_name:
            raise self._no_model(p.common.model)
        prompts, texts = [], []
        for prompt in p.prompts:
            if isinstance(prompt, str):
                self._check_text_size(prompt, "prompt")
                ids = encode(self.tokenizer, prompt)
            else:
                ids = list(prompt)
            if not ids:
                raise bad_request("The prompt is empty (it encodes to no tokens).", param="prompt")
            self._check_context(len(ids), p.common.max_tokens, "prompt")
            if p.echo:
                texts.append(
                    prompt
                    if isinstance(prompt, str)
                    else self.tokenizer.decode(ids, skip_special_tokens=True)
                )
            prompts.append(ids)
        choices = self._choices(p.common, prompts)
        prefixes = {c.index: texts[c.index // p.common.n] for c in choices} if p.echo else {}
        return Plan(
            id=fmt.new_id("cmpl"),
            created=fmt.now(),
            common=p.common,
            prompts=prompts,
            choices=choices,
            prefixes=prefixes,
        )

    # ------------------------------------------------------------ running

    def _submit(self, plan: Plan, disconnected: Disconnected) -> Job:
        if isinstance(self.scheduler, BatchScheduler):
            job = self.scheduler.job(plan.choices, plan.common.stream, plan.prompt_tokens)
        else:
            job = Job(self.runner.work(plan.choices, plan.common.stream, plan.prompt_tokens))
        try:
            self.scheduler.submit(job)
        except QueueFull:
            self.metrics.rejected.labels("queue_full").inc()
            raise server_busy(
                f"The server is busy: {self.scheduler.max_queued} requests are already waiting "
                "for the engine (--max-queued-requests). Retry later."
            ) from None
        except ShuttingDown:
            self.metrics.rejected.labels("shutting_down").inc()
            raise unavailable("The server is shutting down.") from None
        self._wait(job, lambda: job.started.is_set() or job.done.is_set(), disconnected)
        if not job.started.is_set():
            raise self._cancelled(job)
        return job

    @staticmethod
    def _wait(job: Job, ready: Callable[[], bool], disconnected: Disconnected) -> None:
        while not ready():
            if disconnected():
                job.cancel("client_disconnected")
                raise APIError(499, "The client closed the connection.", code="client_closed")
            job.done.wait(_POLL_S) if job.started.is_set() else job.started.wait(_POLL_S)

    @staticmethod
    def _cancelled(job: Job) -> APIError:
        if job.cancel_reason == "shutdown":
            return unavailable("The server shut down before this request finished.")
        return APIError(499, "The request was cancelled.", code="cancelled")

    def _finish(self, job: Job, disconnected: Disconnected) -> list[tuple[int, GenerationResult]]:
        self._wait(job, job.done.is_set, disconnected)
        failure = self._failure(job)
        if failure is not None:
            raise failure
        return sorted(job.results, key=lambda r: r[0])

    def _events(self, job: Job, disconnected: Disconnected) -> Iterator[tuple]:
        while True:
            try:
                event = job.events.get(timeout=_POLL_S)
            except queue.Empty:
                if disconnected():
                    job.cancel("client_disconnected")
                    return
                continue
            yield event
            if event[0] == "done":
                return

    def _failure(self, job: Job) -> APIError | None:
        if isinstance(job.error, APIError):
            return job.error
        if job.error is not None:
            return APIError(500, "generation failed", type="server_error")
        return self._cancelled(job) if job.cancelled else None

    def _stream(self, job: Job, chunks: Iterator[bytes]) -> Iterator[bytes]:
        """The SSE body; if it is closed before its end (the client left), cancel the job.

        Chunks are written together while more events are already queued (the engine ran
        ahead of this thread): one socket write for them, not one per token."""
        finished = False
        held: list[bytes] = []
        try:
            for chunk in chunks:
                held.append(chunk)
                if job.events.empty():
                    yield held[0] if len(held) == 1 else b"".join(held)
                    held.clear()
            if held:
                yield b"".join(held)
            finished = True
        finally:
            if not finished:
                job.cancel("client_disconnected")

    def chat(self, p: ChatParams, disconnected: Disconnected) -> dict | Iterator[bytes]:
        plan = self.plan_chat(p)
        job = self._submit(plan, disconnected)
        if plan.common.stream:
            events = self._events(job, disconnected)
            failure = functools.partial(self._failure, job)
            return self._stream(job, self.responder.chat_stream(plan, events, failure))
        return self.responder.chat_body(plan, self._finish(job, disconnected))

    def complete(self, p: CompletionParams, disconnected: Disconnected) -> dict | Iterator[bytes]:
        plan = self.plan_completion(p)
        job = self._submit(plan, disconnected)
        if plan.common.stream:
            events = self._events(job, disconnected)
            failure = functools.partial(self._failure, job)
            return self._stream(job, self.responder.completion_stream(plan, events, failure))
        return self.responder.completion_body(plan, self._finish(job, disconnected))
