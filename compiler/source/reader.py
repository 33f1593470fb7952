"""Reading the tensors a graph's initializers refer to, with one open handle per file."""

from __future__ import annotations

import numpy as np

from hipc.base.safetensors_file import SafetensorsFile
from hipc.compiler.ir import Constant, Initializer, PackedWeight, StackedWeight, WeightRef
from hipc.compiler.source.gguf_file import GGUFFile


class WeightReader:
    def __init__(self) -> None:
        self._files: dict[str, SafetensorsFile | GGUFFile] = {}

    def _file(self, ref: WeightRef) -> SafetensorsFile | GGUFFile:
        f = self._files.get(ref.path)
        if f is None:
            f = GGUFFile(ref.path) if ref.format == "gguf" else SafetensorsFile(ref.path)
            self._files[ref.path] = f
        return f

    def value(self, init: Initializer) -> np.ndarray:
        """The exact real values (quantized tensors dequantized, bf16 widened)."""
        if isinstance(init, Constant):
            return init.array
        if isinstance(init, PackedWeight):
            return np.concatenate([self.value(p) for p in init.parts], axis=init.axis)
        if isinstance(init, StackedWeight):
            return np.stack([self.value(p) for p in init.parts])
        return _as_ref(self._file(init).load(init.name), init)

    def stored(self, init: WeightRef | PackedWeight | StackedWeight) -> np.ndarray:
        """The bytes as stored: quantized rows as uint8 blocks, bf16 as uint16, else its dtype."""
        if isinstance(init, PackedWeight):
            return np.concatenate([self.stored(p) for p in init.parts], axis=init.axis)
        if isinstance(init, StackedWeight):
            return np.stack([self.stored(p) for p in init.parts])
        arr = np.asarray(self._file(init).raw(init.name))
        return arr if init.dtype not in _FLOAT else _as_ref(arr, init)


_FLOAT = ("float32", "float16", "bfloat16")


def _as_ref(arr: np.ndarray, ref: WeightRef) -> np.ndarray:
    """A float vector a builder reads as one row ([H] as [1, H]: Qwen2-MoE's shared-expert
    gate, which GGUF converters store 1-D) in the shape its WeightRef gives."""
    if arr.shape != ref.shape and arr.size == int(np.prod(ref.shape)):
        return arr.reshape(ref.shape)
    return arr
