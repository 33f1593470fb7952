"""RoPE frequency tables, with the scaling variants transformers implements.

The tables are constants of the graph (cos/sin per position), computed in float64
and stored as float32, so every executor and kernel reads the same numbers.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from hipc.graphs.config import ModelConfig, rope_type


def inv_freq(config: ModelConfig) -> np.ndarray:
    dim = config.rope_dim
    base = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = rope_type(config.rope_scaling)
    if kind == "linear":
        return base / float(scaling["factor"])
    if kind == "llama3":
        return _llama3(base, scaling)
    # "dynamic" (NTK) equals "default" up to max_position_embeddings; the compiled
    # context is capped there (see max_context), so no other positions exist.
    return base


def _llama3(freq: np.ndarray, s: dict) -> np.ndarray:
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / freq
    scaled = np.where(wavelen > old_ctx / low, freq / factor, freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return np.where(medium, smoothed, scaled)


def cos_sin_tables(
    config: ModelConfig, positions: int, local: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """local: the tables of sliding-window layers where they have their own base (Gemma-3),
    which transformers never scales."""
    if local:
        config = dataclasses.replace(config, rope_theta=config.rope_local_theta, rope_scaling=None)
    angles = np.outer(np.arange(positions, dtype=np.float64), inv_freq(config))
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def max_context(config: ModelConfig, requested: int | None = None) -> int:
    """The context a graph is built for: the request, capped at the model's limit."""
    limit = config.max_position_embeddings
    return min(requested, limit) if requested else limit
