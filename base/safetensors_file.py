"""Lazy, memory-mapped reading of .safetensors files.

The format is an 8-byte little-endian header length, a JSON header, then raw
tensor bytes. We read it directly (instead of safetensors' numpy frontend) because
numpy has no bfloat16: bf16 tensors are widened to float32 here, which is exact.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hipc.base.errors import HipcError

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
    "U16": ("uint16", np.uint16),
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


@dataclass(frozen=True)
class LazyTensor:
    """A tensor to write: its dtype and shape now, its bytes only when `load()` is called."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    load: Callable[[], np.ndarray]
    code: str | None = None  # header dtype when numpy's differs (e.g. "BF16" for uint16 bits)


def write_safetensors(
    path: str | Path,
    tensors: list[LazyTensor],
    metadata: dict | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> str:
    """Stream tensors into a .safetensors file, materializing one at a time; returns the
    file's sha256 (hashed on the way out: an artifact's weights are not read twice).

    The caller writes to a temporary path and renames, so a crash leaves nothing.
    """
    header: dict = {"__metadata__": {k: str(v) for k, v in (metadata or {}).items()}}
    offset = 0
    codes = {np.dtype(t): code for code, (_, t) in _DTYPES.items() if code != "BF16"}
    for t in tensors:
        nbytes = np.dtype(t.dtype).itemsize * int(np.prod(t.shape, dtype=np.int64))
        header[t.name] = {
            "dtype": t.code or codes[np.dtype(t.dtype)],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep tensor data 8-byte aligned for mmap readers
    digest = hashlib.sha256()
    with open(path, "wb") as f:

        def put(data) -> None:
            digest.update(data)
            f.write(data)

        put(struct.pack("<Q", len(raw)))
        put(raw)
        done = 0
        for t in tensors:
            arr = np.ascontiguousarray(t.load(), dtype=t.dtype)
            if arr.shape != tuple(t.shape):
                raise ValueError(f"tensor {t.name}: produced shape {arr.shape}, declared {t.shape}")
            put(memoryview(arr).cast("B"))
            done += arr.nbytes
            if on_progress:
                on_progress(done, offset)
    return digest.hexdigest()
