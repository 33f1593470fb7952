"""OpenAI bodies from a plan and its results: whole responses, SSE streams, logprobs.

Streams are built from the job's events (start, step, end, done per choice), with the
reasoning split and logprobs applied to each step as it comes, so a streamed reply is
the non-streamed one cut in pieces.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from hipc.base.tokenizer import IncrementalDecoder, byte_level_alphabet
from hipc.runtime.generate import GenerationResult, TokenLogprob
from hipc.runtime.server import openai_format as fmt
from hipc.runtime.server.errors import APIError
from hipc.runtime.server.reasoning import ReasoningSplitter, split_reasoning
from hipc.runtime.server.runner import ChoiceSpec
from hipc.runtime.server.tools import HERMES, StreamFilter, ToolSpec, parse_reply
from hipc.runtime.server.validation import Common


@dataclass
class Plan:
    """A validated request, ready to queue: its prompts and the choices to generate."""

    id: str
    created: int
    common: Common
    prompts: list[list[int]]  # one per distinct prompt; choice i uses prompts[i // n]
    choices: list[ChoiceSpec]
    prefixes: dict[int, str]  # echo text per choice index
    opens_think: bool = False  # the chat template left a <think> block open
    tools: ToolSpec | None = None
    tool_syntax: str = HERMES

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


Results = list[tuple[int, GenerationResult]]
Failure = Callable[[], APIError | None]


class Responder:
    def __init__(self, model_name: str, tokenizer, reasoning: bool) -> None:
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.reasoning = reasoning
        self.token_text = TokenText(tokenizer)

    # ------------------------------------------------------------ whole responses

    def chat_body(self, plan: Plan, results: Results) -> dict:
        choices, completion_tokens = [], 0
        for index, res in results:
            completion_tokens += len(res.token_ids)
            reasoning, content = (None, res.text)
            if self.reasoning:
                reasoning, content = split_reasoning(res.text, plan.opens_think)
            lps = None
            if plan.common.logprobs is not None:
                lps = [self._chat_logprob(lp) for lp in res.logprobs]
            finish, calls = res.finish_reason, []
            if plan.tools is not None:
                content, calls = parse_reply(content, plan.tools, plan.tool_syntax)
                finish = _tool_finish(finish, calls)
            choice = fmt.chat_choice(index, content, reasoning, finish, lps)
            if calls:
                choice["message"]["tool_calls"] = calls
            choices.append(choice)
        usage = fmt.usage(plan.prompt_tokens, completion_tokens)
        return fmt.chat_completion(plan.id, self.model_name, plan.created, choices, usage)

    def completion_body(self, plan: Plan, results: Results) -> dict:
        choices, completion_tokens = [], 0
        for index, res in results:
            completion_tokens += len(res.token_ids)
            prefix = plan.prefixes.get(index, "")
            lps = None
            if plan.common.logprobs is not None:
                at = _Offsets(self.tokenizer, res.prompt_token_ids, len(prefix))
                lps = self._completion_logprobs(res.logprobs, at(res.token_ids))
            choices.append(fmt.completion_choice(index, prefix + res.text, res.finish_reason, lps))
        usage = fmt.usage(plan.prompt_tokens, completion_tokens)
        return fmt.completion(plan.id, self.model_name, plan.created, choices, usage)

    # ------------------------------------------------------------ streams

    def chat_stream(self, plan: Plan, events: Iterable[tuple], failure: Failure) -> Iterator[bytes]:
        wants_lp = plan.common.logprobs is not None

        fast = _Template(
            fmt.chat_chunk(
                plan.id, self.model_name, plan.created, 0, {"content": _SLOT}, None, None,
                plan.common.include_usage,
            )
        )  # fmt: skip

        def chunk(index, delta, finish=None, lps=()) -> bytes:
            if not wants_lp and finish is None and index == 0 and list(delta) == ["content"]:
                return fast(delta["content"])
            logprobs = [self._chat_logprob(lp) for lp in lps] if wants_lp else None
            return fmt.sse(
                fmt.chat_chunk(
                    plan.id, self.model_name, plan.created, index, delta, finish, logprobs,
                    plan.common.include_usage,
                )
            )  # fmt: skip

        splitter: ReasoningSplitter | None = None
        calls: StreamFilter | None = None
        pending: list[TokenLogprob] = []  # logprobs ride on the next chunk that has text
        completion_tokens = 0
        for event in events:
            kind = event[0]
            if kind == "start":
                splitter = ReasoningSplitter(plan.opens_think) if self.reasoning else None
                if plan.tools is not None:
                    calls = StreamFilter(plan.tools, plan.tool_syntax)
                yield chunk(event[1], {"role": "assistant", "content": ""})
            elif kind == "step":
                index, step = event[1], event[2]
                pending.extend(step.logprobs)
                if step.text:
                    r, c = splitter.feed(step.text) if splitter else ("", step.text)
                    if calls is not None:
                        c = calls.feed(c)
                    for key, piece in (("reasoning_content", r), ("content", c)):
                        if piece:
                            yield chunk(index, {key: piece}, None, pending)
                            pending = []
            elif kind == "end":
                index, res = event[1], event[2]
                completion_tokens += len(res.token_ids)
                r, c = splitter.finish() if splitter else ("", "")
                finish, found = res.finish_reason, []
                if calls is not None:
                    c = calls.feed(c)
                    tail, found = calls.finish()
                    c += tail
                    finish = _tool_finish(finish, found)
                for key, piece in (("reasoning_content", r), ("content", c)):
                    if piece:
                        yield chunk(index, {key: piece}, None, pending)
                        pending = []
                for i, call in enumerate(found):
                    # the call's head first, then its arguments: the shape clients assemble
                    head = {**call, "function": {"name": call["function"]["name"], "arguments": ""}}
                    yield chunk(index, {"tool_calls": [{"index": i, **head}]}, None, pending)
                    pending = []
                    args = {"arguments": call["function"]["arguments"]}
                    yield chunk(index, {"tool_calls": [{"index": i, "function": args}]})
                yield chunk(index, {}, finish, pending)
                pending = []
        yield from self._tail(plan, "chat.completion.chunk", completion_tokens, failure())

    def completion_stream(
        self, plan: Plan, events: Iterable[tuple], failure: Failure
    ) -> Iterator[bytes]:
        wants_lp = plan.common.logprobs is not None

        fast = _Template(
            fmt.completion_chunk(
                plan.id, self.model_name, plan.created, 0, _SLOT, None, None,
                plan.common.include_usage,
            )
        )  # fmt: skip

        def chunk(index, text, finish=None, lps=(), offsets=()) -> bytes:
            if not wants_lp and finish is None and index == 0:
                return fast(text)
            lp = self._completion_logprobs(list(lps), list(offsets)) if wants_lp else None
            return fmt.sse(
                fmt.completion_chunk(
                    plan.id, self.model_name, plan.created, index, text, finish, lp,
                    plan.common.include_usage,
                )
            )  # fmt: skip

        completion_tokens = 0
        at: _Offsets | None = None
        for event in events:
            kind = event[0]
            if kind == "start":
                index = event[1]
                prefix = plan.prefixes.get(index, "")
                prompt = plan.prompts[index // plan.common.n]
                at = _Offsets(self.tokenizer, prompt, len(prefix)) if wants_lp else None
                if prefix:
                    yield chunk(index, prefix)
            elif kind == "step":
                index, step = event[1], event[2]
                if step.text or step.logprobs:
                    offsets = at(step.token_ids) if at is not None else ()
                    yield chunk(index, step.text, None, step.logprobs, offsets)
            elif kind == "end":
                completion_tokens += len(event[2].token_ids)
                yield chunk(event[1], "", event[2].finish_reason)
        yield from self._tail(plan, "text_completion", completion_tokens, failure())

    def _tail(
        self, plan: Plan, object_: str, completion_tokens: int, error: APIError | None
    ) -> Iterator[bytes]:
        """An error event if the job failed, else the usage chunk if asked for; then [DONE]."""
        if error is not None:
            yield fmt.sse(error.body())
        elif plan.common.include_usage:
            usage = fmt.usage(plan.prompt_tokens, completion_tokens)
            yield fmt.sse(fmt.usage_chunk(plan.id, object_, self.model_name, plan.created, usage))
        yield fmt.DONE

    # ------------------------------------------------------------ logprobs

    def _chat_logprob(self, lp: TokenLogprob) -> dict:
        text, raw = self.token_text(lp.token_id)
        top = [fmt.chat_top_logprob(*self.token_text(t), v) for t, v in lp.top]
        return fmt.chat_logprob(text, raw, lp.logprob, top)

    def _completion_logprobs(self, lps: list[TokenLogprob], offsets: list[int]) -> dict:
        tokens = [self.token_text(lp.token_id)[0] for lp in lps]
        tops = None
        if lps and lps[0].top:
            tops = [{self.token_text(t)[0]: v for t, v in lp.top} for lp in lps]
        return fmt.completion_logprobs(tokens, [lp.logprob for lp in lps], tops, offsets)


_SLOT = "\u0000hipc-slot\u0000"


class _Template:
    """A stream chunk's SSE bytes around its one varying string: the chunk dict is rendered
    once per request with a placeholder, so each token costs one string's JSON encoding
    instead of building and encoding the whole dict (the same bytes: fmt.dumps's settings,
    the keys in the same order)."""

    def __init__(self, chunk: dict) -> None:
        head, _, tail = fmt.sse(chunk).partition(fmt.dumps(_SLOT).encode("utf-8"))
        self.head, self.tail = head, tail

    def __call__(self, text: str) -> bytes:
        return self.head + fmt.dumps(text).encode("utf-8") + self.tail


def _tool_finish(finish: str, calls: list) -> str:
    # a reply cut by max_tokens stays "length" even if a call was parsed from it
    return "tool_calls" if calls and finish != "length" else finish


class TokenText:
    """A token's text and raw bytes, for logprobs."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._byte_level = type(tokenizer.backend.decoder).__name__ == "ByteLevel"
        self._unbyte = {c: b for b, c in byte_level_alphabet().items()} if self._byte_level else {}
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self.tokenizer.decode([token_id])
            raw = text.encode("utf-8")
            if self._byte_level:
                piece = self.tokenizer.id_to_token(token_id)
                if all(c in self._unbyte for c in piece):
                    raw = bytes(self._unbyte[c] for c in piece)
            hit = self._cache[token_id] = (text, raw)
        return hit


class _Offsets:
    """Character offset of each generated token in the completion text (text_offset)."""

    def __init__(self, tokenizer, prompt_ids: list[int], start: int) -> None:
        self._decoder = IncrementalDecoder(tokenizer, skip_special_tokens=True, context=prompt_ids)
        self._at = start

    def __call__(self, token_ids: tuple[int, ...] | list[int]) -> list[int]:
        out = []
        for t in token_ids:
            out.append(self._at)
            self._at += len(self._decoder.feed(t))
        return out
