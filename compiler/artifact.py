"""Write a NAME.hipc/ artifact directory, atomically.

Everything is written into a temporary sibling directory, checksummed, and renamed
into place last: a crash or an error leaves either the old artifact or none, never a
half-written one.

  manifest.json        format version, hipc version, model source + hashes, config,
                       targets (code object, toolchain, flags), options, file checksums
  plan.json            weights (W order), states (KV order), arena plan, kernels, launches
  fusion.json          the fusion decisions (what was fused, what was refused and why)
  kernels/<target>.so  the compiled code object;  kernels/<target>.cpp  its source
  weights.safetensors  repacked weights in their storage types
  tokenizer.json, tokenizer_meta.json, generation.json
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hipc.base.errors import HipcError
from hipc.base.safetensors_file import LazyTensor, write_safetensors
from hipc.base.version import ARTIFACT_FORMAT_VERSION, HIPC_VERSION
from hipc.compiler.scratch import (
    pending,
    replace_dir,
    sweep_artifact_leftovers,
    sweep_tool_dirs,
)
from hipc.compiler.targets import Target


@dataclass
class TargetBuild:
    target: Target  # names the files: kernels/<name>.<binary_ext> and .<source_ext>
    binary: bytes
    source: str
    info: dict[str, Any]  # toolchain identity, flags, target id, cpu features ...


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_artifact(
    out: Path,
    *,
    manifest: dict[str, Any],
    plan: dict[str, Any],
    fusion: dict[str, Any],
    builds: list[TargetBuild],
    weights: list[LazyTensor],
    tokenizer_json: str | None,
    tokenizer_meta: dict[str, Any] | None,
    generation: dict[str, Any],
    on_progress: Callable[[int, int], None] | None = None,
) -> Path:
    out = Path(out)
    parent = out.resolve().parent
    if out.exists() and not (out / "manifest.json").is_file():
        raise HipcError(f"-o: {out} exists and is not a hipc artifact; refusing to overwrite it")
    if not parent.is_dir():
        raise HipcError(f"-o: directory {parent} does not exist")
    sweep_artifact_leftovers(parent)  # what compiles killed before us left here,
    sweep_tool_dirs()  # and in the temp folder (a kernel-cache hit runs no toolchain)
    tmp = parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        tmp.mkdir()
    except OSError as e:
        raise HipcError(f"-o: cannot write in {parent} ({e.strerror})") from None
    with pending(_cache_root(), tmp):
        try:
            _write_into(
                tmp, out, manifest, plan, fusion, builds, weights, tokenizer_json,
                tokenizer_meta, generation, on_progress,
            )  # fmt: skip
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            where = e.filename or tmp
            raise HipcError(f"-o {out}: cannot write {where} ({e.strerror})") from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


def _cache_root() -> Path | None:
    from hipc.cache import default_cache_dir

    try:
        return default_cache_dir()
    except RuntimeError:  # no home directory
        return None


def _write_into(
    tmp: Path,
    out: Path,
    manifest: dict[str, Any],
    plan: dict[str, Any],
    fusion: dict[str, Any],
    builds: list[TargetBuild],
    weights: list[LazyTensor],
    tokenizer_json: str | None,
    tokenizer_meta: dict[str, Any] | None,
    generation: dict[str, Any],
    on_progress: Callable[[int, int], None] | None,
) -> None:
    (tmp / "kernels").mkdir()
    targets = {}
    for b in builds:
        t = b.target
        binary, source = f"kernels/{t.name}.{t.binary_ext}", f"kernels/{t.name}.{t.source_ext}"
        (tmp / binary).write_bytes(b.binary)
        (tmp / source).write_text(b.source)
        targets[t.name] = {**b.info, "code_object": binary, "source": source}
    weights_sha = write_safetensors(
        tmp / "weights.safetensors", weights, {"format": "hipc-weights"}, on_progress
    )
    if tokenizer_json is not None:
        (tmp / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
        _write_json(tmp / "tokenizer_meta.json", tokenizer_meta)
    _write_json(tmp / "generation.json", generation)
    _write_json(tmp / "plan.json", plan)
    _write_json(tmp / "fusion.json", fusion)
    files = {
        str(p.relative_to(tmp)): {
            "size": p.stat().st_size,
            "sha256": weights_sha if p.name == "weights.safetensors" else sha256_file(p),
        }
        for p in sorted(tmp.rglob("*"))
        if p.is_file()
    }
    full = {
        "format": "hipc-artifact",
        "format_version": ARTIFACT_FORMAT_VERSION,
        "hipc_version": HIPC_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **manifest,
        "targets": targets,
        "files": files,
    }
    _write_json(tmp / "manifest.json", full)  # last: an artifact without it is not one
    replace_dir(tmp, out)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1, default=_jsonable), encoding="utf-8")


def _jsonable(v: Any) -> Any:
    if isinstance(v, (np.integer, np.floating)):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    with contextlib.suppress(TypeError):
        return dict(v)
    raise TypeError(f"not JSON serializable: {type(v).__name__}")
