"""Raw models compiled on demand (`hipc generate MODEL`), kept in the cache folder.

The key covers the model's files (path, size, mtime), the options, the build
machine's target id, hipc's version and the cpu program's ABI (an artifact of another ABI
would load and then be refused by the backend); a stale or damaged entry is rebuilt.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
from pathlib import Path

from hipc.base.errors import HipcError
from hipc.base.version import ABI_VERSION, HIPC_VERSION
from hipc.cache import KernelCache
from hipc.compiler.options import CompileOptions
from hipc.compiler.toolchains.cpu import CpuToolchain
from hipc.graphs import load_model


def artifact_key(model_ref: str, options: CompileOptions) -> str:
    src = load_model(model_ref).source
    files = (
        sorted(p for p in src.path.rglob("*") if p.is_file()) if src.path.is_dir() else [src.path]
    )
    stamp = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    blob = json.dumps(
        [stamp, options.to_json(), CpuToolchain().target_id, HIPC_VERSION, ABI_VERSION]
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def cached_artifact(model_ref: str, options: CompileOptions, root: Path | None = None) -> Path:
    from hipc.compiler.pipeline import compile_model
    from hipc.runtime.artifact import load_artifact

    cache = KernelCache(root)
    path = cache.artifact_dir(artifact_key(model_ref, options)) / "model.hipc"
    if path.is_dir():
        try:
            load_artifact(path)
            cache.mark_used(path.parent)  # the LRU clock HIPC_CACHE_MAX_BYTES evicts by
            return path
        except HipcError as e:
            print(f"hipc: rebuilding damaged cached artifact ({e})", file=sys.stderr)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise HipcError(f"cache: cannot create {path.parent} ({e.strerror})") from None
    print(
        f"hipc: compiling {model_ref} for {', '.join(options.targets)} (cached in {path.parent})",
        file=sys.stderr,
    )
    try:
        compile_model(model_ref, path, options, cache=cache, verbose=False)
    except BaseException:
        # compile_model writes the artifact whole or not at all: what a failed compile leaves
        # is this entry's empty folder, which the cache would count as an entry (rmdir takes
        # only an empty one)
        with contextlib.suppress(OSError):
            path.parent.rmdir()
        raise
    return path
