"""Lazy, memory-mapped reading of .safetensors files.

The format is an 8-byte little-endian header length, a JSON header, then raw
tensor bytes. We read it directly (instead of safetensors' numpy frontend) because
numpy has no bfloat16: bf16 tensors are widened to float32 here, which is exact.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hipc.runtime.errors import HipcError

_DTYPES = {
    "F64": ("float64", np.float64),
    "F32": ("float32", np.float32),
    "F16": ("float16", np.float16),
    "BF16": ("bfloat16", np.uint16),
    "I64": ("int64", np.int64),
    "I32": ("int32", np.int32),
    "I16": ("int16", np.int16),
    "I8": ("int8", np.int8),
    "U8": ("uint8", np.uint8),
    "BOOL": ("bool", np.bool_),
}


@dataclass(frozen=True)
class SafetensorsEntry:
    dtype: str  # hipc dtype name
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


class SafetensorsFile:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with self.path.open("rb") as f:
                raw_len = f.read(8)
                if len(raw_len) < 8:
                    raise HipcError(f"{self.path}: truncated safetensors file (no header)")
                (header_len,) = struct.unpack("<Q", raw_len)
                if header_len > min(size - 8, 100 << 20):
                    raise HipcError(f"{self.path}: corrupt safetensors header length {header_len}")
                header = json.loads(f.read(header_len))
        except OSError as e:
            raise HipcError(f"{self.path}: cannot read ({e.strerror})") from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise HipcError(f"{self.path}: corrupt safetensors header (not JSON)") from None
        if not isinstance(header, dict):
            raise HipcError(f"{self.path}: corrupt safetensors header")
        self.metadata = header.pop("__metadata__", {}) or {}
        base = 8 + header_len
        self.entries: dict[str, SafetensorsEntry] = {}
        for name, info in header.items():
            try:
                dtype = _DTYPES[info["dtype"]][0]
                begin, end = (base + int(o) for o in info["data_offsets"])
                shape = tuple(int(d) for d in info["shape"])
            except (KeyError, TypeError, ValueError):
                raise HipcError(
                    f"{self.path}: tensor {name!r} has a malformed header entry"
                ) from None
            itemsize = np.dtype(_DTYPES[info["dtype"]][1]).itemsize
            if end - begin != itemsize * int(np.prod(shape, dtype=np.int64)):
                raise HipcError(f"{self.path}: tensor {name!r} byte range does not match its shape")
            if end > size:
                raise HipcError(f"{self.path}: truncated file (tensor {name!r} runs past the end)")
            self.entries[name] = SafetensorsEntry(dtype, shape, begin, end)
        self._mmap: np.memmap | None = None

    def _bytes(self) -> np.memmap:
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mmap

    def raw(self, name: str) -> np.ndarray:
        """The tensor as stored (bf16 as uint16 bit patterns), memory-mapped."""
        e = self.entries[name]
        np_dtype = next(t for n, t in _DTYPES.values() if n == e.dtype)
        return self._bytes()[e.begin : e.end].view(np_dtype).reshape(e.shape)

    def load(self, name: str) -> np.ndarray:
        """The tensor as a numpy array; bf16 widens to float32 (exactly)."""
        arr = self.raw(name)
        if self.entries[name].dtype == "bfloat16":
            return (arr.astype(np.uint32) << 16).view(np.float32)
        return arr
