"""Cache keys for compiled kernels.

A key names everything that can change the compiled bytes: the rendered source (by its
sha256), the toolchain and its version, the flags (in order: later flags can override
earlier ones), the target/arch and the hipc version. Its ``digest`` is the sha256 of a
canonical JSON of those fields and is the entry's address in the cache.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass

# Bump when the meaning of the key or the entry layout changes: every old entry misses.
KEY_SCHEMA = 1

_SHA256_RE = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class CacheKey:
    """Identity of one compiled kernel; ``digest`` is its content address."""

    source_sha256: str
    toolchain: str  # e.g. "nvcc 13.0.88", "hipcc 6.2.41133", "g++ 12.2.0"
    flags: tuple[str, ...]
    target: str  # e.g. "cpu-x86_64-avx2", "sm_90", "gfx1100"
    hipc_version: str

    def __post_init__(self) -> None:
        if not isinstance(self.source_sha256, str) or not _SHA256_RE.fullmatch(self.source_sha256):
            raise ValueError(
                f"source_sha256 must be 64 lowercase hex digits, got {self.source_sha256!r}"
            )
        # Accept any iterable of flags but store a tuple so the key stays hashable.
        flags = self.flags
        if isinstance(flags, str):
            raise TypeError("flags must be a sequence of strings, not a single string")
        flags = tuple(flags)
        if not all(isinstance(f, str) for f in flags):
            raise TypeError(f"flags must all be strings, got {flags!r}")
        object.__setattr__(self, "flags", flags)
        for name in ("toolchain", "target", "hipc_version"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")

    @classmethod
    def for_source(
        cls,
        source: str,
        *,
        toolchain: str,
        flags: Iterable[str],
        target: str,
        hipc_version: str,
    ) -> CacheKey:
        """Key for rendered ``source`` (hashed as UTF-8)."""
        if isinstance(flags, str):
            raise TypeError("flags must be a sequence of strings, not a single string")
        return cls(
            source_sha256=hashlib.sha256(source.encode("utf-8")).hexdigest(),
            toolchain=toolchain,
            flags=tuple(flags),
            target=target,
            hipc_version=hipc_version,
        )

    def as_dict(self) -> dict:
        """The key fields as plain JSON-able values (flags as a list)."""
        return {
            "source_sha256": self.source_sha256,
            "toolchain": self.toolchain,
            "flags": list(self.flags),
            "target": self.target,
            "hipc_version": self.hipc_version,
        }

    def canonical_json(self) -> str:
        """The exact text hashed into ``digest``: sorted keys, no whitespace, UTF-8."""
        doc = {"schema": KEY_SCHEMA, **self.as_dict()}
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    @property
    def digest(self) -> str:
        """Hex sha256 of ``canonical_json()``: the entry's address in the cache."""
        return hashlib.sha256(self.canonical_json().encode("utf-8")).hexdigest()
