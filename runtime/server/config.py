"""Server settings: one class of defaults, each overridable from HIPC_* and from a flag.

Precedence: a command-line flag, then the environment variable (HIPC_ + the field name
in capitals: HIPC_PORT, HIPC_API_KEY ...), then the default here. `OPTIONS` is the one
table of what can be set; `hipc serve`'s flags are generated from it, so every flag has
its variable by construction.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hipc.base.errors import HipcError

ENV_PREFIX = "HIPC_"


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


@dataclass(frozen=True)
class Option:
    field: str
    parse: Callable[[str], Any]
    help: str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.field.upper()


@dataclass(frozen=True)
class Config:
    artifact: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None  # default: the artifact's folder name
    threads: int | None = None  # CPU threads for the engine (default: all cores)
    eager_load: bool = True
    eager_load_prompt: str = "Hello"
    eager_load_max_tokens: int = 4
    max_context_tokens: int | None = None  # default: all the engine holds
    kv_storage: str | None = None  # default: the target's native type
    max_queued_requests: int = 64
    # sequences stepped together (cpu target; GPU targets run 1). 4: on few cores a step of
    # 4 rows costs about twice one row, so 4 clients get ~2x the tokens/s of one, while the
    # default KV pool (max_batch contexts) stays modest; more rows mean slower tokens each.
    max_batch: int = 4
    kv_pool_tokens: int | None = None  # default: max_batch x the admitted context, RAM allowing
    max_body_bytes: int = 4 << 20
    max_json_depth: int = 32
    max_n: int = 8
    shutdown_timeout: float = 30.0
    read_timeout: float = 10.0  # a request must arrive whole within this of its first byte
    max_connections: int = 1000
    chat_template: str | None = None  # a Jinja file replacing the model's template
    reasoning: str = "auto"
    log_level: str = "info"

    def __post_init__(self) -> None:
        checks = [
            ("port", 0 <= self.port <= 65535, "must be 0..65535 (0 picks a free port)"),
            ("threads", self.threads is None or self.threads >= 1, "must be at least 1"),
            ("eager_load_max_tokens", self.eager_load_max_tokens >= 1, "must be at least 1"),
            (
                "max_context_tokens",
                self.max_context_tokens is None or self.max_context_tokens >= 2,
                "must be at least 2",
            ),
            ("max_queued_requests", self.max_queued_requests >= 0, "must be 0 or more"),
            ("max_batch", 1 <= self.max_batch <= 256, "must be 1..256"),
            (
                "kv_pool_tokens",
                self.kv_pool_tokens is None or self.kv_pool_tokens >= 2,
                "must be at least 2",
            ),
            ("max_body_bytes", self.max_body_bytes >= 1024, "must be at least 1024"),
            ("max_json_depth", 2 <= self.max_json_depth <= 1000, "must be 2..1000"),
            ("max_n", 1 <= self.max_n <= 128, "must be 1..128"),
            ("shutdown_timeout", self.shutdown_timeout >= 0, "must be 0 or more"),
            ("read_timeout", 1 <= self.read_timeout <= 3600, "must be 1..3600 seconds"),
            ("max_connections", 16 <= self.max_connections <= 65536, "must be 16..65536"),
            ("reasoning", self.reasoning in ("auto", "on", "off"), "must be auto, on or off"),
            (
                "log_level",
                self.log_level in ("debug", "info", "warning", "error"),
                "must be debug, info, warning or error",
            ),
            ("api_key", self.api_key is None or self.api_key != "", "must not be empty"),
        ]
        for name, ok, why in checks:
            if not ok:
                opt = OPTION_BY_FIELD[name]
                raise HipcError(f"{opt.flag} / {opt.env} = {getattr(self, name)!r}: {why}")

    @classmethod
    def from_sources(
        cls, flags: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
    ) -> Config:
        """Defaults, overridden by HIPC_* variables, overridden by flags that were given."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for opt in OPTIONS:
            raw = environ.get(opt.env)
            if raw is None or raw == "":
                continue
            try:
                value = opt.parse(raw)
            except ValueError as e:
                raise HipcError(f"{opt.env}={raw!r}: {e}") from None
            if opt.choices and value not in opt.choices:
                raise HipcError(f"{opt.env}={raw!r}: expected one of {', '.join(opt.choices)}")
            values[opt.field] = value
        for name, value in (flags or {}).items():
            if name in OPTION_BY_FIELD and value is not None:
                values[name] = value
        return cls(**values)

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)


