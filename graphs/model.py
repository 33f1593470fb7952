"""A loaded model: its source files plus the normalized config, with tensors by role."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from hipc.base.errors import HipcError
from hipc.compiler.ir import WeightRef
from hipc.compiler.source.model import ModelSource, open_model
from hipc.graphs import config as configs
from hipc.graphs.names import NAME_TABLES, name_table


@dataclass
class Model:
    source: ModelSource
    config: configs.ModelConfig

    @property
    def name(self) -> str:
        return self.source.path.name

    def tensor_name(self, role: str, layer: int | None = None) -> str:
        return name_table(self.config.family, self.source.format)[role].format(i=layer)

    def has(self, role: str, layer: int | None = None) -> bool:
        return self.source.has(self.tensor_name(role, layer))

    def weight(self, role: str, layer: int | None, shape: tuple[int, ...]) -> WeightRef:
        name = self.tensor_name(role, layer)
        if not self.source.has(name):
            raise HipcError(f"{self.source.path}: tensor {name!r} is missing")
        ref = self.source.weight_ref(name)
        if ref.shape != shape:
            raise HipcError(
                f"{ref.path}: tensor {name!r} has shape {list(ref.shape)}, "
                f"the config implies {list(shape)}"
            )
        return ref


def load_model(ref: str | os.PathLike) -> Model:
    source = open_model(ref)
    if source.format == "gguf":
        return Model(source, _gguf_config(source))
    config = configs.from_hf(source.raw_config, str(source.path / "config.json"))
    if not config.tie_word_embeddings and not source.has(NAME_TABLES["safetensors"]["lm_head"]):
        # NOTE: some checkpoints leave out lm_head.weight although config says untied;
        # transformers then ties them, and so do we.
        config = dataclasses.replace(config, tie_word_embeddings=True)
    return Model(source, config)


def _gguf_config(source: ModelSource) -> configs.ModelConfig:
    meta = source.raw_config
    names = NAME_TABLES["gguf"]
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens:
        vocab = len(tokens)
    elif source.has(names["embed"]):
        vocab = source.entry(names["embed"])[1][0]
    else:
        raise HipcError(f"{source.path}: no vocabulary (tokenizer.ggml.tokens) and no token_embd")
    config = configs.from_gguf(meta, vocab, str(source.path))
    return dataclasses.replace(
        config,
        tie_word_embeddings=not source.has(names["lm_head"]),
        attention_bias=source.has(names["q_bias"].format(i=0)),
    )
