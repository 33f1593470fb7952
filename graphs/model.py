"""A loaded model: its source files plus the normalized config, with tensors by role."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from hipc.base.errors import HipcError
from hipc.compiler.ir import StackedWeight, WeightRef
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

    def tensor_name(
        self, role: str, layer: int | None = None, expert: int | str | None = None
    ) -> str:
        """The file's name for `role`: the first alternative the file has, else the first
        (expert "*" names all experts of the alternative expert 0 matches)."""
        names = name_table(self.config.family, self.source.format).get(role, ())
        names = (names,) if isinstance(names, str) else names
        probe = 0 if expert == "*" else expert
        found = next((n for n in names if self.source.has(n.format(i=layer, e=probe))), names[0])
        return found.format(i=layer, e=expert)

    def has(self, role: str, layer: int | None = None) -> bool:
        if role not in name_table(self.config.family, self.source.format):
            return False
        return self.source.has(self.tensor_name(role, layer, 0))

    def experts(self, layer: int) -> dict[str, WeightRef | StackedWeight]:
        """The routed experts of `layer` as 3-D weights: gate/up [E, F, H] and down [E, H, F],
        or gate_up [E, 2F, H] and down where the file fuses gate and up."""
        cfg = self.config
        E, F, H = cfg.num_experts, cfg.expert_intermediate_size, cfg.hidden_size
        shapes = {"gate": (E, F, H), "up": (E, F, H), "down": (E, H, F)}
        if self.has("gate_up_exps", layer):
            return {
                "gate_up": self.weight("gate_up_exps", layer, (E, 2 * F, H)),
                "down": self.weight("down_exps", layer, shapes["down"]),
            }
        if self.has("gate_exps", layer):
            return {k: self.weight(f"{k}_exps", layer, s) for k, s in shapes.items()}
        stacked = {}
        for k, (_, rows, cols) in shapes.items():
            parts = tuple(self.weight(f"{k}_exp", layer, (rows, cols), e) for e in range(E))
            stacked[k] = StackedWeight(self.tensor_name(f"{k}_exp", layer, "*"), parts)
        return stacked

    def weight(
        self, role: str, layer: int | None, shape: tuple[int, ...], expert: int | None = None
    ) -> WeightRef:
        name = self.tensor_name(role, layer, expert)
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
    # NOTE: GGUF has no mlp_only_layers; a layer is sparse where it holds a router.
    moe_layers = tuple(i for i in config.moe_layers if source.has(names["router"].format(i=i)))
    if config.family in configs.HYBRID:
        # NOTE: the file is the truth: a layer is linear attention where it holds ssm_a
        # (full_attention_interval describes only a regular pattern)
        config = dataclasses.replace(
            config,
            layer_types=tuple(
                "linear_attention" if source.has(f"blk.{i}.ssm_a") else "full_attention"
                for i in range(config.num_layers)
            ),
        )
    return dataclasses.replace(
        config,
        tie_word_embeddings=not source.has(names["lm_head"]),
        attention_bias=source.has(names["q_bias"].format(i=0)),
        moe_layers=moe_layers,
    )
