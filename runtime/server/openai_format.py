"""The shapes of OpenAI's responses, stream chunks and errors, as plain dicts.

Only shapes live here: no engine, no state. Server-sent events are `data: <json>\\n\\n`,
with `data: [DONE]` last.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from hipc.base.version import HIPC_VERSION

SYSTEM_FINGERPRINT = f"hipc-{HIPC_VERSION}"
DONE = b"data: [DONE]\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj).encode("utf-8") + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def model_card(name: str, created: int, max_context: int) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "hipc",
        "max_model_len": max_context,
    }


def model_list(cards: list[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "list", "data": cards}


# ------------------------------------------------------------------ chat


def chat_completion(
    id: str, model: str, created: int, choices: list[dict], usage_: dict
) -> dict[str, Any]:
    return {
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": choices,
        "usage": usage_,
    }


def chat_choice(
    index: int,
    content: str,
    reasoning: str | None,
    finish_reason: str,
    logprobs: list[dict] | None,
) -> dict[str, Any]:
    return {
        "index": index,
        "message": {
            "role": "assistant",
            "content": content,
            "reasoning_content": reasoning,
            "refusal": None,
        },
        "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
        "finish_reason": finish_reason,
    }


def chat_chunk(
    id: str,
    model: str,
    created: int,
    index: int,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    logprobs: list[dict] | None = None,
    with_usage: bool = False,
) -> dict[str, Any]:
    chunk = {
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": [
            {
                "index": index,
                "delta": delta,
                "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
                "finish_reason": finish_reason,
            }
        ],
    }
    if with_usage:
        chunk["usage"] = None
    return chunk


def chat_logprob(token: str, token_bytes: bytes, logprob: float, top: list[dict]) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token_bytes), "top_logprobs": top}


def chat_top_logprob(token: str, token_bytes: bytes, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token_bytes)}


def usage_chunk(id: str, object_: str, model: str, created: int, usage_: dict) -> dict[str, Any]:
    return {
        "id": id,
        "object": object_,
        "created": created,
        "model": model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": [],
        "usage": usage_,
    }


# ------------------------------------------------------------------ completions


def completion(
    id: str, model: str, created: int, choices: list[dict], usage_: dict
) -> dict[str, Any]:
    return {
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": choices,
        "usage": usage_,
    }


def completion_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict | None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_chunk(
    id: str,
    model: str,
    created: int,
    index: int,
    text: str,
    finish_reason: str | None = None,
    logprobs: dict | None = None,
    with_usage: bool = False,
) -> dict[str, Any]:
    chunk = completion(
        id, model, created, [completion_choice(index, text, finish_reason, logprobs)], {}
    )
    del chunk["usage"]
    if with_usage:
        chunk["usage"] = None
    return chunk


def completion_logprobs(
    tokens: list[str],
    logprobs: list[float],
    tops: list[dict[str, float]] | None,
    offsets: list[int],
) -> dict[str, Any]:
    """The legacy completions shape: parallel arrays."""
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