OPTIONS: tuple[Option, ...] = (
    Option("artifact", str, "the compiled artifact (NAME.hipc/) to serve", "ARTIFACT"),
    Option("host", str, "address to listen on (127.0.0.1: this machine only)"),
    Option("port", int, "TCP port (0 picks a free one, printed when ready)"),
    Option("api_key", str, "require 'Authorization: Bearer KEY' on every route but /health"),
    Option("served_model_name", str, "the model id clients use (default: the artifact name)"),
    Option("threads", int, "CPU threads for the engine (default: all cores)", "N"),
    Option("eager_load", _bool, "run a warmup generation before the port opens"),
    Option(
        "eager_load_prompt",
        str,
        "the warmup prompt (a user turn through the chat template)",
        "TEXT",
    ),
    Option("eager_load_max_tokens", int, "tokens the warmup generates", "N"),
    Option(
        "max_context_tokens",
        int,
        "context admitted per request, prompt + completion (default: all the engine holds)",
        "N",
    ),
    Option(
        "kv_storage",
        str,
        "KV-cache storage type; the target decides what it supports (cpu: float32)",
        "TYPE",
    ),
    Option(
        "max_queued_requests", int, "requests that may wait for the engine; one more is a 429", "N"
    ),
    Option(
        "max_batch",
        int,
        "sequences (requests' choices) decoded together, one step for all (cpu target; "
        "GPU targets run one)",
        "N",
    ),
    Option(
        "kv_pool_tokens",
        int,
        "positions in the paged KV pool the batch shares (default: max-batch x the admitted "
        "context, at most half the free RAM, at least one context)",
        "N",
    ),
    Option("max_body_bytes", int, "largest request body accepted (413 beyond)", "BYTES"),
    Option("max_json_depth", int, "deepest JSON nesting accepted", "N"),
    Option("max_n", int, "most choices one request may ask for (n x prompts)", "N"),
    Option(
        "shutdown_timeout",
        float,
        "on SIGTERM, seconds running and queued requests get to finish",
        "SECONDS",
    ),
    Option(
        "read_timeout",
        float,
        "seconds a request (headers and body) may take to arrive, and an idle connection "
        "may stay open",
        "SECONDS",
    ),
    Option("max_connections", int, "open connections accepted at once", "N"),
    Option(
        "chat_template", str, "a Jinja chat template file to use instead of the model's", "FILE"
    ),
    Option(
        "reasoning",
        str,
        "split <think> spans into reasoning_content: auto (if the model knows <think>), on, off",
        choices=("auto", "on", "off"),
    ),
    Option(
        "log_level",
        str,
        "logging level",
        choices=("debug", "info", "warning", "error"),
    ),
)
OPTION_BY_FIELD = {opt.field: opt for opt in OPTIONS}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add a flag per option (all default None: unset flags leave env and defaults alone)."""
    for opt in OPTIONS:
        default = getattr(Config, opt.field, None)
        shown = "" if default is None else f"; default {default!r}"
        help_text = f"{opt.help} [{opt.env}{shown}]".replace("%", "%%")
        if opt.field == "artifact":
            parser.add_argument(
                "artifact", nargs="?", default=None, metavar=opt.metavar, help=help_text
            )
        elif opt.parse is _bool:
            parser.add_argument(
                opt.flag, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            parser.add_argument(
                opt.flag,
                type=opt.parse,
                default=None,
                metavar=opt.metavar,
                choices=opt.choices,
                help=help_text,
            )
