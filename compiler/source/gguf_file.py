"""Lazy reading of GGUF files through gguf-py (memory-mapped by its reader).

GGUF lists dims innermost first; we expose the numpy order ([out, in] for a
linear weight) everywhere so HF and GGUF tensors look alike to the builder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hipc.base.errors import HipcError

# GGML type name -> hipc dtype name
GGML_DTYPES = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F64": "float64",
    "Q4_0": "q4_0",
    "Q4_1": "q4_1",
    "Q5_0": "q5_0",
    "Q5_1": "q5_1",
    "Q8_0": "q8_0",
    "IQ4_NL": "iq4_nl",
    "IQ4_XS": "iq4_xs",
    "Q2_K": "q2_k",
    "Q3_K": "q3_k",
    "Q4_K": "q4_k",
    "Q5_K": "q5_k",
    "Q6_K": "q6_k",
}


@dataclass(frozen=True)
class GGUFEntry:
    dtype: str
    shape: tuple[int, ...]
    index: int


class GGUFFile:
    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = Path(path)
        try:
            with self.path.open("rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise HipcError(f"{self.path}: cannot read ({e.strerror})") from None
        if magic != b"GGUF":
            raise HipcError(f"{self.path}: not a GGUF file (bad magic {magic!r})")
        try:
            self._reader = gguf.GGUFReader(self.path)
        except Exception as e:  # gguf-py raises assorted errors on damaged files
            raise HipcError(
                f"{self.path}: corrupt or truncated GGUF file ({_one_line(e)})"
            ) from None
        self.entries: dict[str, GGUFEntry] = {}
        for i, t in enumerate(self._reader.tensors):
            dtype = GGML_DTYPES.get(t.tensor_type.name)
            if dtype is None:
                dtype = t.tensor_type.name.lower()
            self.entries[t.name] = GGUFEntry(dtype, tuple(int(d) for d in reversed(t.shape)), i)
        self._meta: dict[str, Any] | None = None

    @property
    def metadata(self) -> dict[str, Any]:
        if self._meta is None:
            meta: dict[str, Any] = {}
            for key, field in self._reader.fields.items():
                if key.startswith("GGUF."):
                    continue
                try:
                    meta[key] = field.contents()
                except Exception as e:
                    raise HipcError(
                        f"{self.path}: metadata key {key!r} is unreadable ({_one_line(e)})"
                    ) from None
            self._meta = meta
        return self._meta

    @property
    def fields(self) -> dict[str, Any]:
        """gguf-py's metadata fields (value and GGUF types), for copying them verbatim."""
        return dict(self._reader.fields)

    def raw(self, name: str) -> np.ndarray:
        """The tensor as stored: quantized types as uint8 blocks, one row per output row;
        bfloat16 as uint16 (gguf-py gives its bytes)."""
        data = self._reader.tensors[self.entries[name].index].data
        if self.entries[name].dtype == "bfloat16" and data.dtype == np.uint8:
            return data.view(np.uint16)
        return data

    def load(self, name: str) -> np.ndarray:
        """The tensor as float32 (dequantized where stored quantized)."""
        import gguf

        t = self._reader.tensors[self.entries[name].index]
        if self.entries[name].dtype in ("float32", "float16", "float64"):
            return np.asarray(t.data).reshape(self.entries[name].shape)
        try:
            out = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise HipcError(
                f"{self.path}: tensor {name!r} has unsupported type {t.tensor_type.name}"
            ) from None
        return out.reshape(self.entries[name].shape)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
